"""The fused CUDA decode path (models/decoder/cuda_kernels.py): each kernel against its MLX reference
(kernel_refs.py), and whole generations equal to the generic path. Runs only on MLX's CUDA
build (skipped elsewhere, CI included); bench/gpu_step.py records the same checks on an H200."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kernel_refs import ref_add_rms_norm, ref_attention_o_proj, ref_decode_attention, ref_qmv, ref_swiglu

from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
from mlx_serving.models._checkpoint import QuantSpec
from mlx_serving.models._weights import Linear
from mlx_serving.models.decoder.cuda_gemv import attention_o_proj, qmv
from mlx_serving.models.decoder.cuda_kernels import add_rms_norm, decode_attention, kernels_available, swiglu

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not kernels_available(), reason="needs MLX's CUDA build and a GPU")]


def test_add_rms_norm_matches_reference():
    h, delta = mx.random.normal((5, 256)), mx.random.normal((5, 256))
    w = mx.random.normal((256,))
    for got, want in zip(add_rms_norm(h, delta, w, 1e-6), ref_add_rms_norm(h, delta, w, 1e-6)):
        assert mx.allclose(got, want, atol=1e-4).item()


def test_swiglu_matches_reference():
    gu = mx.random.normal((3, 2 * 96))
    assert mx.allclose(swiglu(gu), ref_swiglu(gu), atol=1e-5).item()


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_qk_norm"])
def test_paged_decode_attention_matches_reference(qk_norm):
    """q/k norm (or none: the Llama family), RoPE, in-place K/V write and attention: each row reads
    its positions through its block table (blocks out of order, shared by no one); row 1 is
    padding (its output is unused and the kernel writes nothing for it)."""
    b, h, hkv, d, bs, width = 3, 4, 2, 64, 8, 5
    qkv = mx.random.normal((b, (h + 2 * hkv) * d))
    qw, kw = (mx.random.normal((d,)), mx.random.normal((d,))) if qk_norm else (None, None)
    blocks = 1 + b * width
    keys, values = mx.random.normal((blocks * bs, hkv, d)), mx.random.normal((blocks * bs, hkv, d))
    ref_keys, ref_values = mx.array(np.array(keys)), mx.array(np.array(values))
    rng = np.random.default_rng(0)
    table = mx.array(rng.permutation(np.arange(1, blocks))[: b * width].reshape(b, width).astype(np.int32))
    start = mx.array(rng.integers(0, bs * width - 1, b).astype(np.int32))
    n_valid = mx.array([1, 0, 1], dtype=mx.int32)
    kw_args = dict(heads=h, eps=1e-6, rope_theta=1e6, block_table=table, block_size=bs)
    out = decode_attention(qkv, qw, kw, start, n_valid, keys, values, **kw_args)
    mx.eval(out)
    want = ref_decode_attention(qkv, qw, kw, start, n_valid, ref_keys, ref_values, **kw_args)
    np.testing.assert_allclose(np.array(keys)[bs:], np.array(ref_keys)[bs:], atol=1e-4)  # block 0: padding's
    np.testing.assert_allclose(np.array(values)[bs:], np.array(ref_values)[bs:], atol=1e-5)
    np.testing.assert_allclose(np.array(out)[[0, 2]], np.array(want)[[0, 2]], atol=1e-4)


@pytest.mark.parametrize("splits", [1, 3, 32])
def test_split_k_decode_attention_matches_reference(splits):
    """Split-K: the keys of each (row, KV head) shared by several blocks and merged by the combine
    kernel give the reference output, for long and short rows (a row uses one split per 64 keys at
    most, so the 40-key row runs on one), with the new K/V written once."""
    b, h, hkv, d, bs = 3, 8, 2, 128, 16
    lengths = np.array([700, 0, 40], dtype=np.int32)  # row 1: padding
    n_valid = mx.array([1, 0, 1], dtype=mx.int32)
    qkv = mx.random.normal((b, (h + 2 * hkv) * d))
    qw, kw = mx.random.normal((d,)), mx.random.normal((d,))
    width = 48
    keys, values = mx.random.normal(((1 + b * width) * bs, hkv, d)), mx.random.normal(((1 + b * width) * bs, hkv, d))
    table = mx.array(1 + np.random.default_rng(1).permutation(b * width).reshape(b, width).astype(np.int32))
    kw_args = dict(heads=h, eps=1e-6, rope_theta=1e6, block_table=table, block_size=bs)
    ref_keys, ref_values = mx.array(np.array(keys)), mx.array(np.array(values))
    start = mx.array(lengths)
    out = decode_attention(qkv, qw, kw, start, n_valid, keys, values, splits=splits, **kw_args)
    mx.eval(out)
    want = ref_decode_attention(qkv, qw, kw, start, n_valid, ref_keys, ref_values, **kw_args)
    np.testing.assert_allclose(np.array(out)[[0, 2]], np.array(want)[[0, 2]], atol=2e-4)
    np.testing.assert_allclose(np.array(keys)[bs:], np.array(ref_keys)[bs:], atol=1e-4)


def _greedy(state, prompts: list[list[int]], path: str, compiled: bool, new: int) -> dict[int, list[int]]:
    """Greedy ids of ``prompts`` as one continuous batch on the ``path`` decode backend."""
    engine = Engine(state, EngineConfig.of(max_batch=len(prompts), max_len=64, compile_decode=compiled,
                                           decode_path=path))
    assert engine.decode_backend.name == path
    for i, p in enumerate(prompts):
        engine.add(i, p, SamplingParams(max_new_tokens=new, eos_token_ids=()))
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.num_active:
        for ev in engine.step():
            got[ev.seq_id].append(ev.token_id)
    engine.close()
    return got


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_generation_equals_generic_path(tiny32, compiled):
    """Greedy ids of a ragged continuous batch: fused path (eager or compiled) == generic."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 151000, n).tolist() for n in (3, 17, 9, 30)]
    assert _greedy(tiny32, prompts, "matmul", False, 12) == _greedy(tiny32, prompts, "fused", compiled, 12)


def test_fused_generation_without_qk_norm_equals_generic_path(tmp_path):
    """The Llama family (no q/k norm, biases, untied head) on the real kernels: fused == generic."""
    from mlx_serving.models.loader import load
    from mlx_serving.models.seeded_checkpoint import write_checkpoint

    llama = load(write_checkpoint(tmp_path / "llama", family="llama", quantized=False, dtype="float32", seed=2,
                                  tie_word_embeddings=False,
                                  config_overrides={"attention_bias": True, "mlp_bias": True, "rope_scaling": None,
                                                    "num_attention_heads": 2, "num_key_value_heads": 1}))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 1000, n).tolist() for n in (5, 21, 2)]
    assert _greedy(llama, prompts, "matmul", False, 10) == _greedy(llama, prompts, "fused", False, 10)


def _quantized(n: int, k: int, dtype, group: int) -> Linear:
    w = mx.random.normal((n, k)).astype(dtype)
    q, scales, biases = mx.quantize(w, group_size=group, bits=4)
    return Linear(q, scales, biases, QuantSpec(group_size=group, bits=4))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows,k,group", [(1, 1024, 64), (1, 3072, 64), (1, 512, 32), (1, 256, 128)])
def test_qmv_matches_reference(dtype, rows, k, group):
    """The fused 4-bit product against MLX's quantized_matmul (with the norm, residual and SwiGLU as
    separate ops), on fresh random data at each vector width (k / 256 = 4, 12, 2, 1 words a lane)."""
    lin = _quantized(640, k, dtype, group)
    x, w = mx.random.normal((rows, k)).astype(dtype), mx.random.normal((k,)).astype(dtype)
    res = mx.random.normal((rows, 640)).astype(dtype)
    tol = 1e-3 if dtype == mx.float32 else 3e-2
    for kw in ({}, {"norm": w, "eps": 1e-6}, {"residual": res}, {"norm": w, "eps": 1e-6, "glu": True}):
        got, want = qmv(x, lin, **kw).astype(mx.float32), ref_qmv(x, lin, **kw).astype(mx.float32)
        rel = (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()
        assert rel < tol, (kw.keys(), rel)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_qmv_generation_equals_generic_path(tmp_path, dtype):
    """4-bit weights, few rows: the fused backend takes the folded products (qmv) and generates the
    generic path's greedy ids."""
    from test_qwen3_fused_path import quantized_256

    from mlx_serving.models.decoder.decode_backends import decode_backend, qmv_fits

    state = quantized_256(tmp_path, dtype)
    assert decode_backend(state, "fused").qmv is qmv and qmv_fits(state, 1, state.dtype)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 151000, n).tolist() for n in (3, 17, 9, 30)]
    assert _greedy(state, prompts, "matmul", False, 16) == _greedy(state, prompts, "fused", True, 16)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_attention_o_proj_matches_reference(dtype):
    """Split-K attention whose partials o_proj merges as it stages them, plus the residual: the
    reference (attention, then the 4-bit o_proj and the add) for a row of 700 cached positions
    (11 of the 32 splits hold keys), with the new K/V written."""
    b, h, hkv, d, bs, width = 1, 8, 2, 128, 16, 48
    n_valid = mx.array([1], dtype=mx.int32)
    qkv = mx.random.normal((b, (h + 2 * hkv) * d)).astype(dtype)
    qw, kw = mx.random.normal((d,)).astype(dtype), mx.random.normal((d,)).astype(dtype)
    keys = mx.random.normal(((1 + b * width) * bs, hkv, d)).astype(dtype)
    values = mx.random.normal(((1 + b * width) * bs, hkv, d)).astype(dtype)
    table = mx.array(1 + np.random.default_rng(2).permutation(b * width).reshape(b, width).astype(np.int32))
    ref_keys, ref_values = (mx.array(np.array(a.astype(mx.float32))).astype(dtype) for a in (keys, values))
    o_proj, res = _quantized(512, h * d, dtype, 64), mx.random.normal((b, 512)).astype(dtype)
    kw_args = dict(heads=h, eps=1e-6, rope_theta=1e6, block_table=table, block_size=bs)
    start = mx.array(np.array([700], dtype=np.int32))
    got = attention_o_proj(qkv, qw, kw, start, n_valid, keys, values, o_proj=o_proj, residual=res, **kw_args)
    mx.eval(got)
    want = ref_attention_o_proj(qkv, qw, kw, start, n_valid, ref_keys, ref_values, o_proj=o_proj, residual=res,
                                **kw_args)
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    rel = (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()
    assert rel < (1e-3 if dtype == mx.float32 else 3e-2), rel
    np.testing.assert_allclose(np.array(keys.astype(mx.float32))[bs:], np.array(ref_keys.astype(mx.float32))[bs:],
                               atol=1e-4 if dtype == mx.float32 else 2e-2)
