"""Bad input at the generic serving's boundary: a typed error to that caller only, batchmates
unharmed, the serving unaffected (hypothesis draws the bad inputs and deadlines)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_serving.serving import Batch, Serving


def _preprocess(input):
    """Accepts a list of finite floats; anything else is the caller's ValueError."""
    if not isinstance(input, list) or not input or not all(isinstance(x, float) and math.isfinite(x) for x in input):
        raise ValueError(f"input must be a non-empty list of finite floats, got {input!r:.60}")
    return Batch.concatenate([np.asarray(input)]), len(input)


SERVING = (
    Serving.new(lambda batch: batch.data * 2)
    .client_preprocessing(_preprocess)
    .client_postprocessing(lambda out_meta, n: out_meta[0][:n].tolist())
)

bad_inputs = st.one_of(
    st.none(), st.integers(), st.text(max_size=5), st.just([]), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.one_of(st.just(float("nan")), st.just(float("inf")), st.text(max_size=2), st.booleans()), min_size=1, max_size=3),
)
bad_deadlines = st.one_of(
    st.just(float("nan")), st.just(float("inf")), st.just(-1.0), st.just(0), st.booleans(), st.text(max_size=3),
    st.just([1.0]), st.floats(max_value=0.0),
)


@pytest.fixture(scope="module")
def handle():
    with SERVING.start(batch_size=8, batch_timeout=0.002) as h:
        yield h


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.lists(st.one_of(bad_inputs.map(lambda x: ("input", x)), bad_deadlines.map(lambda d: ("deadline", d))),
                    min_size=1, max_size=6),
       good=st.lists(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=4), min_size=1, max_size=6))
def test_bad_requests_fail_alone(handle, bad, good):
    errors: list[BaseException] = []
    answers: dict[int, list[float]] = {}

    def bad_call(kind, value):
        try:
            if kind == "input":
                handle.run(value)
            else:
                handle.run([1.0], deadline=value)
        except ValueError as exc:  # the typed error, naming what is wrong
            assert ("deadline" in str(exc)) == (kind == "deadline")
            return
        except BaseException as exc:
            errors.append(exc)
            return
        errors.append(AssertionError(f"{kind} {value!r} was accepted"))

    def good_call(i, value):
        answers[i] = handle.run(value, deadline=30)

    threads = [threading.Thread(target=bad_call, args=b) for b in bad]
    threads += [threading.Thread(target=good_call, args=(i, g)) for i, g in enumerate(good)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert answers == {i: [2 * x for x in g] for i, g in enumerate(good)}
    stats = handle.stats()
    assert (stats.queued, stats.running, stats.failed) == (0, 0, 0)
