"""Which forward an embedding serving runs (``products``): the packed forward on the native int8
GEMM, or the exact float forward.

"native" (the default where it applies: the CPU device, float32 activations, the native module
built, every projection and the head affine 4/8-bit as :func:`models.decoder.cpu.native_decode`
takes them) packs a batch's texts into one sequence (:mod:`._packed`) over the text-generation
prefill's model (:attr:`models.decoder.cpu.NativeDecode.prefill_state`): every projection runs
the int8 GEMM over its matrix packed once (activations quantized to int8 per block of 32). "matmul" is the exact float forward
(:func:`models.decoder.layers.hidden_states` over the padded rows, compiled).
"""

from __future__ import annotations

import mlx.core as mx

from ..decoder.cpu import native_decode
from ..decoder.layers import State
from ..native import cpu_decode_module, unavailable_reason

__all__ = ["native_state"]


def native_state(state: State, products: str | None) -> State | None:
    """The model the packed forward runs (``state`` with its quantized products on the int8 GEMM),
    or None for the exact float forward: ``products`` "matmul", or None where "native" does not
    apply. Raises ValueError naming ``products`` when "native" is asked for and does not apply
    (saying why)."""
    if products == "matmul":
        return None
    why = _why_not(state)
    native = native_decode(state) if why is None else None
    if native is not None:
        return native.prefill_state
    why = why or "a projection or the head is not MLX affine 4/8-bit with group size 32/64/128"
    if products == "native":
        raise ValueError(f"products 'native' does not apply: {why}; use products='matmul' or None")
    return None


def _why_not(state: State) -> str | None:
    if mx.default_device() != mx.cpu:
        return "it runs on the CPU device only"
    if state.dtype != mx.float32:
        return f"it needs float32 activations, the model computes in {state.dtype}"
    if cpu_decode_module() is None:
        return f"the native module is unavailable ({unavailable_reason()})"
    return None
