"""Tokenizers rebuilt from GGUF metadata (tokenization.tokenizer_files): ids equal llama.cpp's on
its own tokenizer test vocabularies and on SmolLM2 (golden ids from llama-tokenize), the GGUF's
chat template renders as transformers renders it, and hostile metadata raises GGUFMetadataError
naming the key."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_serving.tokenization import (
    GGUFMetadataError,
    StreamingDetokenizer,
    TokenizationError,
    Tokenizer,
    _gguf,
    plain_metadata,
    tokenizer_files,
)

#: The llama.cpp test vocabularies tokenizer_files supports (not bert-bge, gemma-4: other models).
LLAMA_CPP_VOCABS = ("command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "llama-spm",
                    "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")
GOLDEN = json.loads((Path(__file__).parent / "data" / "smollm2_llamacpp_ids.json").read_text(encoding="utf-8"))
CASES = GOLDEN["cases"]


def _metadata(path: Path) -> dict[str, object]:
    return plain_metadata(mx.load(str(path), return_metadata=True)[1])


def _tokenizer(metadata: dict[str, object], root: Path) -> Tokenizer:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(metadata).items():
        (root / name).write_text(text, encoding="utf-8")
    return Tokenizer.from_dir(root)


def _llamacpp_cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's tests/test-tokenizer-0.cpp ``read_tests``: texts separated by
    ``\\n__ggml_vocab_test__\\n`` (one after the last), one line of space-separated ids each."""
    texts = Path(f"{gguf}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":
        texts.pop()
    ids = Path(f"{gguf}.out").read_text(encoding="utf-8").split("\n")[: len(texts)]
    assert len(ids) == len(texts)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]


@pytest.mark.timeout(900)  # the first one fetches the sdist (76 MB) when the cache lacks it
@pytest.mark.parametrize("name", LLAMA_CPP_VOCABS)
def test_llamacpp_vocab(name: str, llamacpp_vocabs: Path, tmp_path: Path) -> None:
    """Every .inp text encodes to its .out ids. llama.cpp's test tokenizes with add_special=false
    and parse_special=false (no BOS, control-token strings as text): Tokenizer.encode's contract."""
    gguf = llamacpp_vocabs / f"ggml-vocab-{name}.gguf"
    tok = _tokenizer(_metadata(gguf), tmp_path)
    cases = _llamacpp_cases(gguf)
    assert len(cases) >= 40
    wrong = [(text, tok.encode(text), ids) for text, ids in cases if tok.encode(text) != ids]
    assert not wrong, wrong[:3]


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("smollm2_tokenizer")
    _tokenizer(_metadata(smollm2_gguf), root)
    return root


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_tokenizer_dir)


def test_smollm2_golden_ids(smollm2: Tokenizer) -> None:
    """llama-tokenize's ids (tests/tokenization/data/smollm2_llamacpp_ids.json, see its note),
    with special strings as text and as control tokens; byte-level decode gives the text back."""
    assert len(CASES) >= 25
    for case in CASES:
        assert smollm2.encode(case["text"]) == case["ids"], case["text"]
        assert smollm2.encode(case["text"], parse_special=True) == case["ids_parse_special"], case["text"]
        assert smollm2.decode(case["ids"]) == case["text"]
    assert smollm2.encode_batch([c["text"] for c in CASES]) == [c["ids"] for c in CASES]


def test_smollm2_specials_and_streaming(smollm2: Tokenizer) -> None:
    assert smollm2.eos_token_ids == {2}  # tokenizer.ggml.eos_token_id: <|im_end|>
    assert smollm2.vocab_size == 49152
    specials = smollm2.special_token_strings()
    assert len(specials) == 17 and specials[1] == "<|im_start|>"  # the 17 control tokens
    ids = [i for case in CASES for i in case["ids_parse_special"]]
    detok = StreamingDetokenizer(smollm2)
    pieces = [detok.add(i) for i in ids] + [detok.finalize()]
    assert "".join(pieces) == smollm2.decode(ids)


def test_smollm2_transformers_conversion_agrees(smollm2_gguf: Path) -> None:
    """transformers' own GGUF tokenizer conversion (integrations/gguf/gguf_tokenizer_mapping.py,
    called directly: AutoTokenizer's gguf_file path needs torch for its reader) gives the same ids
    on these texts, although it splits SmolLM2 text with the plain GPT-2 regex (no entry for
    pre "smollm"): the vocabulary has no multi-digit or space+digit token to merge."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    meta = _metadata(smollm2_gguf)
    names = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    fields = {name: meta[f"tokenizer.{key}"] for key, name in names.items() if f"tokenizer.{key}" in meta}
    backend, _ = mapping.convert_gguf_tokenizer(meta["general.architecture"], fields)
    backend.encode_special_tokens = True
    for case in CASES:
        assert backend.encode(case["text"], add_special_tokens=False).ids == case["ids"], case["text"]


CONVERSATIONS = [
    ([{"role": "user", "content": "Hi there"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], True),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": "and ×3? 日本"}], True),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
     False),
]


@pytest.mark.parametrize(("messages", "add_generation_prompt"), CONVERSATIONS)
def test_smollm2_chat_template_parity(smollm2: Tokenizer, smollm2_tokenizer_dir: Path, messages: list[dict[str, str]],
                                      add_generation_prompt: bool) -> None:
    """The GGUF's tokenizer.chat_template, rendered by ChatTemplate, equals transformers'
    apply_chat_template(tokenize=False) on the same files; encode_chat gives its control ids."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir), local_files_only=True)
    assert smollm2.chat_template is not None
    ours = smollm2.chat_template.apply(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = smollm2.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == smollm2.encode(ours, parse_special=True) and ids.count(1) == ours.count("<|im_start|>")


# ---- hostile metadata --------------------------------------------------------------------------

def _bpe() -> dict[str, object]:
    """A valid tiny byte-level BPE vocabulary."""
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": ["<|endoftext|>", "a", "b", "ab", "Ġ", "Ġab"],
            "tokenizer.ggml.merges": ["a b", "Ġ ab"], "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1],
            "tokenizer.ggml.eos_token_id": 0, "tokenizer.chat_template": "{{ messages[0]['content'] }}"}


def _spm() -> dict[str, object]:
    """A valid tiny SentencePiece vocabulary (byte tokens for fallback)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "▁a", "ab", "▁ab"]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 6,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def test_tiny_vocabularies_build(tmp_path: Path) -> None:
    bpe = _tokenizer(_bpe(), tmp_path / "bpe")
    assert bpe.encode("ab ab") == [3, 5] and bpe.encode("<|endoftext|>") != [0]
    assert bpe.encode("<|endoftext|>", parse_special=True) == [0] and bpe.eos_token_ids == {0}
    spm = _tokenizer(_spm(), tmp_path / "spm")
    assert spm.encode("ab ab") == [264, 264]  # ▁ab ▁ab: a ▁ prepended, the space written ▁
    assert spm.encode("  a") == [259, 259, 262]  # ▁ ▁ ▁a: prepended even before a space (llama.cpp)
    assert spm.encode("é") == [259, 0xC3 + 3, 0xA9 + 3]  # byte fallback for a character without a token
    assert spm.decode(spm.encode("ab é")) == "ab é"
    config = json.loads(tokenizer_files(_spm())["tokenizer_config.json"])
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>" and config["unk_token"] == "<unk>"


HOSTILE = [
    ("tokenizer.ggml.model", None, "missing"),
    ("tokenizer.ggml.model", "bert", "unsupported tokenizer model 'bert'"),
    ("tokenizer.ggml.model", 3, "must be str"),
    ("tokenizer.ggml.pre", "no-such-pre", "unsupported pre-tokenizer 'no-such-pre'"),
    ("tokenizer.ggml.tokens", None, "missing"),
    ("tokenizer.ggml.tokens", "abc", "must be list"),
    ("tokenizer.ggml.tokens", [], "empty vocabulary"),
    ("tokenizer.ggml.tokens", ["<|endoftext|>", "a", "b", "ab", "Ġ", 7], "entry 5 must be str"),
    ("tokenizer.ggml.tokens", ["<|endoftext|>", "a", "b", "ab", "a", "Ġab"], "entry 4 'a' repeats entry 1"),
    ("tokenizer.ggml.tokens", ["<|endoftext|>", "a", "b", "ab", "Ġ", "x" * 5000], "entry 5 is 5000 characters"),
    ("tokenizer.ggml.merges", None, "missing"),
    ("tokenizer.ggml.merges", ["a c"], "entry 0 'a c' names 'c', not in tokenizer.ggml.tokens"),
    ("tokenizer.ggml.merges", ["b a"], "names 'ba'"),
    ("tokenizer.ggml.merges", ["ab"], "names ''"),
    ("tokenizer.ggml.merges", [b"a b"], "entry 0 must be str"),
    ("tokenizer.ggml.token_type", [3, 1], "2 entries for 6 tokens"),
    ("tokenizer.ggml.token_type", ["3"] * 6, "entry 0 must be a finite int"),
    ("tokenizer.ggml.token_type", [True] * 6, "entry 0 must be a finite int"),
    ("tokenizer.ggml.eos_token_id", 6, "id 6 outside the vocabulary (0..5)"),
    ("tokenizer.ggml.eos_token_id", -1, "id -1 outside"),
    ("tokenizer.ggml.eos_token_id", "0", "must be int"),
    ("tokenizer.ggml.bos_token_id", True, "must be int, got bool"),
    ("tokenizer.ggml.add_bos_token", 1, "must be bool, got int"),
    ("tokenizer.chat_template", ["t"], "must be str"),
]


@pytest.mark.parametrize(("key", "value", "message"), HOSTILE)
def test_hostile_bpe_metadata(key: str, value: object, message: str) -> None:
    meta = _bpe()
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    with pytest.raises(GGUFMetadataError) as info:
        tokenizer_files(meta)
    assert info.value.key == key and f"GGUF metadata {key}: " in str(info.value) and message in str(info.value)
    assert isinstance(info.value, TokenizationError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("tokenizer.ggml.scores", None, "missing"),
    ("tokenizer.ggml.scores", [math.nan] * 265, "entry 0 must be a finite float"),
    ("tokenizer.ggml.scores", [0.0] * 10, "10 entries for 265 tokens"),
    ("tokenizer.ggml.unknown_token_id", 265, "outside the vocabulary"),
    ("tokenizer.ggml.add_space_prefix", "yes", "must be bool"),
])
def test_hostile_spm_metadata(key: str, value: object, message: str) -> None:
    meta = _spm()
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    with pytest.raises(GGUFMetadataError, match=message) as info:
        tokenizer_files(meta)
    assert info.value.key == key


def test_size_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lists over MAX_TOKENS, all tokens over MAX_TOTAL_CHARS, and SentencePiece merge derivation
    over MAX_MERGE_WORK stop before any work (limits lowered here to keep the test small)."""
    for limit, value, meta, message in [
        ("MAX_TOKENS", 5, _bpe(), "tokenizer.ggml.tokens: 6 entries, more than 5"),
        ("MAX_TOTAL_CHARS", 8, _bpe(), "tokenizer.ggml.tokens: 21 characters in all, more than 8"),
        ("MAX_MERGE_WORK", 100, _spm(), "tokenizer.ggml.tokens: tokens too long to derive merges"),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(_gguf, limit, value)
            with pytest.raises(GGUFMetadataError, match=message):
                tokenizer_files(meta)


KEYS = sorted({*_bpe(), *_spm(), "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.padding_token_id"})
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=8), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from([_bpe, _spm]), changes=st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=3))
def test_fuzzed_metadata_raises_only_typed_errors(base, changes: dict[str, object]) -> None:
    """Any value under any tokenizer key: files, or GGUFMetadataError (never KeyError, IndexError,
    TypeError or the tokenizers library's own exception)."""
    meta = {**base(), **changes}
    try:
        files = tokenizer_files(meta)
    except GGUFMetadataError:
        return
    assert set(files) == {"tokenizer.json", "tokenizer_config.json"}


def test_plain_metadata() -> None:
    meta = {"a": mx.array(3, dtype=mx.uint32), "b": mx.array(True), "c": mx.array([1.5, 2.0]),
            "d": np.array([1, 2], dtype=np.int32), "e": ["x", "y"], "f": "text"}
    plain = plain_metadata(meta)
    assert plain == {"a": 3, "b": True, "c": [1.5, 2.0], "d": [1, 2], "e": ["x", "y"], "f": "text"}
    assert type(plain["a"]) is int and type(plain["b"]) is bool and type(plain["d"][0]) is int
