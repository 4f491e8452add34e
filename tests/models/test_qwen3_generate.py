"""Forward pass and generate(): parity with mlx-lm, batching, samplers."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_serving.models.generation import generate
from mlx_serving.models.loader import load
from mlx_serving.models.seeded_checkpoint import write_checkpoint
from paged import fresh
from mlx_serving.models.decoder.layers import forward
from mlx_serving.models.generation.sampling import SamplerKind, SamplingParams, sample_top_p

ELIXIR = [7985, 825, 11652, 911, 468, 97772, 13]  # "Write one sentence about Elixir."
PROMPTS = [ELIXIR, [9707, 11, 1879], [int(x) for x in np.random.default_rng(7).integers(0, 151000, 40)]]


def _mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
    return out


def _mlx_lm_model(path: Path, dtype=mx.float32):
    """mlx-lm's model for ``path``, floating parameters cast to ``dtype`` (the packed
    4-bit weights are untouched), so both sides compute in the same precision."""
    from mlx_lm.utils import load_model

    model = load_model(path)[0]
    model.set_dtype(dtype)
    return model


# ---- parity with mlx-lm --------------------------------------------------------------------

def test_greedy_ids_match_mlx_lm(tiny, tiny_ckpt):
    model = _mlx_lm_model(tiny_ckpt)
    for prompt in PROMPTS:
        # mlx-lm's ids: the exact path (the native step's int8 activations differ)
        ours, info = generate(prompt, tiny, max_new_tokens=32, eos_token_ids=[], decode_path="matmul")
        assert ours == _mlx_lm_greedy(model, prompt, 32)
        assert info["finish_reason"] == "length" and len(set(ours)) > 4  # not degenerate


def test_greedy_ids_match_mlx_lm_bfloat16(tiny_bf16, tiny_ckpt):
    model = _mlx_lm_model(tiny_ckpt, mx.bfloat16)  # mlx-lm as it loads the checkpoint
    ours, _ = generate(ELIXIR, tiny_bf16, max_new_tokens=32, eos_token_ids=[])
    assert ours == _mlx_lm_greedy(model, ELIXIR, 32)


@pytest.mark.parametrize("which, ckpt", [("tiny", "tiny_ckpt"), ("tiny_bf16", "tiny_ckpt"),
                                         ("tiny32", "tiny32_ckpt")])
def test_prefill_and_decode_logits_match_mlx_lm(which, ckpt, request):
    from mlx_lm.models.cache import make_prompt_cache

    state = request.getfixturevalue(which)
    model = _mlx_lm_model(request.getfixturevalue(ckpt), state.dtype)
    kv, ref_cache = fresh(state, 64), make_prompt_cache(model)
    t = len(ELIXIR)
    ours = forward(state, kv.cache, kv.rows(mx.array([ELIXIR]), mx.array([0]), mx.array([t]), t,
                                            mx.array([t - 1]), dense=True))
    theirs = model(mx.array([ELIXIR]), cache=ref_cache)[:, -1]
    tol = 1e-4 if state.dtype == mx.float32 else 1e-3
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)), atol=tol)
    nxt = int(mx.argmax(ours))
    for step in range(3):  # a few decode steps, offset advancing
        ours = forward(state, kv.cache, kv.rows(mx.array([[nxt]]), mx.array([t + step]), mx.array([1]),
                                                t + step + 1, mx.array([0]), dense=True))
        theirs = model(mx.array([[nxt]]), cache=ref_cache)[:, -1]
        np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)),
                                   atol=tol)
        nxt = int(mx.argmax(ours))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_ids_match_mlx_lm_0_6b_shape(tmp_path):
    path = write_checkpoint(tmp_path / "q06", "0.6b", seed=0)
    state, model = load(path), _mlx_lm_model(path, mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16)
    for prompt in PROMPTS[:2]:
        # mlx-lm's ids: the exact path (the native step's int8 activations differ)
        ours, _ = generate(prompt, state, max_new_tokens=32, eos_token_ids=[], decode_path="matmul")
        assert ours == _mlx_lm_greedy(model, prompt, 32)


@pytest.mark.real_checkpoint
@pytest.mark.skipif(not os.environ.get("QWEN3_MODEL_PATH"), reason="QWEN3_MODEL_PATH not set")
@pytest.mark.timeout(900)
def test_real_checkpoint_golden_continuation():
    """mlx-lm's greedy output on the real checkpoint (bf16 compute), raw prompt, no template."""
    state = load(os.environ["QWEN3_MODEL_PATH"], dtype="bfloat16")
    ids, _ = generate(ELIXIR, state, max_new_tokens=20)
    assert ids == [481, 2585, 1558, 468, 97772, 3705, 279, 1142, 979, 1052, 374, 902, 821, 304, 279,
                   4625, 30, 481, 3555, 374]


# ---- batching ------------------------------------------------------------------------------

def _ragged_prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(x) for x in rng.integers(0, 151000, n)] for n in (3, 17, 1, 30, 9)]


@pytest.mark.parametrize("chunk", [2048, 4])
def test_batched_rows_equal_solo_rows_float32(tiny32, chunk):
    prompts = _ragged_prompts()
    solo = [generate(p, tiny32, max_new_tokens=12, eos_token_ids=[])[0] for p in prompts]
    batch, info = generate(prompts, tiny32, max_new_tokens=12, eos_token_ids=[], prefill_chunk=chunk)
    assert batch == solo
    assert info["finish_reason"] == ["length"] * len(prompts)


def test_batched_first_step_logits_4bit(tiny_bf16):
    tiny = tiny_bf16
    prompts = _ragged_prompts()[:3]
    t = max(len(p) for p in prompts)
    toks = np.zeros((3, t), dtype=np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    n = mx.array([len(p) for p in prompts])
    kv = fresh(tiny, 64, 3)
    batched = forward(tiny, kv.cache, kv.rows(mx.array(toks), mx.zeros((3,), dtype=mx.int32), n, t, n - 1))
    for i, p in enumerate(prompts):
        one = fresh(tiny, 64)
        solo = forward(tiny, one.cache, one.rows(mx.array([p]), mx.array([0]), mx.array([len(p)]), len(p),
                                                 mx.array([len(p) - 1]), dense=True))
        np.testing.assert_allclose(np.array(batched[i].astype(mx.float32)),
                                   np.array(solo[0].astype(mx.float32)), atol=1e-3)


def test_rows_stop_on_their_own_eos(tiny32):
    prompts = _ragged_prompts()[:3]
    free, _ = generate(prompts, tiny32, max_new_tokens=10, eos_token_ids=[])
    eos = free[0][3]  # row 0 emits this at step 4
    out, info = generate(prompts, tiny32, max_new_tokens=10, eos_token_ids=[eos, 151645])
    cut = free[0].index(eos) + 1
    assert out[0] == free[0][:cut] and info["finish_reason"][0] == "stop"
    for row, ref, reason in zip(out[1:], free[1:], info["finish_reason"][1:]):
        expect = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert row == expect and reason == ("stop" if eos in ref else "length")


def test_generate_timing_and_repeat(tiny32):
    a, info = generate(ELIXIR, tiny32, max_new_tokens=6, max_len=64, eos_token_ids=[])
    b, _ = generate(ELIXIR, tiny32, max_new_tokens=6, max_len=64, eos_token_ids=[], profile_timing=False)
    assert a == b
    t = info["timing"]
    assert t["prefill_ms"] > 0 and len(t["per_token_ms"]) == 5 and t["total_ms"] >= t["prefill_ms"]


def test_generate_rejects_bad_options(tiny32):
    with pytest.raises(ValueError, match=r"7 tokens.*max_new_tokens 10.*max_len 12"):
        generate(ELIXIR, tiny32, max_new_tokens=10, max_len=12)
    with pytest.raises(ValueError, match="top_p"):
        generate(ELIXIR, tiny32, temperature=1.0, top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(ELIXIR, tiny32, temperature=-1)
    with pytest.raises(ValueError, match="seed"):
        generate(ELIXIR, tiny32, temperature=1.0, seed="abc")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(ELIXIR, tiny32, max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        generate([], tiny32)


# ---- samplers ------------------------------------------------------------------------------

PROBS = np.array([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


def _ref_top_p(logits: np.ndarray, temperature: float, top_p: float, u: float) -> int:
    """Reference of ``sample_top_p`` for one row, in float64 numpy."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    sp = p[order]
    cum = np.cumsum(sp)
    n_keep = int(np.count_nonzero(cum - sp < top_p))
    k = int(np.searchsorted(cum[:n_keep], u * cum[n_keep - 1], side="right"))
    return int(order[min(k, n_keep - 1)])


def _device_draws(probs: np.ndarray, top_p: float, us: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    n = len(us)
    logits = mx.array(np.tile(np.log(probs), (n, 1)).astype(np.float32))
    return np.array(sample_top_p(logits, mx.full((n,), temperature), mx.full((n,), top_p),
                                 mx.array(us.astype(np.float32))))


def _ref_draws(probs: np.ndarray, top_p: float, us: np.ndarray) -> np.ndarray:
    return np.array([_ref_top_p(np.log(probs), 1.0, top_p, u) for u in us])


@pytest.mark.parametrize("draw", [_device_draws, _ref_draws])
@pytest.mark.parametrize("top_p, expected", [
    (0.7, {1: 0.5 / 0.8, 3: 0.3 / 0.8}),           # 0.5 < 0.7; 0.8 crosses: kept
    (0.5, {1: 1.0}),                                # reaching top_p exactly: no more
    (0.81, {1: 0.5 / 0.95, 3: 0.3 / 0.95, 2: 0.15 / 0.95}),
    (1.0, {1: 0.5, 3: 0.3, 2: 0.15, 0: 0.05}),
])
def test_nucleus_set_and_renormalized_mass(draw, top_p, expected):
    us = (np.arange(1000) + 0.5) / 1000  # a uniform grid: inverse-CDF sampling is exact
    counts = np.bincount(draw(PROBS, top_p, us), minlength=4) / 1000
    want = np.zeros(4)
    for tok, p in expected.items():
        want[tok] = p
    np.testing.assert_allclose(counts, want, atol=2e-3)


def test_temperature_sharpens():
    us = (np.arange(1000) + 0.5) / 1000
    cold = _device_draws(PROBS, 1.0, us, temperature=0.25)
    hot = _device_draws(PROBS, 1.0, us, temperature=4.0)
    assert (cold == 1).mean() > 0.85 > (hot == 1).mean()


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_seeded_sampling_is_reproducible(tiny32, top_p):
    kw = dict(max_new_tokens=12, temperature=1.5, top_p=top_p, eos_token_ids=[])
    a, _ = generate(ELIXIR, tiny32, seed=11, **kw)
    b, _ = generate(ELIXIR, tiny32, seed=11, **kw)
    c, _ = generate(ELIXIR, tiny32, seed=12, **kw)
    greedy, _ = generate(ELIXIR, tiny32, max_new_tokens=12, eos_token_ids=[])
    assert a == b and a != c and a != greedy
    zero, _ = generate(ELIXIR, tiny32, seed=11, **dict(kw, temperature=0.0))
    assert zero == greedy  # temperature 0 means greedy


@pytest.mark.parametrize("kwargs, match", [
    ({"top_p": 1.5}, "top_p"), ({"top_p": 0}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"top_p": "0.9"}, "top_p"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "1.0"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"max_new_tokens": 2.0}, "max_new_tokens"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_kind():
    assert SamplingParams().kind is SamplerKind.GREEDY
    assert (SamplingParams().temperature, SamplingParams().top_p) == (0.0, 1.0)
    p = SamplingParams(temperature=np.float32(0.5), top_p=1, seed=np.int64(3))
    assert p.kind is SamplerKind.TOP_P
    assert (type(p.temperature), type(p.top_p), type(p.seed)) == (float, float, int)


def _nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """Reference: smallest prefix (by decreasing probability) whose mass reaches top_p, plus
    every token tied with its last one at float32 resolution (the sampler computes in float32,
    where such near-ties, e.g. logits 0 and -2e-14, are exact ties in either order)."""
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    n = min(int(np.searchsorted(cum, top_p - 1e-12) + 1), len(order))
    last = probs[order[n - 1]]
    return set(order[:n].tolist()) | set(np.flatnonzero(probs >= last * (1 - 1e-6)).tolist())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-8, 8), min_size=2, max_size=40), st.floats(0.05, 1.0), st.floats(0, 0.999))
def test_nucleus_membership_property(logits, top_p, u):
    z = np.array(logits, dtype=np.float32)
    probs = np.exp(z.astype(np.float64) - z.max())
    probs /= probs.sum()
    allowed = _nucleus(probs, min(1.0, top_p + 1e-5))  # float32 slack at the boundary
    cpu = _ref_top_p(z, 1.0, top_p, u)
    gpu = int(sample_top_p(mx.array(z[None]), mx.ones((1,)), mx.array([top_p]), mx.array([u]))[0])
    assert cpu in allowed and gpu in allowed
    if u < 1e-9:  # u = 0 picks a most probable token (ties in float64 probability allowed)
        assert probs[cpu] == probs.max()
