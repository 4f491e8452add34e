"""The OpenAI-compatible HTTP server (``mlx-serving serve``): an optional extra,
``pip install 'mlx-serving[server]'``. The core never imports this package; importing it does not
import FastAPI (``create_app`` imports it on first use).

``create_app(models, *, api_key=None, request_timeout=None, stuck_after=60.0, allowed_origins=(),
shutdown_grace=10.0, client_timeout=30.0, keep_alive=None, max_loaded_models=None, load_wait=600.0)``
builds the ASGI app over ``{name: Client or ServedModel or Lazy}`` (docs/server.md; a ``Lazy`` is a
model loaded at its first request and unloaded once idle past its keep-alive); ``client_timeout_protocol(seconds)`` is uvicorn's HTTP protocol with a deadline on
each request head (uvicorn imported on first use); ``draining_server(config, app)`` is uvicorn's
server giving the app's whole (non-streamed) responses the shutdown grace too; ``ServedModel`` (a client with its context
length and tokenizer) and ``Lazy`` are importable without FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._models import Lazy, ServedModel

if TYPE_CHECKING:
    import asyncio

    import uvicorn
    from fastapi import FastAPI

    from ._app import create_app  # its signature, for the type checker; at run time, the wrapper below

__all__ = ["Lazy", "ServedModel", "client_timeout_protocol", "create_app", "draining_server"]


if not TYPE_CHECKING:
    def create_app(*args: object, **kwargs: object) -> FastAPI:
        """The server's ASGI app: see ``mlx_serving.server._app.create_app`` (the arguments are passed
        through)."""
        from ._app import create_app as create

        return create(*args, **kwargs)


def client_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol closing connections whose request head takes over ``seconds``: see
    ``mlx_serving.server._timeouts.client_timeout_protocol``."""
    from ._timeouts import client_timeout_protocol as protocol

    return protocol(seconds)


def draining_server(config: uvicorn.Config, app: FastAPI) -> uvicorn.Server:
    """``uvicorn.Server(config)`` that starts ``app``'s shutdown grace (``create_app``'s
    ``shutdown_grace``) at SIGTERM / Ctrl-C, so whole responses still running at its end get a 503
    ``shutting_down`` instead of uvicorn's bare 500: see ``mlx_serving.server._shutdown.DrainingServer``."""
    from ._shutdown import DrainingServer

    return DrainingServer(config, app.state.drain)
