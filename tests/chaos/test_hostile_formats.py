"""Hostile response formats (issue 25's crash and stall reproductions): a Lark grammar of 3,000
chained rules crashes llguidance itself (SIGSEGV: its compiler recurses on the calling thread's
stack), the 13-character regex ``a{1000}{1000}`` built a lexer for ~1 s and kept ~150 MB under
llguidance's default limits, and formats nested hundreds deep reached recursion limits. Each is
refused (ValueError naming response_format; 400 over HTTP) or bounded, in the caller, and the
serving goes on (over HTTP: tests/server/test_openai_v2.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mlx_serving.models.text_generation import _structured

pytest.importorskip("llguidance")

CHAIN = "start: r0\n" + "".join(f"r{i}: r{i + 1} | \"x{i}\"\n" for i in range(3000)) + "r3000: \"end\"\n"


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_the_chained_grammar_really_crashes_llguidance_unguarded() -> None:
    """The reproduction: llguidance's own validation, without our bounds, kills its process."""
    script = textwrap.dedent(f"""
        import llguidance
        grammar = llguidance.LLMatcher.grammar_from_lark({CHAIN!r})
        llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        print("survived")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode < 0 and "survived" not in done.stdout, (done.returncode, done.stderr[-500:])


def test_the_chained_grammar_is_refused_before_llguidance_sees_it() -> None:
    with pytest.raises(ValueError, match="response_format"):
        _structured.compile_response_format({"type": "grammar", "grammar": CHAIN})
    few = "start: r0\n" + "".join(f"r{i}: r{i + 1} | \"x{i}\"\n" for i in range(200)) + "r200: \"end\"\n"
    assert _structured.compile_response_format({"type": "grammar", "grammar": few})  # real grammars still compile


@pytest.mark.parametrize("depth", [300, 900])
def test_deeply_nested_schemas_are_value_errors(depth: int) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested_schema(depth)}}
    with pytest.raises(ValueError, match="response_format"):
        _structured.compile_response_format(fmt)


def test_an_exploding_regex_is_bounded_in_memory() -> None:
    """Four distinct ``x{1000}{1000}`` regexes, each compiled and its matcher built and asked for a
    mask (what the engine does for a new grammar): peak RSS grows by less than 200 MB in all
    (llguidance's defaults: ~150 MB each, kept by the matcher cache)."""
    script = textwrap.dedent("""
        import resource, sys
        from mlx_serving.tokenization import Tokenizer
        from mlx_serving.models.text_generation import _structured
        def peak_rss_kib():  # ru_maxrss: KiB on Linux, bytes on macOS
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak // 1024 if sys.platform == "darwin" else peak
        tok = Tokenizer.qwen3()
        factory = _structured.constraint_factory(tok, tok.vocab_size)
        factory(_structured.compile_response_format({"type": "regex", "regex": "(yes|no)"}), (151645,)).allowed()
        before = peak_rss_kib()
        for ch in "abcd":
            grammar = _structured.compile_response_format({"type": "regex", "regex": ch + "{1000}{1000}"})
            factory(grammar, (151645,)).allowed()
        print((peak_rss_kib() - before) / 1024)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 200
