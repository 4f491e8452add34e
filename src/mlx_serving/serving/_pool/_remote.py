"""Exceptions across the process boundary: `ErrorInfo` out of a worker, an exception back in."""

from __future__ import annotations

import pickle
import traceback

from .._errors import RemoteError
from ._wire import ErrorInfo

__all__ = ["error_info", "rebuild_error"]


_MAX_CAUSES = 8


def error_info(exc: BaseException, depth: int = 0) -> ErrorInfo:
    """Describe ``exc`` for the wire: type name, message, traceback text, pickled form if any,
    and its ``__cause__`` chain (at most 8 deep)."""
    kind = type(exc)
    try:
        message = str(exc)
    except Exception:
        message = f"<str() of {kind.__qualname__} raised>"
    try:
        text = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
    except Exception:
        text = f"{kind.__qualname__}: {message}\n"
    try:
        pickled: bytes | None = pickle.dumps(exc, protocol=5)
    except Exception:
        pickled = None
    cause = exc.__cause__
    cause_info = error_info(cause, depth + 1) if cause is not None and depth < _MAX_CAUSES else None
    return ErrorInfo(f"{kind.__module__}.{kind.__qualname__}", message, text, pickled, cause_info)


def rebuild_error(info: ErrorInfo, where: str) -> Exception:
    """The exception to raise in the caller for ``info`` (``where`` names the worker).

    Each exception of the worker's ``__cause__`` chain comes back as itself when it unpickles to
    the same type (an ``Exception``; never a ``BaseException`` such as ``SystemExit``), otherwise
    as a `RemoteError`; the chain is rebuilt, and the last rebuilt exception gets a `RemoteError`
    holding the worker's whole traceback as its ``__cause__``. A `RemoteError` has the attributes
    ``type_name`` (``module.qualname``), ``message`` and ``remote_traceback``.
    """
    return _rebuild(info, where, info.traceback)


def _rebuild(info: ErrorInfo, where: str, full_traceback: str) -> Exception:
    exc = _unpickle(info)
    if exc is None:
        exc = _remote_error(info.type_name, info.message, full_traceback, where)
        if info.cause is not None:
            exc.__cause__ = _rebuild(info.cause, where, full_traceback)
        return exc
    if info.cause is not None:
        exc.__cause__ = _rebuild(info.cause, where, full_traceback)
    else:
        exc.__cause__ = _remote_error(info.type_name, info.message, full_traceback, where)
    return exc


def _unpickle(info: ErrorInfo) -> Exception | None:
    if info.pickled is None:
        return None
    try:
        exc = pickle.loads(info.pickled)
    except Exception:
        return None
    kind = type(exc)
    if not isinstance(exc, Exception) or f"{kind.__module__}.{kind.__qualname__}" != info.type_name:
        return None
    return exc


def _remote_error(type_name: str, message: str, traceback_text: str, where: str) -> RemoteError:
    remote = RemoteError(f"{type_name}: {message}\n\nTraceback in {where}:\n{traceback_text}")
    remote.type_name = type_name
    remote.message = message
    remote.remote_traceback = traceback_text
    return remote
