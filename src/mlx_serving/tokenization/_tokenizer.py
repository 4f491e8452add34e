"""``Tokenizer``: a checkpoint's tokenizer over the ``tokenizers`` library, with its EOS ids and
chat template, and special-token safety for user text."""

from __future__ import annotations

import functools
import gzip
import json
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from .._paths import resolves_inside
from ._chat import ChatTemplate, Message
from ._data import data_path
from ._errors import ChatTemplateError, InvalidTextError, TokenizationError
from ._specials import SpecialTokens
from ._stream import ByteTable, check_id, sentencepiece_chain

_TEMPLATE_VARIABLES = ("bos_token", "eos_token", "pad_token", "unk_token")


#: Largest tokenizer.json read, also after decompressing tokenizer.json.gz (Qwen3's: 11.4 MB).
MAX_TOKENIZER_BYTES = 64 * 2**20
#: Largest tokenizer_config.json, generation_config.json, config.json or chat_template.jinja read.
MAX_CONFIG_BYTES = 16 * 2**20
#: Most added (special and non-special) tokens a tokenizer.json may declare (Qwen3: 26).
MAX_ADDED_TOKENS = 65_536


def _inside(model_dir: Path, name: str) -> Path:
    """``model_dir / name``, refusing a symlink that resolves outside ``model_dir`` (except, for a
    Hugging Face cache snapshot ``<repo>/snapshots/<rev>/``, into ``<repo>/blobs/``:
    :func:`mlx_serving._paths.allowed_roots`)."""
    path = model_dir / name
    try:
        inside, real = resolves_inside(path, model_dir)
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise TokenizationError(f"{path} cannot be resolved ({exc})") from None
    if not inside:
        raise TokenizationError(f"{path} resolves to {real}, outside the tokenizer directory")
    return path


def _regular(path: Path) -> Path:
    if not path.is_file():
        raise TokenizationError(f"{path} is not a regular file")
    return path


def _read_bytes(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TokenizationError(f"{path} is larger than the {limit:,} bytes allowed")
    return data


def _utf8(data: bytes, path: Path, error: type[TokenizationError] = TokenizationError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of the tokenizer directory (``{}`` when absent). Raises
    TokenizationError naming the file when it is too large, not UTF-8, not JSON or not an
    object, or a symlink out of the directory."""
    if not os.path.lexists(path):
        return {}
    path = _regular(_inside(path.parent, path.name))
    try:
        value = json.loads(_utf8(_read_bytes(path, MAX_CONFIG_BYTES), path))
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, TokenizationError):
            raise
        raise TokenizationError(f"{path} is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise TokenizationError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _load_backend(model_dir: Path) -> tokenizers.Tokenizer:
    """tokenizer.json, or tokenizer.json.gz decompressed: at most ``MAX_TOKENIZER_BYTES`` either
    way (a gzip bomb stops there, never decompressed whole)."""
    plain, packed = model_dir / "tokenizer.json", model_dir / "tokenizer.json.gz"
    if os.path.lexists(plain):
        path = _regular(_inside(model_dir, plain.name))
        data = _read_bytes(path, MAX_TOKENIZER_BYTES)
    elif os.path.lexists(packed):
        path = _regular(_inside(model_dir, packed.name))
        try:
            with gzip.open(path, "rb") as f:
                data = f.read(MAX_TOKENIZER_BYTES + 1)
        except (OSError, EOFError, zlib.error) as exc:
            raise TokenizationError(f"{path} is not a valid gzip file ({exc})") from None
        if len(data) > MAX_TOKENIZER_BYTES:
            raise TokenizationError(f"{path} decompresses to more than the {MAX_TOKENIZER_BYTES:,} bytes allowed")
    else:
        raise FileNotFoundError(f"{model_dir} has neither tokenizer.json nor tokenizer.json.gz")
    text = _utf8(data, path)
    try:
        backend = tokenizers.Tokenizer.from_str(text)
    except BaseException as exc:  # noqa: BLE001 - the Rust side may panic (pyo3 PanicException)
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        raise TokenizationError(f"{path} is not a valid tokenizer.json: {str(exc)[:300]}") from None
    added = len(backend.get_added_tokens_decoder())
    if added > MAX_ADDED_TOKENS:
        raise TokenizationError(f"{path} has {added:,} added tokens (at most {MAX_ADDED_TOKENS:,})")
    return backend


def _token_text(value: Any, name: str = "token") -> str | None:
    """A special-token entry of tokenizer_config.json: a string, or a dict with ``content``."""
    text = value.get("content") if isinstance(value, Mapping) else value
    if text is not None and not isinstance(text, str):
        raise TokenizationError(
            f"tokenizer_config.json: {name} must be a string, null or {{\"content\": string}}, got {value!r:.80}"
        )
    return text


def _as_ids(value: Any, where: str = "eos_token_id") -> list[int]:
    """``eos_token_id`` of a config: absent, one int, or a list of ints (each in 0..2**32-1)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in items):
        raise TokenizationError(f"{where} must be a token id or a list of token ids, got {value!r:.80}")
    return list(items)


def _template_source(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else ``chat_template`` of tokenizer_config.json (a
    string, or a list of ``{"name", "template"}`` of which the ``default`` one is used).
    Raises ChatTemplateError for anything else."""
    jinja_file = model_dir / "chat_template.jinja"
    if os.path.lexists(jinja_file):
        path = _regular(_inside(model_dir, jinja_file.name))
        return _utf8(_read_bytes(path, MAX_CONFIG_BYTES), path, ChatTemplateError)
    source = config.get("chat_template")
    if isinstance(source, list):
        if not all(isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in source):
            raise ChatTemplateError('tokenizer_config.json: chat_template entries must be {"name": string, '
                                    '"template": string}')
        source = {t["name"]: t["template"] for t in source}.get("default")
    elif source is not None and not isinstance(source, str):
        raise ChatTemplateError("tokenizer_config.json: chat_template must be a string or a list of named "
                                f"templates, got {type(source).__name__}")
    return source


def _check_text(text: object, where: str = "text") -> None:
    """Name what is wrong with a value ``tokenizers`` refused to encode."""
    if not isinstance(text, str):
        raise InvalidTextError(f"{where} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        raise InvalidTextError(
            f"{where} holds a lone surrogate U+{bad:04X} at index {exc.start}; it is not valid Unicode"
        ) from None


class Tokenizer:
    """A checkpoint's tokenizer.

    Build it with ``Tokenizer.from_dir(model_dir)`` or ``Tokenizer.qwen3()``. Instances are
    read-only after construction and safe to share between threads.

    Args:
        backend: the ``tokenizers.Tokenizer`` (its ``encode_special_tokens`` is switched on, so
            special-token strings in text are encoded as text).
        eos_token_ids: ids that end generation.
        chat_template: Jinja source of the chat template, or None.
        template_variables: names the template sees besides the messages (``eos_token``...).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_ids: Iterable[int],
        chat_template: str | None = None,
        template_variables: Mapping[str, Any] | None = None,
    ) -> None:
        backend.encode_special_tokens = True
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._added = {i: (t.content, t.special) for i, t in added.items()}
        self._specials = SpecialTokens({c: i for i, (c, s) in self._added.items() if s})
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template: ChatTemplate | None = (
            None if chat_template is None else ChatTemplate(chat_template, template_variables)
        )

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load from a checkpoint directory: ``tokenizer.json`` (or ``tokenizer.json.gz``), and when
        present ``tokenizer_config.json``, ``generation_config.json``, ``config.json`` and
        ``chat_template.jinja``.

        ``eos_token_ids`` is the union of ``eos_token_id`` in config.json and
        generation_config.json and of tokenizer_config.json's ``eos_token`` (Qwen3: {151643, 151645}).

        The files are untrusted: each is read with a size cap (``MAX_TOKENIZER_BYTES`` for
        tokenizer.json, also decompressed; ``MAX_CONFIG_BYTES`` for the others) and must not be a
        symlink out of ``model_dir``.

        Raises:
            FileNotFoundError: no tokenizer.json(.gz) in ``model_dir``.
            TokenizationError: a file is too large, not UTF-8, not valid JSON / gzip / tokenizer
                data, a symlink out of the directory, or holds a field of the wrong type (named).
            ChatTemplateError: the chat template is not a string (or list of named templates),
                is too long, or does not compile.
        """
        root = Path(model_dir)
        backend = _load_backend(root)
        config = _read_json(root / "tokenizer_config.json")
        variables = {k: _token_text(config.get(k), k) for k in _TEMPLATE_VARIABLES}
        eos = {
            *_as_ids(_read_json(root / "config.json").get("eos_token_id"), "config.json: eos_token_id"),
            *_as_ids(_read_json(root / "generation_config.json").get("eos_token_id"),
                     "generation_config.json: eos_token_id"),
        }
        eos_text = variables["eos_token"]
        if eos_text is not None and (eos_id := backend.token_to_id(eos_text)) is not None:
            eos.add(eos_id)
        return cls(backend, eos, _template_source(root, config), variables)

    @staticmethod
    @functools.cache
    def qwen3() -> Tokenizer:
        """The Qwen3 tokenizer shipped in ``tokenization/data`` (shared by every Qwen3 size).
        Loaded once per process (about 0.5 s) and then returned from cache."""
        return Tokenizer.from_dir(data_path("tokenizer.json.gz").parent)

    def encode(self, text: str, *, parse_special: bool = False) -> list[int]:
        """Ids of ``text`` (no BOS/EOS added).

        Special-token strings in ``text`` (``<|im_end|>``...) are encoded as ordinary text unless
        ``parse_special=True``, which is for trusted text only (e.g. a prompt rendered elsewhere).
        Added tokens that are not special (Qwen3's ``<think>``) are always matched.

        Raises:
            InvalidTextError: ``text`` is not a str, or holds a lone surrogate.
        """
        if parse_special:
            _check_text(text)
            return self._encode_parts(list(self._specials.split(text)))
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            _check_text(text)
            raise

    def encode_batch(self, texts: Sequence[str], *, parse_special: bool = False) -> list[list[int]]:
        """``[encode(t) for t in texts]``, encoded in parallel by the library (Rust threads).

        Raises:
            InvalidTextError: ``texts`` is a str, or an item is not a str or holds a lone
                surrogate (the message gives its index); nothing is returned then.
        """
        if isinstance(texts, str):
            raise InvalidTextError("encode_batch takes a sequence of str, got a single str")
        if parse_special:
            for i, text in enumerate(texts):
                _check_text(text, f"texts[{i}]")
            return [self._encode_parts(list(self._specials.split(t))) for t in texts]
        try:
            return [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]
        except TypeError:
            for i, text in enumerate(texts):
                _check_text(text, f"texts[{i}]")
            raise

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Special tokens are dropped unless ``skip_special_tokens=False``; added
        tokens that are not special (``<think>``) are kept; ids with no token (Qwen3-0.6B's
        embedding rows 151669..151935) give "". Invalid UTF-8 becomes U+FFFD.

        Raises:
            InvalidTokenIdError: an id is not an int in 0..2**32-1.
        """
        ids = list(ids)
        try:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):
            for i in ids:
                check_id(i)
            raise

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: object,
    ) -> list[int]:
        """Ids of the chat prompt: ``encode`` of ``chat_template.apply(...)`` with control tokens
        only where the template itself writes them; special-token strings inside messages, tools
        or kwargs stay text. The decoded ids equal ``chat_template.apply(...)`` for the same input.

        Raises:
            ChatTemplateError: the tokenizer has no chat template, or rendering failed.
            InvalidTextError: a message string holds a lone surrogate.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        guard = self._specials
        rendered = self.chat_template._render(
            messages, add_generation_prompt, enable_thinking, tools, kwargs, guard.escape
        )
        parts = [(guard.unescape(p) if i is None else p, i) for p, i in guard.split(rendered)]
        return self._encode_parts(parts)

    def _encode_parts(self, parts: Sequence[tuple[str, int | None]]) -> list[int]:
        """Join ``(text, None)`` parts encoded as text and ``(string, id)`` control parts."""
        texts = [p for p, i in parts if i is None]
        encoded = iter(self.encode_batch(texts))
        ids: list[int] = []
        for _, i in parts:
            ids.extend(next(encoded) if i is None else [i])
        return ids

    def byte_table(self) -> ByteTable:
        """The id -> bytes table (and each id's text where it stands on its own,
        ``ByteTable.texts``), built on first call (~0.25 s for Qwen3) and cached; used by
        ``StreamingDetokenizer``. Picked by the decoder: ``ByteLevel`` -> byte-level BPE
        (``ByteTable.build``); a SentencePiece chain ``sentencepiece_chain`` accepts ->
        ``ByteTable.build_sentencepiece``.

        Raises:
            TokenizationError: any other decoder (its tokens' text cannot be streamed exactly).
        """
        return self._byte_table

    @functools.cached_property
    def _byte_table(self) -> ByteTable:
        decoder = self._backend.decoder
        vocab = self._backend.get_vocab(with_added_tokens=False)
        if type(decoder).__name__ == "ByteLevel":
            return ByteTable.build(vocab, self._added)
        chain = None if decoder is None else sentencepiece_chain(json.loads(decoder.__getstate__()))
        if chain is None:
            raise TokenizationError(
                "streaming detokenization needs a byte-level BPE decoder or a SentencePiece one "
                '(Replace("▁", " ") or Metaspace, then ByteFallback, Fuse, Strip), got '
                f"{'none' if decoder is None else type(decoder).__name__}")
        return ByteTable.build_sentencepiece(vocab, self._added, chain)

    def special_token_strings(self) -> dict[int, str]:
        """Special (control) token id -> its string, e.g. {151645: "<|im_end|>", ...}."""
        return {i: s for s, i in self._specials.strings.items()}
