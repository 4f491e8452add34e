"""Drive an Engine in tests: every request to its end, or a random workload of arrivals and
cancellations (the loops test_spec_decode, test_spec_draft, test_paged_kv and test_kv_quant share)."""

from __future__ import annotations

from typing import Callable

from mlx_serving.models.generation import Engine, SamplingParams

#: A random workload's request: (prompt ids, sampling, arrival step, cancel after that many steps or None).
Spec = tuple[list[int], SamplingParams, int, "int | None"]


def run_to_end(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
               cancel: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Add request i = (prompts[i], params[i]), cancel request i at step ``cancel[i]``, and step
    until none is active: each request's token ids. Raises AssertionError after 3,000 steps."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add(i, p, sp)
    return step_to_end(engine, cancel)


def step_to_end(engine: Engine, cancel: dict[int, int] | None = None,
                max_steps: int = 3000) -> dict[int, list[int]]:
    """Step the requests already added until none is active (request i cancelled at step
    ``cancel[i]``): each request's token ids. Raises AssertionError after ``max_steps`` steps."""
    out: dict[int, list[int]] = {}
    for step in range(max_steps):
        if not engine.num_active:
            return out
        for i, at in (cancel or {}).items():
            if at == step:
                engine.cancel(i)
        for ev in engine.step():
            out.setdefault(ev.seq_id, []).append(ev.token_id)
    raise AssertionError("engine did not finish")


def run_workload(engine: Engine, specs: list[Spec], settle: int,
                 each_step: Callable[[Engine], None] | None = None) -> tuple[dict[int, list[int]], set[int]]:
    """Requests arriving and cancelled at their steps (:data:`Spec`), stepped until none is active
    after step ``settle`` (the last arrival): each request's token ids and the cancelled ids.
    Asserts no event of a cancelled request; ``each_step`` checks the engine after every step."""
    out: dict[int, list[int]] = {}
    cancelled: set[int] = set()
    for t in range(3000):
        for i, (prompt, p, arrive, cancel) in enumerate(specs):
            if arrive == t:
                engine.add(i, prompt, p)
            if cancel is not None and arrive + cancel == t:
                engine.cancel(i)
                cancelled.add(i)
        if t > settle and not engine.num_active:
            break
        for ev in engine.step():
            assert ev.seq_id not in cancelled
            out.setdefault(ev.seq_id, []).append(ev.token_id)
        if each_step is not None:
            each_step(engine)
    return out, cancelled
