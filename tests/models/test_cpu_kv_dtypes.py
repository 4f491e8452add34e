"""The native CPU decode step over each KV cache dtype (issues 42 and 39): float16 / bfloat16 blocks
and int8 / int4 blocks (Hadamard-rotated, MLX's affine layout) read and written by the step itself.

The step's writes are MLX's, bit for bit (its quantized store against ``mx.quantize`` of
``mx.hadamard_transform``; the first layer's rows, which no cache read feeds, against what
``PagedKVCache.write`` stores); its logits follow the generic path over the same cache dtype; a row
batched equals the row alone and, through the engine, a prefix hit equals a miss, within each dtype.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models import native
from mlx_serving.models.decoder import layers
from mlx_serving.models.decoder.attention import Rows
from mlx_serving.models.decoder.cpu import NativeDecode
from mlx_serving.models.decoder.decode_backends import NATIVE_AUTO_KV, GenericDecode, decode_backend
from mlx_serving.models.decoder.kv_cache import PagedKVCache, init_paged_kv_cache, kv_quant, row_blocks
from mlx_serving.models.decoder.kv_quantizer import fit_int4
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
from engine_runs import run_to_end

module = native.cpu_decode_module()
pytestmark = pytest.mark.skipif(module is None or mx.default_device() != mx.cpu,
                                reason=f"the native CPU kernels are not available: {native.unavailable_reason()}")
DTYPES = ("float16", "bfloat16", "int8", "int4")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("d,group", [(64, 64), (128, 128), (128, 32)])
def test_the_quantized_store_is_mlx_rotation_and_rounding(bits, d, group):
    """Rows with outlier channels, constant rows (a zero edge: no bias) and zeros: the native store
    equals ``mx.quantize(mx.hadamard_transform(x))`` (int8) or ``kv_quantizer.fit_int4`` of it (int4)
    in every word, scale and bias."""
    rng = np.random.default_rng(bits * d + group)
    x = rng.standard_normal((40, d)).astype(np.float32)
    x[:, 3] *= 40  # an outlier channel, as keys have
    x[5] = 0.0
    x[6] = 1.5
    x[7] = -2.25
    x = mx.array(x)
    got = module.kv_quantize(x, bits, group)
    r = mx.hadamard_transform(x)
    want = fit_int4(r, group, mx.float32) if bits == 4 else mx.quantize(r, group_size=group, bits=bits)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.array(g), np.array(w))


def test_the_quantized_store_refuses_what_it_cannot_rotate():
    with pytest.raises(ValueError, match="power of 2"):
        module.kv_quantize(mx.zeros((2, 96)), 8, 32)


def _decode(state, backend, dtype: str, tokens: list[list[int]], table: np.ndarray, positions: list[int]):
    """Teacher-forced one-token steps of ``tokens`` (B rows of T ids from ``positions``) over a
    ``dtype`` cache: logits (T, B, vocab) and the cache."""
    b, t = len(tokens), len(tokens[0])
    cache = init_paged_kv_cache(state, int(table.max()), kv_cache_dtype=dtype)
    out = []
    for j in range(t):
        pos = mx.array([s + j for s in positions], dtype=mx.int32)
        rows = Rows(mx.array([[r[j]] for r in tokens], dtype=mx.int32), pos, mx.ones((b,), mx.int32),
                    max(positions) + j + 1, mx.zeros((b,), mx.int32), mx.array(table[:b]), dense=b == 1)
        logits = layers.forward(state, cache, rows, backend)
        mx.eval(logits, cache.arrays())
        out.append(np.array(logits))
    return np.stack(out), cache


def _bits(a: mx.array) -> np.ndarray:
    """``a`` as numpy, 16-bit floats as their bit patterns (numpy has no bfloat16)."""
    return np.array(a.view(mx.uint16) if a.dtype in (mx.float16, mx.bfloat16) else a)


def _rows(cache: PagedKVCache, table: np.ndarray, b: int, start: int, n: int) -> mx.array:
    return mx.array((table[b, 0] * cache.block_size + np.arange(start, start + n)).tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_writes_equal_mlx_writes(tiny, dtype):
    """The first layer's K/V (no cache read feeds them): the native step's stored rows equal what
    ``PagedKVCache.write`` stores of the float32 cache's rows (the same step's K/V unrounded)."""
    backend = decode_backend(tiny, "native", dtype)
    assert isinstance(backend, NativeDecode)
    ids = [np.random.default_rng(3).integers(0, tiny.config.vocab_size, 7).tolist()]
    table = row_blocks(1, 32)
    _, exact = _decode(tiny, backend, "auto", ids, table, [0])
    _, ours = _decode(tiny, backend, dtype, ids, table, [0])
    rows = _rows(ours, table, 0, 0, 7)
    mlx = init_paged_kv_cache(tiny, int(table.max()), kv_cache_dtype=dtype)
    mlx.write(0, exact.keys[0][rows], exact.values[0][rows], rows)
    mx.eval(mlx.arrays())
    n = len(ours.keys)
    for got, want in zip(ours.arrays()[::n], mlx.arrays()[::n]):  # layer 0 of every part
        np.testing.assert_array_equal(_bits(got[rows]), _bits(want[rows]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_step_follows_the_generic_path_over_the_same_cache(tiny, dtype):
    """12 steps over a ``dtype`` cache: the native step's logits within a few percent of the generic
    path's over the same dtype (its attention dequantizing), the same top-1 at most steps. int4
    rounds the int8-activation K/V's small differences to 16 levels: a wider margin."""
    ids = [np.random.default_rng(5).integers(0, tiny.config.vocab_size, 12).tolist()]
    table = row_blocks(1, 64)
    ours, _ = _decode(tiny, decode_backend(tiny, "native", dtype), dtype, ids, table, [0])
    ref, _ = _decode(tiny, GenericDecode(), dtype, ids, table, [0])
    scale = np.abs(ref).max(-1)
    assert (np.abs(ours - ref).max(-1) <= (0.16 if dtype == "int4" else 0.08) * scale).all()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_batched_equals_the_row_alone_per_dtype(tiny, dtype):
    """Five rows at different positions in one step: each row's logits and stored K/V equal its
    solo run's, bit for bit."""
    backend = decode_backend(tiny, "native", dtype)
    rng = np.random.default_rng(9)
    ids = rng.integers(0, tiny.config.vocab_size, (5, 4)).tolist()
    positions = [0, 17, 5, 30, 2]
    table = row_blocks(5, 64)
    batched, cache = _decode(tiny, backend, dtype, ids, table, positions)
    for b in range(5):
        solo, solo_cache = _decode(tiny, backend, dtype, [ids[b]], table[b:b + 1], [positions[b]])
        np.testing.assert_array_equal(batched[:, b], solo[:, 0])
        rows = _rows(cache, table, b, positions[b], 4)
        for k, ks in zip(cache.arrays(), solo_cache.arrays()):
            np.testing.assert_array_equal(_bits(k[rows]), _bits(ks[rows]))


def _generate(state, prompts: list[list[int]], max_batch: int, dtype: str, **kw) -> list[list[int]]:
    engine = Engine(state, EngineConfig.of(max_batch=max_batch, max_len=64, prefill_chunk=8, block_size=4,
                                           decode_path="native", kv_cache_dtype=dtype, **kw))
    out = run_to_end(engine, prompts, [SamplingParams(max_new_tokens=10, eos_token_ids=())] * len(prompts))
    engine.close()
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_engine_batched_equals_solo_and_prefix_hit_equals_miss(tiny, dtype):
    """Through the engine on the native path ("auto" stores float16 there): a staggered batch
    generates what each request alone does, a prompt whose prefix is cached what it does uncached."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, tiny.config.vocab_size, n).tolist() for n in (5, 13, 1, 9)]
    batched = _generate(tiny, prompts, 4, dtype)
    assert batched == [_generate(tiny, [p], 1, dtype)[0] for p in prompts]
    shared = prompts[1] + prompts[3]
    hit = _generate(tiny, [prompts[1], shared], 1, dtype)[1]
    assert hit == _generate(tiny, [shared], 1, dtype, prefix_caching=False)[0]


def test_auto_is_float16_on_the_native_path_only(tiny):
    """"auto" allocates float16 blocks under the native step, the activation dtype under "matmul";
    a named dtype is kept; the quantized dtypes take the native step too."""
    def cache(path: str, dtype: str = "auto") -> PagedKVCache:
        engine = Engine(tiny, EngineConfig.of(max_batch=1, max_len=32, decode_path=path, kv_cache_dtype=dtype))
        kept = PagedKVCache(list(engine.runner.cache.keys), [], 0, engine.runner.cache.quant)
        engine.close()
        return kept

    assert NATIVE_AUTO_KV == "float16"
    assert cache("native").keys[0].dtype == mx.float16
    assert cache("matmul").keys[0].dtype == tiny.dtype == mx.float32
    assert cache("native", "bfloat16").keys[0].dtype == mx.bfloat16
    assert cache("native", "float32").keys[0].dtype == mx.float32  # the float32 cache, asked for by name
    assert cache("native", "int4").quant == kv_quant("int4", tiny.config.head_dim)
    assert all(isinstance(decode_backend(tiny, None, d), NativeDecode) for d in DTYPES)
