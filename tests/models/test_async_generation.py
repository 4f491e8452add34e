"""Async text generation on the tiny Qwen3 checkpoint: a free event loop, cancellation (queued,
generating, a stream left early), streamed text equal to the non-streamed text, stop strings
held back, max_queue and deadlines; the ASGI example (examples/asgi_stream.py). anyio tests run
on asyncio and on trio."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from starlette.requests import ClientDisconnect
from starlette.testclient import TestClient

from mlx_serving.models import text_generation
from mlx_serving.models.decoder.layers import State
from mlx_serving.serving import DeadlineExceeded, Serving, ServingHandle, ServingOverloaded
from mlx_serving.tokenization import Tokenizer

MAX_LEN = 256
#: Wall-clock caps in this file only end a hang (each test's work takes seconds on a quiet machine):
#: they leave room for cores shared with other busy processes. What the tests assert is counted
#: (steps, stats, pieces) or measured in the loop thread's CPU time, never in wall-clock time.
HANG_S = 300.0
# Multi-byte output (CJK, Hangul, astral-plane letters) on the seed-0 tiny checkpoint; some of
# these rows produce a token that ends inside a character, which the stream must hold back.
MULTIBYTE = ["Ελληνικά 한국어", "数学 你好世界", "Once upon a time 北京", "东京 一二三"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


@pytest.fixture(scope="module")
def gen(tok: Tokenizer, tiny32: State) -> Serving:
    """8 KV slots (``Serving.start`` defaults to batch_size 8)."""
    return text_generation.serving(tok, tiny32, max_new_tokens=12, max_len=MAX_LEN, max_batch=8)


@pytest.fixture(scope="module")
def gen2(tok: Tokenizer, tiny32: State) -> Serving:
    """Only 2 KV slots: a queued row can start only once the engine freed a slot."""
    return text_generation.serving(tok, tiny32, max_new_tokens=12, max_len=MAX_LEN, max_batch=2)


@pytest.fixture(scope="module")
def solo(gen: Serving) -> Callable[[str, int], dict[str, Any]]:
    """``solo(prompt, max_new_tokens)``: the result of that prompt run alone (inline), memoized."""
    cache: dict[tuple[str, int], dict[str, Any]] = {}

    def run(prompt: str, n: int) -> dict[str, Any]:
        if (prompt, n) not in cache:
            cache[(prompt, n)] = Serving.run(gen, {"text": prompt, "max_new_tokens": n})["results"][0]
        return cache[(prompt, n)]

    return run


async def _until(predicate: Callable[[], bool], timeout: float = HANG_S) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.002)


async def _collect(handle: ServingHandle, input: Any, log: list | None = None,
                   name: str = "") -> tuple[list[str], dict[str, Any]]:
    """All text pieces of a stream and its final event; ``log`` gets (name, piece number|"final")."""
    pieces: list[str] = []
    final: dict[str, Any] = {}
    async for item in await Serving.stream_async(handle, input):
        if isinstance(item, str):
            pieces.append(item)
            if log is not None:
                log.append((name, len(pieces)))
        else:
            final = item
            if log is not None:
                log.append((name, "final"))
    return pieces, final


def _same(text_and_final: tuple[str, dict[str, Any]], solo: dict[str, Any]) -> None:
    text, final = text_and_final
    assert text == solo["generated_text"]
    assert (final["num_tokens"], final["finish_reason"]) == (solo["num_tokens"], solo["finish_reason"])


def _core(result: dict[str, Any]) -> tuple[Any, ...]:
    """A result without its timing."""
    return result["generated_text"], result["num_tokens"], result["finish_reason"], result["token_summary"]


def _bounds(pieces: list[str]) -> set[int]:
    """Character offsets where one piece ends and the next begins."""
    ends, n = set(), 0
    for p in pieces[:-1]:
        n += len(p)
        ends.add(n)
    return ends


async def _max_heartbeat_gap(handle: ServingHandle, clients: int) -> float:
    """Most CPU time (s) the event loop's thread spent between two beats of a 10 ms heartbeat task
    while ``clients`` streams generate: what other callbacks held the loop for. CPU time of the
    loop's thread (``time.thread_time``, read on that thread), not wall-clock time, so that other
    processes on the cores cannot stretch it."""
    gaps: list[float] = []
    finals: list[dict[str, Any]] = []
    done = anyio.Event()
    steps = handle.stats().steps_run

    async def heartbeat() -> None:
        last = time.thread_time()
        while not done.is_set():
            await anyio.sleep(0.01)
            now = time.thread_time()
            gaps.append(now - last)
            last = now

    async def client(i: int) -> None:
        finals.append((await _collect(handle, f"request {i}: hello there"))[1])

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        async with anyio.create_task_group() as calls:
            for i in range(clients):
                calls.start_soon(client, i)
        done.set()
    assert [f["num_tokens"] for f in finals] == [12] * clients
    assert handle.stats().steps_run - steps >= 12  # the beats were taken while generation ran
    return max(gaps)


@pytest.mark.anyio
async def test_event_loop_stays_responsive_while_8_requests_generate(gen: Serving) -> None:
    """The loop's thread never spends 50 ms of CPU between two heartbeats while 8 streams
    generate (model work or a tokenizer run on the loop would); measured in that thread's CPU time,
    so it holds however busy the machine is."""
    with anyio.fail_after(HANG_S):
        async with Serving.start(gen) as h:
            await Serving.batched_run_async(h, "warm up")  # first-step costs are not what we measure
            gap = await _max_heartbeat_gap(h, 8)
    assert gap < 0.05, f"the event loop ran {gap * 1e3:.0f} ms of CPU between two heartbeats"


@pytest.mark.anyio
async def test_cancelling_queued_and_generating_requests_leaves_the_others_unchanged(
        gen2: Serving, solo: Callable[[str, int], dict[str, Any]]) -> None:
    a, b, q, c = ("Once upon a time", 24), ("The weather today", 24), ("Hello", 8), ("Write a poem", 8)
    log: list[tuple[str, Any]] = []
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    scopes = {"B": anyio.CancelScope(), "Q": anyio.CancelScope()}
    with anyio.fail_after(HANG_S):
        async with Serving.start(gen2) as h:  # 2 KV slots, batch_size 2

            async def run(name: str, prompt: str, n: int) -> None:
                with scopes.get(name, anyio.CancelScope()):
                    pieces, final = await _collect(h, {"text": prompt, "max_new_tokens": n}, log, name)
                    out[name] = ("".join(pieces), final)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "A", *a)
                tg.start_soon(run, "B", *b)
                await _until(lambda: h.stats().running == 2)
                tg.start_soon(run, "Q", *q)
                await _until(lambda: h.stats().queued == 1)
                scopes["Q"].cancel()  # cancelled while queued
                await _until(lambda: h.stats().cancelled == 1)
                await _until(lambda: (h.stats().queued, h.stats().running) == (0, 2))  # the engine drops Q next step
                await _until(lambda: ("B", 2) in log)
                steps = h.stats().steps_run
                scopes["B"].cancel()  # cancelled mid-generation
                await _until(lambda: h.stats().running == 1)
                assert h.stats().steps_run <= steps + 1
                tg.start_soon(run, "C", *c)
            stats = h.stats()
    assert set(out) == {"A", "C"}
    _same(out["A"], solo(*a))
    _same(out["C"], solo(*c))
    # C took the slot B's cancellation freed while A was still generating (the engine, which has
    # only 2 slots, dropped B's row; Q, queued before C, never took it).
    assert log.index(("C", "final")) < log.index(("A", "final"))
    assert (stats.cancelled, stats.completed, stats.running, stats.queued) == (2, 2, 0, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("leave", ["break", "aclose"])
async def test_breaking_out_of_a_stream_after_two_pieces_frees_its_row(
        gen2: Serving, solo: Callable[[str, int], dict[str, Any]], leave: str) -> None:
    other: dict[str, Any] = {}
    long_input = {"text": "Write a poem", "max_new_tokens": 200}
    with anyio.fail_after(HANG_S):
        async with Serving.start(gen2) as h:
            async with anyio.create_task_group() as tg:

                async def finish_other() -> None:
                    other["result"] = await Serving.batched_run_async(h, "Once upon a time")

                tg.start_soon(finish_other)
                got = []
                if leave == "break":  # the dropped stream is collected at once and withdrawn
                    async for item in await Serving.stream_async(h, long_input):
                        got.append(item)
                        if len(got) == 2:
                            break
                else:
                    async with await Serving.stream_async(h, long_input) as stream:
                        async for item in stream:
                            got.append(item)
                            if len(got) == 2:
                                break
                steps = h.stats().steps_run
                await _until(lambda: h.stats().cancelled == 1)
                assert h.stats().steps_run <= steps + 1
                assert h.stats().running <= 1
            stats = h.stats()
    assert all(isinstance(p, str) for p in got)
    assert _core(other["result"]["results"][0]) == _core(solo("Once upon a time", 12))
    assert (stats.cancelled, stats.completed, stats.running) == (1, 1, 0)


@pytest.mark.anyio
async def test_stream_join_equals_non_streamed_text_for_multibyte_output(gen: Serving, tok: Tokenizer) -> None:
    n = 16
    streamed: dict[str, tuple[list[str], dict[str, Any]]] = {}
    synced: dict[str, list[Any]] = {}
    plain: dict[str, dict[str, Any]] = {}
    with anyio.fail_after(HANG_S):
        async with Serving.start(gen) as h:

            async def one(p: str) -> None:
                streamed[p] = await _collect(h, {"text": p, "max_new_tokens": n})

            async def one_plain(p: str) -> None:
                plain[p] = (await Serving.batched_run_async(h, {"text": p, "max_new_tokens": n}))["results"][0]

            def one_sync(p: str) -> None:
                synced[p] = list(Serving.stream(h, {"text": p, "max_new_tokens": n}, deadline=HANG_S))

            async with anyio.create_task_group() as tg:
                for p in MULTIBYTE:
                    tg.start_soon(one, p)
                    tg.start_soon(one_plain, p)
                    tg.start_soon(anyio.to_thread.run_sync, one_sync, p)
    held_back = 0
    for p in MULTIBYTE:
        pieces, final = streamed[p]
        text = "".join(pieces)
        assert any(ord(ch) > 0x7F for ch in text), f"{p!r} produced ASCII only: {text!r}"
        assert text == plain[p]["generated_text"]
        assert synced[p][:-1] == pieces
        assert {**synced[p][-1], "timing": None} == {**final, "timing": None}
        assert all(isinstance(piece, str) and piece for piece in pieces)
        summary = dict(final["token_summary"])
        assert 0 <= summary.pop("cached") < len(tok.encode(p))  # prefix-cache hits: the paged cache reports them
        assert summary == {"input": len(tok.encode(p)), "output": final["num_tokens"]}
        assert final["finish_reason"] == plain[p]["finish_reason"]
        held_back += final["num_tokens"] - len(pieces)
    assert held_back > 0, "no token ended inside a character: pick prompts that exercise it"


@pytest.mark.anyio
async def test_stop_strings_never_reach_a_piece(gen: Serving) -> None:
    prompt = {"text": "Once upon a time", "max_new_tokens": 16}
    with anyio.fail_after(HANG_S):
        async with Serving.start(gen) as h:
            pieces, final = await _collect(h, prompt)
            text, bounds = "".join(pieces), _bounds(pieces)
            # A stop string straddling a piece boundary (first occurrence there), and a trap whose
            # first two characters end a piece but whose third never comes.
            cut = min(b for b in bounds if b >= 2 and len(text) - b >= 2 and text.find(text[b - 2:b + 2]) == b - 2)
            stop, trap = text[cut - 2:cut + 2], text[cut - 2:cut] + "\u2603"
            assert "\u2603" not in text
            results: dict[str, tuple[list[str], dict[str, Any]]] = {}

            async def run(name: str, stops: list[str]) -> None:
                results[name] = await _collect(h, {**prompt, "stop": stops})

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "stop", [stop])
                tg.start_soon(run, "trap", [trap])
            stats = h.stats()
    stopped, stop_final = results["stop"]
    assert "".join(stopped) == text[:cut - 2]
    assert stop_final["finish_reason"] == "stop" and stop_final["num_tokens"] < final["num_tokens"]
    trapped, trap_final = results["trap"]
    assert "".join(trapped) == text and trap_final["finish_reason"] == final["finish_reason"]
    assert cut in bounds and cut not in _bounds(trapped)  # the trap's prefix was held back
    assert (stats.completed, stats.running, stats.cancelled) == (3, 0, 0)


@pytest.mark.anyio
async def test_max_queue_rejects_at_once_and_queued_work_completes(
        gen: Serving, solo: Callable[[str, int], dict[str, Any]]) -> None:
    a, b = ("Once upon a time", 12), ("Write a poem", 12)
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    with anyio.fail_after(HANG_S):
        async with Serving.start(gen, batch_size=1, max_queue=1) as h:

            async def run(name: str, prompt: str, n: int) -> None:
                pieces, final = await _collect(h, {"text": prompt, "max_new_tokens": n})
                out[name] = ("".join(pieces), final)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "A", *a)
                await _until(lambda: h.stats().running == 1)
                tg.start_soon(run, "B", *b)
                await _until(lambda: h.stats().queued == 1)
                with pytest.raises(ServingOverloaded):
                    await Serving.batched_run_async(h, "Hello")
                with pytest.raises(ServingOverloaded):
                    await Serving.stream_async(h, "Hello")
                stats = h.stats()  # refused while A still runs and B still waits: at once
                assert (stats.rejected, stats.running, stats.queued, stats.completed) == (2, 1, 1, 0)
            stats = h.stats()
    _same(out["A"], solo(*a))
    _same(out["B"], solo(*b))
    assert (stats.completed, stats.rejected, stats.failed) == (2, 2, 0)


@pytest.mark.anyio
async def test_deadline_fails_only_that_request(gen: Serving, solo: Callable[[str, int], dict[str, Any]]) -> None:
    long_input = {"text": "The weather today", "max_new_tokens": MAX_LEN - 16}
    out: dict[str, Any] = {}
    pieces: list[str] = []
    with anyio.fail_after(HANG_S):
        async with Serving.start(gen, batch_size=3) as h:

            async def plain() -> None:
                out["A"] = await Serving.batched_run_async(h, "Once upon a time")

            async def streamed() -> None:
                with pytest.raises(DeadlineExceeded):
                    async for item in await Serving.stream_async(h, long_input, deadline=0.6):
                        pieces.append(item)

            async def awaited() -> None:
                with pytest.raises(DeadlineExceeded):
                    await Serving.batched_run_async(h, long_input, deadline=0.4)

            async with anyio.create_task_group() as tg:
                tg.start_soon(plain)
                tg.start_soon(streamed)
                tg.start_soon(awaited)
            stats = h.stats()
    assert pieces and all(isinstance(p, str) for p in pieces)  # it expired mid-generation
    assert _core(out["A"]["results"][0]) == _core(solo("Once upon a time", 12))
    assert (stats.expired, stats.completed, stats.running, stats.queued) == (2, 1, 0, 0)


@pytest.mark.asyncio
async def test_asyncio_wait_for_timeout_withdraws_the_generating_row(
        gen2: Serving, solo: Callable[[str, int], dict[str, Any]]) -> None:
    async with Serving.start(gen2) as h:
        other = asyncio.create_task(Serving.batched_run_async(h, "Once upon a time"))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(Serving.batched_run_async(h, {"text": "Hello", "max_new_tokens": 200}), 0.3)
        stats = h.stats()
        assert stats.cancelled == 1 and stats.running <= 1
        result = (await asyncio.wait_for(other, HANG_S))["results"][0]
    assert _core(result) == _core(solo("Once upon a time", 12))


@pytest.fixture(scope="module")
def asgi_stream() -> Any:
    """examples/asgi_stream.py, imported from its path (examples/ is not a package)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "asgi_stream.py"
    spec = importlib.util.spec_from_file_location("asgi_stream_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_asgi_example_streams_the_non_streamed_text(gen: Serving, asgi_stream: Any, backend: str) -> None:
    body = {"text": MULTIBYTE[0], "max_new_tokens": 16}
    with TestClient(asgi_stream.create_app(gen), backend=backend) as client:
        with client.stream("POST", "/stream", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            chunks = list(r.iter_bytes())
        whole = client.post("/generate", json=body)
        bad = client.post("/stream", json={"text": ""})
        late = client.post("/generate", json={**body, "max_new_tokens": MAX_LEN - 16, "deadline": 0.2})
    assert whole.status_code == 200
    text = whole.json()["results"][0]["generated_text"]
    assert b"".join(chunks).decode() == text and len(chunks) > 1
    assert bad.status_code == 400 and bad.json()["error"] == "InvalidInput"
    assert late.status_code == 504 and late.json()["error"] == "DeadlineExceeded"


@pytest.mark.anyio
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_asgi_example_client_disconnect_cancels_the_request(gen2: Serving, asgi_stream: Any,
                                                                  spec_version: str) -> None:
    """2.3: the server reports ``http.disconnect``; 2.4: ``send`` raises OSError once the client is gone."""
    app = asgi_stream.create_app(gen2)
    body = json.dumps({"text": "Write a poem", "max_new_tokens": 200}).encode()
    requests = [{"type": "http.request", "body": body, "more_body": False}]
    chunks: list[bytes] = []
    gone = anyio.Event()

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set() and spec_version == "2.4":
            raise OSError("client disconnected")
        if message["type"] == "http.response.body" and message["body"]:
            chunks.append(message["body"])
            if len(chunks) == 2:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/stream", "raw_path": b"/stream", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("client", 1),
             "server": ("server", 80)}
    with anyio.fail_after(HANG_S):
        async with app.router.lifespan_context(app):
            handle = app.state.handle
            with contextlib.suppress(ClientDisconnect):  # raised under 2.4
                await app(scope, receive, send)
            await _until(lambda: handle.stats().cancelled == 1)
            stats = handle.stats()
    assert len(chunks) == 2
    assert (stats.cancelled, stats.running, stats.completed) == (1, 0, 0)
