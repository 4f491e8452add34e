"""The scheduler as its own part: plans are frozen values, counters advance only through
``update``, and random schedules (arrivals, cancels, preemption under tiny budgets, chunked and
budgeted prefill, prefix sharing, greedy and seeded sampled rows) leave every output equal to its
solo run and every block free."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams, generate
from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token
from mlx_serving.models.generation.scheduler import SchedulerOutput


def _params(rng: np.random.Generator) -> SamplingParams:
    n = int(rng.integers(1, 12))
    if rng.random() < 0.5:
        return SamplingParams(max_new_tokens=n, eos_token_ids=())
    return SamplingParams(max_new_tokens=n, temperature=0.9, seed=int(rng.integers(0, 1000)), eos_token_ids=())


def _solo(state, prompt: list[int], p: SamplingParams) -> list[int]:
    return generate(prompt, state, max_new_tokens=p.max_new_tokens, temperature=p.temperature, seed=p.seed,
                    eos_token_ids=(), max_len=64)[0]


def test_plan_is_a_value_and_update_folds_it_back(tiny32) -> None:
    engine = Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64, prefill_chunk=4))
    engine.add(0, list(range(1, 11)), SamplingParams(max_new_tokens=3, eos_token_ids=()))
    sched = engine.scheduler
    plan = sched.schedule()
    assert isinstance(plan, SchedulerOutput) and [r.seq_id for r in plan.started] == [0]
    (chunk,) = plan.prefills
    assert (chunk.start, chunk.tokens.tolist(), chunk.sample) == (0, [1, 2, 3, 4], False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prefills = ()  # type: ignore[misc]
    request = chunk.request
    assert (request.num_computed_tokens, request.num_tokens) == (0, 10)  # nothing moves before update
    sched.update(plan)
    assert (request.num_computed_tokens, request.num_tokens) == (4, 10)
    for _ in range(2):  # the last chunk samples: num_tokens counts the sampled token
        sched.update(sched.schedule())
    assert (request.num_computed_tokens, request.num_tokens, request.decoding) == (10, 11, True)
    (row,) = sched.schedule().decodes
    assert (row.request, row.position) == (request, 10)
    engine.close()


@pytest.mark.parametrize("trial", range(8))
def test_random_schedules_equal_solo_runs(tiny32, trial: int) -> None:
    rng = np.random.default_rng(100 + trial)
    rows, chunk = int(rng.integers(1, 4)), int(rng.choice([4, 8, 512]))
    budget = kv_bytes_per_token(tiny32) * int(rng.integers(65, 160))
    engine = Engine(tiny32, EngineConfig.of(max_batch=rows, max_len=64, prefill_chunk=chunk, kv_cache_bytes=budget,
                                            block_size=4,
                                            max_step_tokens=None if rng.random() < 0.5 else int(rng.integers(2, 12))))
    shared = rng.integers(0, 150000, 12).tolist()  # some prompts share a prefix
    jobs = []
    for i in range(int(rng.integers(4, 9))):
        own = rng.integers(0, 150000, int(rng.integers(1, 30))).tolist()
        jobs.append((int(rng.integers(0, 12)), (shared + own)[:40] if rng.random() < 0.4 else own, _params(rng)))
    cancel = {i: int(rng.integers(1, 25)) for i in range(len(jobs)) if rng.random() < 0.2}
    out: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    for step in range(3000):
        for i, (at, prompt, p) in enumerate(jobs):
            if at == step:
                engine.add(i, prompt, p)
            if cancel.get(i) == step:
                engine.cancel(i)
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
        if step > 30 and not engine.num_active:
            break
    assert not engine.num_active
    for i, (_, prompt, p) in enumerate(jobs):
        solo = _solo(tiny32, prompt, p)
        if i in cancel:
            assert out[i] == solo[: len(out[i])]  # a prefix, then nothing after the cancel
        else:
            assert out[i] == solo, f"trial {trial}, sequence {i}"
    stats = engine.kv_stats()
    assert stats.blocks_used == 0 and stats.blocks_free == stats.blocks_total
    engine.close()



def test_admission_stays_within_the_step_token_budget(tiny32) -> None:
    """Waiting prompts start only while the step's budget has room (vLLM's max_num_batched_tokens):
    the others wait without a row or blocks, and first tokens come a few prompts at a time, each
    output its solo run's."""
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=64, prefill_chunk=8, max_step_tokens=10,
                                            block_size=4, prefix_caching=False))
    p = SamplingParams(max_new_tokens=4, eos_token_ids=())
    prompts = [list(range(10 * i + 1, 10 * i + 9)) for i in range(4)]
    for i, prompt in enumerate(prompts):
        engine.add(i, prompt, p)
    sched = engine.scheduler
    plans: list[SchedulerOutput] = []
    schedule = sched.schedule
    sched.schedule = lambda: plans.append(schedule()) or plans[-1]  # type: ignore[method-assign]  # records
    out: dict[int, list[int]] = {i: [] for i in range(4)}
    first: dict[int, int] = {}
    for step in range(60):
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
            first.setdefault(ev.seq_id, step)
        if step == 0:
            assert [r.seq_id for r in plans[0].started] == [0, 1] and len(sched.waiting) == 2
            assert [len(c.tokens) for c in plans[0].prefills] == [8, 2]
            assert engine.kv_stats().blocks_used == 4  # the first chunks of the two started; none waiting
        if not engine.num_active:
            break
    assert all(plan.num_scheduled_tokens <= 10 for plan in plans)
    assert first[0] < first[2] < first[3]
    assert out == {i: _solo(tiny32, prompt, p) for i, prompt in enumerate(prompts)}
    engine.close()
