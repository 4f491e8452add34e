"""Stream generated text over HTTP: a minimal Starlette app over the text-generation serving.

Needs the ``examples`` extra (starlette, uvicorn, httpx)::

    .venv/bin/python examples/asgi_stream.py [CHECKPOINT_DIR] [--port 8000] [--max-len 2048]
    curl -N localhost:8000/stream -d '{"text": "Hello", "max_new_tokens": 64}'
    curl localhost:8000/generate -d '{"text": "Hello", "stop": ["\\n"], "deadline": 5}'
    curl localhost:8000/stats

``POST /stream`` answers ``text/plain`` chunks, one per text piece, as tokens are generated;
``POST /generate`` answers the whole result as JSON; ``GET /stats`` the serving's counters. The
body is one text-generation input (a string, or a dict with ``text`` or ``messages`` and
per-request options; see ``mlx_serving.models.text_generation``) plus an optional ``deadline`` in seconds.
Concurrent requests are batched together by the serving. A client that disconnects mid-stream
withdraws its request: its row leaves the running batch before the next decode step and its KV
slot is freed.

Status codes: 400 bad input, 503 queue full (``max_queue``; retry later), 504 deadline passed
before the response started (a deadline passing mid-stream ends the stream early).
Without ``CHECKPOINT_DIR`` it serves the default model (SmolLM2-135M-Instruct, ``default_checkpoint()``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_serving import AsyncStream, DeadlineExceeded, Serving, ServingOverloaded


async def _input(request: Request) -> tuple[Any, float | None]:
    """The request body as a generation input and its deadline (seconds or None; the serving
    checks it). Raises ValueError (answered 400) for a body that is not JSON."""
    body = json.loads(await request.body())
    deadline = body.pop("deadline", None) if isinstance(body, dict) else None
    return body, deadline


async def generate(request: Request) -> Response:
    """The whole result, ``{"results": [{"generated_text", "finish_reason", ...}]}``."""
    input, deadline = await _input(request)
    return JSONResponse(await request.app.state.handle.run_async(input, deadline=deadline))


async def stream(request: Request) -> Response:
    """Text pieces as they are generated. The stream is opened before the response starts, so
    bad input and a full queue still get their status codes."""
    input, deadline = await _input(request)
    pieces = await request.app.state.handle.stream_async(input, deadline=deadline)
    return StreamingResponse(_text(pieces), media_type="text/plain; charset=utf-8")


async def _text(pieces: AsyncStream) -> AsyncIterator[str]:
    # Leaving this block by any path (the client disconnected, so the server cancelled this
    # generator; the generator was closed or collected) closes the stream: the request is withdrawn.
    async with pieces:
        try:
            async for item in pieces:
                if isinstance(item, str):  # the last item is the final event (a dict)
                    yield item
        except DeadlineExceeded:
            return  # headers are already sent: end the body early


async def stats(request: Request) -> Response:
    """The serving's counters: queued, running, completed, cancelled, expired, rejected, ..."""
    return JSONResponse(dataclasses.asdict(request.app.state.handle.stats()))


def _error(status: int, headers: dict[str, str] | None = None) -> Any:
    async def handler(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status, headers)

    return handler


def create_app(serving: Serving, **start_options: Any) -> Starlette:
    """An app that starts ``serving`` (``Serving.start_async(serving, **start_options)``) for its
    lifetime and serves ``POST /generate``, ``POST /stream`` and ``GET /stats``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with await Serving.start_async(serving, **start_options) as handle:
            app.state.handle = handle
            yield

    return Starlette(
        routes=[Route("/generate", generate, methods=["POST"]), Route("/stream", stream, methods=["POST"]),
                Route("/stats", stats)],
        exception_handlers={
            ValueError: _error(400),
            ServingOverloaded: _error(503, {"Retry-After": "1"}),
            DeadlineExceeded: _error(504),
        },
        lifespan=lifespan,
    )


def main() -> None:
    import uvicorn

    from mlx_serving import text_generation
    from mlx_serving import default_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: the default model, SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=32, help="sequences decoding at once")
    parser.add_argument("--max-len", type=int, default=2048, help="KV-cache positions per sequence")
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503")
    args = parser.parse_args()
    serving = text_generation.from_mlx4bit(args.checkpoint or default_checkpoint(), max_batch=args.max_batch,
                                           max_len=args.max_len)
    uvicorn.run(create_app(serving, max_queue=args.max_queue), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
