"""The quantized KV cache (``kv_cache_dtype`` "int8" / "int4", issue 42) against its rules.

Within one KV dtype (float "auto" for contrast), on the tiny float32 checkpoint with exact token
equality: batched == solo, prefix hit == miss, preempted == uninterrupted, cancelled sequences'
tokens a prefix of their solo run, cached quantized blocks shared (reference counts > 1) and every
block freed at the end; the compiled decode and the generic (dequantizing) attention give what
the native CPU attention gives. The budget buys more blocks at the smaller block size.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx.core as mx

from mlx_serving.models.decoder.kv_cache import KVQuant, init_paged_kv_cache, kv_bytes_per_token, kv_quant, plan_blocks
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
from mlx_serving.models.generation.config import CacheConfig
from mlx_serving.models.loader import load
from mlx_serving.models.text_generation._options import GenerationOptions

from engine_runs import run_workload, step_to_end

DTYPES = ("auto", "int8", "int4")
BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 151000, n)]


def _engine(state, dtype: str, **options) -> Engine:
    return Engine(state, EngineConfig.of(kv_cache_dtype=dtype, **options))


def _blocks(state, dtype: str, n: int) -> int:
    return kv_bytes_per_token(state, dtype) * BS * n


def _run(engine: Engine, max_steps: int = 3000) -> dict[int, list[int]]:
    return step_to_end(engine, max_steps=max_steps)


_SOLO: dict = {}


def _solo(state, dtype: str, prompt: list[int], p: SamplingParams) -> list[int]:
    key = (id(state), dtype, tuple(prompt), p)
    if key not in _SOLO:
        engine = _engine(state, dtype, max_batch=1, max_len=128, prefix_caching=False)
        engine.add(0, prompt, p)
        _SOLO[key] = _run(engine)[0]
    return _SOLO[key]


def _all_free(engine: Engine) -> None:
    s = engine.kv_stats()
    pool = engine.scheduler.kv.pool
    assert s.blocks_used == 0 and s.blocks_free == s.blocks_total
    assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks + 1))


@pytest.fixture(scope="module")
def generic32(tiny32_ckpt):
    """The float32 checkpoint without the native kernels: attention dequantizes gathered blocks."""
    return load(tiny32_ckpt, native=False)


def test_layout_bytes_and_budget(tiny32):
    c = tiny32.config
    assert kv_quant("auto", c.head_dim) is None
    assert kv_quant("int8", 64) == KVQuant(8, 64) and kv_quant("int4", 128) == KVQuant(4, 128)
    assert kv_quant("int8", 96) == KVQuant(8, 32)
    for bad, match in (("fp8", "kv_cache_dtype must be one of"), ("int8", "divisible by 32")):
        with pytest.raises(ValueError, match=match):
            kv_quant(bad, 40)
    f32 = kv_bytes_per_token(tiny32)
    assert f32 == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    for dtype, bits in (("int8", 8), ("int4", 4)):
        per_head = c.head_dim * bits // 8 + 2 * 4 * (c.head_dim // kv_quant(dtype, c.head_dim).group_size)
        assert kv_bytes_per_token(tiny32, dtype) == 2 * c.num_hidden_layers * c.num_key_value_heads * per_head
        budget = f32 * BS * 40
        assert plan_blocks(tiny32, 64, 256, budget, kv_cache_dtype=dtype) == budget // (
            kv_bytes_per_token(tiny32, dtype) * BS)
        cache = init_paged_kv_cache(tiny32, 10, BS, dtype)
        assert cache.nbytes == kv_bytes_per_token(tiny32, dtype) * BS * 11  # + the null block
        assert cache.keys[0].dtype == mx.uint32 and len(cache.arrays()) == 6 * c.num_hidden_layers
    assert plan_blocks(tiny32, 64, 256, f32 * BS * 40) == 40


def test_option_is_checked_and_reaches_the_engine(tiny32):
    for bad in ("int2", 8, None):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            CacheConfig(kv_cache_dtype=bad)
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            GenerationOptions(kv_cache_dtype=bad)
    opts = GenerationOptions(kv_cache_dtype="int4", max_len=64)
    assert opts.engine.cache.kv_cache_dtype == "int4"
    engine = _engine(tiny32, "int8", max_batch=2, max_len=64, decode_path="native")
    assert engine.cache.quant == kv_quant("int8", tiny32.config.head_dim)
    assert engine.decode_backend.name == "matmul"  # the native decode step reads a float cache only


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_cli_flag_sets_the_option(command, capsys):
    from mlx_serving import cli
    from mlx_serving.server._cli import engine_options

    head = [command, "x"] if command == "generate" else [command]
    assert engine_options(cli._parser().parse_args([*head, "--kv-cache-dtype", "int4"]))["kv_cache_dtype"] == "int4"
    assert engine_options(cli._parser().parse_args(head))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        cli._parser().parse_args([*head, "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", ["native", "generic"])
def test_batched_equals_solo_and_compiled_equals_eager(tiny32, generic32, dtype, model):
    state = tiny32 if model == "native" else generic32
    prompts = [_prompt(30 + i, 9 + 11 * i) for i in range(4)]
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=10, temperature=0.8, seed=3)] * 2
    want = {i: _solo(state, dtype, pr, p) for i, (pr, p) in enumerate(zip(prompts, params))}
    for compiled in (False, True):
        engine = _engine(state, dtype, max_batch=4, max_len=128, prefill_chunk=16, compile_decode=compiled)
        for i, (pr, p) in enumerate(zip(prompts, params)):
            engine.add(i, pr, p)
        assert _run(engine) == want
        _all_free(engine)


def test_quantized_modes_differ_from_the_float_cache(tiny32):
    """The quantized caches are really quantized: int4's greedy tokens leave the float cache's."""
    prompt, p = _prompt(40, 30), SamplingParams(max_new_tokens=16)
    outs = {dtype: _solo(tiny32, dtype, prompt, p) for dtype in DTYPES}
    assert outs["int4"] != outs["auto"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_attention_matches_the_generic_dequantized_path(tiny32, generic32, dtype):
    """One prefill + decode forward: the native attention reading quantized blocks and MLX's
    dequantize + attention agree closely (the float32 logits)."""
    from mlx_serving.models.decoder.attention import Rows
    from mlx_serving.models.decoder.kv_cache import row_blocks
    from mlx_serving.models.decoder.layers import forward

    if tiny32.attention is None:
        pytest.skip("the native kernels are not available here")
    tokens = mx.array([_prompt(41, 37)], dtype=mx.int32)
    logits = []
    for state in (tiny32, generic32):
        cache = init_paged_kv_cache(state, 4, BS, dtype)
        table = mx.array(row_blocks(1, 64))
        z = mx.zeros((1,), dtype=mx.int32)
        rows = Rows(tokens, z, mx.array([37], dtype=mx.int32), 37, mx.array([36], dtype=mx.int32), table)
        logits.append(forward(state, cache, rows))
    assert mx.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [48, 47])
def test_prefix_hit_equals_miss_and_shares_quantized_blocks(tiny32, dtype, shared):
    system = _prompt(7, shared)
    a, b = system + _prompt(8, 9), system + _prompt(9, 5)
    p = SamplingParams(max_new_tokens=6)
    engine = _engine(tiny32, dtype, max_batch=4, max_len=128, prefill_chunk=16)
    engine.add(0, a, p)
    early = [ev.token_id for _ in range(4) for ev in engine.step()]  # a's prefix blocks computed and cached
    engine.add(1, b, p)
    mid = engine.step()
    pool = engine.scheduler.kv.pool
    assert max(pool.refcount(blk) for blk in range(1, pool.num_blocks + 1)) == 2  # one block, two sequences
    out = _run(engine)
    for ev in reversed(mid):
        out.setdefault(ev.seq_id, []).insert(0, ev.token_id)
    out[0] = early + out.get(0, [])
    assert out == {0: _solo(tiny32, dtype, a, p), 1: _solo(tiny32, dtype, b, p)}
    s = engine.kv_stats()
    assert s.prefix_hits == 1 and s.prefix_hit_tokens == (shared // BS) * BS
    _all_free(engine)


@pytest.mark.parametrize("dtype", DTYPES)
def test_preempted_equals_uninterrupted(tiny32, dtype):
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=28, temperature=1.1, seed=2),
              SamplingParams(max_new_tokens=25, temperature=0.7, top_p=0.8, seed=3), SamplingParams(max_new_tokens=30)]
    prompts = [_prompt(20 + i, 10 + 3 * i) for i in range(4)]
    engine = _engine(tiny32, dtype, max_batch=4, max_len=64, prefill_chunk=7, kv_cache_bytes=_blocks(tiny32, dtype, 5))
    assert engine.kv_stats().blocks_total == 5
    for i, (pr, p) in enumerate(zip(prompts, params)):
        engine.add(i, pr, p)
    assert _run(engine) == {i: _solo(tiny32, dtype, pr, p) for i, (pr, p) in enumerate(zip(prompts, params))}
    assert engine.kv_stats().preemptions > 0
    _all_free(engine)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_workloads_with_cancels_keep_outputs_and_free_every_block(tiny32, data):
    dtype = data.draw(st.sampled_from(["int8", "int4"]), label="dtype")
    engine = _engine(tiny32, dtype, max_batch=data.draw(st.integers(1, 4), label="max_batch"), max_len=64,
                     prefill_chunk=data.draw(st.sampled_from([5, 16, 512]), label="chunk"),
                     kv_cache_bytes=_blocks(tiny32, dtype, data.draw(st.integers(5, 9), label="blocks")),
                     prefix_caching=data.draw(st.booleans(), label="cache"))
    prefix = _prompt(50, 40)
    specs = []
    for i in range(data.draw(st.integers(1, 4), label="n")):
        base = data.draw(st.sampled_from([[], prefix]), label="prefix")
        prompt = (base + _prompt(100 + i, data.draw(st.integers(1, 12))))[:50]
        p = SamplingParams(max_new_tokens=data.draw(st.integers(1, 10)),
                           temperature=data.draw(st.sampled_from([0.0, 1.0])), seed=i)
        specs.append((prompt, p, data.draw(st.integers(0, 4)), data.draw(st.one_of(st.none(), st.integers(0, 8)))))
    out, cancelled = run_workload(engine, specs, settle=4)
    for i, (prompt, p, _, _) in enumerate(specs):
        solo = _solo(tiny32, dtype, prompt, p)
        got = out.get(i, [])
        assert got == (solo[: len(got)] if i in cancelled else solo)
    _all_free(engine)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_greedy_with_speculation_equals_without(tiny32, dtype):
    """Speculative verify spans write quantized K/V too (rejected drafts overwritten later):
    greedy tokens with n-gram speculation equal those without, drafts accepted, blocks freed."""
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(6):
        base = [int(x) for x in rng.integers(0, 1000, 10)]
        prompts.append((base * 3 + base[: i % 7])[: 20 + 3 * i])  # repeats: the drafts find matches
    p = SamplingParams(max_new_tokens=24)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    outs, engines = [], []
    for config in (None, spec):
        engine = _engine(tiny32, dtype, max_batch=3, max_len=96, prefill_chunk=7,
                         kv_cache_bytes=_blocks(tiny32, dtype, 10), speculative_config=config)
        if engine.speculator is not None:
            engine.speculator.eager = True  # every row verifies at every step, not only on evidence
        for i, prompt in enumerate(prompts):
            engine.add(i, prompt, p)
        outs.append(_run(engine))
        _all_free(engine)
        engines.append(engine)
    assert outs[0] == outs[1]
    assert engines[1].spec_decode_stats()["spec_decode_num_drafts"] > 0, engines[1].spec_decode_stats()


def _rows_with_outliers(seed: int, n: int, d: int) -> np.ndarray:
    """Key-like rows: Gaussian, one outlier channel, per-row magnitudes over 1e-3..1e3, a zero row,
    a constant row and a row of tiny values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[:, 3] *= 40
    x *= rng.lognormal(0, 2, (n, 1)).astype(np.float32)
    x[0], x[1], x[2] = 0.0, 1.5, 3e-8 * np.arange(d)
    return x


def _minmax_error(x: np.ndarray, group: int) -> np.ndarray:
    """Squared error per group of the plain [min, max] span (scale (max - min) / 15, bias min)."""
    g = x.reshape(-1, group).astype(np.float64)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    s = np.maximum((hi - lo) / 15, 1e-7)
    return ((np.clip(np.round((g - lo) / s), 0, 15) * s + lo - g) ** 2).sum(-1)


@pytest.mark.parametrize("d,group", [(64, 64), (128, 32)])
def test_the_int4_fit_keeps_the_layout_and_lowers_the_error(d, group):
    """``fit_int4`` stores MLX's 4-bit layout (``mx.dequantize`` reads it); every group's squared
    error is at most the plain [min, max] span's (its grid starts there, the refits cannot raise it),
    in all a fifth below ``mx.quantize``'s; zero and constant groups are stored exactly; 16-bit
    scales and biases come back in that dtype."""
    from mlx_serving.models.decoder.kv_quantizer import fit_int4

    x = mx.hadamard_transform(mx.array(_rows_with_outliers(d, 256, d)))
    x = mx.concatenate([mx.zeros((1, d)), mx.full((1, d), 1.5), x])
    w, s, b = fit_int4(x, group, mx.float32)
    assert (w.dtype, w.shape, s.shape, b.shape) == (mx.uint32, (258, d // 8), (258, d // group), (258, d // group))
    got = np.array(mx.dequantize(w, s, b, group_size=group, bits=4))
    ref = np.array(x)
    err = ((got.astype(np.float64) - ref) ** 2).reshape(-1, group).sum(-1)
    assert (err <= _minmax_error(ref, group) * (1 + 1e-4) + 1e-30).all()
    mlx = np.array(mx.dequantize(*mx.quantize(x, group_size=group, bits=4), group_size=group, bits=4))
    assert err.sum() <= 0.85 * ((mlx.astype(np.float64) - ref) ** 2).sum()
    np.testing.assert_array_equal(got[:2], ref[:2])
    w16, s16, b16 = fit_int4(x.astype(mx.bfloat16), group, mx.bfloat16)
    assert s16.dtype == b16.dtype == mx.bfloat16
    got16 = np.array(mx.dequantize(w16, s16, b16, group_size=group, bits=4).astype(mx.float32))
    assert ((got16 - ref) ** 2).sum() <= 1.1 * err.sum() + 1e-30


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_generic_write_stores_the_quantizer_of_its_dtype(tiny32, dtype):
    """``PagedKVCache.write`` stores ``mx.quantize`` (int8) or ``fit_int4`` (int4) of the rotated
    K/V, read back by ``gather`` as ``mx.dequantize`` of those bytes."""
    from mlx_serving.models.decoder.kv_quantizer import fit_int4

    c = tiny32.config
    cache = init_paged_kv_cache(tiny32, 2, BS, dtype)
    q = cache.quant
    k, v = (mx.array(_rows_with_outliers(s, 5 * c.num_key_value_heads, c.head_dim)).reshape(5, -1, c.head_dim)
            for s in (1, 2))
    rows = mx.array([16, 17, 20, 31, 40], dtype=mx.int32)
    cache.write(0, k, v, rows)
    got_k, got_v = cache.gather(0, rows[None])
    for x, got in ((k, got_k), (v, got_v)):
        r = mx.hadamard_transform(x)
        stored = fit_int4(r, q.group_size, tiny32.dtype) if q.bits == 4 else mx.quantize(r, group_size=q.group_size,
                                                                                          bits=q.bits)
        want = mx.dequantize(*stored, group_size=q.group_size, bits=q.bits)
        np.testing.assert_array_equal(np.array(got[0].transpose(1, 0, 2)), np.array(want))


def test_the_native_int4_store_equals_the_fit_on_heavy_tailed_rows():
    """The native decode step's writer (kv_store.cpp) against ``fit_int4`` over 2,000 rows of
    magnitudes 1e-3..1e3 with outliers, zero, constant and tiny rows: every word, scale and bias."""
    from mlx_serving.models import native
    from mlx_serving.models.decoder.kv_quantizer import fit_int4

    module = native.cpu_decode_module()
    if module is None or mx.default_device() != mx.cpu:
        pytest.skip("the native CPU kernels are not available here")
    for d, group in ((64, 64), (128, 128), (128, 32)):
        x = mx.array(_rows_with_outliers(7 + d + group, 2000, d))
        got = module.kv_quantize(x, 4, group)
        want = fit_int4(mx.hadamard_transform(x), group, mx.float32)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.array(g).view(np.uint32), np.array(w).view(np.uint32))


def test_the_int4_fit_refuses_a_group_it_cannot_sum_by_halves():
    from mlx_serving.models.decoder.kv_quantizer import fit_int4

    for group in (48, 96, 0):
        with pytest.raises(ValueError, match="group_size must be a power of 2"):
            fit_int4(mx.zeros((2, 96)), group, mx.float32)
