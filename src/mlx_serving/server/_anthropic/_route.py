"""``AnthropicRoute``: a FastAPI route whose errors answer in Anthropic's shape.

Whatever its handler or its dependencies (the API key check) raise becomes
``{"type": "error", "error": {"type", "message"}}`` with the status :func:`._output.error` gives
(serving input keys named as the Messages API names them); unexpected errors (500) are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...serving import ServingError
from .._errors import APIError
from ._output import error, error_body

__all__ = ["AnthropicRoute"]

_log = logging.getLogger("mlx_serving.server")


class AnthropicRoute(APIRoute):
    """An ``APIRoute`` answering its errors in Anthropic's shape (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except StarletteHTTPException as exc:
                failure = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
            except Exception as exc:  # noqa: BLE001 - every error is answered, in Anthropic's shape
                failure = error(exc)
                if failure.status >= 500 and not isinstance(exc, (APIError, ServingError)):
                    _log.exception("request failed", exc_info=exc)
            return JSONResponse(error_body(failure), failure.status, failure.headers)

        return route
