"""Packed (ragged) prefill: the projections and MLP of a multi-row prefill run on the real prompt
tokens only, and rows sharing a start attend as causal groups; outputs and the KV cache equal the
padded grid's with its boolean mask (tiny float32 checkpoint)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models.decoder import layers
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
from mlx_serving.models.decoder.attention import Rows, packing
from mlx_serving.models.decoder.kv_cache import init_paged_kv_cache

LENGTHS = [5, 1, 13, 9]  # ragged prompts: padded grid 4 x 13 = 52 positions, 28 real tokens


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 151000, n).tolist() for n in LENGTHS]


def test_packing_indices() -> None:
    packed, unpacked = packing(np.array([3, 0, 2]), 4, 7)
    assert packed.tolist() == [0, 1, 2, 8, 9, 0, 0]
    assert unpacked.tolist() == [0, 1, 2, 0, 0, 0, 0, 0, 3, 4, 0, 0]
    with pytest.raises(ValueError, match="n=4 < 5"):
        packing(np.array([3, 0, 2]), 4, 4)


def _rows(prompts: list[list[int]], packed_n: int | None, starts: list[int] | None = None,
          groups: tuple[tuple[int, int, int], ...] | None = None) -> Rows:
    b, t = len(prompts), max(map(len, prompts))
    tokens = np.zeros((b, t), dtype=np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    n_valid = np.array([len(p) for p in prompts], dtype=np.int32)
    table = (1 + np.arange(b * 2, dtype=np.int32)).reshape(b, 2)  # two 16-token blocks per row
    start = np.array(starts or [0] * b, dtype=np.int32)
    packed = unpacked = None
    if packed_n is not None:
        packed, unpacked = packing(n_valid, t, packed_n)
    return Rows(mx.array(tokens), mx.array(start), mx.array(n_valid), int((start + n_valid).max()),
                mx.array(n_valid - 1), mx.array(table), packed=packed, unpacked=unpacked,
                causal_groups=groups)


@pytest.mark.parametrize("packed_n", [sum(LENGTHS), 64])  # exact, and with bucket padding
def test_packed_forward_equals_padded(tiny32, packed_n: int) -> None:
    prompts = _prompts()
    caches, logits = [], []
    for n in (None, packed_n):
        cache = init_paged_kv_cache(tiny32, 2 * len(prompts), 16)
        logits.append(layers.forward(tiny32, cache, _rows(prompts, n)))
        caches.append(cache)
    np.testing.assert_allclose(np.array(logits[1]), np.array(logits[0]), rtol=1e-5, atol=1e-5)
    for i, p in enumerate(prompts):  # the K/V of every real token (row i: blocks 2i+1, 2i+2)
        at = slice(16 * (2 * i + 1), 16 * (2 * i + 1) + len(p))
        for kp, kq in zip(caches[0].keys, caches[1].keys):
            np.testing.assert_allclose(np.array(kq[at]), np.array(kp[at]), rtol=1e-5, atol=1e-5)


def test_causal_groups_equal_boolean_mask(tiny32) -> None:
    """Rows starting at 0, 0, 16, 16 (positions below 16 hold whatever the cache holds: the same
    in both runs): two causal groups give the boolean mask's logits and cache."""
    prompts, starts = _prompts(), [0, 0, 16, 16]
    prompts = [prompts[1], prompts[0], prompts[3], prompts[2][:12]]
    out = []
    for groups in (None, ((0, 2, 0), (2, 4, 16))):
        cache = init_paged_kv_cache(tiny32, 2 * len(prompts), 16)
        out.append((layers.forward(tiny32, cache, _rows(prompts, None, starts, groups)), cache))
    np.testing.assert_allclose(np.array(out[1][0]), np.array(out[0][0]), rtol=1e-5, atol=1e-5)
    for i, (p, s) in enumerate(zip(prompts, starts)):  # real positions (the null block takes padding)
        at = slice(16 * (2 * i + 1) + s, 16 * (2 * i + 1) + s + len(p))
        for vp, vq in zip(out[0][1].values, out[1][1].values):
            np.testing.assert_allclose(np.array(vq[at]), np.array(vp[at]), rtol=1e-5, atol=1e-5)


def _greedy(state, prompts: list[list[int]], bucket: bool, pack: bool | None = None) -> list[list[int]]:
    engine = Engine(state, EngineConfig.of(max_batch=len(prompts), max_len=64, prefill_chunk=8, bucket_shapes=bucket,
                                           pack_prefill=pack))
    for i, p in enumerate(prompts):
        engine.add(i, p, SamplingParams(max_new_tokens=4))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.num_active:
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    return [out[i] for i in range(len(prompts))]


def test_engine_packs_multi_row_prefill(tiny32, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine hands the family packed rows (N = real tokens of the step, or its bucket) where
    ``pack_prefill`` says so, causal groups of rows by start, and the tokens equal each prompt
    generated alone."""
    seen: list[tuple[int, int, int]] = []  # (rows, padded tokens per row, packed tokens)
    groups: list[tuple[tuple[int, int, int], ...] | None] = []
    forward = layers.forward

    def spy(state, cache, rows: Rows, *decode) -> mx.array:
        if rows.packed is not None:
            seen.append((*rows.tokens.shape, rows.packed.shape[0]))
        if rows.tokens.shape[1] > 1:
            groups.append(rows.causal_groups)
        return forward(state, cache, rows, *decode)

    prompts = _prompts()
    solo = [_greedy(tiny32, [p], False)[0] for p in prompts]
    monkeypatch.setattr(layers, "forward", spy)
    assert _greedy(tiny32, prompts, False) == solo  # unbucketed (the CPU default): packed
    assert seen[0] == (4, 8, 5 + 1 + 8 + 8)  # first chunk of 8: rows 4 x 8 padded, 22 real
    assert groups[:2] == [((0, 4, 0),), ((0, 2, 8),)]  # second chunk: the 13- and 9-token rows at 8
    seen.clear()
    assert _greedy(tiny32, prompts, True) == solo  # bucketed (the GPU default): the padded grid
    assert not seen
    assert _greedy(tiny32, prompts, True, pack=True) == solo
    assert seen[0] == (4, 8, 64)  # 22 real tokens in a bucket of 64


@pytest.mark.parametrize("bucket", [False, True])
def test_staggered_starts_make_groups_then_fall_back(tiny32, monkeypatch: pytest.MonkeyPatch, bucket: bool) -> None:
    """Six 30-token prompts arriving one per step with 4-token chunks: a prefill step holds rows at
    up to six starts, so the engine builds 2-4 causal groups, then past four starts one
    boolean-masked call; bucketed (the warmed shapes): first chunks as one group of a power-of-two
    row count, each later chunk a one-row group, never a masked call, trailing padding rows in no
    group; tokens equal each prompt alone."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 151000, 30).tolist() for _ in range(6)]
    solo = [_greedy(tiny32, [p], False)[0] for p in prompts]
    calls: list[tuple[int, int, tuple[tuple[int, int, int], ...] | None]] = []  # (rows, real rows, groups)
    forward = layers.forward

    def spy(state, cache, rows: Rows, *decode) -> mx.array:
        if rows.tokens.shape[1] > 1:
            calls.append((rows.tokens.shape[0], int((np.array(rows.n_valid) > 0).sum()), rows.causal_groups))
        return forward(state, cache, rows, *decode)

    monkeypatch.setattr(layers, "forward", spy)
    engine = Engine(tiny32, EngineConfig.of(max_batch=6, max_len=64, prefill_chunk=4, bucket_shapes=bucket))
    out: dict[int, list[int]] = {i: [] for i in range(6)}
    step = 0
    while step < 6 or engine.num_active:
        if step < 6:
            engine.add(step, prompts[step], SamplingParams(max_new_tokens=4))
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
        step += 1
    assert [out[i] for i in range(6)] == solo
    grouped = [g for _, _, g in calls if g is not None and len(g) >= 2]
    if not bucket:
        assert grouped and max(len(g) for g in grouped) == 4, calls
        assert any(g is None and b > 1 for b, _, g in calls), calls  # five or more starts: one masked call
        return
    assert grouped and max(len(g) for g in grouped) >= 5, calls  # up to six starts, each its group
    for b, _, g in calls:
        assert b & (b - 1) == 0, calls
        if g is None:  # one dense row
            assert b == 1, calls
            continue
        assert all(hi - lo == 1 for lo, hi, start in g if start > 0), calls  # later chunks: one row each
        assert all(hi - lo & (hi - lo - 1) == 0 for lo, hi, start in g if start == 0), calls
    assert any(g is not None and g[-1][1] < b for b, _, g in calls), calls  # trailing padding rows, no group
