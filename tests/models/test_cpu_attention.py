"""The CPU decode step's attention kernel (models/decoder/cpu/attend.cpp) on its own, over a paged
cache of each layout (float32, float16, bfloat16; int8 / int4 of Hadamard-rotated vectors, with one
group per head vector as kv_cache.py stores them and with smaller groups): equal to a float64
reference on every instruction set, and the query heads of a KV head run together equal each run
alone, bit for bit (the decode step runs them together once it has a task per thread), heads over
prefixes of one set of keys (a verify's rows) included."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models import native

module = native.cpu_decode_module()
pytestmark = pytest.mark.skipif(module is None or mx.default_device() != mx.cpu,
                                reason=f"the native CPU kernels are not available: {native.unavailable_reason()}")
D, HKV, G, R = 64, 3, 3, 400  # SmolLM2-135M's head_dim, KV heads and query heads per KV head
LAYOUTS = [("float32", 0, 0), ("float16", 0, 0), ("bfloat16", 0, 0), ("int8", 8, 64), ("int8", 8, 32),
           ("int4", 4, 64), ("int4", 4, 32)]


@pytest.fixture(params=("auto", "avx2", "portable"))
def isa(request):
    module.set_decoder_isa(request.param)
    yield request.param
    module.set_decoder_isa("auto")


def _hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def _cache(rng: np.random.Generator, name: str, bits: int, group: int):
    """Keys or values (R, HKV, D) with an outlier channel, as stored, their scales (quantized) and
    the vectors they stand for in float64 (dequantized: in the rotated basis)."""
    x = rng.standard_normal((R, HKV, D)).astype(np.float32)
    x[..., 5] *= 20
    if not bits:
        stored = mx.array(x).astype(getattr(mx, name))
        return stored, [], np.array(stored.astype(mx.float32), dtype=np.float64)
    w, s, b = mx.quantize(mx.hadamard_transform(mx.array(x.reshape(-1, D))), group_size=group, bits=bits)
    dense = mx.dequantize(w, s, b, group_size=group, bits=bits)
    shape = (R, HKV, -1)
    return w.reshape(shape), [s.reshape(shape), b.reshape(shape)], np.array(dense, dtype=np.float64).reshape(R, HKV, D)


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, rows: np.ndarray, g: int, rotated: bool) -> np.ndarray:
    h = _hadamard(D) if rotated else np.eye(D)
    q = q.astype(np.float64) @ h.T
    s = q @ k[rows, g].T / np.sqrt(D)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v[rows, g] @ h.T


@pytest.mark.parametrize("name,bits,group", LAYOUTS)
@pytest.mark.parametrize("n", [1, 37, 300])
def test_attention_equals_the_reference_and_heads_together_equal_each_alone(isa, name, bits, group, n):
    rng = np.random.default_rng(n * 10 + bits + group)
    k, k_scales, k_dense = _cache(rng, name, bits, group)
    v, v_scales, v_dense = _cache(rng, name, bits, group)
    q = rng.standard_normal((G, D)).astype(np.float32) * 2
    rows = rng.permutation(R)[:n].astype(np.int32)  # paged: the row's keys anywhere in the cache
    g = n % HKV
    scales = k_scales + v_scales
    got = np.array(module.attend(mx.array(q), k, v, mx.array(rows), g, scales, bits, group))
    want = _reference(q, k_dense, v_dense, rows, g, bits > 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    for j in range(G):  # one head alone: the same sums in the same order
        alone = np.array(module.attend(mx.array(q[j:j + 1]), k, v, mx.array(rows), g, scales, bits, group))
        np.testing.assert_array_equal(alone[0], got[j])


@pytest.mark.parametrize("name,bits,group", LAYOUTS)
def test_heads_over_prefixes_of_shared_keys_equal_each_alone(isa, name, bits, group):
    """A verify's k + 1 rows at consecutive positions attend as one call, each head over its own
    prefix of the longest row's keys: every head's output is its solo call's, bit for bit."""
    rng = np.random.default_rng(7 + bits + group)
    k, k_scales, _ = _cache(rng, name, bits, group)
    v, v_scales, _ = _cache(rng, name, bits, group)
    scales = k_scales + v_scales
    rows = rng.permutation(R)[:261].astype(np.int32)
    lengths = [n for n in (257, 258, 259, 260, 261, 1, 16, 17) for _ in range(G)]  # rows x their query heads
    q = rng.standard_normal((len(lengths), D)).astype(np.float32) * 2
    got = np.array(module.attend(mx.array(q), k, v, mx.array(rows), 1, scales, bits, group, lengths))
    for j, n in enumerate(lengths):
        alone = np.array(module.attend(mx.array(q[j:j + 1]), k, v, mx.array(rows[:n]), 1, scales, bits, group))
        np.testing.assert_array_equal(alone[0], got[j])


def test_attention_refuses_a_layout_it_does_not_take():
    k = mx.zeros((4, HKV, D), mx.float16)
    with pytest.raises(ValueError, match="row is out of range"):
        module.attend(mx.zeros((1, D)), k, k, mx.array([4], mx.int32), 0)
    with pytest.raises(ValueError, match="one dtype"):
        module.attend(mx.zeros((1, D)), k, k.astype(mx.float32), mx.array([0], mx.int32), 0)
    with pytest.raises(ValueError, match="length must be in"):
        module.attend(mx.zeros((1, D)), k, k, mx.array([0], mx.int32), 0, [], 0, 0, [2])
    with pytest.raises(ValueError, match="4 scale arrays"):
        module.attend(mx.zeros((1, D)), mx.zeros((4, HKV, D // 4), mx.uint32), mx.zeros((4, HKV, D // 4), mx.uint32),
                      mx.array([0], mx.int32), 0, [], 8, 64)
