"""The type of a JSON value, as ``json.loads`` returns it and ``json.dumps`` takes it.

It lives in the serving layer, the bottom one, so that every layer (models, server) may import it.
Types only: nothing here runs.
"""

from __future__ import annotations

from typing import TypeAlias

__all__ = ["JSON", "JSONObject"]

#: Any JSON value: an object (str keys), an array, a string, a number, true / false, null.
JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
#: A JSON object (a parsed request body, a response dict).
JSONObject: TypeAlias = dict[str, JSON]
