"""Helpers of the HTTP server tests (imported by name: the test folder is on sys.path)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from mlx_serving import ServingHandle

MODEL = "tiny"
OPTIONS = dict(max_new_tokens=8, max_len=320, max_batch=32)


@dataclass
class Server:
    """A running server: its base URL (``http://127.0.0.1:PORT``), the handle it serves and the app."""

    url: str
    handle: ServingHandle
    app: object


@contextmanager
def serve(app: object) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread on a free loopback port; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 120.0, what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms until true; AssertionError naming ``what`` past ``timeout`` s
    (a cap that only ends a hang: a model load on a busy machine can take tens of seconds)."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET {url}/metrics`` (asserted 200, text exposition) as ``{(sample name, sorted labels): value}``."""
    response = httpx.get(f"{url}/metrics", timeout=120)  # httpx's own 5 s is short on a busy machine
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}
