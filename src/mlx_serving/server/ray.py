"""``OpenAIDeployment``: the OpenAI-compatible server (``mlx_serving.server.create_app``) as the HTTP
ingress of a Ray Serve deployment, one started Serving per replica.

Each replica builds the serving with ``factory``, starts it (``Serving.start(serving,
**process_options)``) and then builds its own FastAPI app over that started handle
(``create_app({model: handle}, ...)``, through Serve's late-bound ingress hook
``__serve_build_asgi_app__``). Serve's HTTP proxy spreads the requests over the replicas; inside a
replica they batch in its serving, so ``@serve.batch`` is not used on top. Routes, request fields,
errors and statuses are the server's (docs/server.md): ``POST /v1/chat/completions``, ``POST
/v1/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /``.

Per replica: ``/health`` and ``/metrics`` answer for the replica the proxy routed that request to
(use the ``mlx_serving_*`` Serve gauges or Ray's Prometheus export for the whole deployment). The
handle verbs of ``ServingDeployment`` (``run``, ``stream``, ``stats``), ``check_health`` and the
gauges are the same (``serving.ray._deployment.Replica``). A client that disconnects makes Serve cancel the
replica's request, and the server withdraws its rows from the serving.
"""

from __future__ import annotations

import inspect
from typing import Any, TypedDict

import ray
from ray import serve

from ..serving._pool._worker import Factory
from ..serving.ray._deployment import DEFAULT_MAX_ONGOING, Replica, queue_in_serve

__all__ = ["OpenAIDeployment", "openai_app"]

if inspect.signature(serve.ingress).parameters["app"].default is not None:  # an older Serve: no late binding
    raise ImportError(f"the OpenAI ingress needs Ray Serve's late-bound ingress (serve.ingress() with no app, then "
                      f"__serve_build_asgi_app__), which ray {ray.__version__} lacks: upgrade ray[serve] "
                      f"(tested with 2.60)")


class _AppOptions(TypedDict):
    """The ``create_app`` options a replica passes on."""

    api_key: str | None
    request_timeout: float | None
    stuck_after: float


class _OpenAIReplica(Replica):
    """One replica: a started Serving and the server's app over it (see the module docstring)."""

    def __init__(self, factory: Factory, process_options: dict[str, Any] | None = None, *, model: str,
                 api_key: str | None = None, request_timeout: float | None = None,
                 stuck_after: float = 60.0) -> None:
        _check_model(model)
        super().__init__(factory, process_options, stuck_after=stuck_after)
        self._app_options: _AppOptions = {"api_key": api_key, "request_timeout": request_timeout,
                                           "stuck_after": stuck_after}
        self._model = model

    def __serve_build_asgi_app__(self) -> Any:
        """The server's FastAPI app over this replica's started handle (called by Serve once,
        after ``__init__``)."""
        from ._app import create_app

        return create_app({self._model: self._handle}, **self._app_options)


OpenAIDeployment = serve.deployment(name="OpenAIDeployment", max_ongoing_requests=DEFAULT_MAX_ONGOING)(
    serve.ingress()(_OpenAIReplica)
)


def openai_app(factory: Factory, *, model: str, process_options: dict[str, Any] | None = None,
               api_key: str | None = None, request_timeout: float | None = None, stuck_after: float = 60.0,
               **deployment_options: object) -> serve.Application:
    """``OpenAIDeployment`` bound to ``factory``: the OpenAI API over Serve HTTP.

    model: the model's id in the API (``/v1/models``, a request's ``model``).
    process_options: ``Serving.start`` options of every replica's serving (``batch_size``,
      ``max_queue``, ...); ``max_ongoing_requests`` defaults to its ``max_queue`` when given, so
      that Serve, not the serving, queues the excess (else 64 per replica).
    api_key, request_timeout, stuck_after: ``create_app``'s (``stuck_after`` also bounds
      ``check_health``: Serve replaces a replica whose serving holds rows without progress that long).
    deployment_options: ``.options()`` of the deployment (``num_replicas``, ``ray_actor_options``,
      ``autoscaling_config``, ``max_queued_requests``, ...).

    Returns the bound application, for ``serve.run(app, route_prefix="/")``. Raises ValueError for
    an empty ``model`` (here, before any replica starts).
    """
    _check_model(model)
    options = queue_in_serve(process_options, deployment_options)
    return OpenAIDeployment.options(**options).bind(factory, process_options, model=model, api_key=api_key,
                                                    request_timeout=request_timeout, stuck_after=stuck_after)


def _check_model(model: object) -> None:
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty str (the model's id in the API), got {model!r}")
