"""The native prefill (models/decoder/cpu/prefill.py, qgemm.cpp, pack.cpp, prefill.cpp): the int8 GEMM
over the packed weights against an integer numpy reference and the decode step's own products (every
row count from 1 to 40) on every instruction-set path, its
rows independent of their batchmates and their place among the rows (bit for bit, across row
counts, orders and thread counts), and the prefill forward on the native path against the exact
one (each family), batched == solo and one chunk == two chunks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models import native
from mlx_serving.models.decoder import layers
from mlx_serving.models.decoder.attention import Rows
from mlx_serving.models.decoder.cpu import NativeDecode, native_decode
from mlx_serving.models.decoder.cpu.prefill import PoolAttention
from mlx_serving.models.decoder.kv_cache import PagedKVCache, init_paged_kv_cache, kv_quant, row_blocks
from mlx_serving.models.loader import load
from mlx_serving.models.seeded_checkpoint import write_checkpoint

module = native.cpu_decode_module()
pytestmark = pytest.mark.skipif(module is None or mx.default_device() != mx.cpu,
                                reason=f"the native CPU kernels are not available: {native.unavailable_reason()}")


@pytest.fixture(params=("auto", "avx2", "portable"))
def isa(request):
    """Each instruction set in turn (a lesser one than the CPU has is forced; back to auto after)."""
    module.set_decoder_isa(request.param)
    yield request.param
    module.set_decoder_isa("auto")


def _matrix(rng: np.random.Generator, n: int, k: int, bits: int, group: int, half: bool):
    w, s, b = mx.quantize(mx.array(rng.normal(size=(n, k)).astype(np.float32)), group_size=group, bits=bits)
    return (w, s.astype(mx.float16), b.astype(mx.float16)) if half else (w, s, b)


def _reference(x: np.ndarray, w: mx.array, s: mx.array, b: mx.array, bits: int, group: int) -> np.ndarray:
    """The int8 product in numpy: x rounded per block of 32 (d = max |x| / 127, ties to even), exact
    integer block sums with the unsigned weights, scaled in float64: sum over blocks of
    s d sum(q xq) + b d sum(xq)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    xq = np.round(blocks * np.where(d > 0, np.float32(127) / np.abs(blocks).max(-1), 0)[..., None]).astype(np.int64)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    q = ((np.array(w)[..., None] >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], k // 32, 32).astype(np.int64)
    per = group // 32
    sc = np.repeat(np.array(s.astype(mx.float32), dtype=np.float64), per, axis=1)  # (N, blocks)
    of = np.repeat(np.array(b.astype(mx.float32), dtype=np.float64), per, axis=1)
    dots = np.einsum("mbj,nbj->mnb", xq, q).astype(np.float64)  # exact integer block sums
    return (np.einsum("mnb,nb,mb->mn", dots, sc, d) + np.einsum("nb,mb->mn", of, d * xq.sum(-1))).astype(np.float64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("half", [False, True], ids=["f32-scales", "f16-scales"])
def test_gemm_is_the_int8_reference_and_the_decode_steps_product(isa, bits, group, half):
    """K ending in a partial group of 8 blocks (416: 13 blocks, a padded group of 5; 576: 18, a
    group of 2 in two lanes each; 640: 20, 4 blocks likewise), rows and columns off the tile
    sizes: within float32 accumulation error of the integer reference, and bit for bit the decode
    step's product of each row (qgemv), also when the call has fewer rows than a tile."""
    rng = np.random.default_rng(bits * group + half)
    k = {32: 416, 64: 576, 128: 640}[group]
    w, s, b = _matrix(rng, 45, k, bits, group, half)
    x = (rng.normal(size=(7, k)) * np.linspace(0.1, 3, k)).astype(np.float32)
    got = np.array(module.int8_quantized_matmul(mx.array(x), w, s, b, group, bits, 2))
    ref = _reference(x, w, s, b, bits, group)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    decode = np.array(module.int8_matmul(module.QMatrix(w, s, b, None, bits, group), mx.array(x)))
    np.testing.assert_array_equal(got, decode)
    for m in (1, 3):  # fewer rows than the GEMM's tile: the decode step's product over column ranges
        np.testing.assert_array_equal(np.array(module.int8_quantized_matmul(mx.array(x[:m]), w, s, b, group, bits, 2)),
                                      got[:m])


@pytest.mark.parametrize("threads", [1, 3])
def test_a_row_is_the_same_whatever_its_batchmates_and_place(isa, threads):
    """300 rows (several row chunks on 3 threads), then subsets in shuffled orders and single rows:
    each row's outputs equal, bit for bit."""
    rng = np.random.default_rng(threads)
    w, s, b = _matrix(rng, 70, 1536, 4, 32, True)
    x = rng.normal(size=(300, 1536)).astype(np.float32)
    full = np.array(module.int8_quantized_matmul(mx.array(x), w, s, b, 32, 4, threads))
    for m in (1, 5, 66):
        pick = rng.permutation(300)[:m]
        part = np.array(module.int8_quantized_matmul(mx.array(x[pick]), w, s, b, 32, 4, threads))
        np.testing.assert_array_equal(part, full[pick])


@pytest.mark.parametrize("bits,half", [(4, True), (8, False)], ids=["q4-f16", "q8-f32"])
def test_packed_gemm_is_the_one_row_product_for_every_row_count_and_order(isa, bits, half):
    """The matrix packed once (QMatrix, with a bias; 45 columns: a last tile of 1; K = 576: a last
    group of 2 blocks) run for M = 1..40 rows on 2 threads (micro tiles of 1-4 rows, and on AVX-512
    the zmm tiles of 5 and 6):
    each row bit for bit its one-row product (int8_matmul, row by row), the rows in reverse and
    shuffled order too."""
    rng = np.random.default_rng(bits)
    w, s, b = _matrix(rng, 45, 576, bits, 32, half)
    matrix = module.QMatrix(w, s, b, mx.array(rng.normal(size=45).astype(np.float32)), bits, 32)
    x = rng.normal(size=(40, 576)).astype(np.float32)
    solo = np.array(module.int8_matmul(matrix, mx.array(x)))
    for m in range(1, 41):
        np.testing.assert_array_equal(np.array(module.int8_packed_matmul(matrix, mx.array(x[:m]), 2)), solo[:m])
    for order in (np.arange(40)[::-1], rng.permutation(40)):
        np.testing.assert_array_equal(np.array(module.int8_packed_matmul(matrix, mx.array(x[order]), 2)), solo[order])


def test_gemm_takes_leading_dimensions_and_refuses_bad_arguments():
    rng = np.random.default_rng(0)
    w, s, b = _matrix(rng, 8, 64, 4, 32, False)
    x = rng.normal(size=(2, 3, 64)).astype(np.float32)
    got = np.array(module.int8_quantized_matmul(mx.array(x), w, s, b, 32, 4, 1))
    assert got.shape == (2, 3, 8)
    np.testing.assert_array_equal(got.reshape(6, 8),
                                  np.array(module.int8_quantized_matmul(mx.array(x.reshape(6, 64)), w, s, b, 32, 4, 1)))
    cases = [((mx.array(x), w, s, b, 32, 3, 1), "bits must be 4 or 8"),
             ((mx.array(x), w, s, b, 16, 4, 1), "group_size must be"),
             ((mx.array(x[..., :32]), w, s, b, 32, 4, 1), "x must be"),
             ((mx.array(x), w, s[:, :1], b[:, :1], 32, 4, 1), "scales and biases"),
             ((mx.array(x), w, s, b.astype(mx.float16), 32, 4, 1), "both float32 or both float16"),
             ((mx.array(x), w, s, b, 32, 4, 0), "threads")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            module.int8_quantized_matmul(*args)


def _swiglu(gate_up: np.ndarray) -> np.ndarray:
    g, u = np.split(gate_up.astype(np.float32), 2, axis=-1)
    return g / (np.float32(1) + np.exp(-g)) * u


@pytest.mark.parametrize("threads", [1, 3])
def test_swiglu_product_is_the_gemm_of_the_swiglu_and_rows_stay_independent(isa, threads):
    """gate_up (rows, 2K) = [gate | up] -> the int8 product of silu(gate) * up: the GEMM of numpy's
    SwiGLU (the decode step's formula) up to float32 rounding (a 1-ulp exp can flip one int8
    rounding), not the product of the halves swapped; each row bit for bit the same alone, in a
    subset in another order and among 200 rows."""
    rng = np.random.default_rng(threads)
    w, s, b = _matrix(rng, 40, 1536, 4, 32, True)
    m = module.QMatrix(w, s, b, None, 4, 32)
    gate_up = (rng.normal(size=(200, 3072)) * 2).astype(np.float32)
    got = np.array(module.int8_swiglu_matmul(m, mx.array(gate_up), threads))
    want = np.array(module.int8_quantized_matmul(mx.array(_swiglu(gate_up)), w, s, b, 32, 4, threads))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
    swapped = np.array(module.int8_quantized_matmul(mx.array(_swiglu(np.roll(gate_up, 1536, axis=1))), w, s, b, 32,
                                                    4, threads))
    assert np.abs(got - swapped).max() > 0.1 * np.abs(want).max()
    for pick in (rng.permutation(200)[:9], np.array([17])):
        part = np.array(module.int8_swiglu_matmul(m, mx.array(gate_up[pick]), threads))
        np.testing.assert_array_equal(part, got[pick])


def test_swiglu_product_takes_leading_dimensions_and_refuses_bad_arguments():
    rng = np.random.default_rng(0)
    w, s, b = _matrix(rng, 8, 64, 4, 32, False)
    m = module.QMatrix(w, s, b, None, 4, 32)
    gate_up = rng.normal(size=(2, 3, 128)).astype(np.float32)
    got = np.array(module.int8_swiglu_matmul(m, mx.array(gate_up), 2))
    np.testing.assert_array_equal(
        got.reshape(6, 8), np.array(module.int8_swiglu_matmul(m, mx.array(gate_up.reshape(6, 128)), 2)))
    for args, message in [((m, mx.array(gate_up[..., :64]), 2), "int8_swiglu_matmul: gate_up must be"),
                          ((m, mx.array(gate_up), 0), "int8_swiglu_matmul: threads")]:
        with pytest.raises(ValueError, match=message):
            module.int8_swiglu_matmul(*args)


@pytest.mark.parametrize("bits", [0, 8], ids=["float-cache", "int8-cache"])
def test_attention_on_the_prefill_pool_is_openmps_bit_for_bit(bits):
    """The paged attention of rows at different starts (a prefix in the cache) and padding, float and
    quantized cache: on the prefill's pool of 1 or 3 threads the same bits as on OpenMP's threads;
    negative threads refused."""
    attention = native.paged_attention_cpu()
    rng = np.random.default_rng(bits)
    table = mx.array(row_blocks(3, 96))
    q = mx.array(rng.normal(size=(3, 6, 40, 64)).astype(np.float32))
    kv = [mx.array(rng.normal(size=(int(table.max()) * 16 + 16, 2, 64)).astype(np.float32)) for _ in range(2)]
    extra: dict = {}
    if bits:
        (k, ks, kb), (v, vs, vb) = (mx.quantize(a, group_size=32, bits=bits) for a in kv)
        kv = [k, v]
        extra = dict(k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, group_size=32, bits=bits)
    args = (q, *kv, table, mx.array([0, 37, 5], dtype=mx.int32), mx.array([40, 21, 33], dtype=mx.int32), 0.125, 16)
    ref = np.array(attention(*args, **extra))
    assert np.abs(ref).max() > 0
    for threads in (1, 3):
        np.testing.assert_array_equal(np.array(attention(*args, **extra, threads=threads)), ref)
    with pytest.raises(ValueError, match="threads"):
        attention(*args, **extra, threads=-1)


def _bits(a: mx.array) -> np.ndarray:
    """``a`` as numpy, 16-bit floats as their bit patterns (numpy has no bfloat16)."""
    return np.array(a.view(mx.uint16) if a.dtype in (mx.float16, mx.bfloat16) else a)


def _cache(dtype: str, rows: int, rng: np.random.Generator) -> PagedKVCache:
    """A one-layer ``dtype`` cache of ``rows`` rows (2 KV heads of 64) holding random K/V, MLX-written."""
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, head_dim=64)
    cache = init_paged_kv_cache(SimpleNamespace(config=config, dtype=mx.float32), rows // 16 - 1, 16, dtype)
    kv = [mx.array(rng.normal(size=(rows, 2, 64)).astype(np.float32)) for _ in range(2)]
    cache.write(0, *kv, mx.arange(rows, dtype=mx.int32))
    mx.eval(cache.arrays())
    return cache


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "int4"])
def test_storing_attention_is_the_mlx_write_then_the_attention_bit_for_bit(dtype):
    """The native prefill's attention storing the new K/V itself (rows at different starts over a
    cached prefix, padding tokens all landing in the null block) against PagedKVCache.write, the
    rotation of a quantized cache's queries and output by MLX and the plain attention: every stored
    row (the null block's included) and every output bit for bit, on the pool of 1 or 3 threads and on
    OpenMP's; the cache arrays returned share the given ones' buffers."""
    rng = np.random.default_rng(len(dtype))
    table = mx.array(row_blocks(3, 96))
    start, n_valid, t = mx.array([0, 37, 5], dtype=mx.int32), mx.array([40, 21, 33], dtype=mx.int32), 40
    q = mx.array(rng.normal(size=(3, 6, t, 64)).astype(np.float32))
    new = [mx.array(rng.normal(size=(3 * t, 2, 64)).astype(np.float32)) for _ in range(2)]
    j = mx.arange(t)[None, :]
    pos = start[:, None] + j
    rows = mx.where(j < n_valid[:, None], mx.take_along_axis(table, pos // 16, axis=1) * 16 + pos % 16, 0).reshape(-1)
    q8 = kv_quant(dtype, 64)
    quant = {} if q8 is None else dict(group_size=q8.group_size, bits=q8.bits)
    want = _cache(dtype, int(table.max()) * 16 + 16, np.random.default_rng(1))
    want.write(0, *new, rows)
    scales = {} if q8 is None else dict(k_scales=want.key_scales[0], k_biases=want.key_biases[0],
                                        v_scales=want.value_scales[0], v_biases=want.value_biases[0], **quant)
    ref = want.rotate(native.paged_attention_cpu()(want.rotate(q), want.keys[0], want.values[0], table, start, n_valid,
                                                   0.125, 16, **scales))
    assert np.abs(np.array(ref)).max() > 0
    for threads in (0, 1, 3):  # 0: OpenMP's threads
        given = _cache(dtype, int(table.max()) * 16 + 16, np.random.default_rng(1)).arrays()
        y, *arrays = PoolAttention(module, threads).store_and_attend(q, *new, rows, given, table, start, n_valid,
                                                                     0.125, 16, **quant)
        mx.eval(y, arrays)
        np.testing.assert_array_equal(np.array(y), np.array(ref))
        for a, b, old in zip(arrays, want.arrays(), given, strict=True):
            np.testing.assert_array_equal(_bits(a), _bits(b))
            np.testing.assert_array_equal(_bits(old), _bits(b))  # written in place


def test_storing_attention_refuses_bad_new_kv():
    rng = np.random.default_rng(0)
    cache = _cache("int8", 64, rng)
    q = mx.zeros((1, 2, 4, 64))
    table, one = mx.array([[1, 2]], dtype=mx.int32), mx.array([4], dtype=mx.int32)
    k = mx.zeros((4, 2, 64))
    quant = dict(group_size=64, bits=8)
    for new, rows, message in [((k[:, :1], k[:, :1]), mx.arange(4, dtype=mx.int32), "new_k and new_v"),
                               ((k.astype(mx.float16), k), mx.arange(4, dtype=mx.int32), "new_k and new_v"),
                               ((k, k), mx.arange(3, dtype=mx.int32), "rows must be"),
                               ((k, k), mx.arange(4, dtype=mx.int64), "rows must be")]:
        with pytest.raises(ValueError, match=message):
            PoolAttention(module, 1).store_and_attend(q, *new, rows, cache.arrays(), table, one * 0, one, 0.125, 16,
                                                      **quant)


def test_native_prefill_state_runs_its_mlp_and_attention_natively(family_state):
    """Every layer's MLP is the fused native one, the attention runs on the prefill's pool, and the
    exact state is left as it was."""
    state = _native(family_state)
    assert all(ly.mlp is not None for ly in state.layers)
    assert all(ly.mlp is None for ly in family_state.layers)
    assert state.attention is not None and state.attention is not family_state.attention
    assert state.attention.threads >= 1  # a PoolAttention


# ---- the prefill forward ---------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def family_state(request, tmp_path_factory) -> layers.State:
    """4-bit seeded checkpoints: Qwen3 (q/k norm, tied), Llama (attention and MLP biases, untied head,
    traditional RoPE), Qwen2 (q/k/v biases)."""
    family = request.param
    overrides = {"llama": {"attention_bias": True, "mlp_bias": True, "rope_traditional": True,
                           "num_attention_heads": 4, "num_key_value_heads": 2}}.get(family, {})
    path: Path = write_checkpoint(tmp_path_factory.mktemp("cpu_prefill") / family, family=family, seed=1,
                                  tie_word_embeddings=family != "llama", config_overrides=overrides)
    return load(path)


def _prefill(state: layers.State, tokens: list[list[int]], starts: list[int] | None = None, cache=None,
             table: np.ndarray | None = None):
    """One forward of rows ``tokens`` (right-padded) from ``starts`` (default 0): logits at every
    real position (list of (n_b, vocab)) and the cache."""
    b, t = len(tokens), max(len(r) for r in tokens)
    starts = starts or [0] * b
    table = row_blocks(b, 64) if table is None else table
    cache = cache or init_paged_kv_cache(state, int(table.max()))
    ids = np.zeros((b, t), dtype=np.int32)
    for i, r in enumerate(tokens):
        ids[i, :len(r)] = r
    gather = [i * t + j for i, r in enumerate(tokens) for j in range(len(r))]
    rows = Rows(mx.array(ids), mx.array(starts, dtype=mx.int32), mx.array([len(r) for r in tokens], dtype=mx.int32),
                max(s + t for s in starts), mx.zeros((b,), mx.int32), mx.array(table), dense=b == 1,
                gather=mx.array(gather, dtype=mx.int32))
    logits = np.array(layers.forward(state, cache, rows))
    mx.eval(cache.keys, cache.values)
    split = np.cumsum([len(r) for r in tokens])[:-1]
    return np.split(logits, split), cache


def _native(state: layers.State) -> layers.State:
    backend = native_decode(state)
    assert isinstance(backend, NativeDecode)
    return backend.prefill_state


def test_native_prefill_follows_the_exact_path_on_every_family(family_state):
    """A 40-token prefill: logits within 5% of the exact path's largest at the median position
    (the seeded random weights amplify the int8 rounding at a few positions: up to ~20% seen; real
    text is measured by bench/cpu_decode.py), the same top-1 at 85% of the positions or more, and
    not the exact path by accident."""
    ids = [np.random.default_rng(5).integers(0, family_state.config.vocab_size, 40).tolist()]
    (ours,), _ = _prefill(_native(family_state), ids)
    (ref,), _ = _prefill(family_state, ids)
    assert np.median(np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)) <= 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.85
    assert not np.array_equal(ours, ref)


def test_native_prefill_batched_equals_solo_and_two_chunks_equal_one(family_state):
    """Rows of 23, 7 and 31 tokens in one forward: each equals its solo forward bit for bit; a row
    prefilled in two chunks (the second reading the first's K/V: a prefix hit) equals one chunk."""
    state = _native(family_state)
    rng = np.random.default_rng(9)
    ids = [rng.integers(0, state.config.vocab_size, n).tolist() for n in (23, 7, 31)]
    table = row_blocks(3, 64)
    batched, _ = _prefill(state, ids, table=table)
    for i, row in enumerate(ids):
        (solo,), _ = _prefill(state, [row], table=table[i:i + 1])
        np.testing.assert_array_equal(batched[i], solo)
    row = ids[2]
    (first,), cache = _prefill(state, [row[:16]], table=table[:1])
    (second,), _ = _prefill(state, [row[16:]], [16], cache, table[:1])
    np.testing.assert_array_equal(np.concatenate([first, second]), batched[2])


def test_native_prefill_is_the_native_decode_up_to_float_rounding(family_state):
    """A preempted row's recomputation (a prefill) beside its original decode steps, both native: the
    same int8 products, so the logits differ only by the float32 rounding of the norms, RoPE and
    attention (MLX's operations vs the decode step's): within 1e-5 of the largest, where the exact
    prefill is ~1e-2 away. Not bit for bit: a recomputed greedy token can still differ at a near tie."""
    ids = [np.random.default_rng(1).integers(0, family_state.config.vocab_size, 12).tolist()]
    table = row_blocks(1, 64)
    (prefilled,), _ = _prefill(_native(family_state), ids, table=table)
    (exact,), _ = _prefill(family_state, ids, table=table)
    decoded = _decoded(family_state, ids[0], table)
    scale = np.abs(decoded).max(-1)
    assert (np.abs(prefilled - decoded).max(-1) <= 1e-5 * scale).all()
    assert np.abs(exact - decoded).max() > 1e-3 * scale.max()


def _decoded(state: layers.State, ids: list[int], table: np.ndarray) -> np.ndarray:
    """Logits (T, vocab) of ``ids`` decoded one token per step on the native path (teacher-forced)."""
    backend = native_decode(state)
    cache = init_paged_kv_cache(state, int(table.max()))
    out = []
    for j, token in enumerate(ids):
        rows = Rows(mx.array([[token]], dtype=mx.int32), mx.array([j], dtype=mx.int32), mx.ones((1,), mx.int32),
                    j + 1, mx.zeros((1,), mx.int32), mx.array(table), dense=True)
        out.append(np.array(layers.forward(state, cache, rows, backend))[0])
    return np.stack(out)


def test_gemm_of_no_rows_is_empty():
    w, s, b = _matrix(np.random.default_rng(0), 8, 64, 4, 32, False)
    assert module.int8_quantized_matmul(mx.zeros((0, 64)), w, s, b, 32, 4, 2).shape == (0, 8)
