"""The native CPU kernels (models/native). The quantized matmul's products equal a pure-MLX
reference (dequantize, then matmul) on every supported layout, through both instruction paths,
non-contiguous and batched inputs, inside mx.compile. The paged attention equals a pure-MLX
reference (the K/V gathered through the block table, then ``mx.fast.scaled_dot_product_attention``
with the causal mask, row by row) on GQA and MHA shapes, padding and empty rows, both instruction
paths; each query's result is bit-for-bit independent of its batchmates and of the call's query
count. Bad arguments are refused by name; the loader uses both on the CPU and the generated ids do
not change."""

from __future__ import annotations

import itertools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models import native
from mlx_serving.models.generation.generate import generate
from mlx_serving.models.loader import load

kernel = native.quantized_matmul_cpu()
attention = native.paged_attention_cpu()
pytestmark = [pytest.mark.cpu_kernels,
              pytest.mark.skipif(kernel is None, reason=f"native kernel unavailable: {native.unavailable_reason()}")]


@pytest.fixture(params=["auto", "portable"])
def isa(request: pytest.FixtureRequest):
    module = native._load()
    module.force_portable(request.param == "portable")
    yield module.isa()
    module.force_portable(False)


def _case(m: int, n: int, k: int, bits: int, group: int, seed: int = 0):
    key = mx.random.key(seed)
    kx, kw = mx.random.split(key)
    x = mx.random.normal((m, k), key=kx)
    w, s, b = mx.quantize(mx.random.normal((n, k), key=kw) * 0.2, group_size=group, bits=bits)
    reference = x @ mx.dequantize(w, s, b, group_size=group, bits=bits).T
    mx.eval(x, w, s, b, reference)
    return x, w, s, b, reference


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)])
def test_products_equal_the_mlx_reference(isa: str, bits: int, group: int) -> None:
    for m, n in itertools.product((1, 2, 3, 5, 8, 33), (1, 3, 4, 5, 64, 70)):
        k = 2 * group if group > 32 else 96
        x, w, s, b, want = _case(m, n, k, bits, group, seed=m * 100 + n)
        got = kernel(x, w, s, b, group, bits)
        assert got.shape == (m, n) and got.dtype == mx.float32
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), (isa, m, n, k)


def test_real_layer_shapes_and_mlx_s_own_quantized_matmul(isa: str) -> None:
    for m, n, k in [(1, 960, 576), (7, 1536, 576), (64, 576, 1536), (1, 512, 4096)]:
        x, w, s, b, _ = _case(m, n, k, 4, 32)
        want = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)
        assert mx.allclose(kernel(x, w, s, b, 32, 4), want, rtol=1e-4, atol=1e-4).item(), (isa, m, n, k)


def test_float16_scales_give_the_same_products_bit_for_bit(isa: str) -> None:
    """Scales and biases stored as float16 (what the loader keeps where that is exact) dequantize
    to the same float32 weights, so the products are identical, not merely close."""
    for m, n, k, bits in [(1, 64, 96, 4), (5, 70, 128, 4), (33, 16, 64, 8)]:
        x, w, s, b, _ = _case(m, n, k, bits, 32, seed=m)
        s, b = s.astype(mx.float16).astype(mx.float32), b.astype(mx.float16).astype(mx.float32)
        got = kernel(x, w, s.astype(mx.float16), b.astype(mx.float16), 32, bits)
        assert mx.array_equal(got, kernel(x, w, s, b, 32, bits)).item(), (isa, m, n, k)


def test_batched_and_non_contiguous_inputs() -> None:
    x, w, s, b, _ = _case(12, 40, 64, 4, 32)
    batched = x.reshape(3, 4, 64)
    assert mx.allclose(kernel(batched, w, s, b, 32, 4).reshape(12, 40), kernel(x, w, s, b, 32, 4)).item()
    strided = mx.concatenate([x, x], axis=1)[:, ::2]  # a view with stride 2 along K
    want = strided @ mx.dequantize(w, s, b, group_size=32, bits=4).T
    assert mx.allclose(kernel(strided, w, s, b, 32, 4), want, rtol=1e-5, atol=1e-5).item()


def test_inside_mx_compile_shapeless() -> None:
    x, w, s, b, want = _case(5, 16, 64, 4, 32)
    f = mx.compile(lambda a: kernel(a, w, s, b, 32, 4) * 2.0, shapeless=True)
    assert mx.allclose(f(x), want * 2.0, rtol=1e-5, atol=1e-5).item()
    x2 = mx.concatenate([x, x])
    assert f(x2).shape == (10, 16)


@pytest.mark.parametrize("bad", ["bits", "group", "dtype", "shape"])
def test_bad_arguments_are_refused(bad: str) -> None:
    x, w, s, b, _ = _case(2, 8, 64, 4, 32)
    args = {"bits": (x, w, s, b, 32, 3), "group": (x, w, s, b, 16, 4), "dtype": (x.astype(mx.float16), w, s, b, 32, 4),
            "shape": (x[:, :32], w, s, b, 32, 4)}[bad]
    with pytest.raises(ValueError, match={"bits": "bits must be 4 or 8", "group": "group_size must be",
                                          "dtype": "float32", "shape": "do not agree"}[bad]):
        kernel(*args)


def test_the_loader_uses_it_on_the_cpu_and_the_ids_do_not_change(tiny_ckpt: Path) -> None:
    fast, plain = load(tiny_ckpt), load(tiny_ckpt, native=False)
    assert fast.layers[0].qkv.linears()[0].kernel is not None and fast.lm_head.kernel is not None
    assert fast.layers[0].down_proj.scales.dtype == mx.float16  # stored float16: compacted, exactly
    assert fast.attention is not None and plain.attention is None
    assert plain.layers[0].qkv.linears()[0].kernel is None
    prompt = [7985, 825, 11652, 911, 264, 3460, 13]
    ours, _ = generate(prompt, fast, max_new_tokens=16, eos_token_ids=[])
    theirs, _ = generate(prompt, plain, max_new_tokens=16, eos_token_ids=[])
    assert ours == theirs


def test_without_a_compiler_it_says_so_once_and_falls_back(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A fresh cache and a compiler that fails: one line on stderr, MLX's kernel, the same ids."""
    import os
    import subprocess
    import sys

    script = ("import sys; from mlx_serving.models.loader import load; "
              "from mlx_serving.models.generation.generate import generate; "
              f"s = load({str(tiny_ckpt)!r}); load({str(tiny_ckpt)!r}); "
              "assert s.lm_head.kernel is None and s.attention is None; "
              "print(generate([7985, 825, 11652], s, max_new_tokens=6, eos_token_ids=[])[0])")
    env = {**os.environ, "MLX_SERVING_CACHE": str(tmp_path), "CXX": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("the native CPU kernels are not available") == 1
    assert "the compiler failed" in done.stderr
    plain = load(tiny_ckpt, native=False)
    assert done.stdout.strip() == str(generate([7985, 825, 11652], plain, max_new_tokens=6, eos_token_ids=[])[0])
    off = subprocess.run([sys.executable, "-c", script], env={**env, "MLX_SERVING_NATIVE": "0"},
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and "not available" not in off.stderr  # asked for: nothing to report


# -- paged attention ------------------------------------------------------------------------------

def _paged(b: int, h: int, hkv: int, t: int, d: int, bs: int, width: int, seed: int):
    """Random q (B, H, T, D), a shuffled block pool k, v (R, Hkv, D), a block table (B, W) of
    distinct blocks (block 0 never handed out), starts leaving room for T queries."""
    rng = np.random.default_rng(seed)
    rows = (b * width + 1) * bs
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((b, h, t, d), (rows, hkv, d), (rows, hkv, d)))
    table = mx.array(rng.permutation(np.arange(1, b * width + 1)).reshape(b, width).astype(np.int32))
    start = mx.array(rng.integers(0, width * bs - t + 1, b).astype(np.int32))
    return q, k, v, table, start


def _reference(q, k, v, table, start, n_valid, bs: int) -> mx.array:
    """Pure MLX, row by row: the row's keys and values gathered through its blocks, then MLX's
    attention with the causal mask over positions 0..start + n - 1; padding queries zero."""
    b, h, t, d = q.shape
    out = mx.zeros((b, t, h, d))
    for r in range(b):
        s, n = int(start[r]), int(n_valid[r])
        if n == 0:
            continue
        pos = mx.arange(s + n)
        flat = table[r][pos // bs] * bs + pos % bs
        keys, values = k[flat].transpose(1, 0, 2)[None], v[flat].transpose(1, 0, 2)[None]
        mask = mx.arange(s + n)[None, :] <= (s + mx.arange(n))[:, None]
        o = mx.fast.scaled_dot_product_attention(q[r:r + 1, :, :n], keys, values, scale=d**-0.5, mask=mask)
        out[r, :n] = o[0].transpose(1, 0, 2)
    return out


@pytest.mark.parametrize("b,h,hkv,t,d,bs,width", [(1, 9, 3, 70, 64, 16, 8), (3, 4, 2, 1, 32, 4, 9),
                                                  (2, 6, 6, 5, 20, 8, 3), (4, 8, 2, 33, 128, 16, 4),
                                                  (5, 16, 8, 3, 64, 16, 2)])
def test_paged_attention_equals_the_mlx_reference(isa: str, b: int, h: int, hkv: int, t: int, d: int, bs: int,
                                                  width: int) -> None:
    q, k, v, table, start = _paged(b, h, hkv, t, d, bs, width, seed=b * 7 + t)
    n_valid = mx.array(np.random.default_rng(t).integers(0, t + 1, b).astype(np.int32))
    n_valid[0] = t  # one full row at least; others may be padding-only (0)
    got = attention(q, k, v, table, start, n_valid, d**-0.5, bs)
    assert got.shape == (b, t, h, d) and got.dtype == mx.float32
    want = _reference(q, k, v, table, start, n_valid, bs)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), (isa, float(mx.abs(got - want).max()))


def test_paged_attention_is_batch_and_chunk_invariant() -> None:
    """A row alone equals the row in a batch, and a query computed in a prefill of many tokens
    equals the same query in a one-token call at its position (decode; a prefix-cache hit's or a
    preempted row's recomputation): bit for bit, not merely close."""
    b, h, hkv, t, d, bs = 4, 9, 3, 40, 64, 16
    q, k, v, table, start = _paged(b, h, hkv, t, d, bs, 6, seed=3)
    n_valid = mx.array([40, 17, 40, 1], dtype=mx.int32)
    batched = attention(q, k, v, table, start, n_valid, 0.125, bs)
    for r in range(b):
        alone = attention(q[r:r + 1], k, v, table[r:r + 1], start[r:r + 1], n_valid[r:r + 1], 0.125, bs)
        assert mx.array_equal(alone[0], batched[r]).item(), r
    for j in (0, 15, 16, 31, 39):  # block edges of the key tiling and of the query tiles
        one = attention(q[:1, :, j:j + 1], k, v, table[:1], start[:1] + j, mx.array([1], dtype=mx.int32), 0.125, bs)
        assert mx.array_equal(one[0, 0], batched[0, j]).item(), j


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "int4"])
def test_a_converted_prefix_shared_by_query_tiles_equals_each_tile_alone(isa: str, dtype: str) -> None:
    """A 16-bit or quantized cache: rows of 70 and 45 queries (their prefix converted to float32 once,
    shared by their query tiles) equal, bit for bit, each tile of 16 queries attending alone (a
    one-tile call converts its own blocks)."""
    b, h, hkv, t, d, bs = 2, 6, 2, 70, 64, 16
    q, k, v, table, start = _paged(b, h, hkv, t, d, bs, 8, seed=11)
    extra: dict = {}
    if dtype in ("int8", "int4"):
        bits = 8 if dtype == "int8" else 4
        (k, ks, kb), (v, vs, vb) = (mx.quantize(a, group_size=64, bits=bits) for a in (k, v))
        extra = dict(k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, group_size=64, bits=bits)
    else:
        k, v = k.astype(getattr(mx, dtype)), v.astype(getattr(mx, dtype))
    n_valid = mx.array([70, 45], dtype=mx.int32)
    full = attention(q, k, v, table, start, n_valid, 0.125, bs, **extra)
    assert float(mx.abs(full).max()) > 0
    for r in range(b):
        for j0 in range(0, int(n_valid[r]), 16):
            m = min(16, int(n_valid[r]) - j0)
            tile = attention(q[r:r + 1, :, j0:j0 + 16], k, v, table[r:r + 1], start[r:r + 1] + j0,
                             mx.array([m], dtype=mx.int32), 0.125, bs, **extra)
            assert mx.array_equal(tile[0, :m], full[r, j0:j0 + m]).item(), (isa, dtype, r, j0)


def test_paged_attention_inside_mx_compile() -> None:
    q, k, v, table, start = _paged(2, 4, 2, 3, 32, 8, 4, seed=5)
    n_valid = mx.array([3, 2], dtype=mx.int32)
    f = mx.compile(lambda a: attention(a, k, v, table, start, n_valid, 0.5, 8) + 1.0)
    assert mx.allclose(f(q), attention(q, k, v, table, start, n_valid, 0.5, 8) + 1.0).item()


@pytest.mark.parametrize("bad", ["dtype", "index dtype", "heads", "table"])
def test_paged_attention_bad_arguments_are_refused(bad: str) -> None:
    q, k, v, table, start = _paged(2, 4, 2, 3, 32, 8, 4, seed=1)
    n = mx.array([3, 3], dtype=mx.int32)
    args = {"dtype": (q.astype(mx.float16), k, v, table, start, n), "index dtype": (q, k, v, table, start.astype(mx.int64), n),
            "heads": (q[:, :3], k, v, table, start, n), "table": (q, k, v, table[:1], start, n)}[bad]
    with pytest.raises(ValueError, match={"dtype": "must be float32", "index dtype": "must be int32",
                                          "heads": "H % Hkv == 0", "table": "block_table"}[bad]):
        attention(*args, 0.5, 8)
