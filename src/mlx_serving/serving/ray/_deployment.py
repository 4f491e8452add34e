"""``ServingDeployment``: a Ray Serve deployment wrapping one started Serving per replica.

Each replica builds the serving with ``factory`` and starts it (``Serving.start(serving,
**process_options)``): requests routed to a replica batch together inside its serving, so
``@serve.batch`` is not used on top. Verbs, through a ``DeploymentHandle``:

- ``handle.run.remote(input, deadline=None)``: one request, its result;
- ``handle.options(stream=True).stream.remote(input, deadline=None)``: a streaming response,
  one item per item of ``stream_async``;
- ``handle.stats.remote()``: the replica's ``ServingStats``;
- HTTP (when the app has a route): ``POST`` a JSON body, the JSON result back; ``503`` when the
  serving refused it (``ServingOverloaded``), ``504`` past ``?deadline=`` seconds.

A caller that cancels its response (``response.cancel()``, an HTTP client that disconnects)
cancels the replica's task, so the serving drops the request's rows. Back-pressure: Serve sends a
replica at most ``max_ongoing_requests`` requests (``serving_app`` sets it to the serving's
``max_queue`` when given); the rest wait in Serve's queue (``max_queued_requests`` bounds it) rather
than in the serving. ``check_health`` fails when the serving holds rows but has made no progress
(no batch, step or finished request) for ``stuck_after`` seconds, and Serve replaces the replica.
The serving's stats are exported as ``ray.serve.metrics`` gauges (``mlx_serving_*``), refreshed at
every health check and stats call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve import metrics

from .._errors import DeadlineExceeded, ServingOverloaded
from .._pool._worker import Factory, resolve_factory
from .._progress import Progress  # the stuck rule the HTTP server's /health uses too
from .._telemetry import ServingStats

__all__ = ["DEFAULT_MAX_ONGOING", "Replica", "ServingDeployment", "queue_in_serve", "serving_app"]

_GAUGES = ("queued", "running", "rows_in_flight", "batches_run", "steps_run", "mean_batch_fill", "completed",
           "failed", "cancelled", "expired", "rejected")
DEFAULT_MAX_ONGOING = 64  # Serve's own default (5) would cap each replica's batches at 5 rows


class Replica:
    """A started Serving in a Serve replica: the handle verbs, ``check_health`` and the gauges
    (shared by ``ServingDeployment`` and the OpenAI ingress, ``mlx_serving.server.ray.OpenAIDeployment``).
    Defines no ``__call__``: ``serve.ingress`` refuses a class that has one."""

    def __init__(self, factory: Factory, process_options: dict[str, Any] | None = None, *,
                 stuck_after: float = 60.0) -> None:
        from .._serving import Serving

        serving = resolve_factory(factory)()
        if not isinstance(serving, Serving):
            raise TypeError(f"the deployment's factory must return a Serving, got {type(serving).__name__}")
        self._handle = Serving.start(serving, **(process_options or {}))
        self._progress = Progress(stuck_after)
        self._gauges = {
            name: metrics.Gauge(f"mlx_serving_{name}", description=f"the replica's Serving: {name} (ServingStats)")
            for name in _GAUGES
        }

    async def run(self, input: object, deadline: float | None = None) -> object:
        """One request: ``run_async`` on the replica's serving."""
        return await self._handle.run_async(input, deadline=deadline)

    async def stream(self, input: object, deadline: float | None = None) -> AsyncIterator[object]:
        """Streaming response: the items of ``stream_async``."""
        async with await self._handle.stream_async(input, deadline=deadline) as stream:
            async for item in stream:
                yield item

    async def stats(self) -> ServingStats:
        """The serving's ``ServingStats`` (also exported as gauges)."""
        return self._record()

    def check_health(self) -> None:
        """Raise when the serving holds rows and made no progress for ``stuck_after`` s."""
        stats = self._record()
        idle = self._progress.stuck_for(stats)
        if idle is not None:
            raise RuntimeError(
                f"the replica's serving is stuck: {stats.rows_in_flight} rows in flight and no batch, step "
                f"or finished request for {idle:.1f} s (stuck_after {self._progress.stuck_after} s)"
            )

    def _record(self) -> ServingStats:
        stats = self._handle.stats()
        for name, gauge in self._gauges.items():
            gauge.set(float(getattr(stats, name)))
        return stats

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()


class _ServingReplica(Replica):
    """One replica: a started Serving (see the module docstring)."""

    async def __call__(self, request: Any) -> Any:
        """HTTP: the JSON body in, the JSON result out (503 overloaded, 504 deadline)."""
        from starlette.responses import JSONResponse

        deadline = request.query_params.get("deadline")
        try:
            result = await self._handle.run_async(await request.json(),
                                                  deadline=None if deadline is None else float(deadline))
        except ServingOverloaded as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        except DeadlineExceeded as exc:
            return JSONResponse({"error": str(exc)}, status_code=504)
        return JSONResponse(result)


ServingDeployment = serve.deployment(name="ServingDeployment", max_ongoing_requests=DEFAULT_MAX_ONGOING)(
    _ServingReplica
)


def serving_app(factory: Factory, *, process_options: dict[str, Any] | None = None, stuck_after: float = 60.0,
                **deployment_options: object) -> serve.Application:
    """``ServingDeployment`` bound to ``factory``, with ``max_ongoing_requests`` defaulting to the
    serving's ``max_queue`` (when given) so that Serve, not the serving, queues the excess;
    ``deployment_options`` go to ``.options()`` (``num_replicas``, ``ray_actor_options``,
    ``max_queued_requests``, ``health_check_period_s``, ...)."""
    options = queue_in_serve(process_options, deployment_options)
    return ServingDeployment.options(**options).bind(factory, process_options, stuck_after=stuck_after)


def queue_in_serve(process_options: dict[str, Any] | None, deployment_options: dict[str, Any]) -> dict[str, Any]:
    """``deployment_options`` with ``max_ongoing_requests`` defaulting to the serving's ``max_queue``."""
    max_queue = (process_options or {}).get("max_queue")
    if max_queue is None:
        return deployment_options
    return {"max_ongoing_requests": max_queue, **deployment_options}
