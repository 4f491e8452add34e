"""``create_app``: the OpenAI-compatible ASGI app (FastAPI) over one or more served models.

Each model is a :class:`~mlx_serving.serving.Client` (a started handle, a ``ServingPool``, ...), or a
:class:`~._models.ServedModel` holding one with its context length and tokenizer; the app uses only
the contract's verbs (``run_async``, ``stream_async``, ``stats``, ``aclose``), so it never branches
on which client it holds; a model may also be a :class:`~._models.Lazy`, loaded at its first request
and unloaded once idle (:mod:`._registry`: every route gets its model from ``await served.pick``).
Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(:mod:`._responses_api`), ``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's
Messages API, :mod:`._anthropic`), ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET /health``, ``GET /metrics``, ``GET /`` (the chat page). Every error, unknown routes and
methods included, has OpenAI's shape (the Messages API's: Anthropic's); every response carries
``x-request-id`` (the request's own, or a new one); CORS answers only for ``allowed_origins``.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from importlib import resources
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.middleware.cors import CORSMiddleware

from ..serving import AsyncStream, InvalidInput, RequestTooLarge, ServingError
from . import _anthropic
from ._embeddings import embedding_call, embedding_response, input_error
from ._errors import RETRY_AFTER_S, APIError, from_exception
from ._metrics import Metrics
from ._keep_alive import NEVER
from ._models import detokenize, tokenize
from ._registry import LeaseScope, Loader, ModelRegistry, Models
from ._requests import Call, chat_call, completion_call, messages_of
from ._responses import Echo, Kind, StreamState, chat_response, completion_response, new_id
from ._responses_api import ResponsesAPI
from ._shutdown import Drain
from ._sse import ShuttingDown, stream_events

__all__ = ["MAX_BODY_BYTES", "create_app"]

_log = logging.getLogger("mlx_serving.server")

#: Default cap on a request body: far above any prompt a 2,048-position model takes (the serving
#: refuses prompts that cannot fit before tokenizing them), far below what would strain memory.
MAX_BODY_BYTES = 32 << 20

def create_app(models: Models | Loader, *, api_key: str | None = None, request_timeout: float | None = None,
               stuck_after: float = 60.0, max_body_bytes: int = MAX_BODY_BYTES,
               on_load_error: Callable[[BaseException], None] | None = None,
               allowed_origins: tuple[str, ...] = (), shutdown_grace: float = 10.0,
               client_timeout: float | None = 30.0, keep_alive: float | None = None,
               max_loaded_models: int | None = None, load_wait: float = 600.0) -> FastAPI:
    """The server's ASGI app.

    ``models``: ``{name: client or ServedModel or Lazy}``, a client served as given (the caller closes
    it), a ``Lazy`` loaded at its first request (docs/server.md, "Models on demand"), or a function returning
    that mapping, called on a thread when the app starts (``/health`` answers 503 "loading" until it
    returns; the app closes those clients at shutdown; if it raises, ``/health`` answers 503
    "failed" and ``on_load_error(exc)`` is called). ``api_key``: when set, ``/v1/*`` needs
    ``Authorization: Bearer <api_key>`` (401 otherwise; ``/v1/messages`` takes ``x-api-key: <api_key>``
    too). ``request_timeout``: the deadline in seconds of a request that gives none (504 past it;
    None: no deadline). ``stuck_after``: ``/health`` answers 503 "stuck" when a model holds rows
    without progress for this long.
    ``max_body_bytes``: larger request bodies are refused with 413 before they are read whole.
    ``allowed_origins``: origins (``https://host:port``, or ``*``) a browser may call the API from
    (CORS; none by default: cross-origin pages get no CORS headers). ``shutdown_grace``: seconds
    open streams may go on after the server begins to shut down (SIGTERM); then each ends with an
    error event and ``[DONE]`` (run uvicorn with a ``timeout_graceful_shutdown`` above it).
    ``client_timeout``: seconds a client may take to send its request body (408 past it; None: no
    limit; idle connections and slow headers are :func:`~._timeouts.client_timeout_protocol`'s).
    ``keep_alive``: seconds a ``Lazy`` model stays loaded once idle (None: until evicted; a request's
    ``keep_alive`` field overrides it); ``max_loaded_models``: most models loaded at once (None: no
    cap; past it the least recently used idle ``Lazy`` model is unloaded); ``load_wait``: seconds a
    request waits for its model to load (503 + Retry-After past it).
    Raises ValueError for an empty mapping, a negative ``shutdown_grace`` or ``keep_alive``, a
    ``max_loaded_models`` below 1 or a ``load_wait`` not > 0.
    """
    served = ModelRegistry(stuck_after, NEVER if keep_alive is None else keep_alive, max_loaded_models, load_wait)
    drain = Drain(shutdown_grace)
    loader: Loader | None = models if callable(models) else None
    if not callable(models):
        served.ready(models, owned=False)
    metrics = Metrics(served.stats, served.lifecycle)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with served.running(loader, on_load_error):
            yield

    app = FastAPI(title="mlx-serving", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  max_body_size=max_body_bytes)
    app.state.served, app.state.metrics = served, metrics
    app.state.drain = drain  # DrainingServer (the CLI) starts its grace at the shutdown signal
    _error_handlers(app)
    app.state.client_timeout = client_timeout
    app.include_router(_v1_router(served, metrics, api_key, request_timeout, drain))
    app.include_router(_messages_router(served, metrics, api_key, request_timeout, drain))
    app.include_router(_token_router(served, api_key))
    _add_service_routes(app, served, metrics)
    _add_middleware(app, allowed_origins)
    return app


def _add_middleware(app: FastAPI, allowed_origins: tuple[str, ...]) -> None:
    """``x-request-id`` on every response (the request's, else a new one); CORS when asked for."""

    @app.middleware("http")
    async def request_id(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        rid = request.headers.get("x-request-id", "")[:128] or secrets.token_hex(16)
        response = await call_next(request)
        response.headers["x-request-id"] = rid
        return response

    app.add_middleware(LeaseScope)  # a picked model stays loaded until its request ends
    if allowed_origins:
        app.add_middleware(_CORS, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type", "x-request-id"],
                           expose_headers=["x-request-id", "retry-after"])


class _CORS(CORSMiddleware):
    """Starlette's CORS middleware whose refused preflights (an unlisted origin, method or header)
    answer in OpenAI's error shape instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        reason = bytes(response.body).decode("utf-8", "replace")
        error = APIError(400, f"CORS preflight refused: {reason}", code="cors_refused")
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(error.body(), 400, headers)


@contextmanager
def _rows_named(param: str, fields: Mapping[str, str] | None = None) -> Iterator[None]:
    """A RequestTooLarge (more rows than the serving queues at once) as a 400 naming ``param``, the
    request field that made the rows (a list of prompts or inputs, ``n``); an InvalidInput as a 400
    naming the field the client sent (``fields``: ``Call.fields``)."""
    try:
        yield
    except RequestTooLarge as exc:
        raise APIError(400, str(exc), param=param) from None
    except InvalidInput as exc:
        if fields is None:  # the caller maps it (embeddings: input_error)
            raise
        raise from_exception(exc, fields) from None


def _error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> Response:
        error = from_exception(exc)
        if error.status >= 500 and not isinstance(exc, (APIError, ServingError)):
            _log.exception("request failed", exc_info=exc)
        return JSONResponse(error.body(), error.status, error.headers)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Starlette's own errors (no such route: 404, wrong method: 405, ...) in OpenAI's shape."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = {404: f"no route {request.method} {request.url.path}",
                  405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        error = APIError(exc.status_code, detail, kind, code=str(exc.status_code), headers=dict(exc.headers or {}))
        return JSONResponse(error.body(), error.status, error.headers)

    for exc_type in (APIError, ValueError, ServingError, Exception):
        app.add_exception_handler(exc_type, handle)
    # Starlette types a handler as taking any Exception (starlette#2417); it passes this one only HTTPExceptions
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]


def _auth(api_key: str | None, header: str | None = None) -> Callable[[Request], Awaitable[None]]:
    """The API key check: ``Authorization: Bearer <key>``, or ``<header>: <key>`` when given."""
    how = "'Authorization: Bearer <key>'" + (f" or '{header}: <key>'" if header else "")

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" and header is not None:
            token = request.headers.get(header, "")
        elif scheme.lower() != "bearer":
            token = ""
        if not token or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, f"a valid API key is required: send {how}", "authentication_error",
                           code="invalid_api_key")
    return check


def _v1_router(served: ModelRegistry, metrics: Metrics, api_key: str | None, request_timeout: float | None,
               drain: Drain) -> APIRouter:
    """The ``/v1`` routes: chat, completions, responses, embeddings and models."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(_auth(api_key))])

    async def complete(request: Request, kind: Kind) -> Response:
        arrival = time.perf_counter()
        body = await _body(request)
        keep_alive = body.pop("keep_alive", None)
        call = chat_call(body) if kind == "chat" else completion_call(body)
        name, model = await served.pick(body.get("model"), "generate", keep_alive)
        client = model.client
        deadline = call.deadline if call.deadline is not None else request_timeout
        record = _Recorder(metrics, name, call, arrival)
        rows_field = "prompt" if call.prompts > 1 else "n"  # what made more rows than the queue holds
        if call.stream:
            with _rows_named(rows_field, call.fields):
                stream = await client.stream_async(call.input, deadline=deadline)
            state = StreamState(kind, name, isinstance(call.input, list), call.n, call.prompts * call.n,
                                continuous_usage=call.continuous_usage, echo=_echo(body, call))
            # sse-starlette types shutdown_event as an anyio.Event but only calls its set(), which Drain has
            return EventSourceResponse(_sse(stream, state, call, record, drain), sep="\n",
                                       shutdown_event=drain,  # type: ignore[arg-type]
                                       shutdown_grace_period=drain.grace + 1)  # ours ends the stream first
        with _rows_named(rows_field, call.fields):
            result = await _unless_disconnected(request, lambda: client.run_async(call.input, deadline=deadline),
                                                  drain)
        if result is _GONE:
            record.aborted()
            return Response(status_code=499)
        record.result(result)
        rid = new_id(kind)
        echo = _echo(body, call)
        body_out = (chat_response(result, name, rid, echo) if kind == "chat" else
                    completion_response(result, name, rid, echo))
        return JSONResponse(body_out)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "completion")

    _responses_routes(router, served, metrics, request_timeout, drain)
    _embeddings_route(router, served, metrics, request_timeout, drain)

    @router.get("/models")
    async def list_models() -> Response:
        served.check_ready()  # 503 while loading
        return JSONResponse({"object": "list", "data": served.models()})

    @router.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        served.check_ready()
        return JSONResponse(served.describe(model_id))

    return router


def _messages_router(served: ModelRegistry, metrics: Metrics, api_key: str | None, request_timeout: float | None,
                     drain: Drain) -> APIRouter:
    """Anthropic's Messages API (:mod:`._anthropic`): ``POST /v1/messages`` and ``POST
    /v1/messages/count_tokens``, errors in Anthropic's shape, the key as ``x-api-key`` or Bearer."""
    router = APIRouter(prefix="/v1", route_class=_anthropic.AnthropicRoute,
                       dependencies=[Depends(_auth(api_key, "x-api-key"))])

    @router.post("/messages")
    async def create_message(request: Request) -> Response:
        arrival = time.perf_counter()
        body = await _body(request)
        keep_alive = body.pop("keep_alive", None)
        turn = _anthropic.turn(body)
        name, model = await served.pick(turn.prompt.model, "generate", keep_alive)
        client = model.client
        if turn.call.stream:  # message_start carries the prompt's tokens: counted first (0 with no tokenizer)
            tokens = 0 if model.tokenizer is None else await anyio.to_thread.run_sync(
                _anthropic.count_tokens, turn.prompt, model.tokenizer)
            record = _Recorder(metrics, name, turn.call, arrival)
            stream = await client.stream_async(turn.call.input, deadline=request_timeout)
            # sse-starlette types shutdown_event as an anyio.Event but only calls its set(), which Drain has
            return EventSourceResponse(_anthropic.events(stream, name, turn.stop_sequences, tokens, record, drain),
                                       sep="\n", shutdown_event=drain,  # type: ignore[arg-type]
                                       shutdown_grace_period=drain.grace + 1)
        record = _Recorder(metrics, name, turn.call, arrival)
        result = await _unless_disconnected(request, lambda: client.run_async(turn.call.input,
                                                                              deadline=request_timeout), drain)
        if result is _GONE:
            record.aborted()
            return Response(status_code=499)
        record.result(result)
        return JSONResponse(_anthropic.message(result, name, turn.stop_sequences))

    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        body = await _body(request)
        keep_alive = body.pop("keep_alive", None)
        prompt = _anthropic.prompt(body)
        _, model = await served.pick(prompt.model, "generate", keep_alive)
        return JSONResponse({"input_tokens": await anyio.to_thread.run_sync(_anthropic.count_tokens, prompt,
                                                                            model.tokenizer)})

    return router


def _responses_routes(router: APIRouter, served: ModelRegistry, metrics: Metrics, request_timeout: float | None,
                      drain: Drain) -> None:
    """OpenAI's Responses API on ``router``: ``POST /responses``, ``GET`` / ``DELETE /responses/{id}``."""
    responses = ResponsesAPI()  # this app's stored responses (previous_response_id, GET /v1/responses/{id})

    @router.post("/responses")
    async def create_response(request: Request) -> Response:
        arrival = time.perf_counter()
        body = await _body(request)
        keep_alive = body.pop("keep_alive", None)
        turn = responses.turn(body)
        name, model = await served.pick(body.get("model"), "generate", keep_alive)
        deadline = turn.call.deadline if turn.call.deadline is not None else request_timeout
        record = _Recorder(metrics, name, turn.call, arrival)
        if turn.call.stream:
            stream = await responses.stream(model.client, turn, deadline)
            # sse-starlette types shutdown_event as an anyio.Event but only calls its set(), which Drain has
            return EventSourceResponse(responses.events(stream, turn, name, record, drain), sep="\n",
                                       shutdown_event=drain,  # type: ignore[arg-type]
                                       shutdown_grace_period=drain.grace + 1)
        result = await _unless_disconnected(request, lambda: responses.run(model.client, turn, deadline), drain)
        if result is _GONE:
            record.aborted()
            return Response(status_code=499)
        record.result(result)
        return JSONResponse(responses.response(turn, name, result))

    @router.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return JSONResponse(responses.store.response(response_id))

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return JSONResponse(responses.store.delete(response_id))


def _embeddings_route(router: APIRouter, served: ModelRegistry, metrics: Metrics, request_timeout: float | None,
                      drain: Drain) -> None:
    """``POST /embeddings`` on ``router`` (an embedding model's; :mod:`._embeddings`)."""

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        arrival = time.perf_counter()
        body = await _body(request)
        keep_alive = body.pop("keep_alive", None)
        call = embedding_call(body)
        name, model = await served.pick(body.get("model"), "embed", keep_alive)
        try:
            with _rows_named("input"):
                result = await _unless_disconnected(
                    request, lambda: model.client.run_async(call.inputs, deadline=request_timeout), drain)
        except InvalidInput as exc:
            raise input_error(exc) from None
        if result is _GONE:
            return Response(status_code=499)
        metrics.embedded(name, [int(r["num_tokens"]) for r in result], time.perf_counter() - arrival)
        return JSONResponse(embedding_response(result, name, call.encoding_format))


def _token_router(served: ModelRegistry, api_key: str | None) -> APIRouter:
    """vLLM's ``/tokenize`` and ``/detokenize`` (behind the API key, as ``/v1``)."""
    router = APIRouter(dependencies=[Depends(_auth(api_key))])

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        body = await _body(request)
        name, model = await served.pick(body.get("model"))
        messages = messages_of(body) if "messages" in body else None
        return JSONResponse(await anyio.to_thread.run_sync(tokenize, body, name, model, messages))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        body = await _body(request)
        name, model = await served.pick(body.get("model"))
        return JSONResponse(await anyio.to_thread.run_sync(detokenize, body, name, model))

    return router


def _add_service_routes(app: FastAPI, served: ModelRegistry, metrics: Metrics) -> None:
    @app.get("/health")
    async def health() -> Response:
        if served.status != "ready":
            return JSONResponse(served.not_ready(), 503, {"Retry-After": str(RETRY_AFTER_S)})
        stats = await anyio.to_thread.run_sync(served.stats)
        stuck = served.stuck(stats)
        if stuck is not None:
            name, idle = stuck
            return JSONResponse({"status": "stuck", "model": name,
                                 "detail": f"{stats[name].rows_in_flight} rows in flight and no progress for "
                                           f"{idle:.1f} s"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        from .._version import __version__

        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await anyio.to_thread.run_sync(metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def chat_page() -> Response:
        return HTMLResponse(resources.files(__package__).joinpath("static/index.html").read_text("utf-8"))

    # The chat page's vendored libraries (static/vendor/README.md): only these names, served as is.
    vendored = {"marked.umd.js": "text/javascript; charset=utf-8", "purify.min.js": "text/javascript; charset=utf-8",
                "highlight.min.js": "text/javascript; charset=utf-8",
                "highlight-github.min.css": "text/css; charset=utf-8",
                "highlight-github-dark.min.css": "text/css; charset=utf-8"}

    @app.get("/static/{name}")
    async def chat_page_asset(name: str) -> Response:
        if name not in vendored:
            raise APIError(404, f"no static file {name!r:.80}", code="not_found")
        data = resources.files(__package__).joinpath("static", "vendor", name).read_bytes()
        return Response(data, media_type=vendored[name], headers={"Cache-Control": "public, max-age=3600"})


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object a POST carries; APIError 415 for another media type (a cross-origin HTML form
    may post ``text/plain`` without a CORS preflight), 400 for invalid JSON or a non-object, 499
    (not logged) when the client leaves before the body ends, 408 when it takes longer than the app's
    ``client_timeout`` to send it."""
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"the request body must be JSON (content-type: application/json), got {media!r:.80}",
                       code="unsupported_media_type")
    timeout = request.app.state.client_timeout
    try:
        with anyio.fail_after(timeout if timeout is not None else math.inf):
            raw = await request.body()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None  # the rest of the body would be read as a request
    except ClientDisconnect:  # the client left mid-body: nothing to answer, nothing to log
        raise APIError(499, "the client disconnected before sending its whole request", code="client_closed") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # Python's parser gives up past ~1,000 levels: no request needs that many
        raise APIError(400, "the request body is nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


_GONE = object()


async def _unless_disconnected(request: Request, run: Callable[[], Awaitable[Any]], drain: Drain) -> Any:
    """``await run()``, cancelled (which withdraws the request) when the client disconnects first:
    then ``_GONE``; or when the server's shutdown grace ends first: then APIError 503
    (``shutting_down``). What ``run`` raises is raised as is (not in an exception group)."""
    with drain.scope() as shutdown:
        outcome = await _race_disconnect(request, run)
    if shutdown.cancelled_caught:
        raise ShuttingDown(drain.grace).error()
    return outcome


async def _race_disconnect(request: Request, run: Callable[[], Awaitable[Any]]) -> Any:
    outcome: list[Any] = []

    async def watch(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        outcome.append(_GONE)
        scope.cancel()

    async def call(scope: anyio.CancelScope) -> None:
        try:
            outcome.append(await run())
        except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
            outcome.append(exc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        tg.start_soon(call, tg.cancel_scope)
    if not outcome:  # cancelled from outside (the shutdown scope)
        return _GONE
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


class _Recorder:
    """Feeds a request's finished completions to the metrics (once each) and counts the rest as
    aborted when the request ends early."""

    def __init__(self, metrics: Metrics, model: str, call: Call, arrival: float) -> None:
        self._metrics, self._model, self._call, self._arrival = metrics, model, call, arrival
        self._prompts_seen: set[int] = set()
        self._finished = 0
        first = call.input[0] if isinstance(call.input, list) else call.input
        max_tokens = first.get("max_new_tokens")
        metrics.arrived(model, call.n, max_tokens if isinstance(max_tokens, int) else None)

    def final(self, choice: int, final: Mapping[str, Any]) -> None:
        prompt = choice // self._call.n
        first = prompt not in self._prompts_seen
        self._prompts_seen.add(prompt)
        self._finished += 1
        self._metrics.finished(self._model, final, time.perf_counter() - self._arrival, first)

    def result(self, result: Any) -> None:
        for p, r in enumerate(result if isinstance(result, list) else [result]):
            for i, entry in enumerate(r["results"]):
                self.final(p * self._call.n + i, entry)

    def aborted(self) -> None:
        self._metrics.aborted(self._model, self._call.prompts * self._call.n - self._finished)


def _echo(body: dict[str, Any], call: Call) -> Echo:
    """What ``call`` asked of its prompts (completions ``echo``, vLLM's ``prompt_logprobs``)."""
    items = call.input if isinstance(call.input, list) else [call.input]
    prompts = tuple(item["text"] for item in items) if call.echo else ()
    return Echo(prompts, call.echo and bool(items[0].get("logprobs")), body.get("prompt_logprobs") is not None)


async def _sse(stream: AsyncStream, state: StreamState, call: Call, record: _Recorder,
               drain: Drain) -> AsyncIterator[str]:
    """The SSE data of a streamed response. Leaving early (the client disconnected: sse-starlette
    cancels this generator) closes the stream, which withdraws the request; so does the end of the
    shutdown grace period, after an error event."""
    try:
        async with stream:
            for chunk in state.first_chunks():
                yield chunk
            try:
                async for ev in stream_events(stream, drain, record, state.is_list, state.n):
                    for chunk in state.chunks(ev):
                        yield chunk
            except ShuttingDown as exc:
                yield json.dumps(exc.error().body(), ensure_ascii=False)
            except (ServingError, ValueError) as exc:  # headers are sent: the error goes in the stream
                yield json.dumps(from_exception(exc).body(), ensure_ascii=False)
            if call.include_usage and state.done:
                yield state.usage_chunk()
            yield "[DONE]"
    finally:
        record.aborted()
