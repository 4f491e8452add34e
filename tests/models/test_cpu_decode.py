"""The native CPU decode step (models/decoder/cpu, ``decode_path="native"``): its int8 products
against a float reference on every instruction-set path, the whole step against the exact generic
path on each family (Qwen3 q/k norm, Llama biases + untied head, Qwen2 biases), and batch invariance
(a row batched equals the row alone, bit for bit; through the engine too)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models import native
from mlx_serving.models.decoder import layers
from mlx_serving.models.decoder.attention import Rows
from mlx_serving.models.decoder.cpu import NativeDecode, native_decode
from mlx_serving.models.decoder.decode_backends import GenericDecode, decode_backend
from mlx_serving.models.decoder.kv_cache import init_paged_kv_cache, row_blocks
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
from mlx_serving.models.loader import load
from mlx_serving.models.seeded_checkpoint import write_checkpoint
from engine_runs import run_to_end

module = native.cpu_decode_module()
pytestmark = pytest.mark.skipif(module is None or mx.default_device() != mx.cpu,
                                reason=f"the native CPU kernels are not available: {native.unavailable_reason()}")
ISAS = ("auto", "avx2", "portable")


@pytest.fixture(params=ISAS)
def isa(request):
    """Each instruction set in turn (a lesser one than the CPU has is forced; back to auto after)."""
    module.set_decoder_isa(request.param)
    yield request.param
    module.set_decoder_isa("auto")


def _rounded(x: np.ndarray) -> np.ndarray:
    """``x`` (M, K) as the int8 activations the products read: per block of 32, round(x / d) * d
    with d = max |x| / 127 (ties to even, as the kernel's nearbyint)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    q = np.round(blocks / np.where(d > 0, d, 1))
    return (q * d).reshape(x.shape).astype(np.float64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("half", [False, True], ids=["f32-scales", "f16-scales"])
def test_int8_product_is_the_product_of_the_rounded_activations(isa, bits, group, half):
    """y = x @ dequantize(w).T + bias with x rounded to int8 per block: equal to the float64 product
    of the rounded activations within float32 accumulation error, and within 2% of the unrounded one."""
    rng = np.random.default_rng(bits * group)
    w, s, b = mx.quantize(mx.array(rng.normal(size=(40, 256)).astype(np.float32)), group_size=group, bits=bits)
    if half:
        s, b = s.astype(mx.float16), b.astype(mx.float16)
    bias = rng.normal(size=40).astype(np.float32)
    x = rng.normal(size=(3, 256)).astype(np.float32) * np.linspace(0.1, 3, 256, dtype=np.float32)
    got = np.array(module.int8_matmul(module.QMatrix(w, s, b, mx.array(bias), bits, group), mx.array(x)))
    dense = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits),
                     dtype=np.float64)
    np.testing.assert_allclose(got, _rounded(x) @ dense.T + bias, rtol=1e-4, atol=1e-3)
    exact = x.astype(np.float64) @ dense.T + bias
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


def test_int8_product_refuses_a_layout_it_does_not_take():
    w, s, b = mx.quantize(mx.ones((8, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        module.QMatrix(w, s, b, None, 3, 32)
    with pytest.raises(ValueError, match="scales and biases"):
        module.QMatrix(w, s[:, :1], b[:, :1], None, 4, 32)


# ---- the whole step ------------------------------------------------------------------------------

def _checkpoint(tmp: Path, family: str) -> Path:
    """A 4-bit seeded checkpoint of ``family``: Qwen3 (q/k norm, tied), Llama (attention and MLP
    biases, untied head, traditional RoPE), Qwen2 (q/k/v biases)."""
    overrides = {"llama": {"attention_bias": True, "mlp_bias": True, "rope_traditional": True,
                           "num_attention_heads": 4, "num_key_value_heads": 2},
                 "qwen2": {}, "qwen3": {}}[family]
    return write_checkpoint(tmp / family, family=family, seed=1, tie_word_embeddings=family != "llama",
                            config_overrides=overrides)


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def family_state(request, tmp_path_factory) -> layers.State:
    return load(_checkpoint(tmp_path_factory.mktemp("cpu_decode"), request.param))


def _decode(state, backend, tokens: list[list[int]], table: np.ndarray, positions: list[int] | None = None):
    """Teacher-forced one-token steps of rows ``tokens`` (B rows of T ids; row b starts at
    ``positions[b]``, default 0): logits (T, B, vocab) float32 and the cache."""
    b, t = len(tokens), len(tokens[0])
    start = positions or [0] * b
    cache = init_paged_kv_cache(state, int(table.max()))  # blocks 1..max: every entry of the table
    out = []
    for j in range(t):
        pos = mx.array([s + j for s in start], dtype=mx.int32)
        rows = Rows(mx.array([[r[j]] for r in tokens], dtype=mx.int32), pos, mx.ones((b,), mx.int32),
                    max(start) + j + 1, mx.zeros((b,), mx.int32), mx.array(table[:b]), dense=b == 1)
        logits = layers.forward(state, cache, rows, backend)
        mx.eval(logits, cache.keys, cache.values)
        out.append(np.array(logits))
    return np.stack(out), cache


def test_native_step_follows_the_exact_path_on_every_family(family_state):
    """Logits of 12 teacher-forced steps within a few percent of the exact path's, the same top-1
    at most steps; the native path is really taken (not the fallback)."""
    backend = decode_backend(family_state, "native")
    assert isinstance(backend, NativeDecode)
    ids = [np.random.default_rng(5).integers(0, family_state.config.vocab_size, 12).tolist()]
    table = row_blocks(1, 64)
    ours, _ = _decode(family_state, backend, ids, table)
    ref, _ = _decode(family_state, GenericDecode(), ids, table)
    scale = np.abs(ref).max(-1)
    assert (np.abs(ours - ref).max(-1) <= 0.08 * scale).all()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    assert not np.array_equal(ours, ref)  # int8 activations: not the exact path by accident


def test_a_row_batched_equals_the_row_alone_bit_for_bit(family_state):
    """Six rows at different positions in one step (past the step's GEMM threshold: its products
    run as the int8 GEMM, a solo row's as qgemv): each row's logits and K/V equal its solo run's."""
    backend = decode_backend(family_state, "native")
    rng = np.random.default_rng(9)
    ids = rng.integers(0, family_state.config.vocab_size, (6, 6)).tolist()
    positions = [0, 17, 5, 30, 2, 11]
    table = row_blocks(6, 64)
    batched, cache = _decode(family_state, backend, ids, table, positions)
    for b in range(6):
        solo, solo_cache = _decode(family_state, backend, [ids[b]], table[b:b + 1], [positions[b]])
        np.testing.assert_array_equal(batched[:, b], solo[:, 0])
        rows = (table[b, 0] * 16 + np.arange(positions[b], positions[b] + 6)).tolist()
        for k, ks in zip(cache.keys, solo_cache.keys):
            np.testing.assert_array_equal(np.array(k[mx.array(rows)]), np.array(ks[mx.array(rows)]))


@pytest.mark.parametrize("threads", ["1", "64"])
def test_a_streams_consecutive_rows_in_one_step_equal_its_steps(family_state, monkeypatch, threads):
    """A verify's rows: one stream's tokens at consecutive positions over one block table in one
    step (their attention one call per KV head on one thread, ``threads`` 1, else per row and
    head), next to another stream's row: each row's logits equal the stream's one-token steps'."""
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    backend = decode_backend(family_state, "native")
    ids = np.random.default_rng(4).integers(0, family_state.config.vocab_size, 8).tolist()
    other = ids[5]
    table = row_blocks(2, 64)
    steps, _ = _decode(family_state, backend, [ids], table[:1])
    state, cache = family_state, init_paged_kv_cache(family_state, int(table.max()))
    for j in range(3):  # the stream's first tokens, one step each
        rows = Rows(mx.array([[ids[j]]]), mx.array([j], mx.int32), mx.ones((1,), mx.int32), j + 1,
                    mx.zeros((1,), mx.int32), mx.array(table[:1]), dense=True)
        mx.eval(layers.forward(state, cache, rows, backend), cache.keys, cache.values)
    pos = [3, 4, 5, 6, 7, 0]
    rows = Rows(mx.array([[t] for t in ids[3:]] + [[other]], dtype=mx.int32), mx.array(pos, mx.int32),
                mx.ones((6,), mx.int32), 8, mx.zeros((6,), mx.int32), mx.array(table[[0] * 5 + [1]]))
    logits = np.array(layers.forward(state, cache, rows, backend))
    np.testing.assert_array_equal(logits[:5], steps[3:, 0])
    alone, _ = _decode(family_state, backend, [[other]], table[1:2])
    np.testing.assert_array_equal(logits[5], alone[0, 0])


def test_a_cache_of_strided_arrays_gets_the_same_step(tiny):
    """The step takes the cache arrays without a copy node and writes in place; arrays that are
    not row-contiguous (transposed views here, holding three steps' K/V) are copied first: the
    fourth step's logits and K/V are those of the contiguous cache."""
    backend = decode_backend(tiny, "native")
    ids = [np.random.default_rng(3).integers(0, tiny.config.vocab_size, 4).tolist()]
    table = row_blocks(1, 16)
    want, cache = _decode(tiny, backend, ids, table)
    _, strided = _decode(tiny, backend, [ids[0][:3]], table)

    def view(a: mx.array) -> mx.array:  # the same values through a transposed layout
        return mx.contiguous(a.swapaxes(1, 2)).swapaxes(1, 2)

    strided.keys[:], strided.values[:] = [view(k) for k in strided.keys], [view(v) for v in strided.values]
    rows = Rows(mx.array([[ids[0][3]]], dtype=mx.int32), mx.array([3], mx.int32), mx.ones((1,), mx.int32), 4,
                mx.zeros((1,), mx.int32), mx.array(table), dense=True)
    logits = layers.forward(tiny, strided, rows, backend)
    mx.eval(logits, strided.keys, strided.values)
    np.testing.assert_array_equal(np.array(logits), want[3])
    at = mx.array([int(table[0, 0]) * strided.block_size + p for p in range(4)])  # the four positions' rows
    for got, ref in zip(strided.keys + strided.values, cache.keys + cache.values):
        np.testing.assert_array_equal(np.array(got[at]), np.array(ref[at]))


def test_portable_and_vector_paths_agree(family_state):
    """The same step through the portable loops and the best vector path: the same int8 products,
    float32 sums in another order."""
    backend = decode_backend(family_state, "native")
    ids = [np.random.default_rng(2).integers(0, family_state.config.vocab_size, 5).tolist()]
    table = row_blocks(1, 32)
    best, _ = _decode(family_state, backend, ids, table)
    module.set_decoder_isa("portable")
    try:
        portable, _ = _decode(family_state, backend, ids, table)
    finally:
        module.set_decoder_isa("auto")
    np.testing.assert_allclose(portable, best, rtol=1e-3, atol=1e-3 * np.abs(best).max())


# ---- through the engine ----------------------------------------------------------------------------

def _generate(state, prompts: list[list[int]], max_batch: int, compiled: bool, path: str = "native",
              **kw) -> list[list[int]]:
    engine = Engine(state, EngineConfig.of(max_batch=max_batch, max_len=64, prefill_chunk=8, block_size=4,
                                           decode_path=path, compile_decode=compiled, **kw))
    assert engine.decode_backend.name == path
    out = run_to_end(engine, prompts, [SamplingParams(max_new_tokens=10, eos_token_ids=())] * len(prompts))
    engine.close()
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_batched_equals_solo_and_prefix_hit_equals_miss(tiny, compiled):
    """Through the engine on the native path: a staggered batch generates what each request alone
    does, and a prompt whose prefix is cached generates what it does uncached, token for token."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, tiny.config.vocab_size, n).tolist() for n in (5, 13, 1, 9)]
    batched = _generate(tiny, prompts, 4, compiled)  # 4 rows decode together: the step's GEMM
    assert batched == [_generate(tiny, [p], 1, compiled)[0] for p in prompts]
    shared = prompts[1] + prompts[3]
    hit = _generate(tiny, [prompts[1], shared], 1, compiled)[1]  # the second request hits the first's blocks
    assert hit == _generate(tiny, [shared], 1, compiled, prefix_caching=False)[0]


def test_backend_choice(tiny):
    """The default (None) and "native" build the native step for a 4-bit model computing in float32
    on the CPU, "matmul" the exact path; dense weights or bfloat16 activations fall back to the
    exact path."""
    assert isinstance(decode_backend(tiny, "native"), NativeDecode)
    assert isinstance(decode_backend(tiny), NativeDecode)
    assert decode_backend(tiny, "matmul") == GenericDecode()
    dense = load(tiny.path, dequantize=True)
    assert native_decode(dense) is None and decode_backend(dense, "native") == GenericDecode()
    assert decode_backend(dense) == GenericDecode()
    assert native_decode(load(tiny.path, dtype="bfloat16")) is None


@pytest.mark.timeout(300)  # a cap that only ends a hang
def test_a_pool_destroyed_at_once_stops_its_workers(tiny, monkeypatch):
    """A native step built and dropped before its pool's workers ran (a worker that read the wake
    count after the destructor's wake-up slept for ever and the destructor's join hung). 63 workers
    per pool, dropped as soon as built: before the fix the first build already hung; after each
    drop the process has no more threads than after the first (every worker joined)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # pool_threads(): the caller + 63 workers

    def threads() -> int:
        return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0

    assert native_decode(tiny) is not None  # the first build may start MLX's own threads
    before = threads()
    for _ in range(4):
        assert native_decode(tiny) is not None  # dropped here (no reference cycle): the pool's destructor joins
        assert threads() <= before
