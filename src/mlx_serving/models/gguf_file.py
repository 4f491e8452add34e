"""Read a GGUF file's header: its key/value metadata and tensor table, checked, without its data.

A GGUF file is untrusted input. This reader parses the header as the format specifies
(ggml's ``docs/gguf.md``: magic ``GGUF``, version 2 or 3, tensor count, key/value count, the
key/value pairs, the tensor infos, then the data section aligned to ``general.alignment``,
default 32) with a bound on every count and length it reads, and checks that every tensor's
data lies inside the file, before anything else (MLX's own GGUF reader) touches the data.
Every error is a :class:`GGUFError` (a ``ValueError``) naming the file and what is wrong.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Union

__all__ = ["GGMLType", "GGUFError", "GGUFHeader", "MetaValue", "TensorEntry", "read_header"]

#: A metadata value as plain Python: numbers, bools, strings and (nested) lists of them.
MetaValue = Union[int, float, bool, str, list["MetaValue"]]

#: Most key/value pairs, tensors, dimensions, array items and string bytes a header may declare.
#: Far above any released model (Llama-3.1-405B: ~1,140 tensors; vocabularies of 262,144 tokens).
MAX_KV = 100_000
MAX_TENSORS = 1_000_000
MAX_ARRAY = 2**24
MAX_STRING = 2**26
MAX_DIMS = 4


class GGUFError(ValueError):
    """The GGUF file is malformed or holds what this reader does not accept."""


class GGMLType(IntEnum):
    """ggml tensor types (``ggml.h`` ``enum ggml_type``) by their numbers in the file."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


#: (values per block, bytes per block) of the types whose size this reader checks
#: (``ggml.c`` ``type_traits``); a tensor of any other type is refused by name.
BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34), GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: ``name``, ``shape`` in row-major order (GGUF stores dimensions
    innermost first; this is reversed, so a weight matrix reads ``(out, in)`` as in PyTorch),
    ``type`` (a :class:`GGMLType`, or the raw number for one ggml does not define), byte
    ``offset`` from the start of the file and size ``nbytes``."""

    name: str
    shape: tuple[int, ...]
    type: GGMLType | int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The ggml name of the type (``"Q4_K"``), or ``"type N"`` for an unknown number."""
        return self.type.name if isinstance(self.type, GGMLType) else f"type {self.type}"


@dataclass(frozen=True)
class GGUFHeader:
    """A parsed header: ``version``, ``metadata`` (key -> plain value) and ``tensors`` by name."""

    path: Path
    version: int
    metadata: dict[str, MetaValue]
    tensors: dict[str, TensorEntry]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Bounded little-endian reads from a memory map; every overrun is a :class:`GGUFError`."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (at byte {self.pos:,})")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"truncated: {n:,} more bytes needed, the file has {len(self.data):,}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> int | float | bool:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, limit: int, what: str) -> int:
        n = int(self.scalar("<Q"))
        if n > limit:
            raise self.fail(f"{what} is {n:,}, more than the {limit:,} allowed")
        return n

    def string(self, what: str = "string") -> str:
        raw = self.take(self.count(MAX_STRING, f"{what} length"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, kind: int, key: str, depth: int = 0) -> MetaValue:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string(f"value of {key!r}")
        if kind == _ARRAY and depth == 0:
            item = int(self.scalar("<I"))
            n = self.count(MAX_ARRAY, f"array length of {key!r}")
            if item in _SCALARS:  # one unpack for the whole array: tokenizer scores, token types
                fmt = _SCALARS[item]
                return list(struct.unpack(f"<{n}{fmt[1]}", self.take(n * struct.calcsize(fmt))))
            return [self.value(item, key, depth + 1) for _ in range(n)]
        raise self.fail(f"metadata {key!r} has value type {kind}, which GGUF does not define here")


def _tensor(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string("tensor name")
    n_dims = int(cur.scalar("<I"))
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
    dims = [int(cur.scalar("<Q")) for _ in range(n_dims)]
    if any(d < 1 or d > 2**40 for d in dims):
        raise cur.fail(f"tensor {name!r} has dimensions {dims}")
    kind = int(cur.scalar("<I"))
    return name, tuple(reversed(dims)), kind, int(cur.scalar("<Q"))


def _nbytes(path: Path, name: str, shape: tuple[int, ...], kind: int) -> int:
    try:
        gtype = GGMLType(kind)
    except ValueError:
        raise GGUFError(f"{path}: tensor {name!r} has ggml type {kind}, which is not known") from None
    if gtype not in BLOCK_LAYOUT:
        raise GGUFError(f"{path}: tensor {name!r} has ggml type {gtype.name}, whose size this reader "
                        "does not know (unsupported)")
    per_block, block_bytes = BLOCK_LAYOUT[gtype]
    if shape[-1] % per_block:
        raise GGUFError(f"{path}: tensor {name!r} ({gtype.name}) has {shape[-1]} values per row, "
                        f"not a multiple of its block of {per_block}")
    count = 1
    for d in shape:
        count *= d
    return count // per_block * block_bytes


def read_header(path: str | Path) -> GGUFHeader:
    """Parse the header of the GGUF file ``path`` (its data is not read).

    Returns the metadata (key -> int / float / bool / str / list) and the tensor table, every
    tensor's data checked to lie inside the file. Raises FileNotFoundError when the file is
    missing; :class:`GGUFError` (a ValueError) naming the file for a wrong magic or version, a
    count or length over its bound (:data:`MAX_KV`, :data:`MAX_TENSORS`, :data:`MAX_ARRAY`,
    :data:`MAX_STRING`), a truncated header, a duplicate key or tensor, a tensor whose type is
    unknown or whose data lies outside the file.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 24:
            raise GGUFError(f"{path}: {size} bytes, too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(_Cursor(data, path), size)


def _parse(cur: _Cursor, size: int) -> GGUFHeader:
    path = cur.path
    if cur.take(4) != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (its first bytes are not 'GGUF')")
    version = int(cur.scalar("<I"))
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = cur.count(MAX_TENSORS, "tensor count")
    n_kv = cur.count(MAX_KV, "metadata count")
    metadata: dict[str, MetaValue] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(int(cur.scalar("<I")), key)
    raw = [_tensor(cur) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or not 1 <= alignment <= 2**20:
        raise GGUFError(f"{path}: general.alignment must be an integer in 1..1,048,576, got {alignment!r}")
    start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorEntry] = {}
    for name, shape, kind, offset in raw:
        nbytes = _nbytes(path, name, shape, kind)
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        if offset % alignment or start + offset + nbytes > size:
            raise GGUFError(f"{path}: tensor {name!r} data (offset {offset:,}, {nbytes:,} bytes) lies outside "
                            f"the file ({size:,} bytes) or is not aligned to {alignment}")
        tensors[name] = TensorEntry(name, shape, GGMLType(kind), start + offset, nbytes)
    return GGUFHeader(path, version, metadata, tensors)
