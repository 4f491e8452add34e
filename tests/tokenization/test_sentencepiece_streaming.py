"""Streaming detokenization of SentencePiece vocabularies (Llama 2 / Mistral style: ``▁`` spaces,
``<0xXX>`` byte fallback): the pieces of StreamingDetokenizer join to Tokenizer.decode for any ids,
on llama.cpp's llama-spm test vocabulary built by tokenizer_files and on the usual Hugging Face
decoder chains; a tiny Llama GGUF with that vocabulary is served end to end."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders

from mlx_serving import Serving
from mlx_serving.models import gguf as G
from mlx_serving.models import text_generation
from mlx_serving.tokenization import (
    ByteTable,
    StreamingDetokenizer,
    TokenizationError,
    Tokenizer,
    plain_metadata,
    tokenizer_files,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from gguf_files import Shape, write_gguf  # noqa: E402

VOCAB = 32000
BYTES = range(3, 259)  # <0x00>..<0xFF> in the llama-spm vocabulary
#: A Llama 2 style chat template (the llama-spm test vocabulary carries none).
LLAMA2_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                   "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + eos_token }}"
                   "{% endif %}{% endfor %}")
TEXTS = ["Hello world", " leading", "trailing  ", "a   b", "\n\nnew\nlines\n", "中文字符 and 日本語",
         "emoji 😀🤖👍🏽 flags 🇫🇷", "  ", "x", "tab\there", "Ünïcödé ß ø", "\u2581 literal", "한국어 텍스트"]


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = StreamingDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.finalize()]


@pytest.fixture(scope="module")
def spm_metadata(llamacpp_vocabs: Path) -> dict[str, object]:
    return plain_metadata(mx.load(str(llamacpp_vocabs / "ggml-vocab-llama-spm.gguf"), return_metadata=True)[1])


@pytest.fixture(scope="module")
def spm(spm_metadata: dict[str, object], tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    root = tmp_path_factory.mktemp("llama_spm")
    for name, text in tokenizer_files(spm_metadata).items():
        (root / name).write_text(text, encoding="utf-8")
    return Tokenizer.from_dir(root)


def _ids() -> st.SearchStrategy[list[int]]:
    """Byte tokens (runs of them form and break UTF-8 characters), any token, the control tokens
    <unk> <s> </s>, and ids past the vocabulary."""
    one = st.one_of(st.sampled_from(BYTES), st.integers(0, VOCAB - 1), st.integers(0, 2),
                    st.integers(VOCAB, VOCAB + 9))
    return st.lists(one, max_size=30)


def _with_decoder(tok: Tokenizer, decoder: decoders.Decoder, added: Sequence[AddedToken] = ()) -> Tokenizer:
    backend = tokenizers.Tokenizer.from_str(tok._backend.to_str())
    backend.decoder = decoder
    backend.add_tokens(list(added))
    return Tokenizer(backend, tok.eos_token_ids)


def test_table(spm: Tokenizer) -> None:
    table = spm.byte_table()
    assert table.sentencepiece is not None and table.sentencepiece.byte_ids == frozenset(BYTES)
    assert table.sentencepiece.strip == 1  # tokenizer_files' Strip(" ", 1, 0): add_space_prefix
    assert table.pieces[3 + 0xE4] == b"\xe4" and table.texts[3 + 0xE4] is None
    hello = spm.encode("Hello")[0]
    assert table.pieces[hello] == b" Hello" and table.texts[hello] == " Hello"  # ▁ -> space
    assert table.pieces[:3] == (None, None, None)  # <unk> <s> </s>: special


@settings(max_examples=400, deadline=None)
@given(ids=_ids(), skip=st.booleans())
def test_stream_equals_decode(spm: Tokenizer, ids: list[int], skip: bool) -> None:
    pieces = _stream(spm, ids, skip)
    assert "".join(pieces) == spm.decode(ids, skip_special_tokens=skip)
    general = StreamingDetokenizer(_GeneralPathOnly(spm), skip_special_tokens=skip)  # type: ignore[arg-type]
    assert [general.add(i) for i in ids] + [general.finalize()] == pieces


class _GeneralPathOnly:
    """The same table without ``texts``: every id takes the general path."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok

    def byte_table(self) -> ByteTable:
        table = self._tok.byte_table()
        return ByteTable(table.pieces, sentencepiece=table.sentencepiece)

    def special_token_strings(self) -> dict[int, str]:
        return self._tok.special_token_strings()


@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_streams_without_broken_characters(spm: Tokenizer, text: str) -> None:
    ids = spm.encode(text)
    pieces = _stream(spm, ids)
    assert "".join(pieces) == spm.decode(ids) == text.replace("\u2581", " ")  # a typed ▁ is a space
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30))
def test_any_text_streams_back(spm: Tokenizer, text: str) -> None:
    ids = spm.encode(text)
    pieces = _stream(spm, ids)
    assert "".join(pieces) == spm.decode(ids)
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in text


def test_byte_run_is_held_until_it_ends(spm: Tokenizer) -> None:
    emoji = [3 + b for b in "😀".encode()]
    world = spm.encode("world")  # ▁world
    assert _stream(spm, [*emoji, *world]) == ["", "", "", "", "😀 world", ""]
    assert _stream(spm, emoji) == ["", "", "", "", "😀"]
    # one invalid byte makes the whole run U+FFFD, as ByteFallback does (decode agrees)
    bad = [3 + 0xE4, 3 + 0xB8, 3 + 0xAD, 3 + 0x80]
    assert "".join(_stream(spm, [*bad, *world])) == spm.decode([*bad, *world]) == "\ufffd" * 4 + " world"
    # a skipped special token does not end the run; a kept one does
    split = [3 + 0xE4, 1, 3 + 0xB8, 3 + 0xAD]
    assert "".join(_stream(spm, split)) == spm.decode(split) == "中"
    assert "".join(_stream(spm, split, False)) == spm.decode(split, False) == "\ufffd<s>\ufffd\ufffd"


def test_leading_space_of_the_first_token(spm: Tokenizer) -> None:
    """The generation's first ``▁Paris`` streams as "Paris": decode of the generated ids alone
    (the StreamingDetokenizer contract), not the " Paris" it adds after a prompt in context."""
    prompt, generated = spm.encode("The capital is"), spm.encode("Paris")
    assert _stream(spm, generated) == ["Paris", ""] and spm.decode(generated) == "Paris"
    assert spm.decode(prompt + generated)[len(spm.decode(prompt)):] == " Paris"
    two = spm.encode(" x")  # ▁▁x or ▁ ▁x: one leading space stripped, the other kept
    assert "".join(_stream(spm, two)) == spm.decode(two) == " x"
    assert "".join(_stream(spm, [1, *generated])) == "Paris"  # a skipped <s> is not the first token
    assert "".join(_stream(spm, [1, *generated], False)) == spm.decode([1, *generated], False) == "<s> Paris"


def test_reusable_after_finalize(spm: Tokenizer) -> None:
    detok = StreamingDetokenizer(spm)
    first = [detok.add(i) for i in spm.encode("one")] + [detok.finalize()]
    second = [detok.add(i) for i in spm.encode("two")] + [detok.finalize()]
    assert "".join(first) == "one" and "".join(second) == "two"


R, BF, FUSE = decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()
DECODERS = {
    "llama": decoders.Sequence([R, BF, FUSE, decoders.Strip(" ", 1, 0)]),
    "strip-2": decoders.Sequence([R, BF, FUSE, decoders.Strip(" ", 2, 0)]),
    "no-strip (gemma)": decoders.Sequence([R, BF, FUSE]),
    "metaspace-first": decoders.Metaspace("▁", prepend_scheme="first"),
    "metaspace-always": decoders.Metaspace("▁", prepend_scheme="always"),
    "metaspace-never": decoders.Metaspace("▁", prepend_scheme="never"),
    "metaspace+bytes": decoders.Sequence([decoders.Metaspace("▁", prepend_scheme="first"), BF, FUSE]),
    "replace-only": R,
}


@pytest.fixture(scope="module")
def chains(spm: Tokenizer) -> dict[str, Tokenizer]:
    """The llama-spm tokenizer under each chain, with a user-defined added token holding ▁ and a
    leading space (id 32000, drawn among the ids past the vocabulary)."""
    added = [AddedToken(" x▁y", special=False, normalized=False)]
    return {name: _with_decoder(spm, decoder, added) for name, decoder in DECODERS.items()}


@pytest.mark.parametrize("name", DECODERS)
@settings(max_examples=60, deadline=None)
@given(ids=_ids(), skip=st.booleans())
def test_hugging_face_decoder_chains(chains: dict[str, Tokenizer], name: str, ids: list[int], skip: bool) -> None:
    """Each supported chain gives decode's text."""
    tok = chains[name]
    assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("decoder", [
    decoders.WordPiece(), decoders.Sequence([FUSE, R]), decoders.Sequence([R, BF, decoders.Strip(" ", 1, 0)]),
    decoders.Sequence([R, BF, FUSE, decoders.Strip(" ", 0, 1)]), decoders.Replace("_", " "),
    decoders.Sequence([BF, R, FUSE]), decoders.Metaspace("_"),
], ids=["wordpiece", "fuse-first", "strip-without-fuse", "strip-trailing", "other-replace", "bytes-first",
        "other-metaspace"])
def test_other_decoders_are_refused(spm: Tokenizer, decoder: decoders.Decoder) -> None:
    with pytest.raises(TokenizationError, match="byte-level BPE decoder or a SentencePiece one"):
        _with_decoder(spm, decoder).byte_table()


# ---- end to end: a tiny Llama GGUF with the llama-spm vocabulary --------------------------------

@pytest.fixture(scope="module")
def spm_checkpoint(spm_metadata: dict[str, object], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spm_gguf")
    vocab = {k: v for k, v in spm_metadata.items() if k.startswith("tokenizer.")}
    vocab["tokenizer.chat_template"] = LLAMA2_TEMPLATE
    write_gguf(root / "m.gguf", Shape(layers=1), tokenizer=vocab)
    return G.convert(root / "m.gguf", root / "ckpt")


def test_served_text_equals_decoded_ids(spm_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(spm_checkpoint)
    assert json.loads((spm_checkpoint / "config.json").read_text())["vocab_size"] == VOCAB
    serving = text_generation.from_mlx4bit(spm_checkpoint, max_new_tokens=24, max_len=256, max_batch=2)
    try:
        for request in ({"text": "Hello world, 中文 😀", "seed": 1, "temperature": 1.0},
                        {"text": "The capital of France is"}):
            result = serving.run(request)["results"][0]
            with serving.stream(request) as stream:
                items = list(stream)
            pieces, final = items[:-1], items[-1]
            assert all(isinstance(p, str) and p for p in pieces) and final["num_tokens"] == result["num_tokens"]
            assert "".join(pieces) == result["generated_text"]
            ids = _generated_ids(serving, request, result["num_tokens"])
            assert tok.decode(ids) == result["generated_text"]
        chat = serving.run({"messages": [{"role": "user", "content": "Hi there"}]})["results"][0]
        prompt = tok.encode_chat([{"role": "user", "content": "Hi there"}])
        assert prompt[0] == 1 and tok.decode(prompt) == "[INST] Hi there [/INST]"
        assert chat["token_summary"]["input"] == len(prompt) and isinstance(chat["generated_text"], str)
    finally:
        serving.close()


def _generated_ids(serving: Serving, request: dict[str, object], count: int) -> list[int]:
    """The request's generated ids, from one logprob entry per token (same seed, same ids)."""
    with serving.stream({**request, "logprobs": True}) as stream:
        deltas = [item for item in stream if "logprobs" in item]
    ids = [entry["token_id"] for delta in deltas for entry in delta["logprobs"]]
    assert len(ids) == count
    return ids
