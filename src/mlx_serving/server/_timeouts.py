"""``client_timeout_protocol``: uvicorn's HTTP protocol with a deadline on a client's request head.

uvicorn closes a kept-alive connection that stays idle (``timeout_keep_alive``), but a connection
that never sends a request, or sends its headers a byte at a time, is held for as long as the
client likes (400 idle clients were held 60 s, each a socket and a protocol object). The protocol
returned here closes a connection whose next request head has not arrived ``seconds`` after the
connection opened or after its previous response ended; a request under way is never cut (its
body's deadline is the app's ``client_timeout``, a 408).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["client_timeout_protocol"]


class _HeadDeadline:
    """A mixin over uvicorn's h11 or httptools protocol (both keep the request under way in
    ``cycle`` and call ``on_response_complete`` after each response)."""

    head_timeout: float
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    # Each ``super()`` call below reaches the uvicorn protocol class this mixin is combined with,
    # which mypy cannot see from the mixin: hence ``type: ignore[misc]`` on them.
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        waiting_after = self.cycle  # the request before the head awaited (None: a new connection)
        self._head_timer = self.loop.call_later(self.head_timeout, self._expire, waiting_after)

    def _disarm(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()

    def _expire(self, waiting_after: Any) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self.cycle is waiting_after and idle and not self.transport.is_closing():  # no request began
            self.transport.close()


def client_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's default HTTP protocol class (httptools if installed, else h11) whose connections
    close when a request head takes longer than ``seconds`` (> 0) to arrive. Pass it as
    ``uvicorn.Config(http=...)``. Raises ValueError for ``seconds <= 0``."""
    if not seconds > 0:
        raise ValueError(f"the client timeout must be > 0 seconds, got {seconds!r}")
    return type("ClientTimeoutProtocol", (_HeadDeadline, AutoHTTPProtocol), {"head_timeout": float(seconds)})
