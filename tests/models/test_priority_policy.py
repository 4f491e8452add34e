"""The "priority" scheduling policy through the text-generation serving: a request's
``priority`` (lower first) decides which waiting request the engine starts next; the engine, not
the serving's arrival-order queue, holds the waiting requests (GenerationOptions.policy)."""

from __future__ import annotations

import threading
import time

import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.decoder.layers import State
from mlx_serving.serving import Serving
from mlx_serving.tokenization import Tokenizer


def _finish_order(tiny32: State, policy: str) -> list[str]:
    """Two rows busy (a short and a long request), then "low" (priority 5) and "high" (priority 0)
    arrive in that order; returns the order in which the four requests finished."""
    gen = text_generation.serving(Tokenizer.qwen3(), tiny32, max_len=160, max_batch=2, policy=policy)
    order: list[str] = []
    lock = threading.Lock()
    started = threading.Barrier(3)

    def busy(name: str, tokens: int) -> None:
        with h.stream({"text": f"busy {name}", "max_new_tokens": tokens}) as stream:
            first = True
            for _ in stream:
                if first:
                    started.wait(timeout=60)
                    first = False
        with lock:
            order.append(name)

    def waiting(name: str, priority: int) -> None:
        h.run({"text": f"waiting {name}", "max_new_tokens": 4, "priority": priority})
        with lock:
            order.append(name)

    with Serving.start(gen) as h:
        threads = [threading.Thread(target=busy, args=("short", 24)), threading.Thread(target=busy, args=("long", 120))]
        for t in threads:
            t.start()
        started.wait(timeout=60)  # both rows decoding: later requests wait
        low = threading.Thread(target=waiting, args=("low", 5))
        low.start()
        while policy == "priority" and h.stats().backend.get("seqs_waiting", 0) < 1:
            time.sleep(0.001)  # "low" is in the engine's waiting queue before "high" arrives
        high = threading.Thread(target=waiting, args=("high", 0))
        high.start()
        for t in (*threads, low, high):
            t.join(timeout=120)
    return order


@pytest.mark.parametrize(("policy", "first"), [("priority", "high"), ("fcfs", "low")])
def test_waiting_requests_start_in_policy_order(tiny32: State, policy: str, first: str) -> None:
    order = _finish_order(tiny32, policy)
    assert sorted(order) == ["high", "long", "low", "short"]
    assert order.index(first) < order.index("high" if first == "low" else "low")


def test_priority_must_be_an_int(tiny32: State) -> None:
    gen = text_generation.serving(Tokenizer.qwen3(), tiny32, max_len=64, max_new_tokens=8, max_batch=2,
                                  policy="priority")
    for bad in ("1", 1.5, True):
        with pytest.raises(ValueError, match="priority"):
            Serving.run(gen, {"text": "hi", "max_new_tokens": 1, "priority": bad})


def test_policy_option_is_checked(tiny32: State) -> None:
    with pytest.raises(ValueError, match="policy"):
        text_generation.serving(Tokenizer.qwen3(), tiny32, policy="lifo")


def test_priority_overtakes_every_queued_request(tiny32: State) -> None:
    """One row, busy; four priority-5 requests queue, then a priority-0 one: the serving hands every
    queued row to the engine (one queue), so the priority-0 request starts next and finishes before
    all four. Under the two-queue design it waited behind the serving's FIFO and finished last."""
    gen = text_generation.serving(Tokenizer.qwen3(), tiny32, max_len=160, max_batch=1, policy="priority")
    order: list[str] = []
    lock = threading.Lock()

    def run(name: str, tokens: int, priority: int) -> None:
        h.run({"text": f"request {name}", "max_new_tokens": tokens, "priority": priority})
        with lock:
            order.append(name)

    with Serving.start(gen) as h:
        with h.stream({"text": "busy", "max_new_tokens": 60}) as busy:
            next(iter(busy))  # the only row is decoding
            lows = [threading.Thread(target=run, args=(f"low{i}", 4, 5)) for i in range(4)]
            for t in lows:
                t.start()
            deadline = time.monotonic() + 60
            while h.stats().backend.get("seqs_waiting", 0) < 4 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert h.stats().queued == 4 and h.stats().backend["seqs_waiting"] == 4  # all in the engine's queue
            high = threading.Thread(target=run, args=("high", 4, 0))
            high.start()
            list(busy)
        for t in (*lows, high):
            t.join(timeout=120)
    assert order[0] == "high" and sorted(order[1:]) == [f"low{i}" for i in range(4)]
