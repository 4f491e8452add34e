"""The fused CUDA decode path (models/qwen3/kernels.py): each kernel against its MLX
reference, and whole generations equal to the generic path. Runs only on MLX's CUDA build
(skipped elsewhere, CI included); bench/gpu_step.py records the same checks on an H200."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from models.qwen3 import Engine, SamplingParams
from models.qwen3 import model as qmodel
from models.qwen3.kernels import add_rms_norm, decode_attention, kernels_available, swiglu

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs MLX's CUDA build and a GPU")


def test_add_rms_norm_matches_mlx():
    h, delta = mx.random.normal((5, 256)), mx.random.normal((5, 256))
    w = mx.random.normal((256,))
    s, x = add_rms_norm(h, delta, w, 1e-6)
    assert mx.allclose(s, h + delta, atol=1e-6).item()
    assert mx.allclose(x, mx.fast.rms_norm(h + delta, w, 1e-6), atol=1e-4).item()


def test_swiglu_matches_mlx():
    gu = mx.random.normal((3, 2 * 96))
    gate, up = gu[:, :96], gu[:, 96:]
    assert mx.allclose(swiglu(gu), gate * mx.sigmoid(gate) * up, atol=1e-5).item()


def test_decode_attention_matches_reference():
    """q/k norm, RoPE, in-place K/V write and attention over each row's own prefix."""
    b, h, hkv, d, length = 3, 4, 2, 64, 40
    rng = np.random.default_rng(0)
    qkv = mx.random.normal((b, (h + 2 * hkv) * d))
    qw, kw = mx.random.normal((d,)), mx.random.normal((d,))
    keys, values = mx.random.normal((4, hkv, length, d)), mx.random.normal((4, hkv, length, d))
    mx.eval(keys, values)
    old_k, old_v = np.array(keys), np.array(values)
    start = mx.array(rng.integers(0, length - 1, b).astype(np.int32))
    n_valid = mx.array([1, 0, 1], dtype=mx.int32)  # row 1 is padding: writes nothing
    out = decode_attention(qkv, qw, kw, start, n_valid, keys, values, heads=h, eps=1e-6, rope_theta=1e6)
    mx.eval(out)
    q, k, v = mx.split(qkv, [h * d, (h + hkv) * d], axis=-1)
    rope = lambda x: mx.fast.rope(x, d, traditional=False, base=1e6, scale=1.0, offset=start)  # noqa: E731
    q = rope(mx.fast.rms_norm(q.reshape(b, h, d), qw, 1e-6)[:, :, None])[:, :, 0]
    k = rope(mx.fast.rms_norm(k.reshape(b, hkv, d), kw, 1e-6)[:, :, None])[:, :, 0]
    v = v.reshape(b, hkv, d)
    new_k, new_v = np.array(keys), np.array(values)
    for r in range(b):
        p = int(start[r].item())
        ref_k, ref_v = old_k.copy(), old_v.copy()
        if r != 1:
            ref_k[r, :, p], ref_v[r, :, p] = np.array(k[r]), np.array(v[r])
        np.testing.assert_allclose(new_k[r], ref_k[r], atol=1e-4)
        np.testing.assert_allclose(new_v[r], ref_v[r], atol=1e-5)
        if r == 1:
            continue
        kk = mx.repeat(mx.array(ref_k[r, :, : p + 1]), h // hkv, axis=0)
        vv = mx.repeat(mx.array(ref_v[r, :, : p + 1]), h // hkv, axis=0)
        probs = mx.softmax((q[r][:, None] @ kk.swapaxes(-1, -2)) * d**-0.5, axis=-1)
        np.testing.assert_allclose(np.array(out[r]).reshape(h, d), np.array((probs @ vv)[:, 0]), atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_generation_equals_generic_path(tiny32, compiled):
    """Greedy ids of a ragged continuous batch: fused path (eager or compiled) == generic."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 151000, n).tolist() for n in (3, 17, 9, 30)]
    outs = []
    try:
        for path in ("matmul", "fused"):
            qmodel.DECODE_PATH = path
            engine = Engine(tiny32, max_batch=4, max_len=64, compile_decode=compiled and path == "fused")
            for i, p in enumerate(prompts):
                engine.add(i, p, SamplingParams(max_new_tokens=12, eos_token_ids=()))
            got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
            while engine.num_active:
                for ev in engine.step():
                    got[ev.seq_id].append(ev.token_id)
            outs.append(got)
    finally:
        qmodel.DECODE_PATH = None
    assert outs[0] == outs[1]
