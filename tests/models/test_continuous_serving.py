"""Continuous batching through the text-generation Serving (process mode, tiny float32 Qwen3).

Every request's output must equal its solo (inline, alone) run whatever its batchmates and
arrival time; rows leave on EOS, length or cancel and free their KV slot for queued rows;
admission respects the KV budget; random load with random cancellations never hangs.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.generation import generate
from mlx_serving.models.decoder.layers import State
from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token
from mlx_serving.serving import DeadlineExceeded, Serving, ServingHandle, ServingOverloaded, TelemetryEvent
from mlx_serving.tokenization import Tokenizer

pytestmark = pytest.mark.timeout(600)  # ends a hang only

#: Bound on any single blocking wait and the deadline of every request that must complete: it only
#: ends a hang (each takes well under a second on an idle machine), with room for cores shared with
#: other busy processes. What the tests assert is counted (tokens, stats), never timed.
WAIT_S = 120.0
WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rain "
         "and green hills under grey clouds near old stone walls").split()
PREFILL_CHUNK = 8


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


# Mixed lengths and per-request options; REQS[1] is longer than PREFILL_CHUNK (chunked prefill).
REQS: list[dict[str, Any]] = [
    {"text": text(3, 0), "max_new_tokens": 10},
    {"text": text(30, 1), "max_new_tokens": 6, "temperature": 1.3, "top_p": 0.9, "seed": 11},
    {"text": text(5, 2), "max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95, "seed": 5},
    {"text": text(12, 3), "max_new_tokens": 4, "temperature": 0.0, "top_p": 0.5},
    {"text": text(20, 4), "max_new_tokens": 7, "temperature": 1.0, "seed": 3},
    {"text": text(2, 5), "max_new_tokens": 5},
]

Outcome = tuple[str, int, str]  # (generated_text, num_tokens, finish_reason)


@pytest.fixture(scope="module")
def tokenizer(tiny32_ckpt: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny32_ckpt)


def make(tokenizer: Tokenizer, state: State, **options: Any) -> Serving:
    opts = dict(max_len=96, max_new_tokens=8, max_batch=4, prefill_chunk=PREFILL_CHUNK)
    opts.update(options)
    return text_generation.serving(tokenizer, state, **opts)


def outcome(result: dict[str, Any]) -> Outcome:
    r = result["results"][0]
    return r["generated_text"], r["num_tokens"], r["finish_reason"]


def read(items: Any, on_item: Callable[[], None] = lambda: None) -> Outcome:
    """Collect one single-input stream into an Outcome; ``on_item`` runs after each item."""
    pieces: list[str] = []
    final: dict[str, Any] = {}
    for item in items:
        if isinstance(item, str):
            pieces.append(item)
        else:
            final = item
        on_item()
    return "".join(pieces), final["num_tokens"], final["finish_reason"]


@pytest.fixture(scope="module")
def solo(tokenizer: Tokenizer, tiny32: State) -> list[Outcome]:
    s = make(tokenizer, tiny32, max_batch=1)
    return [outcome(s.run(r)) for r in REQS]


def step_rows(events: list[int]) -> Callable[[TelemetryEvent], None]:
    """Telemetry callback appending each iterative step's active row count to ``events``."""
    return lambda e: events.append(e.rows) if e.kind == "step" else None


def wait_for(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.005)


class Arrivals:
    """Runs requests on threads through ``Serving.stream``; ``first[i]`` is set on request i's first item."""

    def __init__(self, handle: ServingHandle):
        self.handle = handle
        self.results: dict[int, Outcome | BaseException] = {}
        self.first = {i: threading.Event() for i in range(len(REQS))}
        self.threads: list[threading.Thread] = []

    def launch(self, *indices: int) -> None:
        for i in indices:
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, i: int) -> None:
        try:
            self.results[i] = read(Serving.stream(self.handle, REQS[i], deadline=WAIT_S), self.first[i].set)
        except BaseException as e:  # reported by the test thread
            self.results[i] = e
            self.first[i].set()

    def join(self) -> dict[int, Outcome | BaseException]:
        for t in self.threads:
            t.join(WAIT_S)
            assert not t.is_alive(), "a request never finished"
        return self.results


def test_staggered_arrivals_match_solo_runs(tokenizer, tiny32, solo):
    assert len(tokenizer.encode(REQS[1]["text"])) > 2 * PREFILL_CHUNK  # chunked prefill is exercised
    rows: list[int] = []
    s = make(tokenizer, tiny32, max_batch=3).telemetry(step_rows(rows))
    with s.start() as h:
        run = Arrivals(h)
        run.launch(0)
        assert run.first[0].wait(WAIT_S)  # 0 is decoding: 1 (long prompt) and 2 join between its steps
        run.launch(1, 2)
        assert run.first[1].wait(WAIT_S)
        run.launch(3, 4, 5)  # 3 slots busy or nearly: these queue for a slot
        results = run.join()
    assert {i: results[i] for i in range(len(REQS))} == dict(enumerate(solo))
    joined = [i for i in range(1, len(rows)) if 0 < rows[i - 1] < rows[i]]
    assert joined, f"no row joined a running batch: {rows}"
    assert max(rows) <= 3


def test_simultaneous_mixed_requests_match_solo_runs(tokenizer, tiny32, solo):
    s = make(tokenizer, tiny32, max_batch=8)
    order = [5, 3, 1, 0]  # singles, plus one caller sending REQS[2] and REQS[4] as a list

    async def main() -> tuple[dict[int, Any], Any]:
        results: dict[int, Any] = {}
        pair: list[Any] = []

        async def one(i: int) -> None:
            results[i] = await Serving.batched_run_async(h, REQS[i], deadline=WAIT_S)

        async def two() -> None:
            pair.append(await Serving.batched_run_async(h, [REQS[2], REQS[4]], deadline=WAIT_S))

        with anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(two)
                for i in order:
                    tg.start_soon(one, i)
        return results, pair[0]

    with s.start() as h:
        results, pair = anyio.run(main)
    for i in order:
        assert outcome(results[i]) == solo[i], f"request {i}"
    assert [outcome(r) for r in pair] == [solo[2], solo[4]]


def test_long_request_does_not_hold_short_ones_hostage(tokenizer, tiny32):
    s = make(tokenizer, tiny32, max_batch=4, max_len=128)
    with s.start() as h:
        long = Serving.stream(h, {"text": text(4, 9), "max_new_tokens": 100}, deadline=WAIT_S)
        next(long)  # the long request is decoding
        shorts: list[Outcome] = []

        def short(i: int) -> None:
            shorts.append(outcome(Serving.batched_run(h, {"text": text(3, 20 + i), "max_new_tokens": 3},
                                                      deadline=WAIT_S)))

        threads = [threading.Thread(target=short, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert [n for _, n, _ in shorts] == [3, 3, 3]
        stats = h.stats()
        assert stats.running == 1 and stats.completed == 3  # the long one still decodes
        assert read(long)[1:] == (100, "length")  # num_tokens counts the whole request


def _first_new_token(tokenizer: Tokenizer, state: State, prompt: str) -> tuple[int, int]:
    """(k, token): greedy token ``k`` (k >= 1) of ``prompt`` does not occur before it."""
    ids, _ = generate(tokenizer.encode(prompt), state, max_new_tokens=8, max_len=96, eos_token_ids=())
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])
    return k, ids[k]


def test_row_leaves_on_eos_and_frees_its_slot(tokenizer, tiny32, solo):
    prompt = REQS[0]["text"]
    k, eos = _first_new_token(tokenizer, tiny32, prompt)
    eos_tokenizer = copy.copy(tokenizer)
    eos_tokenizer.eos_token_ids = frozenset({eos})  # this token ends generation
    s = make(eos_tokenizer, tiny32, max_batch=1, max_len=96)  # one KV slot
    with s.start(batch_size=2) as h:  # two rows may run: the KV slot is what binds
        other: list[Any] = []
        a = Serving.stream(h, {"text": prompt, "max_new_tokens": 60}, deadline=WAIT_S)
        t = threading.Thread(target=lambda: other.append(Serving.batched_run(h, REQS[5], deadline=WAIT_S)))
        t.start()
        _, n, reason = read(a)
        t.join(WAIT_S)
        assert (n, reason) == (k + 1, "stop")  # the EOS is the last token
        assert outcome(other[0]) == solo[5]  # ran in the slot the EOS freed
        stats = h.stats()
    assert stats.steps_run < 30 and stats.completed == 2 and stats.running == 0


def test_cancel_frees_the_slot_for_a_queued_request(tokenizer, tiny32, solo):
    s = make(tokenizer, tiny32, max_batch=1, max_len=128)  # one KV slot
    with s.start(batch_size=4) as h:
        a = Serving.stream(h, {"text": text(3, 7), "max_new_tokens": 100}, deadline=WAIT_S)
        next(a)  # a holds the only slot
        done: list[Any] = []
        t = threading.Thread(target=lambda: done.append(Serving.batched_run(h, REQS[3], deadline=WAIT_S)))
        t.start()
        wait_for(lambda: h.stats().queued == 1)  # waits for a KV slot, not for batch_size
        assert h.stats().running == 1
        a.close()
        t.join(WAIT_S)
        assert outcome(done[0]) == solo[3]
        stats = h.stats()
    assert stats.cancelled == 1 and stats.completed == 1 and stats.running == 0
    assert stats.steps_run < 50  # the cancelled row stopped long before its 100 tokens


def test_stop_string_ends_the_row_and_frees_its_slot(tokenizer, tiny32, solo):
    full = solo[0][0]  # greedy text of REQS[0]'s first 10 tokens
    stop = full[len(full) // 3 : len(full) // 3 + 2]
    s = make(tokenizer, tiny32, max_batch=1, max_len=96)  # one KV slot
    with s.start(batch_size=2) as h:
        other: list[Any] = []
        a = Serving.stream(h, {**REQS[0], "max_new_tokens": 80, "stop": stop}, deadline=WAIT_S)
        t = threading.Thread(target=lambda: other.append(Serving.batched_run(h, REQS[5], deadline=WAIT_S)))
        t.start()
        generated, _, reason = read(a)
        t.join(WAIT_S)
        assert (generated, reason) == (full[: full.index(stop)], "stop")
        assert outcome(other[0]) == solo[5]  # ran in the slot the stop string freed
        stats = h.stats()
    assert stats.steps_run < 40 and stats.completed == 2 and stats.running == 0


def test_kv_budget_admission_by_blocks(tokenizer, tiny32, solo):
    """A budget of 2.5 slot-design sequences (15 KV blocks of 16 tokens): the paged cache admits
    by free blocks, so more than 2 rows run at once; blocks that run out mid-decode preempt the
    newest sequence (recomputed later): every output still equals its solo run."""
    max_len = 96
    per_seq = kv_bytes_per_token(tiny32) * (max_len + 1)
    rows: list[int] = []
    s = make(tokenizer, tiny32, max_batch=8, max_len=max_len, kv_cache_bytes=2 * per_seq + per_seq // 2)
    s = s.telemetry(step_rows(rows))
    with s.start(max_queue=16) as h:
        long = [Serving.stream(h, {"text": text(3, 30 + i), "max_new_tokens": 40}, deadline=WAIT_S) for i in range(2)]
        queued = [Serving.stream(h, REQS[i % len(REQS)], deadline=WAIT_S) for i in range(8)]
        assert [read(x)[1:] for x in long] == [(40, "length")] * 2
        assert [read(x) for x in queued] == [solo[i % len(REQS)] for i in range(8)]
        stats = h.stats()
    assert stats.completed == 10 and stats.running == stats.queued == 0
    assert max(rows) > 2


def test_request_that_can_never_fit_fails_only_its_caller(tokenizer, tiny32, solo):
    s = make(tokenizer, tiny32, max_batch=2, max_len=64)
    with s.start() as h:
        ok: list[Any] = []
        t = threading.Thread(target=lambda: ok.append(Serving.batched_run(h, REQS[0], deadline=WAIT_S)))
        t.start()
        with pytest.raises(ValueError, match=r"\+ max_new_tokens 60 = .* exceeds max_len 64"):
            Serving.batched_run(h, {"text": text(10, 40), "max_new_tokens": 60}, deadline=WAIT_S)
        with pytest.raises(ValueError, match="input 1: .*exceeds max_len 64"):
            Serving.batched_run(h, [REQS[5], {"text": text(4, 41), "max_new_tokens": 61}], deadline=WAIT_S)
        t.join(WAIT_S)
        assert outcome(ok[0]) == solo[0]
        assert outcome(Serving.batched_run(h, REQS[5], deadline=WAIT_S)) == solo[5]  # still serving


def _random_specs(n: int, seed: int) -> list[tuple[dict[str, Any], str, float]]:
    """(request, how the caller behaves, a delay or deadline in seconds)."""
    rng = random.Random(seed)
    samplers = [{}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}]
    specs = []
    for i in range(n):
        req = {"text": text(rng.randint(1, 20), 100 + i), "max_new_tokens": rng.randint(1, 5),
               "seed": i, **rng.choice(samplers)}
        mode = rng.choice(["run", "cancel", "stream_break", "deadline", "thread"])
        specs.append((req, mode, rng.uniform(0.01, 0.4)))
    return specs


def test_no_hang_under_100_random_requests_with_cancellations(tokenizer, tiny32, solo):
    s = make(tokenizer, tiny32, max_batch=8, max_len=64)
    specs = _random_specs(100, seed=7)
    finished: dict[int, Outcome] = {}
    expired = 0

    async def one(i: int, req: dict[str, Any], mode: str, t: float) -> None:
        nonlocal expired
        if mode == "run":
            finished[i] = outcome(await Serving.batched_run_async(h, req, deadline=WAIT_S))
        elif mode == "cancel":
            with anyio.move_on_after(t):
                await Serving.batched_run_async(h, req, deadline=WAIT_S)
        elif mode == "stream_break":
            async with await Serving.stream_async(h, req, deadline=WAIT_S) as stream:
                async for _ in stream:
                    break
        elif mode == "thread":
            finished[i] = outcome(await anyio.to_thread.run_sync(lambda: Serving.batched_run(h, req, deadline=WAIT_S)))
        else:
            try:
                await Serving.batched_run_async(h, req, deadline=t)
            except DeadlineExceeded:
                expired += 1

    async def main() -> None:
        with anyio.fail_after(2 * WAIT_S):
            async with anyio.create_task_group() as tg:
                for i, spec in enumerate(specs):
                    tg.start_soon(one, i, *spec)

    with s.start() as h:
        anyio.run(main)
        wait_for(lambda: h.stats().rows_in_flight == 0)
        stats = h.stats()
        assert stats.completed + stats.cancelled + stats.expired == len(specs)
        assert stats.failed == stats.rejected == 0 and stats.completed >= len(finished) > 0
        assert stats.cancelled > 0 and stats.expired >= expired
        assert outcome(Serving.batched_run(h, REQS[2], deadline=WAIT_S)) == solo[2]  # still serving
    alone = make(tokenizer, tiny32, max_batch=1, max_len=64)
    assert finished == {i: outcome(alone.run(specs[i][0])) for i in finished}  # batchmates changed nothing


def test_kv_budget_that_holds_no_sequence_is_a_bad_option(tokenizer, tiny32):
    per_seq = kv_bytes_per_token(tiny32) * (64 + 1)
    for budget in (0, -1, per_seq - 1):  # before the fix: accepted, then BackendError on every run
        with pytest.raises(ValueError, match=f"kv_cache_bytes={budget} holds no sequence of max_len=64"):
            make(tokenizer, tiny32, max_len=64, kv_cache_bytes=budget)
    assert make(tokenizer, tiny32, max_len=64, kv_cache_bytes=per_seq).run(REQS[5])["results"][0]["num_tokens"] == 5
