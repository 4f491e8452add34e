"""``ResponseStore``: the responses an app keeps (``store``, default true) for ``previous_response_id``
and ``GET`` / ``DELETE /v1/responses/{id}``.

In memory, least recently used first out, bounded by count and characters. Each entry holds the
response object and its whole conversation (:class:`~._items.Item` s: the earlier turns, its input,
then its output). An unknown id is :class:`~.._errors.APIError` 400 naming
``previous_response_id`` when a request continues it, 404 when it is retrieved or deleted.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from .._errors import APIError
from ._items import Item, Json

__all__ = ["ResponseStore"]


@dataclass
class _Stored:
    response: Json
    items: list[Item]  # the conversation: its input items (with the earlier turns), then its output
    chars: int


class ResponseStore:
    """Stored responses, least recently used first out: at most ``max_responses`` of them holding at
    most ``max_chars`` characters together (a response's whole conversation counts, so what a chain
    holds is bounded too). One bigger than ``max_chars`` alone is not stored."""

    def __init__(self, max_responses: int = 1000, max_chars: int = 64 << 20) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: Json, items: list[Item]) -> None:
        chars = sum(it.chars() for it in items) + len(json.dumps(response, ensure_ascii=False))
        if chars > self.max_chars:
            return
        self._entries[response["id"]] = _Stored(response, items, chars)
        self.chars += chars
        while len(self._entries) > self.max_responses or self.chars > self.max_chars:
            self.chars -= self._entries.popitem(last=False)[1].chars

    def items(self, rid: str) -> list[Item]:
        """The conversation a ``previous_response_id`` continues; APIError 400 naming it when unknown."""
        entry = self._get(rid)
        if entry is None:
            raise APIError(400, f"Previous response with id '{rid:.100}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        return entry.items

    def response(self, rid: str) -> Json:
        """A stored response object; APIError 404 when unknown."""
        entry = self._get(rid)
        if entry is None:
            raise APIError(404, f"Response with id '{rid:.100}' not found.", "not_found_error", code="not_found")
        return entry.response

    def delete(self, rid: str) -> Json:
        """Forget a stored response: ``{"id", "object": "response", "deleted": true}``; APIError 404 when unknown."""
        self.response(rid)
        self.chars -= self._entries.pop(rid).chars
        return {"id": rid, "object": "response", "deleted": True}

    def _get(self, rid: str) -> _Stored | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry
