"""Ollama's ``keep_alive``: how long a model loaded on demand stays loaded once idle.

A value is a number of seconds (an int, a float or a numeric string), a Go-style duration string
(``"5m"``, ``"1h30m"``, ``"300ms"``; units ``ns``, ``us``, ``ms``, ``s``, ``m``, ``h``), or
``"never"``; a negative value means never (keep the model loaded), ``0`` unload it as soon as it is
idle. Parsed without FastAPI (the CLI's ``--keep-alive`` uses it at argument parsing).
"""

from __future__ import annotations

import math
import re

__all__ = ["NEVER", "parse_keep_alive"]

#: The parsed value of "never" or of any negative keep-alive: the model stays loaded.
NEVER = math.inf

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION = re.compile(rf"([+-]?)((?:{_PART.pattern})+)")


def parse_keep_alive(value: object) -> float:
    """Seconds to stay loaded once idle (>= 0), or ``NEVER`` (inf) for "never" or a negative value.
    Raises ValueError saying what is accepted for anything else (a bool, NaN, ``"5 minutes"``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _from_text(value.strip())
    else:
        seconds = math.nan
    if math.isnan(seconds):
        raise ValueError(f"keep_alive must be seconds (a number) or a duration like '5m', '1h30m' or 'never', "
                         f"got {value!r:.80}")
    return NEVER if seconds < 0 else seconds


def _from_text(text: str) -> float:
    """Seconds of a numeric string, a Go duration or "never"; NaN when it is none of them."""
    if text.lower() == "never":
        return NEVER
    try:
        return float(text)
    except ValueError:
        pass
    match = _DURATION.fullmatch(text)
    if match is None:
        return math.nan
    seconds = sum(float(number) * _UNITS[unit] for number, unit in _PART.findall(match.group(2)))
    return -seconds if match.group(1) == "-" else seconds
