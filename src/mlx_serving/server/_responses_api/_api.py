"""``ResponsesAPI``: the Responses routes' logic over one app's :class:`~._store.ResponseStore`.

The app maps a body (:meth:`ResponsesAPI.turn`), runs or streams it on a client, and answers the
response object (:meth:`ResponsesAPI.response`) or the events (:meth:`ResponsesAPI.events`). Errors
are :class:`~.._errors.APIError` naming the Responses field; the serving's ``ValueError`` is
renamed likewise.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from ...serving import AsyncStream, Client
from .._responses import Result
from .._shutdown import Drain
from . import _output, _request, _stream
from ._items import Json
from ._request import Turn
from ._store import ResponseStore
from ._stream import Recorder

__all__ = ["ResponsesAPI"]


class ResponsesAPI:
    """The Responses routes' logic over one app's :class:`ResponseStore` (``store``)."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store if store is not None else ResponseStore()

    def turn(self, body: Json) -> Turn:
        """Map a ``POST /v1/responses`` body (see :mod:`._request`). Raises APIError 400 naming the
        Responses field at fault (``previous_response_id`` when that response is not stored)."""
        return _request.turn(body, self.store)

    async def run(self, client: Client, turn: Turn, deadline: float | None) -> Result:
        """``client.run_async`` of the turn; the serving's ValueError as an APIError naming the Responses field."""
        try:
            return await client.run_async(turn.call.input, deadline=deadline)
        except ValueError as exc:
            raise _request.renamed(exc) from None

    async def stream(self, client: Client, turn: Turn, deadline: float | None) -> AsyncStream:
        """``client.stream_async`` of the turn (errors as :meth:`run`)."""
        try:
            return await client.stream_async(turn.call.input, deadline=deadline)
        except ValueError as exc:
            raise _request.renamed(exc) from None

    def response(self, turn: Turn, model: str, result: Result) -> Json:
        """The ``response`` object of a finished (non-list) result, stored when the turn asks."""
        return _output.finish(_output.response(turn, model, result), turn, self.store)

    def events(self, stream: AsyncStream, turn: Turn, model: str, record: Recorder,
               drain: Drain) -> AsyncIterator[Json]:
        """The SSE events (``{"event", "data"}``) of a streamed turn (see :mod:`._stream`)."""
        return _stream.events(stream, turn, model, record, drain, self.store)
