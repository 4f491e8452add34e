"""The OpenAI-compatible HTTP server (``mlx-serving serve``): an optional extra,
``pip install 'mlx-serving[server]'``. The core never imports this package; importing it does not
import FastAPI (``create_app`` imports it on first use).

``create_app(models, *, api_key=None, request_timeout=None, stuck_after=60.0, allowed_origins=())``
builds the ASGI app over ``{name: Client or ServedModel}`` (docs/server.md); ``ServedModel`` (a
client with its context length and tokenizer) is importable without FastAPI.
"""

from __future__ import annotations

from typing import Any

from ._models import ServedModel

__all__ = ["ServedModel", "create_app"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """The server's ASGI app: see ``mlx_serving.server._app.create_app``."""
    from ._app import create_app as create

    return create(*args, **kwargs)
