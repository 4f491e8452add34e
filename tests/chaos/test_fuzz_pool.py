"""Bad text-generation requests through a ServingPool of one worker (tiny seeded 4-bit Qwen3): the
requests of tests/chaos/test_fuzz_text_generation.py, fewer of them. Client preprocessing runs in
the worker, so each bad request's error crosses the process boundary: it must come back as the
same type with the same message as the local preprocessing raises (a ValueError stays a
ValueError), or as TypeError for an input the wire cannot carry (a lone surrogate; documented in
``ServingPool.run``). Good requests sent with them get exactly their solo results, and the worker
never crashes or restarts (issue 12)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_serving.models.text_generation import GenerationOptions, from_mlx4bit
from mlx_serving.models.text_generation._inputs import max_bytes_per_token, preprocess
from mlx_serving.serving import ServingPool
from mlx_serving.serving._pool._wire import encode_payload
from mlx_serving.tokenization import Tokenizer

from test_fuzz_text_generation import GOOD, OPTIONS, _key, _wait_idle, bad_input, fire  # tests/chaos, on sys.path


@pytest.fixture(scope="module")
def pool(tiny_ckpt):
    with ServingPool(functools.partial(from_mlx4bit, tiny_ckpt, **OPTIONS), workers=1) as p:
        yield p


@pytest.fixture(scope="module")
def solo(pool) -> list[tuple[str, int, str]]:
    return [_key(pool.run(g, deadline=60)) for g in GOOD]


@pytest.fixture(scope="module")
def local_error(tiny_ckpt):
    """What the worker's preprocessing raises for ``value``, computed here: (type, message)."""
    tokenizer = Tokenizer.from_dir(tiny_ckpt)
    opts, per_token = GenerationOptions(**OPTIONS), max_bytes_per_token(tokenizer)

    def error(value: Any) -> tuple[type[BaseException], str | None]:
        try:
            encode_payload(value)
        except TypeError:
            return TypeError, None  # never leaves the caller
        try:
            preprocess(value, tokenizer, opts, per_token)
        except Exception as exc:  # noqa: BLE001 - compared with the pool's
            return type(exc), str(exc)
        raise AssertionError(f"{value!r:.200} is not a bad request")

    return error


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(bad=st.lists(bad_input, min_size=1, max_size=4), good=st.lists(st.integers(0, len(GOOD) - 1), min_size=1,
                                                                       max_size=3))
def test_bad_requests_fail_alone_across_the_process_boundary(pool, solo, local_error, bad, good):
    def check(value: Any, exc: BaseException) -> str | None:
        kind, message = local_error(value)
        if kind is TypeError:
            return None if type(exc) is TypeError else f"raised {type(exc).__name__}, not TypeError (not sendable)"
        if not issubclass(kind, ValueError):
            return f"local preprocessing raised {kind.__name__}: {message}"
        if type(exc) is not kind or str(exc) != message:
            return f"the pool raised {type(exc).__name__}: {exc!s:.200}; locally {kind.__name__}: {message:.200}"
        return None

    answers = fire(lambda value, deadline: pool.run(value, deadline=deadline), bad, good, check)
    assert answers == {i: solo[g] for i, g in enumerate(good)}
    stats = _wait_idle(pool.stats)
    assert (stats.running, stats.queued, stats.failed) == (0, 0, 0), stats
    (health,) = pool.health()
    assert (health.state, health.alive, health.restarts) == ("ready", True, 0), health
