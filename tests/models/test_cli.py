"""The ``mlx-serving`` command: generate (streamed), chat (history), Ctrl-C (between turns: exit 130;
during a reply: that reply stops, the chat goes on), mlx-lm's flag names, --version, --help,
stdin prompts, the timing line. (Model sources and the cache's write-then-rename:
tests/models/test_sources.py.)"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import mlx_serving
from mlx_serving import text_generation
from mlx_serving import cli

_TIMING = re.compile(r"\[prompt (\d+) tokens?, ([0-9.]+) tok/s \| (\d+) new tokens?, decode ([0-9.]+) tok/s"
                     r" \| peak memory ([0-9.]+) GB \| finish_reason (\w+)\]")
_SMALL = ["--max-new-tokens", "6", "--max-len", "64"]
_from_mlx4bit = text_generation.from_mlx4bit  # the real one (the ``recorders`` fixture wraps it)


def _greedy_text(ckpt: Path, request: Any, **options: Any) -> str:
    serving = _from_mlx4bit(ckpt, max_new_tokens=6, max_len=64, **options)
    try:
        return serving.run(request)["results"][0]["generated_text"]
    finally:
        serving.close()


class _Stdout(io.StringIO):
    """A stdout that records each write and whether a flush followed it."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def write(self, s: str) -> int:
        self.events.append(s)
        return super().write(s)

    def flush(self) -> None:
        self.events.append("<flush>")

    def isatty(self) -> bool:
        return False


class _RecordingStream:
    def __init__(self, stream: Any, items: list[Any]):
        self._stream, self._items = stream, items

    def __enter__(self) -> _RecordingStream:
        self._stream.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stream.__exit__(*exc)

    def __iter__(self) -> Any:
        for item in self._stream:
            self._items.append(item)
            yield item


class _Recorder:
    """Wraps the serving the CLI builds: records each request and its stream items."""

    def __init__(self, serving: Any):
        self.serving = serving
        self.requests: list[Any] = []
        self.items: list[list[Any]] = []
        self.closed = False

    def stream(self, input: Any, **kw: Any) -> _RecordingStream:
        self.requests.append(copy.deepcopy(input))
        self.items.append([])
        return _RecordingStream(self.serving.stream(input, **kw), self.items[-1])

    def stats(self) -> Any:
        return self.serving.stats()

    def close(self) -> None:
        self.closed = True
        self.serving.close()

    def reply(self, i: int) -> str:
        return "".join(x for x in self.items[i] if isinstance(x, str))

    def final(self, i: int) -> dict[str, Any]:
        return next(x for x in self.items[i] if isinstance(x, dict))


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> list[_Recorder]:
    made: list[_Recorder] = []
    def from_mlx4bit(*args: Any, **kwargs: Any) -> _Recorder:
        assert "sampler" not in kwargs
        made.append(_Recorder(_from_mlx4bit(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(text_generation, "from_mlx4bit", from_mlx4bit)
    return made


def _stdin(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))


# ---- generate -----------------------------------------------------------------------------------

def test_generate_streams_pieces_equal_to_the_non_streamed_text(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, recorders: list[_Recorder]) -> None:
    out = _Stdout()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["generate", "Hello", "--model", str(tiny_ckpt), *_SMALL]) == 0
    expected = _greedy_text(tiny_ckpt, "Hello", chat=True)  # the model's chat template, as mlx-lm's generate
    assert out.getvalue() == expected + "\n"
    pieces = [e for e in out.events if e not in ("<flush>", "\n")]
    assert len(pieces) > 1 and "".join(pieces) == expected  # printed piece by piece
    for i, e in enumerate(out.events):
        if e != "<flush>":
            assert out.events[i + 1] == "<flush>"  # each piece flushed as it came
    (rec,) = recorders
    assert rec.closed and rec.requests == [{"text": "Hello"}]


def test_generate_dash_reads_the_prompt_from_stdin(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        recorders: list[_Recorder]) -> None:
    _stdin(monkeypatch, "Hello there\n")
    assert cli.main(["generate", "-", "--model", str(tiny_ckpt), *_SMALL]) == 0
    assert recorders[0].requests == [{"text": "Hello there"}]
    assert capsys.readouterr().out == _greedy_text(tiny_ckpt, "Hello there", chat=True) + "\n"  # as an argument
    _stdin(monkeypatch, "Hello there\n")
    assert cli.main(["generate", "-", "--raw", "--model", str(tiny_ckpt), *_SMALL]) == 0
    assert capsys.readouterr().out == _greedy_text(tiny_ckpt, "Hello there") + "\n"


def test_generate_passes_sampling_options_and_chat(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str], recorders: list[_Recorder]) -> None:
    args = ["generate", "Hi", "--model", str(tiny_ckpt), *_SMALL, "--chat", "--temperature", "0.8",
            "--top-p", "0.5", "--seed", "3"]
    assert cli.main(args) == 0
    assert recorders[0].requests == [{"text": "Hi", "seed": 3}]
    first = capsys.readouterr().out
    assert cli.main(args) == 0
    assert capsys.readouterr().out == first  # seeded sampling is reproducible
    assert first == _greedy_text(tiny_ckpt, {"text": "Hi", "seed": 3}, chat=True, temperature=0.8,
                                 top_p=0.5) + "\n"


def test_generate_passes_top_k_min_p_and_repetition_penalty(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str], recorders: list[_Recorder]) -> None:
    args = ["generate", "Hi", "--raw", "--model", str(tiny_ckpt), *_SMALL, "--temperature", "0.8", "--seed", "3",
            "--top-k", "5", "--min-p", "0.1", "--repetition-penalty", "1.3"]
    assert cli.main(args) == 0
    request = {"text": "Hi", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "seed": 3}
    assert recorders[0].requests == [request]
    assert capsys.readouterr().out == _greedy_text(tiny_ckpt, request, temperature=0.8) + "\n"
    assert cli.main(["generate", "Hi", "--model", str(tiny_ckpt), *_SMALL, "--top-k", "-2"]) != 0  # checked


def test_mlx_lm_flag_names_are_accepted(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str], recorders: list[_Recorder]) -> None:
    """``-p/--prompt``, ``-m/--max-tokens``, ``--temp`` and ``--system-prompt`` as mlx-lm spells them."""
    assert cli.main(["generate", "-p", "Hi", "--model", str(tiny_ckpt), "-m", "6", "--max-len", "64",
                     "--temp", "0.8", "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    assert cli.main(["generate", "Hi", "--model", str(tiny_ckpt), *_SMALL, "--chat", "--temperature", "0.8",
                     "--seed", "3"]) == 0
    assert capsys.readouterr().out == sampled  # -p applies the chat template, as mlx-lm's does
    assert cli.main(["generate", "--prompt", "Hi", "--model", str(tiny_ckpt), *_SMALL,
                     "--system-prompt", "Be brief."]) == 0
    assert recorders[-1].requests == [{"messages": [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}]}]
    assert cli.main(["generate", "Hi", "-p", "Hi", "--model", str(tiny_ckpt), *_SMALL]) == 2  # the prompt twice
    assert "give the prompt once" in capsys.readouterr().err


@pytest.fixture(scope="module")
def plain_ckpt(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint without a chat template (a base model's tokenizer_config.json)."""
    folder = tmp_path_factory.mktemp("plain") / "plain"
    shutil.copytree(tiny_ckpt, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_prompt_goes_through_the_chat_template_unless_raw(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 40 item 5: as mlx-lm's generate, the prompt is one user message in the model's chat
    template; ``--raw`` or mlx-lm's ``--ignore-chat-template`` sends it as it is."""
    chat, plain = _greedy_text(tiny_ckpt, "Hi", chat=True), _greedy_text(tiny_ckpt, "Hi")
    assert chat != plain
    for flags, expected in ([[], chat], [["--chat"], chat], [["--raw"], plain], [["--ignore-chat-template"], plain]):
        assert cli.main(["generate", "Hi", "--model", str(tiny_ckpt), *_SMALL, *flags]) == 0
        assert capsys.readouterr().out == expected + "\n", flags
    assert cli.main(["generate", "-p", "Hi", "--ignore-chat-template", "--model", str(tiny_ckpt), *_SMALL]) == 0
    assert capsys.readouterr().out == plain + "\n"  # mlx-lm's spelling, both flags
    for flags in (["--chat"], ["--system-prompt", "Be brief."]):
        assert cli.main(["generate", "Hi", "--raw", *flags, "--model", str(tiny_ckpt), *_SMALL]) == 2
        err = capsys.readouterr().err
        assert "--raw" in err and "model:" not in err


def test_a_model_without_a_chat_template_completes_the_prompt_and_refuses_chat(
        plain_ckpt: Path, tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "Hi", "--model", str(plain_ckpt), *_SMALL]) == 0
    assert capsys.readouterr().out == _greedy_text(tiny_ckpt, "Hi") + "\n"  # the same weights, no template
    for args in (["generate", "Hi", "--chat"], ["generate", "Hi", "--system-prompt", "Be brief."], ["chat"]):
        assert cli.main([*args, "--model", str(plain_ckpt), *_SMALL]) == 2
        assert "plain has no chat template: chat, --chat and --system-prompt need one" in capsys.readouterr().err


def _timing(err: str) -> re.Match[str]:
    m = _TIMING.search(err)
    assert m, err
    return m


def test_a_smaller_max_len_fits_the_default_new_tokens(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 40 item 6: without --max-new-tokens, a reply gets at most 100 tokens, half of --max-len
    when smaller, and no more than the prompt leaves; a given one that cannot fit is refused."""
    ten = "word " * 9 + "word"  # 10 tokens
    assert cli.main(["generate", ten, "--raw", "--model", str(tiny_ckpt), "--max-len", "16"]) == 0
    m = _timing(capsys.readouterr().err)
    assert int(m.group(1)) == 10 and int(m.group(3)) <= 6  # min(16 // 2, 16 - 10)
    assert cli.main(["generate", "Hi", "--raw", "--model", str(tiny_ckpt), "--max-len", "16", "--seed", "0",
                     "--temperature", "1e6"]) == 0  # near-uniform sampling: an early EOS is unlikely
    m = _timing(capsys.readouterr().err)
    assert int(m.group(3)) <= 8 and (m.group(6) == "stop" or int(m.group(3)) == 8)
    _stdin(monkeypatch, "Hello\n")
    assert cli.main(["chat", "--model", str(tiny_ckpt), "--max-len", "64"]) == 0
    assert _timing(capsys.readouterr().err)
    assert cli.main(["generate", "Hi", "--model", str(tiny_ckpt), "--max-len", "64", "--max-new-tokens", "64"]) == 2
    assert "max_new_tokens 64 must be < max_len 64" in capsys.readouterr().err


def test_an_over_long_prompt_names_the_flags_and_truncation_fits_it(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long = "word " * 79 + "word"  # 80 tokens
    assert cli.main(["generate", long, "--raw", "--model", str(tiny_ckpt), "--max-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "prompt of 80 tokens exceeds max_len 64" in err and "truncate_prompt_tokens" in err and "--max-len" in err
    assert cli.main(["generate", long, "--raw", "--model", str(tiny_ckpt), "--max-len", "64",
                     "--truncate-prompt-tokens", "-1"]) == 0
    assert int(_timing(capsys.readouterr().err).group(1)) == 32  # 64 - the default 32 new tokens
    assert cli.main(["generate", long, "--model", str(tiny_ckpt), "--max-len", "64", "--max-new-tokens", "4",
                     "--truncate-prompt-tokens", "20"]) == 0  # the chat-rendered prompt's last 20 tokens
    assert int(_timing(capsys.readouterr().err).group(1)) == 20


def test_the_readme_command_answers_with_the_default_model(smollm2_dir: Path) -> None:
    """The positional prompt, no --chat, no --max-new-tokens: the default model answers (it printed
    an empty reply without the chat template); a smaller --max-len needs no other flag."""
    for flags in ([], ["--max-len", "64"]):
        done = subprocess.run([sys.executable, "-m", "mlx_serving", "generate", "What is the capital of Japan?",
                               *flags], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "The capital of Japan is Tokyo.", flags


def test_timing_line_has_prompt_and_decode_rates_and_peak_memory(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "Hello", "--raw", "--model", str(tiny_ckpt), *_SMALL]) == 0
    err = capsys.readouterr().err
    m = _TIMING.search(err)
    assert m, err
    assert int(m.group(1)) == 1 and int(m.group(3)) == 6 and m.group(6) == "length"
    assert float(m.group(2)) > 0 and float(m.group(4)) > 0 and float(m.group(5)) > 0
    assert "nan" not in err.lower()


def test_timing_line_after_a_stop_string(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = _greedy_text(tiny_ckpt, "Hello")
    stop = full[3:6]
    assert cli.main(["generate", "Hello", "--raw", "--model", str(tiny_ckpt), *_SMALL, "--stop", stop]) == 0
    out, err = capsys.readouterr()
    assert out == full[: full.index(stop)] + "\n"
    m = _TIMING.search(err)
    assert m and m.group(6) == "stop" and float(m.group(2)) > 0, err
    assert "nan" not in err.lower()


_SPEC = re.compile(r"\| speculation (\d+)/(\d+) draft tokens accepted \((\d+%|-)\) in (\d+) drafts? \| "
                   r"finish_reason (\w+)\]")


def test_timing_line_shows_the_acceptance_rate_with_speculation(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --speculative-config the timing line says the reply's accepted / drafted tokens (the
    acceptance rate) and its drafts; the reply's text is the one without speculation (greedy)."""
    prompt = "one two three four one two three four one two three four one two three"
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
            '"prompt_lookup_min": 1}']
    flags = ["--raw", "--model", str(tiny_ckpt), "--max-new-tokens", "24", "--max-len", "96"]
    assert cli.main(["generate", prompt, *flags, *spec]) == 0
    out, err = capsys.readouterr()
    m = _SPEC.search(err)
    assert m, err
    accepted, drafted, drafts = int(m.group(1)), int(m.group(2)), int(m.group(4))
    assert accepted <= drafted and drafts <= drafted and (drafts > 0) == (drafted > 0)
    assert m.group(3) == (f"{accepted / drafted:.0%}" if drafted else "-")
    assert cli.main(["generate", prompt, *flags]) == 0
    plain_out, plain_err = capsys.readouterr()
    assert plain_out == out and "speculation" not in plain_err


def test_timing_line_counts_the_reply_s_own_drafts() -> None:
    """The reply's share of the serving's counters (drafts, draft tokens, accepted), its
    acceptance rate in the line; a serving that reported nothing before its first request counts
    from 0; no speculation part without counters."""
    assert cli._spec_delta((1, 2, 1), (3, 8, 5)) == (2, 6, 4)
    assert cli._spec_delta(None, (3, 8, 5)) == (3, 8, 5)
    assert cli._spec_delta((1, 2, 1), None) is None
    final = {"finish_reason": "stop", "num_tokens": 5, "token_summary": {"input": 3, "output": 5},
             "timing": {"prefill_ms": 5.0, "decode_ms": 8.0, "total_ms": 13.0}}
    m = _SPEC.search(cli._timing_line(final, (2, 6, 4)))
    assert m and m.groups() == ("4", "6", "67%", "2", "stop")
    assert "speculation" not in cli._timing_line(final)


@pytest.mark.parametrize("final", [
    {},
    {"finish_reason": "stop", "num_tokens": 1, "token_summary": {"input": 3, "output": 1},
     "timing": {"prefill_ms": 5.0, "decode_ms": 0.0, "total_ms": 5.0}},
    {"finish_reason": "length", "num_tokens": 4, "token_summary": {"input": 3, "output": 4},
     "timing": {"prefill_ms": 0.0, "decode_ms": float("nan"), "total_ms": 0.0}},
    {"finish_reason": "length", "num_tokens": 4, "token_summary": {"input": 3, "output": 4}},
])
def test_timing_line_prints_a_dash_for_what_cannot_be_computed(final: dict[str, Any]) -> None:
    line = cli._timing_line(final)
    assert "nan" not in line.lower() and "- tok/s" in line


def test_bad_input_options_and_checkpoint_exit_2(
        tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "", "--model", str(tiny_ckpt)]) == 2
    assert "mlx-serving: error: " in capsys.readouterr().err
    assert cli.main(["generate", "x", "--model", str(tiny_ckpt), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "mlx-serving: error: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "x", "--seed", "-1"])
    assert e.value.code == 2


def test_a_bad_option_fails_before_the_model_is_resolved(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "x", "--max-new-tokens", "0", "--model", "no/such-model"]) == 2
    err = capsys.readouterr().err
    assert "max_new_tokens" in err and "model:" not in err and "Hugging Face" not in err


_ENGINE_ARGS = ["--prefill-chunk", "8", "--max-num-batched-tokens", "24", "--kv-cache-memory-bytes", "4000000",
                "--no-enable-prefix-caching", "--block-size", "8", "--buffer-cache-bytes", "none",
                "--decode-path", "sdpa", "--compile-decode", "--no-bucket-shapes", "--no-pack-prefill",
                "--max-causal-groups", "2", "--speculative-config", '{"num_speculative_tokens": 3}']
_ENGINE_VALUES = dict(prefill_chunk=8, max_step_tokens=24, kv_cache_bytes=4000000, prefix_caching=False, block_size=8,
                      buffer_cache_bytes=None, decode_path="sdpa", compile_decode=True, bucket_shapes=False,
                      pack_prefill=False, max_causal_groups=2, speculative_config='{"num_speculative_tokens": 3}',
                      kv_cache_dtype="auto")  # its flag left at its default: the float cache keeps the greedy text


def test_every_engine_field_has_a_flag() -> None:
    """generate / chat / serve reach every EngineConfig field (serve also --max-batch and --policy,
    by vLLM's names too); each flag lands in the GenerationOptions field of its name."""
    from mlx_serving.models.generation import EngineConfig
    from mlx_serving.server._cli import _generation_options, engine_options

    for command in ("generate", "chat"):
        args = cli._parser().parse_args([command, *(["x"] if command == "generate" else []), *_ENGINE_ARGS])
        assert engine_options(args) == {**_ENGINE_VALUES, "kv_cache_fraction": None}
        assert set(EngineConfig.field_names()) - set(engine_options(args)) == {"max_len", "max_batch", "policy"}
    serve = cli._parser().parse_args(["serve", *_ENGINE_ARGS, "--max-num-seqs", "4", "--scheduling-policy",
                                      "priority", "--kv-cache-fraction", "0.5"])
    options = _generation_options(serve)
    assert options == {**_ENGINE_VALUES, "max_batch": 4, "policy": "priority", "kv_cache_fraction": 0.5,
                       "max_new_tokens": 256, "max_len": 2048, "generation_config": "auto"}
    assert set(EngineConfig.field_names()) <= set(options)
    defaults = text_generation.GenerationOptions()
    assert all(getattr(defaults, k) == v for k, v in engine_options(cli._parser().parse_args(["chat"])).items())


def test_generate_builds_its_engine_from_the_flags(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    given: list[dict[str, Any]] = []

    def from_mlx4bit(*args: Any, **kwargs: Any) -> Any:
        given.append(kwargs)
        return _from_mlx4bit(*args, **kwargs)

    monkeypatch.setattr(text_generation, "from_mlx4bit", from_mlx4bit)
    assert cli.main(["generate", "Hello", "--raw", "--model", str(tiny_ckpt), *_SMALL, *_ENGINE_ARGS]) == 0
    # the same tokens as the exact path's (the flags pick sdpa; the default would be the native step)
    assert capsys.readouterr().out == _greedy_text(tiny_ckpt, "Hello", decode_path="matmul") + "\n"
    engine = text_generation.GenerationOptions(**given[0]).engine
    assert (engine.cache.block_size, engine.cache.prefix_caching, engine.decode.decode_path) == (8, False, "sdpa")
    assert engine.scheduler.max_step_tokens == 24 and engine.scheduler.max_batch == 1
    assert cli.main(["generate", "x", "--block-size", "0", "--model", "no/such-model"]) == 2
    err = capsys.readouterr().err
    assert "block_size must be" in err and "model:" not in err


# ---- --version, --help --------------------------------------------------------------------------

def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"mlx-serving {mlx_serving.__version__}\n"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_lists_every_option_with_its_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    assert isinstance(sub.formatter_class(command), argparse.ArgumentDefaultsHelpFormatter)
    for action in sub._actions:
        if action.dest == "help" or not action.option_strings:
            continue
        assert action.option_strings[0] in text
        if action.default is None:
            assert "(default: " in (action.help or ""), action.dest
        else:
            assert f"(default: {action.default})" in text, action.dest
    assert "sampler" not in text
    for flag, default in {"--max-new-tokens": 100, "--max-len": 2048, "--temperature": 0.0, "--top-p": 1.0}.items():
        assert re.search(rf"{flag} \S+ .*?\(default: {default}\)", text)


# ---- chat ---------------------------------------------------------------------------------------

def test_chat_keeps_the_history_across_turns(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        recorders: list[_Recorder]) -> None:
    _stdin(monkeypatch, "Hello\n\nHow are you?\n/exit\nnever read\n")
    assert cli.main(["chat", "--model", str(tiny_ckpt), *_SMALL, "--system", "Be brief."]) == 0
    (rec,) = recorders
    assert rec.closed and len(rec.requests) == 2
    system = {"role": "system", "content": "Be brief."}
    user1, user2 = {"role": "user", "content": "Hello"}, {"role": "user", "content": "How are you?"}
    assert rec.requests[0] == {"messages": [system, user1]}
    assert rec.requests[1] == {"messages": [system, user1, {"role": "assistant", "content": rec.reply(0)}, user2]}
    first, second = rec.final(0), rec.final(1)
    assert second["token_summary"]["input"] > first["token_summary"]["input"] + first["num_tokens"]
    out, err = capsys.readouterr()
    assert out == rec.reply(0) + "\n" + rec.reply(1) + "\n"
    assert len(_TIMING.findall(err)) == 2 and "nan" not in err.lower()


def test_chat_reset_clears_the_history_and_eof_ends(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        recorders: list[_Recorder]) -> None:
    _stdin(monkeypatch, "Hello\n/reset\nHello\n")
    assert cli.main(["chat", "--model", str(tiny_ckpt), *_SMALL]) == 0
    (rec,) = recorders
    assert rec.requests == [{"messages": [{"role": "user", "content": "Hello"}]}] * 2
    assert rec.reply(0) == rec.reply(1)
    assert "history cleared" in capsys.readouterr().err


def test_chat_no_thinking_changes_the_rendered_prompt(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, recorders: list[_Recorder]) -> None:
    for flags in ([], ["--no-thinking"]):
        _stdin(monkeypatch, "Hello\n")
        assert cli.main(["chat", "--model", str(tiny_ckpt), *_SMALL, *flags]) == 0
    thinking, plain = recorders
    assert thinking.requests == [{"messages": [{"role": "user", "content": "Hello"}]}]
    assert plain.requests == [{"messages": [{"role": "user", "content": "Hello"}], "enable_thinking": False}]
    # Qwen3's template writes an empty <think></think> block when thinking is off
    assert plain.final(0)["token_summary"]["input"] > thinking.final(0)["token_summary"]["input"]


def test_chat_passes_top_k_min_p_and_repetition_penalty(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, recorders: list[_Recorder]) -> None:
    _stdin(monkeypatch, "Hello\n")
    assert cli.main(["chat", "--model", str(tiny_ckpt), *_SMALL,
                     "--top-k", "5", "--min-p", "0.1", "--repetition-penalty", "1.3"]) == 0
    assert recorders[0].requests == [{"messages": [{"role": "user", "content": "Hello"}],
                                      "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3}]


def test_chat_turn_too_long_for_max_len_is_reported_and_the_chat_goes_on(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        recorders: list[_Recorder]) -> None:
    _stdin(monkeypatch, ("word " * 80) + "\nHello\n")
    assert cli.main(["chat", "--model", str(tiny_ckpt), *_SMALL]) == 0
    (rec,) = recorders
    assert rec.requests[-1] == {"messages": [{"role": "user", "content": "Hello"}]}  # the long turn was dropped
    assert "exceeds max_len 64" in capsys.readouterr().err


# ---- Ctrl-C (a real process) ----------------------------------------------------------------------

def default_sigint() -> None:
    """In the child: Ctrl-C's default action, also when the tests run as a background job (whose
    shell started them with SIGINT ignored, an inherited setting a SIGINT test would never see)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _chat_child(ckpt: Path, *flags: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "mlx_serving", "chat", "--model", str(ckpt), *flags],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=default_sigint)


def _wait_ready(child: subprocess.Popen[bytes]) -> None:
    assert child.stderr is not None
    line = child.stderr.readline().decode()
    assert line.startswith(f"model: {Path(child.args[5]).name} (the directory "), line  # which model it loads
    line = child.stderr.readline().decode()
    assert line.startswith("mlx-serving chat:"), line


def _assert_interrupted(child: subprocess.Popen[bytes], timeout: float) -> None:
    t0 = time.monotonic()
    _, err = child.communicate(timeout=timeout)
    text = err.decode()
    assert child.returncode == 130, text
    assert "Traceback" not in text
    assert text == "mlx-serving: interrupted\n", text  # one line (after the ready line)
    assert time.monotonic() - t0 < timeout


def test_ctrl_c_while_waiting_for_input_exits_130(tiny_ckpt: Path) -> None:
    child = _chat_child(tiny_ckpt, *_SMALL)
    try:
        _wait_ready(child)
        time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        _assert_interrupted(child, 30)
    finally:
        child.kill()
        child.wait()


def test_ctrl_c_while_generating_stops_the_reply_and_the_chat_goes_on(tiny_ckpt: Path) -> None:
    # 2000 greedy tokens of the tiny checkpoint take ~20 s on 2 CPU cores (no EOS): the interrupt
    # must end that reply long before, and the session must take the next line.
    child = _chat_child(tiny_ckpt, "--max-new-tokens", "2000", "--max-len", "2100")
    try:
        _wait_ready(child)
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        t0 = time.monotonic()
        child.stdin.write(b"Hello\n")
        child.stdin.flush()
        assert os.read(child.stdout.fileno(), 1)  # the reply has started streaming
        child.send_signal(signal.SIGINT)
        assert child.stderr.readline().decode() == "[reply stopped; not kept in the history]\n"
        child.stdin.write(b"/exit\n")
        child.stdin.flush()
        _, err = child.communicate(timeout=10)
        assert child.returncode == 0 and "Traceback" not in err.decode(), err.decode()
        assert time.monotonic() - t0 < 10
    finally:
        child.kill()
        child.wait()


def test_an_option_the_engine_refuses_exits_2_with_one_line(
        tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU-only decode path on a machine without MLX's CUDA kernels: the engine refuses it when it
    is built (a BackendError whose cause is the ValueError); the CLI prints the cause, no traceback."""
    from mlx_serving.models.decoder.cuda_kernels import kernels_available
    if kernels_available():
        pytest.skip("the fused CUDA kernels run here")
    assert cli.main(["generate", "x", "--decode-path", "fused", "--model", str(tiny_ckpt), *_SMALL]) == 2
    err = capsys.readouterr().err
    assert "mlx-serving: error: decode_path 'fused'" in err and "Traceback" not in err
