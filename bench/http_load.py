"""HTTP overhead of ``mlx-serving serve``: N concurrent streaming clients over HTTP vs the same load
in process, and vs ``mlx_lm.server`` on the same checkpoint.

Every client sends one streamed completion (a distinct short prompt, greedy, ``--max-tokens``
tokens), all starting together; ``--rounds`` rounds per mode, the mode order rotated each round.
Modes:

- ``inproc``: a started handle in this process, one asyncio task per client, ``stream_async`` (the
  runtime without HTTP);
- ``serve``: ``mlx-serving serve`` in a subprocess (``--max-batch`` = clients), one asyncio task per
  client streaming ``POST /v1/completions`` (SSE) with httpx;
- ``mlx_lm``: ``python -m mlx_lm.server`` in a subprocess (``--decode-concurrency`` = clients), the
  same HTTP client code;
- ``echo`` (the front end's ceiling): the server app (``create_app``) in a subprocess over an
  iterative serving with no model, whose every step emits one text piece per row at once, so the
  tok/s measured is what the HTTP layer (uvicorn, SSE, the client contract, the client) streams
  at most on this machine.

Per mode: TTFT p50/p99 (send -> first non-empty text), aggregate tok/s (completion tokens / wall
time from the first send to the last end; tokens from the final ``usage`` chunk), each as the
median over rounds; ``vs inproc`` is the tok/s ratio taken within each round, then the median.

Run: ``.venv/bin/python bench/http_load.py [--model DIR] [--clients 64] [--max-tokens 32]``
(default model: the tiny seeded checkpoint, written to a temporary directory); writes
bench/results/http_load.json (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# bench/ holds scripts named like the packages (bench/tokenization.py): keep it off sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_serving.models import text_generation  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.serving import Serving  # noqa: E402

_RETRIES = 5
_WORDS = ("river", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "quartz", "ember", "violet")


@dataclass
class Sample:
    """One request: seconds from send to first text and to the end, completion tokens."""

    ttft: float
    end: float
    tokens: int


class _Instant:
    """An iterative backend with no model: each step emits one event per row (a countdown)."""

    def init(self, mode: str, arg: Any, partitions: int) -> dict[int, int]:
        return {}

    def admit(self, state: dict[int, int], rows: list[tuple[int, int]], partition: int) -> list[Any]:
        state.update(rows)
        return []

    def free_slots(self, state: dict[int, int]) -> int:
        return 4096

    def step(self, state: dict[int, int]) -> list[tuple[int, int, bool]]:
        out = []
        for row in list(state):
            state[row] -= 1
            out.append((row, state[row], state[row] == 0))
            if state[row] == 0:
                del state[row]
        return out

    def cancel(self, state: dict[int, int], row_ids: list[int]) -> None:
        for row in row_ids:
            state.pop(row, None)

    def active(self, state: dict[int, int]) -> int:
        return len(state)


class _Pieces:
    """Transducer of the echo serving: a text piece per event, then the final dict."""

    def __init__(self, info: Any) -> None:
        self.tokens = 0

    def feed(self, row: int, left: int) -> list[Any]:
        self.tokens += 1
        if left:
            return [" tok"]
        return [" tok", {"finish_reason": "length", "num_tokens": self.tokens,
                         "token_summary": {"input": 1, "output": self.tokens}}]

    def stop_rows(self) -> list[int]:
        return []

    def close(self) -> list[Any]:
        return []


def serve_echo(port: int) -> None:
    """Run the server app over the instant serving on 127.0.0.1:``port`` (blocks)."""
    import uvicorn

    from mlx_serving.serving import Batch
    from mlx_serving.server import create_app

    serving = (Serving.new(_Instant()).client_preprocessing(lambda x: (Batch.stack([x["max_new_tokens"]]), None))
               .streaming(_Pieces).client_postprocessing(lambda result, info: result))
    with Serving.start(serving, batch_size=4096, batch_timeout=0.005) as handle:
        uvicorn.run(create_app({"echo": handle}), host="127.0.0.1", port=port, log_level="warning")


def prompts(n: int) -> list[str]:
    return [f"{_WORDS[i % 10]} {_WORDS[(i // 10) % 10]} {i}" for i in range(n)]


async def inproc_round(handle: Any, texts: list[str], max_tokens: int) -> tuple[list[Sample], float]:
    start = time.perf_counter()

    async def one(text: str) -> Sample:
        t0 = time.perf_counter()
        first, tokens = None, 0
        async with await handle.stream_async({"text": text, "max_new_tokens": max_tokens}) as stream:
            async for item in stream:
                if isinstance(item, str):
                    first = first if first is not None else time.perf_counter() - t0
                else:
                    tokens = item["num_tokens"]
        return Sample(first if first is not None else float("nan"), time.perf_counter() - t0, tokens)

    samples = await asyncio.gather(*(one(t) for t in texts))
    return list(samples), time.perf_counter() - start


async def _stream_one(client: httpx.AsyncClient, body: dict[str, Any], t0: float) -> Sample:
    first, tokens, pieces = None, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or ()):
                pieces += 1
                first = first if first is not None else time.perf_counter() - t0
    return Sample(first if first is not None else float("nan"), time.perf_counter() - t0,
                  tokens if tokens is not None else pieces)


async def http_round(url: str, model: str, texts: list[str], max_tokens: int,
                     retries: list[int]) -> tuple[list[Sample], float]:
    """Every client streams one completion; ``retries[0]`` counts requests sent again after their
    connection was refused or reset (TTFT still counts from the first send)."""
    limits = httpx.Limits(max_connections=len(texts) + 8, max_keepalive_connections=len(texts) + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        start = time.perf_counter()

        async def one(text: str) -> Sample:
            body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            for attempt in range(_RETRIES + 1):
                try:
                    return await _stream_one(client, body, t0)
                except httpx.TransportError:  # refused or reset (mlx_lm.server's accept backlog is 5)
                    if attempt == _RETRIES:
                        raise
                    retries[0] += 1
                    await asyncio.sleep(0.05 * (attempt + 1))
            raise AssertionError("unreachable")

        samples = await asyncio.gather(*(one(t) for t in texts))
        return list(samples), time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def subprocess_server(command: list[str], port: int, ready_path: str, log: Path | None = None) -> Iterator[str]:
    """Start a server command, wait until ``GET ready_path`` answers 200 (300 s at most); yields its
    URL. ``log``: a file for its stdout and stderr (whose tail an early exit's error quotes)."""
    url = f"http://127.0.0.1:{port}"
    with open(log or os.devnull, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                tail = log.read_text()[-1500:] if log else ""
                raise RuntimeError(f"{command[:4]} exited with {process.returncode}: {tail}")
            try:
                if httpx.get(url + ready_path, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{command[:4]} did not become ready")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def summarize(rounds: list[tuple[list[Sample], float]]) -> dict[str, float]:
    per_round = []
    for samples, wall in rounds:
        ttft = np.array([s.ttft for s in samples]) * 1e3
        tokens = sum(s.tokens for s in samples)
        per_round.append({"ttft_p50_ms": float(np.nanpercentile(ttft, 50)),
                          "ttft_p99_ms": float(np.nanpercentile(ttft, 99)), "tok_s": tokens / wall, "tokens": tokens})
    return {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: tiny seeded)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="inproc,serve,mlx_lm")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "http_load.json")
    ap.add_argument("--serve-echo", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_echo is not None:
        serve_echo(args.serve_echo)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_checkpoint(Path(tmp) / "tiny", "tiny", seed=0)
        run(model, args)
    print(args.out.read_text())


def write_report(args: argparse.Namespace, results: dict[str, Any], rounds_done: int) -> None:
    """Write the results so far (after every round: a run stopped early keeps what it measured)."""
    report = {"model": str(args.model or "tiny (seed 0)"), "clients": args.clients, "max_tokens": args.max_tokens,
              "rounds": rounds_done, "cpu_count": os.cpu_count(), "modes": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


def run(model: Path, args: argparse.Namespace) -> None:
    """All rounds of every mode; the report is rewritten after each round."""
    modes = args.modes.split(",")
    texts = prompts(args.clients)
    name = model.resolve().name
    rounds: dict[str, list[tuple[list[Sample], float]]] = {m: [] for m in modes}
    retries: dict[str, list[int]] = {}
    port_serve, port_mlx = _free_port(), _free_port()
    serve_cmd = [sys.executable, "-m", "mlx_serving", "serve", "--model", str(model), "--port", str(port_serve),
                 "--max-batch", str(args.clients), "--max-len", str(args.max_len),
                 "--max-new-tokens", str(args.max_tokens), "--log-level", "warning"]
    mlx_cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port_mlx),
               "--decode-concurrency", str(args.clients), "--prompt-concurrency", str(args.clients),
               "--log-level", "WARNING"]
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            rounds[mode].append(one_round(mode, model, name, texts, args, serve_cmd, mlx_cmd, port_serve, port_mlx,
                                          retries.setdefault(mode, [0])))
            print(f"round {r} {mode}: {summarize(rounds[mode][-1:])}", file=sys.stderr)
        write_report(args, _results(rounds, retries, modes), r + 1)


def _results(rounds: dict[str, list[tuple[list[Sample], float]]], retries: dict[str, list[int]],
             modes: list[str]) -> dict[str, Any]:
    out = {mode: {**summarize(rs), "retries": retries.get(mode, [0])[0]} for mode, rs in rounds.items()}
    if "inproc" in rounds:
        for mode in modes:
            ratios = [(sum(s.tokens for s in rs[0]) / rs[1]) / (sum(s.tokens for s in base[0]) / base[1])
                      for rs, base in zip(rounds[mode], rounds["inproc"])]
            out[mode]["tok_s_vs_inproc"] = statistics.median(ratios)
    return out


def one_round(mode: str, model: Path, name: str, texts: list[str], args: argparse.Namespace, serve_cmd: list[str],
              mlx_cmd: list[str], port_serve: int, port_mlx: int, retries: list[int]) -> tuple[list[Sample], float]:
    """One round of ``mode``: a fresh server (or handle) per round, warmed up by one request first."""
    if mode == "inproc":
        serving = text_generation.from_mlx4bit(model, max_len=args.max_len, max_batch=args.clients)
        with Serving.start(serving) as handle:
            return _warm_then(lambda: inproc_round(handle, texts, args.max_tokens),
                              lambda: inproc_round(handle, texts[:1], 2))
    command, port, ready, model_id = {
        "serve": (serve_cmd, port_serve, "/health", name),
        "mlx_lm": (mlx_cmd, port_mlx, "/v1/models", str(model)),
        "echo": ([sys.executable, __file__, "--serve-echo", str(port_serve)], port_serve, "/health", "echo"),
    }[mode]
    with subprocess_server(command, port, ready) as url:
        return _warm_then(lambda: http_round(url, model_id, texts, args.max_tokens, retries),
                          lambda: http_round(url, model_id, texts[:1], 2, retries))


def _warm_then(measure: Callable[[], Awaitable[Any]], warm: Callable[[], Awaitable[Any]]) -> Any:
    async def both() -> Any:
        await warm()
        return await measure()
    return asyncio.run(both())


if __name__ == "__main__":
    main()
