"""How ``mlx-serving serve`` ends and what it does to slow clients, as a user meets it: a subprocess
and real signals. SIGTERM lets an open stream finish within ``--shutdown-grace``; past it the stream
gets an error event (``shutting_down``) and ``[DONE]``. A connection that sends no request, or its
headers too slowly, is closed after ``--client-timeout``; a body that does not arrive gets 408."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

import httpx

from server_helpers import metric_samples
from test_serve_cli import serve_process


def _serve(ckpt: Path, *options: str) -> AbstractContextManager[tuple[str, subprocess.Popen]]:
    return serve_process(ckpt, "--max-len", "2048", "--log-level", "warning", *options)


def _stream_through_sigterm(url: str, process: subprocess.Popen, max_tokens: int) -> list[str]:
    """A streamed completion (EOS ignored: exactly ``max_tokens``); SIGTERM after its first two
    chunks; every ``data:`` payload it received."""
    body = {"prompt": "once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    payloads = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                payloads.append(line.removeprefix("data:").strip())
                if len(payloads) == 2:
                    process.send_signal(signal.SIGTERM)
    return payloads


def test_sigterm_lets_an_open_stream_finish_within_the_grace(tiny_ckpt: Path):
    with _serve(tiny_ckpt, "--shutdown-grace", "60") as (url, process):
        payloads = _stream_through_sigterm(url, process, max_tokens=200)
        assert process.wait(60) == -signal.SIGTERM, process.stderr.read()  # uvicorn re-raises it once done
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in c for c in chunks)  # no error event (the sampled text itself may say "error")


def test_sigterm_ends_a_stream_past_the_grace_with_an_error_event(tiny_ckpt: Path):
    with _serve(tiny_ckpt, "--shutdown-grace", "0.5") as (url, process):
        payloads = _stream_through_sigterm(url, process, max_tokens=2000)  # far longer than the grace
        assert process.wait(60) == -signal.SIGTERM, process.stderr.read()  # uvicorn re-raises it once done
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    texts = [json.loads(p)["choices"][0] for p in payloads[:-2]]
    assert 2 <= len(texts) < 2000 and all(c["finish_reason"] is None for c in texts)


def _running(url: str) -> float:
    return sum(v for (name, _), v in metric_samples(url).items() if name == "mlx_serving:num_requests_running")


def test_sigterm_ends_a_whole_response_past_the_grace_with_a_503(tiny_ckpt: Path):
    """A non-streamed completion still running when the grace ends gets OpenAI's error shape (503,
    ``shutting_down``), not a bare 500 from uvicorn's forced cancel, and no traceback is logged."""
    body = {"prompt": "once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with _serve(tiny_ckpt, "--shutdown-grace", "0.5") as (url, process):
        with ThreadPoolExecutor(1) as pool:
            response = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            while _running(url) != 1:
                assert not response.done(), response.result().text
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            answer = response.result()
        assert process.wait(60) == -signal.SIGTERM
        log = process.stderr.read()
    assert answer.status_code == 503, (answer.text, log)
    error = answer.json()["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    assert "Traceback" not in log and "CancelledError" not in log, log


def _closed_by_server(sock: socket.socket) -> bytes:
    """What the server sends before it closes ``sock`` (AssertionError if it keeps it open 20 s)."""
    sock.settimeout(20)
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


def test_idle_and_slow_clients_are_timed_out(tiny_ckpt: Path):
    with _serve(tiny_ckpt, "--client-timeout", "1") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as idle, \
                socket.create_connection(("127.0.0.1", port)) as slow_head, \
                socket.create_connection(("127.0.0.1", port)) as slow_body:
            slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100\r\n\r\n{\"prompt\":")  # 90 bytes never come
            assert _closed_by_server(idle) == b""
            assert _closed_by_server(slow_head) == b""
            answer = _closed_by_server(slow_body)  # after the 408, the next head's deadline closes it
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"did not arrive within 1 s" in answer and b"connection: close" in answer.lower()
        # the server is fine for everyone else
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
