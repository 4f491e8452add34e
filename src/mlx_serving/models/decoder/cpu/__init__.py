"""The native CPU decode step (issue 39): the shared decoder's one-token forward as one MLX primitive.

:class:`NativeDecode` is the decode backend (``decode_path="native"``): a step of B one-token rows
is one primitive (``decode_step.cpp``) instead of ~20 MLX operations per layer, its work on a thread
pool kept alive across steps (``pool.h``: dynamic task claiming, brief spinning then sleeping), and
its products quantize their activations to int8 per block of 32 and take integer dot products with
the 4- or 8-bit weights (``qdot.cpp``: AVX-512 VNNI, AVX2 or a portable loop, picked at run time).
The weights are MLX's own arrays, shared with the generic path, not copied. Prefill on this path
is the generic forward over :attr:`NativeDecode.prefill_state`, whose products are the same int8
products as a GEMM (:mod:`.prefill`).

Numerics: the int8 activations make the logits differ from the exact float path (``"matmul"``) by
~1e-2 relative; bench/cpu_decode.py measures top-1 agreement and perplexity on real text.
A row's result never depends on its batchmates (batched == solo, bit for bit). The sources are
built with the other native kernels (:mod:`models.native`: one module, compiled once and cached).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..._weights import Fused, Linear
from ...native import cpu_decode_module
from ..attention import Cache, Rows
from ..layers import Layer, State
from .prefill import prefill_state

__all__ = ["NativeDecode", "native_decode", "pool_threads"]


@dataclass(frozen=True)
class NativeDecode:
    """The native CPU decode backend over one loaded model (``decoder``: the built C++ decoder,
    ``module``: the native module that runs it, ``prefill_state``: the model whose projections
    run the int8 GEMM, for the forwards of more than one token per row: :mod:`.prefill`)."""

    decoder: Any
    module: Any
    prefill_state: State
    name: str = "native"
    sdpa: bool = False
    reads_own_length: bool = True
    verifies_as_rows: bool = True  # a verify is the decode step's own products and attention: exact

    def decode(self, state: State, cache: Cache, rows: Rows, h: mx.array) -> mx.array | None:
        """Logits ``(B, vocab)`` float32 of one-token ``rows`` from their embeddings ``h``
        ``(B, hidden)``; the new K/V are written into ``cache`` (its arrays replaced by the step's
        outputs, which share their buffers), in its layout: float32, float16, bfloat16, or int8 /
        int4 stored as :meth:`~..kv_cache.PagedKVCache.write` stores them, bit for bit."""
        q, n = cache.quant, len(cache.keys)
        out = self.module.decode_step(self.decoder, h, rows.start, rows.n_valid, rows.block_table, cache.keys,
                                      cache.values, cache.block_size, cache.arrays()[2 * n:],
                                      0 if q is None else q.bits, 0 if q is None else q.group_size)
        cache.set_arrays(out[1:])
        return out[0]


def pool_threads() -> int:
    """The decode step's threads: ``OMP_NUM_THREADS`` when set (as the other native kernels), else
    the cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, int(env)) if env.isdigit() else max(1, cores)


def native_decode(state: State) -> NativeDecode | None:
    """The native decode backend for ``state``, or None when it does not apply: not the CPU device,
    activations not float32, the native module unavailable (:func:`models.native.unavailable_reason`),
    or a projection or head not stored as MLX affine 4/8-bit with group size 32/64/128 (q/k/v and
    gate/up each fused into one matrix)."""
    if mx.default_device() != mx.cpu or state.dtype != mx.float32:
        return None
    module = cpu_decode_module()
    if module is None:
        return None
    head = _matrix(module, state.lm_head)
    layers = [_layer(module, layer) for layer in state.layers]
    if head is None or any(layer is None for layer in layers):
        return None
    c = state.config
    linear = c.rope_scaling is not None and c.rope_scaling.rope_type == "linear"
    decoder = module.make_decoder(
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps,
        c.rope_traditional, 1 / c.rope_scaling.factor if linear and c.rope_scaling is not None else 1.0,
        layers, state.norm, head, _inverse_frequencies(state), pool_threads())
    return NativeDecode(decoder, module, prefill_state(state, module, pool_threads()))


def _inverse_frequencies(state: State) -> mx.array:
    """RoPE's ``(head_dim / 2,)`` inverse frequencies, as ``mx.fast.rope`` derives them: from the
    "llama3" table, else ``rope_theta ** (-2i / head_dim)``."""
    if state.rope_freqs is not None:
        return 1 / state.rope_freqs.astype(mx.float32)
    d = state.config.head_dim
    return mx.power(mx.array(state.config.rope_theta, mx.float32), -mx.arange(0, d, 2, dtype=mx.float32) / d)


def _matrix(module: Any, m: Linear) -> Any | None:
    """``m`` as the module's QMatrix, or None when it is not affine 4/8-bit with group 32/64/128."""
    spec = m.spec
    if (spec is None or m.scales is None or m.biases is None or spec.mode != "affine" or spec.bits not in (4, 8)
            or spec.group_size not in (32, 64, 128) or m.scales.dtype not in (mx.float32, mx.float16)):
        return None
    scales, biases = m.scales, m.biases.astype(m.scales.dtype)
    if scales.dtype == mx.float32:  # float16 copies where exact (a tied GGUF head): half the bytes read per step
        half = [a.astype(mx.float16) for a in (scales, biases)]
        if all(mx.array_equal(h.astype(mx.float32), a).item() for h, a in zip(half, (scales, biases))):
            scales, biases = half
    return module.QMatrix(m.weight, scales, biases, m.bias, spec.bits, spec.group_size)


def _fused(module: Any, f: Fused) -> Any | None:
    return None if f.merged is None else _matrix(module, f.merged)


def _layer(module: Any, layer: Layer) -> Any | None:
    parts = (_fused(module, layer.qkv), _matrix(module, layer.o_proj), _fused(module, layer.gate_up),
             _matrix(module, layer.down_proj))
    if any(p is None for p in parts):
        return None
    return module.LayerWeights(layer.input_layernorm, layer.post_attention_layernorm, *parts, layer.q_norm,
                               layer.k_norm)
