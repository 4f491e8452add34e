"""Tokenizer files and chat templates are untrusted input.

A malformed tokenizer.json / tokenizer.json.gz / tokenizer_config.json / config.json /
generation_config.json / chat_template.jinja raises TokenizationError (ChatTemplateError for the
template) naming the file or field, never a raw JSONDecodeError, UnicodeDecodeError, TypeError or
KeyError; compressed input is decompressed only up to a cap; symlinks may not leave the directory.
A hostile chat template is stopped by the bounded sandbox (time, loop iterations, value and output
sizes) with ChatTemplateError, in well under a couple of seconds and without a large allocation.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from mlx_serving.tokenization import ChatTemplate, ChatTemplateError, TokenizationError, Tokenizer, data_path
from mlx_serving.tokenization import _chat
from portable import peak_rss_kib

#: A hostile case must fail within this much CPU time of this process (the render's own budget is
#: 0.5 s of CPU time): CPU time, not wall-clock time, so that other work on the cores cannot fail it.
CPU_S = 1.5
QWEN3_TEMPLATE = json.loads(data_path("tokenizer_config.json").read_text())["chat_template"]
CHAT = [{"role": "user", "content": "Hi"}]


def _small_tokenizer_json() -> str:
    """A byte-level BPE over the 256 byte characters plus Qwen3's three chat special tokens:
    loads in milliseconds, unlike the 11 MB Qwen3 one."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok.to_str()


SMALL = _small_tokenizer_json()


def _put(d: Path, name: str, data: bytes | str) -> None:
    """Replace ``d / name`` (unlinking first: it may be a hard link shared with other tests)."""
    path = d / name
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_bytes(data.encode() if isinstance(data, str) else data)


@pytest.fixture
def tdir(tmp_path: Path) -> Path:
    """A tokenizer directory: the small tokenizer.json, the shipped tokenizer_config.json (Qwen3's
    template, eos_token <|im_end|>), generation_config.json and a config.json with eos ids."""
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(SMALL)
    shutil.copyfile(data_path("tokenizer_config.json"), d / "tokenizer_config.json")
    shutil.copyfile(data_path("generation_config.json"), d / "generation_config.json")
    (d / "config.json").write_text(json.dumps({"eos_token_id": 151645}))
    return d


def _refused(d: Path, exc: type[TokenizationError], *patterns: str) -> str:
    t0 = time.process_time()
    with pytest.raises(exc) as info:
        Tokenizer.from_dir(d)
    assert time.process_time() - t0 < CPU_S
    message = str(info.value)
    for p in patterns:
        assert p in message, (p, message)
    return message


def test_the_small_directory_loads(tdir):
    tok = Tokenizer.from_dir(tdir)
    assert tok.chat_template is not None and tok.decode(tok.encode("hello")) == "hello"
    specials = {v: k for k, v in tok.special_token_strings().items()}
    assert tok.encode_chat(CHAT)[0] == specials["<|im_start|>"]
    assert 151645 in tok.eos_token_ids


# ---- malformed JSON files ----------------------------------------------------------------------

MALFORMED = {
    "not JSON": b'{"a": ',
    "empty": b"",
    "a JSON list": b"[1, 2]",
    "a JSON number": b"42",
    "null": b"null",
    "invalid UTF-8": b'{"a": "\xff\xfe"}',
    "UTF-16": '{"a": 1}'.encode("utf-16"),
    "deeply nested": b"[" * 200_000 + b"]" * 200_000,
    "NaN soup": b"NaN",
}


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"])
@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_json_file(tdir, name, kind):
    _put(tdir, name, MALFORMED[kind])
    _refused(tdir, TokenizationError, name)


@pytest.mark.parametrize("body", [
    {}, {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}, {"model": {"type": "Nope"}},
    {"model": {"type": "BPE", "vocab": {"a": 2**40}, "merges": []}},
    {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
     "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(((("}, "behavior": "Isolated", "invert": False}},
])
def test_tokenizer_json_that_the_library_refuses(tdir, body):
    _put(tdir, "tokenizer.json", json.dumps(body))
    _refused(tdir, TokenizationError, "tokenizer.json", "not a valid tokenizer.json")


def test_oversized_files_are_refused_without_reading_them(tdir):
    for name, size in (("tokenizer.json", 65 * 2**20), ("tokenizer_config.json", 17 * 2**20)):
        with open(tdir / name, "ab") as f:
            f.truncate(size)  # sparse: nothing written
        before = peak_rss_kib()
        _refused(tdir, TokenizationError, name, "bytes allowed")
        assert peak_rss_kib() - before < 256 * 1024  # KiB
        _put(tdir, name, SMALL if name == "tokenizer.json" else data_path(name).read_bytes())


def test_too_many_added_tokens(tdir):
    body = json.loads(SMALL)
    body["added_tokens"] = [
        {"id": 300 + i, "content": f"<s{i}>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for i in range(70_000)]
    _put(tdir, "tokenizer.json", json.dumps(body))
    _refused(tdir, TokenizationError, "70,000 added tokens")


# ---- compressed input --------------------------------------------------------------------------

def _gz_dir(tdir: Path, payload: bytes) -> Path:
    (tdir / "tokenizer.json").unlink()
    _put(tdir, "tokenizer.json.gz", payload)
    return tdir


def test_gzipped_tokenizer_loads(tdir):
    _gz_dir(tdir, gzip.compress(SMALL.encode()))
    assert Tokenizer.from_dir(tdir).encode("ab") == Tokenizer.from_dir(tdir).encode("ab")


def test_gzip_bomb_stops_at_the_cap(tdir):
    """10 GiB of zeros in 10 MB (10,240 gzip members of 1 MiB each): refused after decompressing
    64 MiB, quickly and without holding more than that."""
    member = gzip.compress(b"\0" * 2**20, compresslevel=9)
    _gz_dir(tdir, member * 10_240)
    before = peak_rss_kib()
    _refused(tdir, TokenizationError, "tokenizer.json.gz", "decompresses to more than")
    assert peak_rss_kib() - before < 256 * 1024  # KiB


def test_gzip_bomb_in_one_member(tdir):
    """One deflate stream of 256 MiB of spaces (~250 KB): same cap."""
    z = gzip.compress(b" " * 2**28, compresslevel=1)
    _gz_dir(tdir, z)
    _refused(tdir, TokenizationError, "decompresses to more than")


@pytest.mark.parametrize("payload,pattern", [
    (b"not gzip at all", "not a valid gzip file"),
    (gzip.compress(SMALL.encode(), mtime=0)[:200], "not a valid gzip file"),  # truncated
    (gzip.compress(b"\xff\xfe\xfd", mtime=0), "not UTF-8"),
    (gzip.compress(b"[1, 2]", mtime=0), "not a valid tokenizer.json"),
    (b"", "not a valid tokenizer.json"),  # an empty gzip file reads as empty
], ids=["not gzip", "truncated", "not UTF-8", "not JSON", "empty"])  # stable ids (pytest-xdist)
def test_malformed_gzip(tdir, payload, pattern):
    _gz_dir(tdir, payload)
    _refused(tdir, TokenizationError, "tokenizer.json.gz", pattern)


# ---- fields of the wrong type ------------------------------------------------------------------

@pytest.mark.parametrize("template,pattern", [
    (42, "chat_template must be a string"), (True, "chat_template must be"), ({"default": "x"}, "chat_template"),
    ([1, 2], "chat_template entries"), ([{"name": 1, "template": "x"}], "chat_template entries"),
    ([{"name": ["a"], "template": "x"}], "chat_template entries"),  # used to be a TypeError (unhashable)
    ([{"name": "default", "template": 5}], "chat_template entries"),
    ("{% for %}", "does not compile"), ("x" * (_chat.MAX_TEMPLATE_CHARS + 1), "longer than"),
    ("{% if true %}" * 5000 + "{% endif %}" * 5000, "does not compile"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not compile"),
])
def test_bad_chat_template_field(tdir, template, pattern):
    cfg = json.loads(data_path("tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    _put(tdir, "tokenizer_config.json", json.dumps(cfg))
    _refused(tdir, ChatTemplateError, pattern)


def test_chat_template_list_without_default_means_no_template(tdir):
    cfg = json.loads(data_path("tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}]
    _put(tdir, "tokenizer_config.json", json.dumps(cfg))
    assert Tokenizer.from_dir(tdir).chat_template is None
    cfg["chat_template"] = [{"name": "default", "template": "{{ messages[0].content }}"}]
    _put(tdir, "tokenizer_config.json", json.dumps(cfg))
    assert Tokenizer.from_dir(tdir).chat_template.apply(CHAT) == "Hi"


@pytest.mark.parametrize("field", ["eos_token", "bos_token", "pad_token", "unk_token"])
@pytest.mark.parametrize("value", [5, ["<|im_end|>"], {"content": 5}, {"content": ["x"]}, True, 1.5])
def test_bad_special_token_field(tdir, field, value):
    cfg = json.loads(data_path("tokenizer_config.json").read_text())
    cfg[field] = value
    _put(tdir, "tokenizer_config.json", json.dumps(cfg))
    _refused(tdir, TokenizationError, "tokenizer_config.json", field)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("value", ["151645", [151645, "x"], -1, True, 2**40, [None], {"id": 1}, 1.0])
def test_bad_eos_token_id(tdir, name, value):
    _put(tdir, name, json.dumps({"eos_token_id": value}))
    _refused(tdir, TokenizationError, name, "eos_token_id")


@pytest.mark.parametrize("data,pattern", [
    (b"{{ messages \xff }}", "not UTF-8"), ("{% for %}".encode(), "does not compile"),
    (("x" * (_chat.MAX_TEMPLATE_CHARS + 1)).encode(), "longer than"),
])
def test_bad_chat_template_jinja(tdir, data, pattern):
    _put(tdir, "chat_template.jinja", data)
    _refused(tdir, ChatTemplateError, pattern)


# ---- symlinks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json",
                                  "generation_config.json", "chat_template.jinja"])
def test_symlink_leaving_the_directory(tdir, name):
    outside = tdir.parent / f"outside-{name}"
    src = tdir / name
    outside.write_bytes(src.read_bytes() if src.exists() else b"{{ messages }}")
    if src.exists():
        src.unlink()
    src.symlink_to(outside)
    _refused(tdir, TokenizationError, name, "outside the tokenizer directory")


def test_symlink_to_a_device_is_refused(tdir):
    (tdir / "tokenizer.json").unlink()
    (tdir / "tokenizer.json.gz").symlink_to("/dev/zero")
    _refused(tdir, TokenizationError, "outside the tokenizer directory")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_symlink_loop(tdir, name):
    if (tdir / name).exists():
        (tdir / name).unlink()
    (tdir / name).symlink_to(name)
    _refused(tdir, TokenizationError, name)


def test_non_regular_files_are_refused(tdir):
    (tdir / "tokenizer_config.json").unlink()
    (tdir / "tokenizer_config.json").mkdir()
    _refused(tdir, TokenizationError, "tokenizer_config.json", "not a regular file")
    (tdir / "tokenizer_config.json").rmdir()
    os.mkfifo(tdir / "chat_template.jinja")  # would block a plain read forever
    _refused(tdir, TokenizationError, "chat_template.jinja", "not a regular file")


def test_symlinks_inside_and_hub_cache_layout_load(tdir, tmp_path):
    (tdir / "sub").mkdir()
    (tdir / "tokenizer.json").rename(tdir / "sub" / "t.json")
    (tdir / "tokenizer.json").symlink_to("sub/t.json")
    assert Tokenizer.from_dir(tdir).encode("a")
    repo = tmp_path / "models--org--m"
    snap, blobs = repo / "snapshots" / "rev", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(["tokenizer.json", "tokenizer_config.json"]):
        shutil.copyfile(tdir / name, blobs / f"b{i}")
        (snap / name).symlink_to(f"../../blobs/b{i}")
    assert Tokenizer.from_dir(snap).chat_template is not None
    blobs.rename(tmp_path / "elsewhere")  # a blobs folder that is a symlink is no hub cache
    blobs.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    _refused(snap, TokenizationError, "outside the tokenizer directory")


# ---- hostile chat templates --------------------------------------------------------------------

HOSTILE = {
    # time
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a string": "{% set s = 'a' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "loop.cycle in nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ loop.cycle('') }}"
                                  "{% endfor %}{% endfor %}",
    "recursive loop": "{% for i in [1, 2] recursive %}{% if loop.depth < 40 %}{{ loop([1, 2]) }}{% endif %}"
                      "{% endfor %}",
    "exponential macro": "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}"
                         "{{ m(40) }}",
    "infinite macro recursion": "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "self-recursive block": "{% block a %}{{ self.a() }}{% endblock %}",
    "range too long": "{{ range(10**12)|list|length }}",
    # memory: repetition and arithmetic
    "str * 10**10": "{{ 'a' * 10**10 }}",
    "list * 10**9": "{{ ([1] * 10**9)|length }}",
    "int ** huge": "{{ 2 ** 100000000 }}",
    "int squaring": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "~ doubling": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "+ doubling": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list doubling": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "many-part ~": "{% set s = 'a' * 4000000 %}{{ (" + " ~ ".join(["s"] * 64) + ")|length }}",
    "shared nesting printed": "{% set ns = namespace(s=['aaaa']) %}{% for i in range(64) %}"
                              "{% set ns.s = [ns.s, ns.s] %}{% endfor %}{{ ns.s }}",
    "shared nesting tojson": "{% set ns = namespace(s=['aaaa']) %}{% for i in range(64) %}"
                             "{% set ns.s = [ns.s, ns.s] %}{% endfor %}{{ ns.s|tojson }}",
    "self-containing namespace": "{% set ns = namespace() %}{% set ns.a = ns %}{{ ns }}",
    "list of big strings printed": "{% set s = 'a' * 4000000 %}{{ [s] * 1000 }}",
    "huge int from hex": "{% set x = ('f' * 4000000)|int(base=16) %}{{ x // 7 }}",
    "huge int from bytes": "{% set b = ('f' * 4000000).encode() %}{{ (1).from_bytes(b, 'big') % 7 }}",
    # memory: builtins, str methods and formatting
    "lipsum(n=10**6)": "{{ lipsum(n=10**6) }}",
    "lipsum many words": "{{ lipsum(n=100, max=10**7) }}",
    "strftime_now huge format": "{{ strftime_now('%Y' * 10**7) }}",
    "strftime_now long format": "{% set f = '%c' * 100000 %}{{ strftime_now(f) }}",
    "str.center": "{{ 'a'.center(10**10) }}",
    "str.ljust": "{{ 'a'.ljust(10**9) }}",
    "str.zfill": "{{ '1'.zfill(10**9) }}",
    "str.expandtabs": "{% set s = '\t' * 1000000 %}{{ s.expandtabs(1000000)|length }}",
    "str.replace": "{% set s = 'a' * 1000000 %}{{ s.replace('a', s)|length }}",
    "str.replace empty": "{% set s = 'a' * 100000 %}{{ s.replace('', 'b' * 64)|length }}",
    "str.join": "{% set s = 'a' * 1000000 %}{{ s.join([s] * 100000)|length }}",
    "str.translate": "{% set s = 'a' * 1000000 %}{{ s.translate({97: s})|length }}",
    "str.format width": "{{ '{:10000000000}'.format(1) }}",
    "str.format nested width": "{{ '{:{w}}'.format(1, w=10**10) }}",
    "str.format many fields": "{% set s = 'a' * 1000000 %}{{ ('{0}' * 1000).format(s)|length }}",
    "% width": "{{ '%10000000000d' % 1 }}",
    "% star width": "{{ '%*d' % (10**10, 1) }}",
    "int.to_bytes": "{{ (1).to_bytes(10**10, 'big')|length }}",
    "upper of a long string": "{% set s = 'ß' * 4000000 %}{{ s.upper()|length }}",
    # memory: filters
    "center filter": "{{ 'a'|center(10**10) }}",
    "format filter": "{{ '%10000000000d'|format(1) }}",
    "replace filter": "{% set s = 'a' * 1000000 %}{{ s|replace('a', s)|length }}",
    "join filter": "{% set s = 'a' * 1000000 %}{{ ([s] * 100000)|join|length }}",
    "indent filter": "{% set s = '\n' * 1000000 %}{{ s|indent(1000000)|length }}",
    "indent by a string": "{% set s = '\n' * 1000000 %}{{ s|indent('x' * 1000000)|length }}",
    "wordwrap filter": "{% set s = 'a ' * 1000000 %}{{ s|wordwrap(1, wrapstring='x' * 100000)|length }}",
    "batch fill": "{{ [1]|batch(10**10, 0)|list|length }}",
    "slice count": "{{ [1]|slice(10**9)|list|length }}",
    "sum of lists": "{{ ([[1]] * 100000)|sum(start=[])|length }}",
    "tojson indent": "{{ [[[[1]]]]|tojson(indent=10**9) }}",
    "escape a long string": "{% set s = '<' * 4000000 %}{{ s|e|length }}",
    "pprint": "{% set s = 'a' * 4000000 %}{{ ([s] * 1000)|pprint }}",
    "urlize": "{% set s = 'a.co ' * 800000 %}{{ s|urlize(target='x' * 1000)|length }}",
    "map center": "{{ range(100000)|map('center', 4000000)|list|length }}",
    "dict.fromkeys to json": "{{ {}.fromkeys(range(100000), 'a' * 4000000)|tojson|length }}",
    "sort a huge list": "{{ (range(100000)|list * 40)|sort|length }}",
    # memory: output and captured output
    "long output": "{% set s = 'a' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "set block": "{% set s = 'a' * 1000000 %}{% set x %}{% for i in range(100000) %}{{ s }}{% endfor %}"
                 "{% endset %}{{ x|length }}",
    "macro output": "{% set s = 'a' * 1000000 %}{% macro m() %}{% for i in range(100000) %}{{ s }}{% endfor %}"
                    "{% endmacro %}{{ m()|length }}",
    "filter block": "{% set s = 'a' * 1000000 %}{% filter upper %}{% for i in range(100000) %}{{ s }}"
                    "{% endfor %}{% endfilter %}",
    # compile-time constant folding
    "folded constants": "{{ 'x'|center(4000000)|length }}" * 2000,
    # errors that used to escape as raw exceptions
    "zero division": "{{ 1 // 0 }}",
    "include": "{% include 'x' %}",
    "int to str over 4300 digits": "{{ ('f' * 2000)|int(base=16) }}",
    "bad format": "{{ '{0[}'.format(1) }}",
    "bad % args": "{{ '%d' % 'x' }}",
    "float overflow": "{{ 10.0 ** 400 }}",
    "bad range args": "{{ range('a') }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_stopped(name):
    before = peak_rss_kib()
    t0 = time.process_time()
    with pytest.raises(ChatTemplateError):
        ChatTemplate(HOSTILE[name]).apply(CHAT)
    elapsed = time.process_time() - t0
    grown = peak_rss_kib() - before
    assert elapsed < CPU_S, elapsed
    assert grown < 768 * 1024, f"peak memory grew by {grown // 1024} MB"  # KiB


def test_hostile_template_through_encode_chat(tdir):
    cfg = json.loads(data_path("tokenizer_config.json").read_text())
    cfg["chat_template"] = HOSTILE["nested range loops"]
    _put(tdir, "tokenizer_config.json", json.dumps(cfg))
    tok = Tokenizer.from_dir(tdir)
    with pytest.raises(ChatTemplateError, match="loop iterations"):
        tok.encode_chat(CHAT)


@pytest.mark.parametrize("source", [None, 42, b"{{ x }}", ["{{ x }}"]])
def test_template_source_must_be_a_string(source):
    with pytest.raises(ChatTemplateError, match="must be a string"):
        ChatTemplate(source)


def test_limits_are_per_render_and_per_thread():
    """A render that ran out of budget leaves nothing behind, and a hostile render in one thread
    does not spend the budget of a render in another."""
    hostile, good = ChatTemplate(HOSTILE["loop.cycle in nested loops"]), ChatTemplate(QWEN3_TEMPLATE)
    for _ in range(2):
        with pytest.raises(ChatTemplateError):
            hostile.apply(CHAT)
        assert good.apply(CHAT).startswith("<|im_start|>user\nHi")
    results: list[Any] = []

    def run(t: ChatTemplate) -> None:
        try:
            results.append(t.apply(CHAT))
        except ChatTemplateError as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in (hostile, good, good)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sum(isinstance(r, ChatTemplateError) for r in results) == 1
    assert sum(isinstance(r, str) for r in results) == 2


def test_large_legitimate_conversations_still_render():
    """Limits sit far above real use: 2,000 turns with thinking blocks, and a 2 MB message."""
    t = ChatTemplate(QWEN3_TEMPLATE)
    turns = [m for i in range(1000) for m in ({"role": "user", "content": f"question {i}"},
                                               {"role": "assistant", "content": f"<think>t{i}</think>answer {i}"})]
    out = t.apply(turns + CHAT)
    assert out.count("<|im_start|>") == 2002  # 2,001 turns and the generation prompt
    big = "word " * 400_000
    assert len(t.apply([{"role": "user", "content": big}])) > len(big)
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(500)]
    assert "f499" in t.apply(CHAT, tools=tools)


def test_ordinary_template_features_still_work():
    src = ("{{ [1, 2]|sum }} {{ '%s-%05d' % ('a', 3) }} {{ '{:>5}'.format('x') }} {{ 'a b'|wordwrap(1) }} "
           "{{ [1, 2]|join(',') }} {{ 'x'|indent(2, true) }} {{ {'a': 1}|tojson(indent=2) }} "
           "{{ 'aXa'|replace('X', 'y') }} {{ [1, 2, 3]|batch(2, 0)|list }} {{ [1, 2, 3]|slice(2)|list }} "
           "{{ lipsum(1, false, 2, 3)|length > 0 }} {{ strftime_now('%Y')|length }} {{ 'ab' ~ 1 ~ none }} "
           "{{ 2 ** 10 }} {{ 'ab' * 2 }} {{ [1] + [2] }} {% for x in 'ab' %}{{ loop.index }}{% endfor %} "
           "{{ messages|map(attribute='content')|join }} {{ 'a,b'.split(',')|length }} {{ 'x'.center(5) }}")
    out = ChatTemplate(src).apply(CHAT)
    assert out == ('3 a-00003     x a\nb 1,2   x {\n  "a": 1\n} aya [[1, 2], [3, 0]] [[1, 2], [3]] True 4 ab1None '
                   "1024 abab [1, 2] 12 Hi 2   x  ")


# ---- fuzz: any tokenizer_config.json value loads or raises TokenizationError ------------------------

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=12)
    | st.sampled_from(["<|im_end|>", "{{ messages }}", "{% for %}", "{{ 'a' * 10**10 }}"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["content", "name", "template", "default"]), inner, max_size=3),
    max_leaves=6,
)
FIELDS = st.sampled_from(["chat_template", "eos_token", "bos_token", "pad_token", "unk_token", "eos_token_id"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(FIELDS, VALUES, min_size=1, max_size=3), where=st.sampled_from(
    ["tokenizer_config.json", "config.json", "generation_config.json"]))
def test_fuzz_tokenizer_config_fields(tdir, changes, where):
    cfg = json.loads(data_path(where).read_text()) if where != "config.json" else {}
    cfg.update(changes)
    _put(tdir, where, json.dumps(cfg))
    try:
        tok = Tokenizer.from_dir(tdir)
    except TokenizationError:
        return
    finally:
        _put(tdir, where, data_path(where).read_bytes() if where != "config.json" else b"{}")
    if tok.chat_template is not None:
        try:
            tok.encode_chat(CHAT)
        except TokenizationError:
            pass
