"""Fixtures of the HTTP server tests: the tiny text-generation serving, a started handle over it
and a real uvicorn server (in a thread, on a free 127.0.0.1 port) serving ``create_app``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server extra (mlx-serving[server]) is not installed")

from mlx_serving import Serving, text_generation  # noqa: E402
from mlx_serving.server import create_app  # noqa: E402
from server_helpers import MODEL, OPTIONS, Server, serve  # noqa: E402


@pytest.fixture(scope="session")
def tiny_serving(tiny_ckpt: Path) -> Iterator[Serving]:
    serving = text_generation.from_mlx4bit(tiny_ckpt, **OPTIONS)
    yield serving
    serving.close()


@pytest.fixture(scope="module")
def server(tiny_serving: Serving) -> Iterator[Server]:
    with Serving.start(tiny_serving, max_queue=1024) as handle:
        app = create_app({MODEL: handle})
        with serve(app) as url:
            yield Server(url, handle, app)
