"""The native CPU decode step (issue 39): the shared decoder's one-token forward as one MLX primitive.

:class:`NativeDecode` is the decode backend (``decode_path="native"``): a step of B one-token rows
is one primitive (``decode_step.cpp``) instead of ~20 MLX operations per layer, its work on a thread
pool kept alive across steps (``pool.h``: dynamic task claiming, brief spinning then sleeping), and
its products quantize their activations to int8 per block of 32 and take integer dot products with
the 4- or 8-bit weights (``qgemm.cpp``: AVX-512 VNNI, AVX2 or a portable loop, picked at run time).
The weights are packed once, when the decoder is made, in the order the products' micro kernel
reads them (``pack.h``: 4-bit kept as nibbles, so a copy of MLX's size; the decoder keeps no
reference to MLX's arrays). Prefill on this path is the generic forward over
:attr:`NativeDecode.prefill_state`, whose products are the same int8 products over the same packed
matrices (:mod:`.prefill`) and which holds no MLX copy of the projections, nor of a tied head's
table (its embedding lookup gathers the packed head's rows: :class:`.prefill.PackedEmbedding`,
``embed_rows.cpp``, bit for bit MLX's lookup; an untied embedding stays MLX's): the model a
caller keeps in place of the loaded one, so that the process holds the weights once. :func:`native_decode` over that model packs nothing again: its
decoder shares the packed matrices (a decoder per engine, each with its own thread pool).

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

from ..._weights import Linear
from ...native import cpu_decode_module
from ..attention import Cache, Rows
from ..layers import State
from .prefill import PackedLayer, packed_matrix, prefill_state

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
    gate/up each fused into one matrix). ``state`` may be a :attr:`NativeDecode.prefill_state`:
    its packed matrices are shared, not packed again."""
    if mx.default_device() != mx.cpu or state.dtype != mx.float32:
        return None
    module = cpu_decode_module()
    if module is None:
        return None
    linears = [[ly.qkv.merged, ly.o_proj, ly.gate_up.merged, ly.down_proj] for ly in state.layers]
    if not _takes(state.lm_head) or not all(m is not None and _takes(m) for ms in linears for m in ms):
        return None  # checked before any packing
    head = _matrix(module, state.lm_head)
    layers = [PackedLayer(*(_matrix(module, m) for m in ms if m is not None)) for ms in linears]
    c = state.config
    linear = c.rope_scaling is not None and c.rope_scaling.rope_type == "linear"
    decoder = module.make_decoder(
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps,
        c.rope_traditional, 1 / c.rope_scaling.factor if linear and c.rope_scaling is not None else 1.0,
        [module.LayerWeights(ly.input_layernorm, ly.post_attention_layernorm, p.qkv, p.o, p.gate_up, p.down,
                             ly.q_norm, ly.k_norm) for ly, p in zip(state.layers, layers, strict=True)],
        state.norm, head, _inverse_frequencies(state), pool_threads())
    return NativeDecode(decoder, module, prefill_state(state, module, pool_threads(), layers, head))


def _inverse_frequencies(state: State) -> mx.array:
    """RoPE's ``(head_dim / 2,)`` inverse frequencies, as ``mx.fast.rope`` derives them: from the
    "llama3" table, else ``rope_theta ** (-2i / head_dim)``."""
    if state.rope_freqs is not None:
        return 1 / state.rope_freqs.astype(mx.float32)
    d = state.config.head_dim
    return mx.power(mx.array(state.config.rope_theta, mx.float32), -mx.arange(0, d, 2, dtype=mx.float32) / d)


def _takes(m: Linear) -> bool:
    """Whether ``m`` is packed already or affine 4/8-bit with group 32/64/128 and float32 or float16
    scales."""
    if packed_matrix(m) is not None:
        return True
    spec = m.spec
    return (spec is not None and m.scales is not None and m.biases is not None and spec.mode == "affine"
            and spec.bits in (4, 8) and spec.group_size in (32, 64, 128) and m.scales.dtype in (mx.float32, mx.float16))


def _matrix(module: Any, m: Linear) -> Any:
    """``m`` (:func:`_takes`) as the module's QMatrix: its weights packed once for the int8
    products, a copy of MLX's size (``m``'s arrays are not kept by it), or the one that computes it
    already (:func:`.prefill.packed_matrix`)."""
    packed = packed_matrix(m)
    if packed is not None:
        return packed
    spec = m.spec
    assert spec is not None and m.scales is not None and m.biases is not None  # _takes
    scales, biases = m.scales, m.biases.astype(m.scales.dtype)
    if scales.dtype == mx.float32:  # float16 copies where exact (a tied GGUF head): half the bytes read per step
        half = [a.astype(mx.float16) for a in (scales, biases)]
        if all(mx.array_equal(h.astype(mx.float32), a).item() for h, a in zip(half, (scales, biases))):
            scales, biases = half
    return module.QMatrix(m.weight, scales, biases, m.bias, spec.bits, spec.group_size)
