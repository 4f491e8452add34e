"""SamplingParams: the issue-14 options (contract A) validate with a ValueError naming the field."""

from __future__ import annotations

import pickle

import pytest

from mlx_serving.models.generation.events import FinishReason, SeqEvent
from mlx_serving.models.generation.sampling import MAX_LOGPROBS, SamplingParams


def test_defaults_are_off() -> None:
    p = SamplingParams()
    assert (p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0, 0.0, 1.0, 0.0, 0.0)
    assert (p.logit_bias, p.min_tokens, p.logprobs, p.grammar) == ((), 0, None, None)


def test_logit_bias_mapping_is_normalized_and_picklable() -> None:
    p = SamplingParams(logit_bias={7: 2, 3: -1.5}, top_k=4, logprobs=MAX_LOGPROBS, grammar="g")
    assert p.logit_bias == ((3, -1.5), (7, 2.0))
    assert all(isinstance(b, float) for _, b in p.logit_bias)
    assert SamplingParams(logit_bias=[(7, 2), (3, -1.5)]) == SamplingParams(logit_bias={3: -1.5, 7: 2.0})
    assert pickle.loads(pickle.dumps(p)) == p


@pytest.mark.parametrize("field, value", [
    ("top_k", -1), ("top_k", 1.0), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.01), ("min_p", float("nan")), ("min_p", True),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", False),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "1"),
    ("frequency_penalty", -3), ("frequency_penalty", float("nan")), ("frequency_penalty", True),
    ("logit_bias", {1: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}), ("logit_bias", {1: True}),
    ("logit_bias", {1.0: 1.0}), ("logit_bias", 5), ("logit_bias", [(1, 1.0), (1, 2.0)]), ("logit_bias", [(1,)]),
    ("min_tokens", -1), ("min_tokens", 101), ("min_tokens", True), ("min_tokens", 1.0),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", True), ("logprobs", 1.0),
    ("grammar", 3), ("grammar", b"x"),
    ("eos_token_ids", [1.5]), ("eos_token_ids", [True]), ("eos_token_ids", 3),
])
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bounds_are_inclusive() -> None:
    p = SamplingParams(max_new_tokens=5, min_tokens=5, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                       logit_bias={0: -100, 1: 100}, logprobs=0, top_k=1)
    assert (p.min_tokens, p.min_p, p.presence_penalty, p.frequency_penalty, p.logprobs) == (5, 1.0, -2.0, 2.0, 0)


def test_finish_reasons_and_event_fields() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "cancelled", "tool_calls"]
    assert str(FinishReason.CANCELLED) == "cancelled" and FinishReason.TOOL_CALLS == "tool_calls"
    ev = SeqEvent(1, 2, 0.5)
    assert ev.logprob is None and ev.top_logprobs is None
    ev = SeqEvent(1, 2, 0.5, None, -0.25, ((2, -0.25), (9, -2.0)))
    assert ev.top_logprobs[1] == (9, -2.0)
