"""Per-caller slicing and reassembly of batch outputs (leading axis = rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias, Union, cast

import numpy as np

from ._batch import _Array, _is_array, _is_mlx

if TYPE_CHECKING:
    import mlx.core as mx

# A backend output (as ``output_rows`` accepts it): an array, a list of rows, or a dict or tuple of
# outputs.
Output: TypeAlias = Union[_Array, list[Any], dict[Any, "Output"], tuple["Output", ...]]


def output_rows(output: object) -> int:
    """Leading size of an output; ``TypeError`` if it has no rows axis."""
    if _is_array(output):
        if len(output.shape) == 0:
            raise TypeError("handle_batch returned a scalar array; its output needs a leading rows axis")
        return int(output.shape[0])
    if isinstance(output, list):
        return len(output)
    if isinstance(output, (dict, tuple)) and output:
        values = output.values() if isinstance(output, dict) else output
        return min(output_rows(v) for v in values)
    raise TypeError(
        f"handle_batch returned {type(output).__name__}; expected an array, a dict or tuple of arrays, "
        "or a list with one result per row"
    )


def check_output_rows(output: object, rows: int, batch_size: int) -> None:
    """``ValueError`` unless ``output`` (what ``handle_batch`` returned for a batch of ``rows`` real
    rows) has at least ``rows`` rows and at most what padding explains: ``batch_size`` rounded up to
    a power of two (a backend may pad to fixed shapes), or ``rows`` when more. ``TypeError`` as
    :func:`output_rows`."""
    got = output_rows(output)
    most = max(rows, 1 << max(batch_size - 1, 0).bit_length())
    if not rows <= got <= most:
        raise ValueError(f"handle_batch returned {got} rows for a batch of {rows} (padding may take it to "
                         f"at most {most}: batch_size {batch_size} rounded up to a power of two)")


def slice_output(output: Output, start: int, size: int) -> Output:
    """Rows ``[start, start + size)`` of every leaf."""
    if isinstance(output, dict):
        return {k: slice_output(v, start, size) for k, v in output.items()}
    if isinstance(output, tuple):
        return tuple(slice_output(v, start, size) for v in output)
    return output[start : start + size]


def concat_outputs(parts: list[Output]) -> Output:
    """Join per-chunk outputs of one caller in order (the inverse of splitting).

    Every part has the kind of the first (slices of one backend's outputs)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, dict):
        return {k: concat_outputs([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(concat_outputs([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, list):
        return [row for part in cast("list[list[Any]]", parts) for row in part]  # all lists, as the first
    if _is_mlx(first):
        import mlx.core as mx

        return mx.concatenate(cast("list[mx.array]", parts), axis=0)  # all MLX arrays, as the first
    return np.concatenate(cast("list[np.ndarray[Any, Any]]", parts), axis=0)  # all numpy arrays
