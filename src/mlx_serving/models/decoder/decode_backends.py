"""How a one-token decode forward attends: a backend object, chosen once when an engine is built.

- :class:`GenericDecode` (``"matmul"``, ``"sdpa"``): the shared decoder of :func:`models.decoder.layers.forward`,
  masked attention through batched matmuls or ``mx.fast.scaled_dot_product_attention``;
- :class:`FusedDecode` (``"fused"``): the custom CUDA kernels of :mod:`.cuda_kernels`, 8 launches per
  layer, no mask; with 4-bit weights and at most :data:`.cuda_gemv.MAX_ROWS` rows, 5 launches per layer
  (:func:`.cuda_gemv.qmv`: the norms, residual adds and SwiGLU folded into the products); each row's kernel reads its own length, so a compiled decode needs one graph per
  row count, not per attention span. The kernels implement the shared decoder with plain
  split-half RoPE (no ``rope_scaling``, not ``rope_traditional``), q/k RMSNorm folded into the
  attention kernel where the family has it (Qwen3) and skipped where not (Llama, Qwen2).
- :class:`~.cpu.NativeDecode` (``"native"``): the native CPU decode step of :mod:`.cpu`, one
  primitive per step with int8-activation products (every family and RoPE variant; the
  projections and head stored affine 4- or 8-bit, float32 activations on the CPU).

:func:`decode_backend` picks one for a model: the fused kernels where they run (MLX's CUDA build,
a supported shape) and the config fits them, else the native step where it applies (the CPU,
float32 activations, affine 4/8-bit weights), else the matmul path; the exact ``"matmul"`` path by
name. bench/gpu_step.py times the GPU ones, bench/cpu_decode.py the CPU ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .._weights import swiglu as split_swiglu
from . import cuda_gemv, cuda_kernels
from .attention import Cache, Rows
from .cpu import NativeDecode, native_decode
from .kv_cache import kv_quant
from .attention import DecodeBackend as _DecodeBackend
from .layers import State

__all__ = ["DECODE_PATHS", "NATIVE_AUTO_KV", "DecodeBackend", "FusedDecode", "GenericDecode", "NativeDecode",
           "decode_backend", "fits_fused", "kv_cache_dtype_for", "qmv_fits"]

#: The decode paths a caller may ask for by name.
DECODE_PATHS = ("fused", "matmul", "native", "sdpa")


#: What ``kv_cache_dtype="auto"`` stores on the native CPU path (llama.cpp's default f16 cache: half
#: the float32 cache's bytes; docs/benchmarks.md measures its perplexity against float32).
NATIVE_AUTO_KV = "float16"


#: What the engine and the decoder ask of a decode backend over this package's State.
DecodeBackend = _DecodeBackend["State"]


@dataclass(frozen=True)
class GenericDecode:
    """The shared decoder's own attention: ``sdpa`` False ("matmul") or True ("sdpa")."""

    sdpa: bool = False
    reads_own_length: bool = False
    verifies_as_rows: bool = False

    @property
    def name(self) -> str:
        return "sdpa" if self.sdpa else "matmul"

    def decode(self, state: State, cache: Cache, rows: Rows, h: mx.array) -> mx.array | None:
        return None


@dataclass(frozen=True)
class FusedDecode:
    """The fused CUDA decode forward. The three kernels are fields (defaults: :mod:`.cuda_kernels`)
    so that their documented contracts can stand in for them on any device (tests/models/kernel_refs.py)."""

    attention: Callable[..., mx.array] = cuda_kernels.decode_attention
    add_rms_norm: Callable[..., tuple[mx.array, mx.array]] = cuda_kernels.add_rms_norm
    swiglu: Callable[[mx.array], mx.array] = cuda_kernels.swiglu
    #: The fused 4-bit product (:func:`.cuda_gemv.qmv`'s contract), used where every matrix and the
    #: row count fit it (:func:`.cuda_gemv.fits`); None: MLX's matmuls and the kernels above.
    qmv: Callable[..., mx.array] | None = None
    #: With ``qmv``: attention, o_proj and the residual add (:func:`.cuda_gemv.attention_o_proj`'s contract).
    attention_o: Callable[..., mx.array] = cuda_gemv.attention_o_proj
    name: str = "fused"
    sdpa: bool = False
    reads_own_length: bool = True
    verifies_as_rows: bool = False

    def decode(self, state: State, cache: Cache, rows: Rows, h: mx.array) -> mx.array | None:
        """The decode forward from the embedded tokens ``h`` ``(B, hidden)`` over the blocks of
        ``rows.block_table``; the K/V cache is written in place. Returns logits ``(B, vocab_size)``, as :func:`models.decoder.layers.forward`."""
        if self.qmv is not None and qmv_fits(state, h.shape[0], h.dtype):
            return self._decode_qmv(self.qmv, state, cache, rows, h)
        c = state.config
        eps = c.rms_norm_eps
        x = mx.fast.rms_norm(h, state.layers[0].input_layernorm, eps)
        for i, layer in enumerate(state.layers):
            qkv = layer.qkv.merged(x) if layer.qkv.merged is not None else mx.concatenate(layer.qkv(x), axis=-1)
            attn = self.attention(qkv, layer.q_norm, layer.k_norm, rows.start, rows.n_valid, cache.keys[i],
                                  cache.values[i], heads=c.num_attention_heads, eps=eps, rope_theta=c.rope_theta,
                                  block_table=rows.block_table, block_size=cache.block_size)
            h, x = self.add_rms_norm(h, layer.o_proj(attn), layer.post_attention_layernorm, eps)
            gate_up = layer.gate_up.merged
            act = self.swiglu(gate_up(x)) if gate_up is not None else split_swiglu(*layer.gate_up(x))
            after = state.layers[i + 1].input_layernorm if i + 1 < len(state.layers) else state.norm
            h, x = self.add_rms_norm(h, layer.down_proj(act), after, eps)
        return state.lm_head(x)

    def _decode_qmv(self, qmv: Callable[..., mx.array], state: State, cache: Cache, rows: Rows,
                    h: mx.array) -> mx.array:
        """Five launches per layer: the norms, residual adds, SwiGLU and the merge of attention's split-K
        partials folded into the 4-bit products."""
        c = state.config
        eps = c.rms_norm_eps
        for i, layer in enumerate(state.layers):
            qkv = qmv(h, layer.qkv.merged, norm=layer.input_layernorm, eps=eps)
            h = self.attention_o(qkv, layer.q_norm, layer.k_norm, rows.start, rows.n_valid, cache.keys[i],
                                 cache.values[i], o_proj=layer.o_proj, residual=h, heads=c.num_attention_heads,
                                 eps=eps, rope_theta=c.rope_theta, block_table=rows.block_table,
                                 block_size=cache.block_size)
            act = qmv(h, layer.gate_up.merged, norm=layer.post_attention_layernorm, eps=eps, glu=True)
            h = qmv(act, layer.down_proj, residual=h)
        return qmv(h, state.lm_head, norm=state.norm, eps=eps)


def qmv_fits(state: State, rows: int, dtype: mx.Dtype) -> bool:
    """Every projection (q/k/v and gate/up merged) and the head fit :func:`.cuda_gemv.qmv` at ``rows`` rows."""
    mats = [m for layer in state.layers for m in (layer.qkv.merged, layer.o_proj, layer.gate_up.merged,
                                                  layer.down_proj)]
    return all(cuda_gemv.fits(m, rows, dtype) for m in [*mats, state.lm_head])


def fits_fused(state: State) -> bool:
    """The config is the fused kernels' architecture (plain split-half RoPE; q/k norm or none) and
    shape (:func:`~.cuda_kernels.supports`)."""
    c = state.config
    return c.rope_scaling is None and not c.rope_traditional and cuda_kernels.supports(c.hidden_size, c.head_dim)


def decode_backend(state: State, path: str | DecodeBackend | None = None,
                   kv_cache_dtype: str = "auto") -> DecodeBackend:
    """The decode backend for ``state``: ``path`` as given when it is a backend; by name "fused"
    (the CUDA kernels where the config fits them, else "matmul"), "native" (the CPU decode step
    where it applies, :func:`~.cpu.native_decode`, else "matmul"), "matmul" or "sdpa"; None:
    "fused" where the kernels run and fit, else "native" where it applies, else "matmul" (the
    native step's int8 activations change the numerics: "matmul" is the exact path, asked for by
    name). The fused kernels read a cache in the activation dtype only: with another
    ``kv_cache_dtype`` a name or None gives "native" where it applies (it reads 16-bit and int8 /
    int4 blocks itself; a quantized one needs a power-of-2 head_dim, the rotation it recomputes),
    else "matmul" (whose attention dequantizes, or on the CPU reads the blocks in the native
    attention). Raises ValueError for another name."""
    if path is not None and not isinstance(path, str):
        return path
    if path is not None and path not in DECODE_PATHS:
        raise ValueError(f"decode_path must be one of {list(DECODE_PATHS)} or None, got {path!r}")
    if kv_cache_dtype != "auto":
        d = state.config.head_dim
        native = path in ("native", None) and (kv_quant(kv_cache_dtype, d) is None or d & (d - 1) == 0)
        return (native_decode(state) if native else None) or GenericDecode(sdpa=path == "sdpa")
    c = state.config
    runs = cuda_kernels.kernels_available() and cuda_kernels.supports(c.hidden_size, c.head_dim)
    if path == "fused" or (path is None and runs):
        return FusedDecode(qmv=cuda_gemv.qmv) if fits_fused(state) else GenericDecode()
    if path in ("native", None):
        return native_decode(state) or GenericDecode()
    return GenericDecode(sdpa=path == "sdpa")


def kv_cache_dtype_for(backend: DecodeBackend, kv_cache_dtype: str) -> str:
    """What the blocks of a cache read by ``backend`` hold: ``kv_cache_dtype``, but "auto" on the
    native CPU path is :data:`NATIVE_AUTO_KV` (the exact "matmul" path keeps the activation dtype)."""
    return NATIVE_AUTO_KV if kv_cache_dtype == "auto" and isinstance(backend, NativeDecode) else kv_cache_dtype
