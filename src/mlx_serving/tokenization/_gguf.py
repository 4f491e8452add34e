"""Tokenizer files (``tokenizer.json``, ``tokenizer_config.json``) from a GGUF file's metadata.

A GGUF carries its tokenizer as key/value metadata under llama.cpp's names (``tokenizer.ggml.*``).
``tokenizer_files`` rebuilds the tokenizer with the ``tokenizers`` library so that
``Tokenizer.from_dir`` on the written files encodes as llama.cpp does (``llama_vocab::impl::load``
and ``tokenize`` in llama.cpp's src/llama-vocab.cpp, version vendored by llama-cpp-python 0.3.36):

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` + ``merges``; the text is
  split by the regexes llama.cpp picks for ``tokenizer.ggml.pre`` (``llm_tokenizer_bpe``), applied
  one after another with every match and every gap kept (``unicode_regex_split``), then written in
  the GPT-2 byte alphabet.
- ``tokenizer.ggml.model == "llama"``: SentencePiece BPE from ``tokens`` + ``scores`` (merges ranked
  by the merged token's score, ``llm_tokenizer_spm_session``), ``<0xXX>`` byte fallback, spaces as
  ``▁``, and a ``▁`` prepended to every text fragment when ``add_space_prefix`` (default true).

Token types (``tokenizer.ggml.token_type``, llama.cpp's ``llama_token_type``): 3 (control) and
2 (unknown) become special added tokens, which ``Tokenizer.encode`` leaves as text as llama.cpp does
with ``parse_special=false``; 4 (user-defined) become non-special added tokens, matched in text.

The metadata is untrusted: every value is type- and size-checked, and every problem raises
``GGUFMetadataError`` naming the metadata key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, overload

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from ._errors import TokenizationError

__all__ = ["GGUFMetadataError", "MAX_TOKENS", "plain_metadata", "tokenizer_files"]

#: Most tokens (``tokenizer.ggml.tokens``) and most merges accepted.
MAX_TOKENS = 2**24
#: Longest token and longest merge string, in characters.
MAX_TOKEN_CHARS = 4096
#: Most characters of all tokens, and of all merges: the 64 MiB ``tokenizer.json`` cap of
#: ``Tokenizer.from_dir`` (``MAX_TOKENIZER_BYTES``) could not hold more.
MAX_TOTAL_CHARS = 64 * 2**20
#: Most work (sum of squared token lengths) spent deriving SentencePiece merges from the tokens.
MAX_MERGE_WORK = 2**28

# llama.cpp's llama_token_type (include/llama.h).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Non-ASCII ranges written as \u escapes, as in llama.cpp's source (copying the characters risks an
# editor's Unicode normalization turning a range end into another code point).
_CJK = "\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-z" + "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+",
    r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    f"[{_CJK}]+",
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", f"[{_CJK}]+", r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + f"(?:{_CONTRACTIONS})?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + f"(?:{_CONTRACTIONS})?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")

#: ``tokenizer.ggml.pre`` -> (regexes, ignore_merges): llama.cpp's ``llama_vocab::impl::load`` maps
#: the name to a pre-type (and ``ignore_merges``), ``llm_tokenizer_bpe``'s constructor the pre-type
#: to the regexes. Only pre-types whose regexes are llama.cpp's plain ports of the reference
#: tokenizer.json are listed (those llama.cpp hand-codes in unicode.cpp, e.g. kimi-k2, are not).
_PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT, False),
    **{n: ((_LLAMA3,), True) for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                         "midm-2.0", "lfm2", "jina-v5-nano")},
    **{n: ((_LLAMA3,), False) for n in ("dbrx", "smaug-bpe")},
    "deepseek-llm": (_DEEPSEEK_LLM, False),
    "deepseek-coder": (_DEEPSEEK_CODER, False),
    **{n: (_DEEPSEEK_V3, False) for n in ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4")},
    "falcon": (_FALCON, False),
    **{n: ((r"\p{N}", _GPT2), False) for n in ("starcoder", "refact", "command-r", "smollm", "codeshell",
                                                "exaone", "minerva-7b", "mellum2")},
    **{n: ((_GPT2,), False) for n in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                                       "a.x-4.0", "mellum", "mpt", "olmo", "jais", "trillion", "granite-docling",
                                       "exaone4")},
    **{n: ((_QWEN2,), False) for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                                        "hunyuan", "solar-open")},
    "qwen35": ((_QWEN35,), False),
    "tekken": ((_TEKKEN,), True),
    **{n: ((_GPT4O,), False) for n in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
}


class GGUFMetadataError(TokenizationError):
    """GGUF tokenizer metadata is missing, of the wrong type or size, or inconsistent; ``key`` is
    the metadata key at fault."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"GGUF metadata {key}: {problem}")
        self.key = key


def plain_metadata(meta: Mapping[str, object]) -> dict[str, object]:
    """GGUF metadata as plain Python: each array-like value (``mx.array`` from
    ``mx.load(path, return_metadata=True)[1]``, or a numpy array) becomes ``.tolist()`` (a scalar
    for a 0-d array, a list otherwise); str and list values pass through."""
    return {key: value.tolist() if hasattr(value, "tolist") else value for key, value in meta.items()}


def tokenizer_files(metadata: Mapping[str, object]) -> dict[str, str]:
    """``{"tokenizer.json": ..., "tokenizer_config.json": ...}`` (file name -> text) rebuilt from a
    GGUF's metadata (plain Python values, see ``plain_metadata``), for ``Tokenizer.from_dir``.

    Raises:
        GGUFMetadataError: a ``tokenizer.*`` key is missing, mistyped, too large or inconsistent
            (unsupported ``tokenizer.ggml.model`` / ``tokenizer.ggml.pre`` included), named.
    """
    model = _get(metadata, "tokenizer.ggml.model", str, required=True)
    tokens = _tokens(metadata)
    types = _numbers(metadata, "tokenizer.ggml.token_type", len(tokens), int) or [1] * len(tokens)
    if model == "gpt2":
        backend, add_bos = _byte_level_bpe(metadata, tokens), False
    elif model == "llama":
        backend, add_bos = _sentencepiece_bpe(metadata, tokens), True
    else:
        raise GGUFMetadataError("tokenizer.ggml.model", f"unsupported tokenizer model {model!r} "
                                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k in (_CONTROL, _UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
    add_bos = _get(metadata, "tokenizer.ggml.add_bos_token", bool, default=add_bos)
    config = _tokenizer_config(metadata, tokens, add_bos)
    if add_bos and config["bos_token"] is not None:
        bos = config["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokens.index(bos))])
    return {"tokenizer.json": backend.to_str(), "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2)}


def _get(metadata: Mapping[str, object], key: str, kind: type, *, required: bool = False,
         default: Any = None) -> Any:
    """``metadata[key]`` checked to be a ``kind`` (an ``int`` is not a ``bool`` and vice versa),
    ``default`` when absent. Raises GGUFMetadataError when absent but required, or mistyped."""
    if key not in metadata:
        if required:
            raise GGUFMetadataError(key, "missing")
        return default
    value = metadata[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GGUFMetadataError(key, f"must be {kind.__name__}, got {type(value).__name__}")
    return value


def _list(metadata: Mapping[str, object], key: str, required: bool) -> list[Any] | None:
    value = _get(metadata, key, list, required=required)
    if value is not None and len(value) > MAX_TOKENS:
        raise GGUFMetadataError(key, f"{len(value)} entries, more than {MAX_TOKENS}")
    return value


def _strings(metadata: Mapping[str, object], key: str, required: bool) -> list[str] | None:
    """A list of str, each at most ``MAX_TOKEN_CHARS`` long, ``MAX_TOTAL_CHARS`` in all."""
    values = _list(metadata, key, required)
    if values is None:
        return None
    total = 0
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise GGUFMetadataError(key, f"entry {i} must be str, got {type(value).__name__}")
        if len(value) > MAX_TOKEN_CHARS:
            raise GGUFMetadataError(key, f"entry {i} is {len(value)} characters, more than {MAX_TOKEN_CHARS}")
        total += len(value)
    if total > MAX_TOTAL_CHARS:
        raise GGUFMetadataError(key, f"{total} characters in all, more than {MAX_TOTAL_CHARS}")
    return values


def _numbers(metadata: Mapping[str, object], key: str, count: int, kind: type) -> list[Any] | None:
    """A list of ``kind`` (int, or float which also takes int) with at least ``count`` entries
    (llama.cpp reads the first ``count``, as in its ``Index out of array bounds`` check); floats
    must be finite."""
    values = _list(metadata, key, False)
    if values is None:
        return None
    if len(values) < count:
        raise GGUFMetadataError(key, f"{len(values)} entries for {count} tokens")
    kinds = (int, float) if kind is float else (int,)
    for i, value in enumerate(values[:count]):
        if not isinstance(value, kinds) or isinstance(value, bool) or (kind is float and not math.isfinite(value)):
            raise GGUFMetadataError(key, f"entry {i} must be a finite {kind.__name__}, got {value!r:.40}")
    return values[:count]


def _tokens(metadata: Mapping[str, object]) -> list[str]:
    """``tokenizer.ggml.tokens``: non-empty, unique (llama.cpp asserts it); an empty token is
    renamed ``[EMPTY_<id>]`` as llama.cpp does."""
    tokens = _strings(metadata, "tokenizer.ggml.tokens", required=True)
    assert tokens is not None
    if not tokens:
        raise GGUFMetadataError("tokenizer.ggml.tokens", "empty vocabulary")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if seen.setdefault(token, i) != i:
            raise GGUFMetadataError("tokenizer.ggml.tokens", f"entry {i} {token!r:.60} repeats entry {seen[token]}")
    return tokens


def _merges(metadata: Mapping[str, object], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, split at the first space after the first character
    (llama.cpp's ``word.find(' ', 1)``); both halves and their concatenation must be tokens."""
    key = "tokenizer.ggml.merges"
    merges = _strings(metadata, key, required=True)
    assert merges is not None
    pairs = []
    for i, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1:]) if cut > 0 else (merge, "")
        for part in (left, right, left + right):
            if part not in vocab:
                raise GGUFMetadataError(key, f"entry {i} {merge!r:.60} names {part!r:.60}, not in tokenizer.ggml.tokens")
        pairs.append((left, right))
    return pairs


def _byte_level_bpe(metadata: Mapping[str, object], tokens: list[str]) -> tokenizers.Tokenizer:
    """Byte-level BPE for ``tokenizer.ggml.model == "gpt2"`` (llama.cpp's ``llm_tokenizer_bpe``):
    the ``pre`` regexes as isolated splits in sequence, then the GPT-2 byte alphabet; no
    normalizer (llama.cpp has none). A missing ``pre`` is llama.cpp's "default"."""
    pre = _get(metadata, "tokenizer.ggml.pre", str, default="default")
    if pre not in _PRE:
        raise GGUFMetadataError("tokenizer.ggml.pre", f"unsupported pre-tokenizer {pre!r:.60} "
                                f"(supported: {', '.join(sorted(_PRE))})")
    regexes, ignore_merges = _PRE[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, _merges(metadata, vocab), ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: Mapping[str, object], tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece BPE for ``tokenizer.ggml.model == "llama"`` (llama.cpp's
    ``llm_tokenizer_spm_session``): merges ranked by the score of the merged token, ``<0xXX>``
    byte fallback for characters without a token, spaces written ``▁`` and, with
    ``add_space_prefix`` (llama.cpp's default true for this model), a ``▁`` prepended to every text
    fragment (a Prepend normalizer: llama.cpp prepends even to text that starts with a space)."""
    scores = _numbers(metadata, "tokenizer.ggml.scores", len(tokens), float)
    if scores is None:
        raise GGUFMetadataError("tokenizer.ggml.scores", "missing (a SentencePiece vocabulary needs scores)")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = _token_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens), default=0)
    model = models.BPE(vocab, _derived_merges(tokens, scores), unk_token=tokens[unk], fuse_unk=True,
                       byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    prefix = _get(metadata, "tokenizer.ggml.add_space_prefix", bool, default=True)
    replace = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend


def _derived_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split ``(left, right)`` of a token whose halves are tokens, best merged score first
    (ties: longer left half, then vocabulary order), as transformers' ``generate_merges`` orders
    them; llama.cpp merges the adjacent pair whose concatenation scores highest, which is this
    rank order. Raises GGUFMetadataError past ``MAX_MERGE_WORK``."""
    work = sum(len(t) ** 2 for t in tokens)
    if work > MAX_MERGE_WORK:
        raise GGUFMetadataError("tokenizer.ggml.tokens", f"tokens too long to derive merges ({work} > {MAX_MERGE_WORK})")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []  # (score, len(left), len(right), left, right)
    for token, score in zip(tokens, scores):
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in splits)
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


@overload
def _token_id(metadata: Mapping[str, object], key: str, count: int, default: int) -> int: ...


@overload
def _token_id(metadata: Mapping[str, object], key: str, count: int, default: None = None) -> int | None: ...


def _token_id(metadata: Mapping[str, object], key: str, count: int, default: int | None = None) -> int | None:
    """A token id (``tokenizer.ggml.*_token_id``) in 0..count-1, ``default`` when absent."""
    value = _get(metadata, key, int, default=default)
    if value is not None and not 0 <= value < count:
        raise GGUFMetadataError(key, f"id {value} outside the vocabulary (0..{count - 1})")
    return value


def _tokenizer_config(metadata: Mapping[str, object], tokens: list[str], add_bos: bool) -> dict[str, Any]:
    """tokenizer_config.json: the chat template, special-token strings from their ids, the add
    flags (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``) and ``model_max_length`` from
    ``<general.architecture>.context_length`` when present."""
    config: dict[str, Any] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = _token_id(metadata, f"tokenizer.ggml.{key}", len(tokens))
        config[name] = None if token_id is None else tokens[token_id]
    config["add_bos_token"] = add_bos
    config["add_eos_token"] = _get(metadata, "tokenizer.ggml.add_eos_token", bool, default=False)
    config["clean_up_tokenization_spaces"] = False
    template = _get(metadata, "tokenizer.chat_template", str)
    if template is not None:
        config["chat_template"] = template
    architecture = _get(metadata, "general.architecture", str)
    if architecture is not None:
        context = _get(metadata, f"{architecture}.context_length", int)
        if context is not None:
            config["model_max_length"] = context
    return config
