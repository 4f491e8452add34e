"""``Batch``: ordered rows plus a batch key, the unit a backend executes.

Rows may be numpy arrays or MLX arrays (leading axis = rows), dicts of those (every value with the
same number of rows), or plain Python objects (e.g. ragged token-id lists), one object per row.
A batch is lazy: pieces are kept as given and joined only when ``data`` is read.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol, TypeGuard, Union

import numpy as np

__all__ = ["Batch"]

_ROWS = "rows"  # template of a batch of plain Python rows

# The shape/dtype signature of a piece, without the rows axis: ``_ROWS``, ``(library, dtype,
# inner shape)`` for an array, or a dict of those.
Template = Union[str, tuple[str, str, tuple[int, ...]], dict[Hashable, "Template"]]


class _Array(Protocol):
    """What this package reads of a numpy or MLX array."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...

    def __getitem__(self, index: Any, /) -> Any: ...


def _is_mlx(x: Any) -> bool:
    return type(x).__module__.startswith("mlx.")


def _is_array(x: object) -> TypeGuard[_Array]:
    return isinstance(x, np.ndarray) or (_is_mlx(x) and hasattr(x, "shape"))


def _template(data: Any) -> Any:
    """Shape/dtype signature of a container, without the leading (rows) axis."""
    if _is_array(data):
        return ("mlx" if _is_mlx(data) else "numpy", str(data.dtype), tuple(data.shape[1:]))
    if isinstance(data, dict):
        return {k: _template(v) for k, v in data.items()}
    return _ROWS


def _leading(data: Any) -> int:
    if _is_array(data):
        if len(data.shape) == 0:
            raise ValueError("cannot concatenate a scalar array: it has no leading (rows) axis")
        return int(data.shape[0])
    if isinstance(data, list):
        return len(data)
    sizes = {_leading(v) for v in data.values()}
    if len(sizes) != 1:
        raise ValueError(f"every value of a dict entry needs the same number of rows, got {sorted(sizes)}")
    return sizes.pop()


def _expand(item: Any) -> Any:
    if _is_array(item):
        return item[None]
    if isinstance(item, dict):
        if not item:
            raise ValueError("cannot stack an empty dict")
        return {k: _expand(v) for k, v in item.items()}
    return [item]


def _rows_of(item: Any) -> Any:
    if isinstance(item, (list, tuple)):
        return list(item)
    if _is_array(item) or isinstance(item, dict):
        return item
    raise ValueError(f"concatenate needs arrays, dicts of arrays or lists of rows; got a scalar {type(item).__name__}")


def _slice(data: Any, start: int, stop: int) -> Any:
    if isinstance(data, dict):
        return {k: _slice(v, start, stop) for k, v in data.items()}
    return data[start:stop]


def _join(pieces: list[Any], template: Any, pad: int) -> Any:
    if template == _ROWS:
        rows = [row for piece in pieces for row in piece]
        return rows + [None] * pad
    if isinstance(template, dict):
        return {k: _join([p[k] for p in pieces], template[k], pad) for k in template}
    lib, _, inner = template
    if pad:
        pieces = pieces + [_zeros(pieces[0], (pad, *inner))]
    if len(pieces) == 1:
        return pieces[0]
    if lib == "mlx":
        import mlx.core as mx

        return mx.concatenate(pieces, axis=0)
    return np.concatenate(pieces, axis=0)


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    if _is_mlx(like):
        import mlx.core as mx

        return mx.zeros(shape, dtype=like.dtype)
    return np.zeros(shape, dtype=like.dtype)


class Batch:
    """Ordered rows with a batch key. Immutable: every method returns a new ``Batch``.

    Build one with ``Batch.stack(items)`` (each item is one row) or ``Batch.concatenate(items)``
    (each item's leading axis counts rows). ``data`` joins the pieces: arrays are concatenated
    along axis 0 (numpy or MLX, as given), dicts key by key, plain rows into a list; ``pad(n)``
    appends ``n`` rows of zeros (``None`` for plain rows).

    Raises ``ValueError`` for an empty batch, a scalar in ``concatenate``, or pieces whose
    shapes/dtypes/kinds differ (the message names both).
    """

    __slots__ = ("_pieces", "_sizes", "_template", "_key", "_pad", "_data")

    def __init__(self, pieces: list[Any], sizes: list[int], template: Template, key: Hashable = "default",
                 pad: int = 0):
        if not pieces or sum(sizes) == 0:
            raise ValueError("cannot build an empty Batch")
        self._pieces, self._sizes, self._template = pieces, sizes, template
        self._key, self._pad = key, pad
        self._data: Any = None

    @classmethod
    def stack(cls, items: Iterable[object]) -> Batch:
        """One row per item: arrays gain a leading axis, other objects become one row each."""
        return cls._build([_expand(item) for item in items])

    @classmethod
    def concatenate(cls, items: Iterable[object]) -> Batch:
        """Each item holds rows on its leading axis (a list holds one row per element)."""
        return cls._build([_rows_of(item) for item in items])

    @classmethod
    def _build(cls, pieces: list[Any]) -> Batch:
        if not pieces:
            raise ValueError("cannot build an empty Batch")
        template = _template(pieces[0])
        sizes = []
        for piece in pieces:
            _check_compatible(template, _template(piece))
            sizes.append(_leading(piece))
        return cls(pieces, sizes, template)

    @classmethod
    def merge(cls, batches: Sequence[Batch]) -> Batch:
        """Join batches in order; their keys and templates must match. Padding is dropped."""
        if not batches:
            raise ValueError("cannot merge an empty list of batches")
        first = batches[0]
        pieces, sizes = [], []
        for batch in batches:
            if batch._key != first._key:
                raise ValueError(f"cannot merge batches with different keys: {first._key!r} and {batch._key!r}")
            _check_compatible(first._template, batch._template)
            pieces += batch._pieces
            sizes += batch._sizes
        return cls(pieces, sizes, first._template, first._key)

    @property
    def size(self) -> int:
        """Number of real rows (padding excluded)."""
        return sum(self._sizes)

    @property
    def padding(self) -> int:
        """Number of pad rows appended by ``data``."""
        return self._pad

    @property
    def batch_key(self) -> Hashable:
        """The batch key (``"default"`` unless set with ``key``)."""
        return self._key

    @property
    def data(self) -> Any:
        """The rows joined: an array/dict of arrays with ``size + padding`` leading rows, or a list."""
        if self._data is None:
            self._data = _join(self._pieces, self._template, self._pad)
        return self._data

    def key(self, key: Hashable) -> Batch:
        """A copy of this batch with batch key ``key``."""
        return Batch(self._pieces, self._sizes, self._template, key, self._pad)

    def pad(self, n: int) -> Batch:
        """A copy with exactly ``n`` trailing pad rows (sets, does not add)."""
        if n < 0:
            raise ValueError(f"pad must be >= 0, got {n}")
        return Batch(self._pieces, self._sizes, self._template, self._key, n)

    def compatible(self, other: Batch) -> bool:
        """True when ``other`` has the same key and row shapes/dtypes, so the two can merge."""
        return self._key == other._key and self._template == other._template

    def split(self, n: int) -> tuple[Batch, Batch | None]:
        """``(first n rows, the rest or None)``; the key is kept on both halves.

        When ``n >= size`` the first half keeps up to ``n - size`` pad rows and the rest is None.
        """
        if n <= 0:
            raise ValueError(f"split needs n >= 1, got {n}")
        if n >= self.size:
            return Batch(self._pieces, self._sizes, self._template, self._key, min(self._pad, n - self.size)), None
        left_p, left_s, right_p, right_s, taken = [], [], [], [], 0
        for piece, size in zip(self._pieces, self._sizes):
            take = min(size, max(n - taken, 0))
            if take:
                left_p.append(piece if take == size else _slice(piece, 0, take))
                left_s.append(take)
            if take < size:
                right_p.append(piece if take == 0 else _slice(piece, take, size))
                right_s.append(size - take)
            taken += take
        return (
            Batch(left_p, left_s, self._template, self._key),
            Batch(right_p, right_s, self._template, self._key, self._pad),
        )

    def rows(self) -> list[Any]:
        """The real rows one by one (array rows lose the leading axis; dict rows stay dicts)."""
        data = self.data
        if self._template == _ROWS:
            return list(data[: self.size])
        return [_row(data, i) for i in range(self.size)]

    def __repr__(self) -> str:
        return f"Batch(size={self.size}, padding={self._pad}, key={self._key!r})"


def _row(data: Any, i: int) -> Any:
    if isinstance(data, dict):
        return {k: _row(v, i) for k, v in data.items()}
    return data[i]


def _check_compatible(a: Any, b: Any) -> None:
    if a != b:
        raise ValueError(f"incompatible batch entries: {_describe(a)} and {_describe(b)}")


def _describe(template: Any) -> str:
    if template == _ROWS:
        return "plain Python rows"
    if isinstance(template, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in template.items()) + "}"
    lib, dtype, inner = template
    return f"{lib} {dtype} rows of shape {inner}"
