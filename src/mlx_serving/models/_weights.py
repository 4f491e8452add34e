"""Weight matrices every model family shares: :class:`Linear` (dense or quantized, optional
bias), :class:`Fused` (linears reading the same input, run as one matmul) and :class:`Reader`
(builds them from a checkpoint's tensors and its quantization block)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ._checkpoint import QuantSpec, Quantization
from .native import QuantizedMatmul

__all__ = ["Fused", "Linear", "Reader", "swiglu"]


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """The gated MLP activation of a gate/up projection pair: ``silu(gate) * up``, ``(rows, I)``
    each -> ``(rows, I)`` in their dtype (mlx-lm's ``swiglu``; one compiled kernel)."""
    return gate * mx.sigmoid(gate) * up


@dataclass
class Linear:
    """A weight matrix of logical shape ``(out, in)``, dense or quantized, with an optional
    ``bias`` ``(out,)``.

    Dense: ``weight`` is ``(out, in)`` float; ``weight_t`` is its transposed view, made once
    (evaluated at load, it is a leaf of every step's graph rather than one more node per
    call). Quantized: ``weight`` packed uint32, with ``scales``/``biases`` (the quantization's
    per-group offsets, not the layer's ``bias``) and ``spec``.
    Call with 2-D ``x`` ``(rows, in)`` -> ``(rows, out)``. The bias is added as mlx-lm's
    ``nn.Linear`` (``mx.addmm``) and ``nn.QuantizedLinear`` (a sum after the matmul) add it,
    so the results are the same to the bit. ``kernel``: the product of a quantized matrix when
    not MLX's ``mx.quantized_matmul`` (the native CPU kernel, :func:`models.native.quantized_matmul_cpu`,
    set at load by :meth:`with_kernel`).
    """

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    spec: QuantSpec | None = None
    weight_t: mx.array | None = field(default=None, repr=False)
    bias: mx.array | None = None
    kernel: QuantizedMatmul | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.scales is None and self.weight_t is None:
            self.weight_t = self.weight.T

    def __call__(self, x: mx.array) -> mx.array:
        if self.weight_t is not None:  # dense: __post_init__ sets weight_t exactly when scales is None
            return x @ self.weight_t if self.bias is None else mx.addmm(self.bias, x, self.weight_t)
        scales, spec = self._quant()
        if self.kernel is not None and self.biases is not None:  # a kernel is only set for affine (biases)
            y = self.kernel(x, self.weight, scales, self.biases, spec.group_size, spec.bits)
        else:
            y = mx.quantized_matmul(x, self.weight, scales, self.biases, transpose=True,
                                    group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
        return y if self.bias is None else y + self.bias

    def _quant(self) -> tuple[mx.array, QuantSpec]:
        """``scales`` and ``spec`` of a quantized matrix (always set together: :meth:`Reader.linear`)."""
        if self.scales is None or self.spec is None:
            raise ValueError("not a quantized matrix: it needs both scales and spec")
        return self.scales, self.spec

    def with_kernel(self, kernel: QuantizedMatmul) -> "Linear":
        """This matrix computed by ``kernel`` when it is quantized in a layout the native CPU kernel
        takes (affine, 4 or 8 bits, group size 32 / 64 / 128, float32 scales); itself otherwise."""
        spec = self.spec
        takes = (spec is not None and spec.mode == "affine" and spec.bits in (4, 8) and spec.group_size in (32, 64, 128)
                 and self.scales is not None and self.scales.dtype == mx.float32)
        return replace(self, kernel=kernel) if takes else self

    def compact(self) -> "Linear":
        """This matrix with its quantization scales and biases stored as float16 when the native
        kernel computes it and float16 holds them exactly (a GGUF's or an MLX float16 checkpoint's
        always do): the same products, a sixth fewer bytes per 4-bit weight read; itself otherwise."""
        scales, biases = self.scales, self.biases
        # with_kernel sets a kernel only on affine matrices, which have both scales and biases
        if self.kernel is None or scales is None or biases is None or scales.dtype != mx.float32:
            return self
        half = [a.astype(mx.float16) for a in (scales, biases)]
        exact = all(mx.array_equal(h.astype(mx.float32), a).item() for h, a in zip(half, (scales, biases)))
        return replace(self, scales=half[0], biases=half[1]) if exact else self

    def dequantized(self, dtype: mx.Dtype) -> "Linear":
        """This matrix as a dense ``(out, in)`` Linear in ``dtype`` (itself when dense)."""
        if self.scales is None:
            return self
        scales, spec = self._quant()
        return Linear(mx.dequantize(self.weight, scales, self.biases, group_size=spec.group_size,
                                    bits=spec.bits, mode=spec.mode).astype(dtype), bias=self.bias)

    def rows(self, ids: mx.array) -> mx.array:
        """Embedding lookup: rows ``ids`` (any int shape) -> ``ids.shape + (in,)``.

        Quantized tables gather the packed rows and dequantize only those (as mlx-lm's
        ``QuantizedEmbedding`` does), never the whole table.
        """
        if self.scales is None:
            return self.weight[ids]
        scales, spec = self._quant()
        return mx.dequantize(
            self.weight[ids], scales[ids], None if self.biases is None else self.biases[ids],
            group_size=spec.group_size, bits=spec.bits, mode=spec.mode,
        )

    def arrays(self) -> list[mx.array]:
        """The arrays this matrix holds (to evaluate at load)."""
        return [a for a in (self.weight, self.scales, self.biases, self.weight_t, self.bias) if a is not None]


@dataclass
class Fused:
    """Linears that read the same input (q/k/v, gate/up), run as one matmul.

    When every part is stored alike (all dense in one dtype, or all quantized with one
    spec; all with a bias or none) their rows are concatenated once at load into ``merged``
    (exact: each output is the same dot product) and ``splits`` holds the output offsets;
    otherwise ``parts`` run one by one. Call with ``(rows, in)`` -> list of ``(rows, out_i)``.
    Fewer, larger matmuls mean fewer kernel launches per decode step.
    """

    merged: Linear | None
    splits: list[int]
    parts: list[Linear]

    def __call__(self, x: mx.array) -> list[mx.array]:
        if self.merged is None:
            return [p(x) for p in self.parts]
        return mx.split(self.merged(x), self.splits, axis=-1)  # type: ignore[return-value]  # mlx's stub says array; split returns a list

    @classmethod
    def of(cls, parts: list[Linear]) -> "Fused":
        first = parts[0]
        alike = all((p.scales is None) == (first.scales is None) and p.spec == first.spec
                    and p.weight.dtype == first.weight.dtype and (p.bias is None) == (first.bias is None)
                    for p in parts)
        if not alike:
            return cls(None, [], parts)
        weight = mx.concatenate([p.weight for p in parts])
        cat = [mx.concatenate([getattr(p, f) for p in parts]) if getattr(first, f) is not None else None
               for f in ("scales", "biases", "bias")]
        offsets = [int(x) for x in np.cumsum([p.weight.shape[0] for p in parts])[:-1]]
        return cls(Linear(weight, cat[0], cat[1], first.spec, bias=cat[2]), offsets, [])

    def map(self, fn: Callable[[Linear], Linear]) -> "Fused":
        """The same linears, each replaced by ``fn`` of it (the merged one, or every part)."""
        if self.merged is None:
            return Fused(None, [], [fn(p) for p in self.parts])
        return Fused(fn(self.merged), self.splits, [])

    def dequantized(self, dtype: mx.Dtype) -> "Fused":
        """The same linears stored dense in ``dtype``."""
        return self.map(lambda m: m.dequantized(dtype))

    def with_kernel(self, kernel: QuantizedMatmul) -> "Fused":
        """The same linears, each computed by ``kernel`` where it takes them (:meth:`Linear.with_kernel`)."""
        return self.map(lambda m: m.with_kernel(kernel))

    def compact(self) -> "Fused":
        """The same linears, each :meth:`Linear.compact`."""
        return self.map(Linear.compact)

    def linears(self) -> list[Linear]:
        """The matrices this holds (the merged one, or the parts)."""
        return self.parts if self.merged is None else [self.merged]


class Reader:
    """Builds a family's weights from a checkpoint's loaded ``tensors`` (names as stored)."""

    def __init__(self, path: Path, tensors: dict[str, mx.array], quantization: Quantization | None):
        self.path, self.tensors, self.quantization = path, tensors, quantization

    def release(self, prefix: str) -> None:
        """Forget every tensor whose name starts with ``prefix`` (built into weights already)."""
        for name in [n for n in self.tensors if n.startswith(prefix)]:
            del self.tensors[name]

    def tensor(self, name: str) -> mx.array:
        """Tensor ``name``; KeyError naming it when absent."""
        if name not in self.tensors:
            raise KeyError(f"checkpoint {self.path}: missing tensor {name!r}")
        return self.tensors[name]

    def linear(self, module: str, bias: bool = False) -> Linear:
        """``module``'s weight matrix: quantized when ``.scales`` is stored (per the
        quantization block), dense otherwise; with ``module.bias`` when ``bias``."""
        weight = self.tensor(f"{module}.weight")
        b = self.tensor(f"{module}.bias") if bias else None
        if f"{module}.scales" not in self.tensors:
            return Linear(weight, bias=b)
        quant = self.quantization
        spec = quant.spec_for(module) if quant is not None else None
        if spec is None:
            raise ValueError(
                f"checkpoint {self.path}: {module}.scales present but config.json's "
                f"quantization block does not quantize {module!r}"
            )
        biases = self.tensors.get(f"{module}.biases")
        if biases is None and spec.mode == "affine":
            raise KeyError(f"checkpoint {self.path}: missing tensor '{module}.biases'")
        return Linear(weight, self.tensor(f"{module}.scales"), biases, spec, bias=b)
