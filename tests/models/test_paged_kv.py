"""Paged KV cache (models/generation): block pool accounting, prefix caching and preemption.

Invariants (tiny float32 checkpoint, exact token equality): prefix hit == miss; preempted ==
uninterrupted; block accounting returns to all-free after random workloads (hypothesis: random
arrivals, prompt lengths, shared prefixes, cancels, preemptions under a tiny block budget).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_serving.models.generation import BlockPool, Engine, EngineConfig, block_hash
from mlx_serving.models.decoder.decode_backends import decode_backend, kv_cache_dtype_for
from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token
from mlx_serving.models.generation import SamplingParams, generate

from engine_runs import run_workload, step_to_end

BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 151000, n)]


def _budget(state, blocks: int, path: str | None = "matmul") -> int:
    """Bytes of ``blocks`` blocks of the cache the engine builds on ``path`` ("auto" stores float16
    under the native step)."""
    return kv_bytes_per_token(state, kv_cache_dtype_for(decode_backend(state, path), "auto")) * BS * blocks


def _run(engine: Engine, max_steps: int = 2000) -> dict[int, list[int]]:
    return step_to_end(engine, max_steps=max_steps)


_SOLO: dict = {}


def _solo(state, prompt: list[int], p: SamplingParams) -> list[int]:
    key = (id(state), tuple(prompt), p)
    if key not in _SOLO:
        _SOLO[key] = generate(prompt, state, max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                              top_p=p.top_p, seed=p.seed, eos_token_ids=p.eos_token_ids, max_len=128)[0]
    return _SOLO[key]


@pytest.fixture(params=["matmul", "native"])
def path_state(request):
    """(model, decode path): the float32 checkpoint on the exact path, the 4-bit one (float32
    activations) on the native CPU step."""
    return request.getfixturevalue("tiny32" if request.param == "matmul" else "tiny"), request.param


def _all_free(engine: Engine) -> None:
    s = engine.kv_stats()
    pool = engine.scheduler.kv.pool
    assert s.blocks_used == 0 and s.blocks_free == s.blocks_total
    assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks + 1))


def test_block_pool_lru_and_hash_chain():
    pool = BlockPool(3)
    a = pool.allocate(2)
    assert a == [1, 2] and pool.available == 1 and pool.allocate(2) is None and pool.available == 1
    h1 = block_hash(None, np.arange(BS))
    h2 = block_hash(h1, np.arange(BS))
    assert h1 != h2 and h1 == block_hash(None, np.arange(BS))  # chained over the parent
    pool.register(a[0], h1)
    pool.register(a[1], h1)  # a hash held by another block: ignored
    for b in reversed(a):
        pool.free(b)
    assert pool.cached_free == 1 and pool.lookup(h1) == 1 and pool.available == 3
    pool.touch(1)  # reuse a cached block: leaves the free lists
    assert pool.available == 2 and pool.used == 1
    pool.free(1)
    got = pool.allocate(3)  # plain blocks first, the cached one evicted last
    assert got[-1] == 1 and pool.lookup(h1) is None and pool.evictions == 1


def test_budget_is_allocated_up_front_and_logged(tiny32, caplog):
    with caplog.at_level(logging.INFO, logger="mlx_serving"):
        engine = Engine(tiny32, EngineConfig.of(max_batch=32, max_len=2048, kv_cache_bytes=_budget(tiny32, 200)))
    assert engine.kv_stats().blocks_total == 200
    assert engine.cache.nbytes == _budget(tiny32, 201)  # + the null block
    assert any("KV cache: 200 blocks of 16 tokens" in r.getMessage() for r in caplog.records)
    default = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=100))  # never more than every row at full length
    assert default.kv_stats().blocks_total == 4 * -(-100 // BS)


@pytest.mark.parametrize("shared", [48, 47, 64])
def test_prefix_hit_equals_miss(path_state, shared):
    """A second sequence sharing a prefix reuses its full blocks and prefills only the rest;
    its tokens equal a cold run's (bit for bit on both decode paths)."""
    tiny32, path = path_state
    system = _prompt(7, shared)
    a, b = system + _prompt(8, 9), system + _prompt(9, 5)
    p = SamplingParams(max_new_tokens=6)
    q = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=4)
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=128, decode_path=path))
    engine.add(0, a, p)
    out = _run(engine)
    engine.add(1, b, q)
    out.update(_run(engine))
    engine.add(2, a, p)  # the whole prompt is cached: one token is still recomputed
    out.update(_run(engine))
    assert out == {0: _solo(tiny32, a, p), 1: _solo(tiny32, b, q), 2: _solo(tiny32, a, p)}
    s = engine.kv_stats()
    assert (s.prefix_queries, s.prefix_hits) == (3, 2)
    assert s.prefix_hit_tokens == (shared // BS) * BS + ((len(a) - 1) // BS) * BS
    cold = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=128, prefix_caching=False, decode_path=path))
    cold.add(1, b, q)
    assert _run(cold) == {1: out[1]} and cold.kv_stats().prefix_hits == 0
    _all_free(engine)


def test_concurrent_sequences_share_cached_blocks(tiny32):
    system = _prompt(3, 40)
    prompts = [system + _prompt(10 + i, 3 + i) for i in range(4)]
    p = SamplingParams(max_new_tokens=5)
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=128, prefill_chunk=16))
    engine.add(0, prompts[0], p)
    early = [ev.token_id for _ in range(4) for ev in engine.step()]  # seq 0's blocks computed and cached
    for i in (1, 2, 3):
        engine.add(i, prompts[i], p)
    out = _run(engine)
    out[0] = early + out.get(0, [])
    assert out == {i: _solo(tiny32, prompts[i], p) for i in range(4)}
    assert engine.kv_stats().prefix_hits == 3
    _all_free(engine)


@pytest.mark.parametrize("chunk", [512, 7])
def test_preempted_equals_uninterrupted(path_state, chunk):
    """5 blocks for 4 sequences that each need 3: decode runs out of blocks, the newest running
    sequence is preempted and recomputed; no token changes or repeats. On the native path the
    recompute is a float prefill of tokens decoded with int8 activations, so only what it
    guarantees is checked: the never-preempted oldest sequence and every first token (from the
    prefill) equal the solo runs, every sequence gets its full length."""
    tiny32, path = path_state
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=28, temperature=1.1, seed=2),
              SamplingParams(max_new_tokens=25, temperature=0.7, top_p=0.8, seed=3), SamplingParams(max_new_tokens=30)]
    prompts = [_prompt(20 + i, 10 + 3 * i) for i in range(4)]
    for caching in (True, False):
        engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=64, prefill_chunk=chunk, decode_path=path,
                                                kv_cache_bytes=_budget(tiny32, 5, path), prefix_caching=caching))
        assert engine.kv_stats().blocks_total == 5
        for i, (pr, p) in enumerate(zip(prompts, params)):
            engine.add(i, pr, p)
        out = _run(engine)
        solo = {i: _solo(tiny32, pr, p) for i, (pr, p) in enumerate(zip(prompts, params))}
        if path == "matmul":
            assert out == solo
        else:
            assert out[0] == solo[0] and all(out[i][0] == solo[i][0] for i in solo)
            assert [len(out[i]) for i in solo] == [p.max_new_tokens for p in params]
        assert engine.kv_stats().preemptions > 0
        _all_free(engine)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_random_workloads_keep_outputs_and_free_every_block(tiny32, data):
    blocks = data.draw(st.integers(5, 9), label="blocks")
    engine = Engine(tiny32, EngineConfig.of(
        max_batch=data.draw(st.integers(1, 4), label="max_batch"), max_len=64,
        prefill_chunk=data.draw(st.sampled_from([5, 16, 512]), label="chunk"), kv_cache_bytes=_budget(tiny32, blocks),
        prefix_caching=data.draw(st.booleans(), label="cache"), bucket_shapes=data.draw(st.booleans(), label="bucket")))
    prefixes = [_prompt(50, 40), _prompt(51, 20)]
    n = data.draw(st.integers(1, 5), label="n")
    specs = []
    for i in range(n):
        base = data.draw(st.sampled_from([[], prefixes[0], prefixes[1]]), label="prefix")
        tail = _prompt(100 + data.draw(st.integers(0, 3)), data.draw(st.integers(1, 12)))
        prompt = (base + tail)[:50]
        p = SamplingParams(max_new_tokens=data.draw(st.integers(1, 10)),
                           temperature=data.draw(st.sampled_from([0.0, 1.0])), seed=i)
        arrive = data.draw(st.integers(0, 6))
        cancel = data.draw(st.one_of(st.none(), st.integers(0, 12)))
        specs.append((prompt, p, arrive, cancel))
    out, cancelled = run_workload(engine, specs, settle=6, each_step=_blocks_add_up)
    assert not engine.num_active
    for i, (prompt, p, _, _) in enumerate(specs):
        solo = _solo(tiny32, prompt, p)
        if i in cancelled:
            assert out.get(i, []) == solo[: len(out.get(i, []))]
        else:
            assert out[i] == solo
    _all_free(engine)


def _blocks_add_up(engine: Engine) -> None:
    s = engine.kv_stats()
    assert 0 <= s.blocks_used <= s.blocks_total and s.blocks_used + s.blocks_free == s.blocks_total


def test_text_generation_backend_exposes_kv_stats(tiny32):
    from mlx_serving.models.generation import KVStats
    from mlx_serving.models.text_generation._backend import GenerationBackend
    from mlx_serving.models.text_generation._inputs import Prompt
    from mlx_serving.models.text_generation._options import GenerationOptions

    backend = GenerationBackend(tiny32, GenerationOptions(max_new_tokens=4, max_len=64, max_batch=2))
    engine = backend.init("inline", None, 1)
    system = _prompt(5, 40)
    for round_ in range(2):
        assert backend.admit(engine, [(round_, Prompt(system + [round_ + 1], SamplingParams(4)))], 0) == []
        while backend.active(engine):
            backend.step(engine)
    stats = backend.kv_stats(engine)
    assert isinstance(stats, KVStats) and stats.prefix_queries == 2 and stats.prefix_hit_tokens == 32
    assert stats.blocks_used == 0 and stats.blocks_cached >= 2


def test_priority_policy_starts_and_preempts_by_priority(tiny32):
    """One row: the waiting sequences start lowest priority value first (ties: arrival); under a
    tight budget the lowest-priority running sequence is the one preempted; outputs unchanged."""
    p = SamplingParams(max_new_tokens=3)
    prompts = {i: _prompt(60 + i, 5) for i in range(4)}
    engine = Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64, policy="priority"))
    for i, prio in zip(range(4), (5, 1, 5, 0)):
        engine.add(i, prompts[i], p, priority=prio)
    order: list[int] = []
    while engine.num_active:
        for ev in engine.step():
            if ev.finish_reason:
                order.append(ev.seq_id)
    assert order == [3, 1, 0, 2]  # priority 0, 1, then the two 5s in arrival order
    with pytest.raises(ValueError, match="priority"):
        engine.add(9, [1], p, priority=1.5)
    q = SamplingParams(max_new_tokens=30)
    long = {i: _prompt(70 + i, 12) for i in range(3)}
    engine = Engine(tiny32, EngineConfig.of(max_batch=3, max_len=64, kv_cache_bytes=_budget(tiny32, 5),
                                            policy="priority"))
    for i, prio in zip(range(3), (0, 9, 1)):
        engine.add(i, long[i], q, priority=prio)
    done: list[int] = []
    out: dict[int, list[int]] = {}
    while engine.num_active:
        for ev in engine.step():
            out.setdefault(ev.seq_id, []).append(ev.token_id)
            if ev.finish_reason:
                done.append(ev.seq_id)
    assert done[-1] == 1 and engine.kv_stats().preemptions > 0
    assert out == {i: _solo(tiny32, long[i], q) for i in range(3)}
    _all_free(engine)


@pytest.mark.parametrize("budget", [1, 6, 20])
def test_step_token_budget_bounds_prefill_and_keeps_outputs(tiny32, budget):
    prompts = [_prompt(80 + i, 30 + 7 * i) for i in range(3)]
    p = SamplingParams(max_new_tokens=5)
    engine = Engine(tiny32, EngineConfig.of(max_batch=3, max_len=96, prefill_chunk=16, max_step_tokens=budget))
    plans = []  # every plan the scheduler returns
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    engine.add(0, prompts[0], p)
    out: dict[int, list[int]] = {}
    for t in range(400):
        if t == 2:
            for i in (1, 2):
                engine.add(i, prompts[i], p)
        if t > 2 and not engine.num_active:
            break
        for ev in engine.step():
            out.setdefault(ev.seq_id, []).append(ev.token_id)
        plan = plans[-1] if plans else None
        if plan is not None and not plan.empty:
            assert plan.num_scheduled_tokens <= max(budget, len(plan.decodes))  # decode rows are always scheduled
            assert sum(len(c.tokens) for c in plan.prefills) <= max(budget - len(plan.decodes), 0)
            plans.clear()
    assert out == {i: _solo(tiny32, prompts[i], p) for i in range(3)}
    with pytest.raises(ValueError, match="max_step_tokens"):
        Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64, max_step_tokens=0))


def test_text_generation_kv_options(tiny32):
    from mlx_serving.models.text_generation._backend import GenerationBackend
    from mlx_serving.models.text_generation._inputs import Prompt
    from mlx_serving.models.text_generation._options import GenerationOptions
    from mlx_serving.models.generation import Engine as Reexported

    assert Reexported is Engine
    for bad in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="kv_cache_fraction"):
            GenerationOptions(kv_cache_fraction=bad)
    with pytest.raises(ValueError, match="prefix_caching"):
        GenerationOptions(prefix_caching=1)
    backend = GenerationBackend(tiny32, GenerationOptions(max_new_tokens=4, max_len=64, max_batch=2,
                                                          prefix_caching=False, kv_cache_fraction=0.001))
    engine = backend.init("inline", None, 1)
    system = _prompt(5, 40)
    for round_ in range(2):
        backend.admit(engine, [(round_, Prompt(system + [round_ + 1], SamplingParams(4)))], 0)
        while backend.active(engine):
            backend.step(engine)
    assert backend.kv_stats(engine).prefix_hits == 0


def test_serving_stats_carry_the_kv_and_prefix_cache_counters(tiny32_ckpt):
    from mlx_serving import text_generation

    serving = text_generation.from_mlx4bit(tiny32_ckpt, max_new_tokens=2, max_len=128, max_batch=2)
    prompt = "a shared system prompt that spans more than one block of sixteen tokens, " * 3
    with serving.start() as h:
        h.run(prompt + "first")
        h.run(prompt + "second")
        stats = h.stats().backend
    assert stats["prefix_queries"] == 2 and stats["prefix_hits"] >= 1 and stats["prefix_hit_tokens"] >= 16
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == stats["blocks_total"]


def test_default_budget_runs_every_row_at_full_length(tiny32):
    """A max_len that is not a multiple of the block size still gets whole blocks for every row:
    all max_batch sequences of max_len run at once (the cap counts blocks, not tokens)."""
    engine = Engine(tiny32, EngineConfig.of(max_batch=8, max_len=28))
    for i in range(8):
        engine.add(i, [1 + i] * 20, SamplingParams(max_new_tokens=8, eos_token_ids=()))
    engine.step()
    assert engine.num_waiting == 0 and engine.kv_stats().preemptions == 0
    while engine.num_active:
        engine.step()
    assert engine.kv_stats().preemptions == 0


def test_prefix_caching_off_is_a_prefix_cache_that_does_nothing():
    """prefix_caching=False gives the no-op prefix cache: nothing found, nothing registered, no
    token stream read (the engine calls it as it calls the real one)."""
    from mlx_serving.models.generation.block_pool import BlockPool
    from mlx_serving.models.generation.prefix_cache import HashPrefixCache, NoPrefixCache, SeqBlocks, prefix_cache

    pool = BlockPool(8)
    tokens = np.arange(40, dtype=np.int32)
    cache = prefix_cache(pool, 16, True)
    sb = SeqBlocks(blocks=pool.allocate(3))
    assert isinstance(cache, HashPrefixCache)
    cache.commit(sb, 2, lambda: tokens)
    assert len(cache.lookup(SeqBlocks(), tokens)) == 2  # a later sequence finds both full blocks
    off = prefix_cache(BlockPool(8), 16, False)
    assert isinstance(off, NoPrefixCache)

    def unread() -> np.ndarray:
        raise AssertionError("the no-op cache read the token stream")

    other = SeqBlocks(blocks=[1, 2, 3])
    off.commit(other, 2, unread)
    assert other.committed == 2 and off.lookup(other, tokens) == []
    assert not off.prefilling_elsewhere(SeqBlocks(), tokens, [other])
