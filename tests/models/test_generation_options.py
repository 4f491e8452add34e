"""Issue 14 through the text-generation serving, caller side: every request option parsed into
SamplingParams / Prompt (or refused with a ValueError naming it), n completions as n rows with
derived seeds, and the outputs beyond text (logprobs with token text, per-completion results,
stream deltas with "index") built by the transducer from scripted token events. End to end through
run / stream / async / a pool: tests/models/test_generation_serving.py."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_serving.models.generation.events import FinishReason
from mlx_serving.models.text_generation import GenerationOptions, TokenEvent
from mlx_serving.models.text_generation._inputs import Prompt, RequestInfo, RowOutput, preprocess
from mlx_serving.models.text_generation._request import completion_seed
from mlx_serving.models.text_generation._schema import MAX_LOGIT_BIAS
from mlx_serving.models.text_generation._stream import GenerationTransducer, collect
from mlx_serving.tokenization import Tokenizer

OPTS = GenerationOptions(max_new_tokens=4, max_len=128)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


def _rows(tok: Tokenizer, input: Any) -> tuple[list[Prompt], RequestInfo]:
    batch, info = preprocess(input, tok, OPTS)
    return batch.rows(), info


# ---- inputs -> SamplingParams / Prompt ---------------------------------------------------------

def test_every_sampling_key_reaches_the_row_params(tok: Tokenizer) -> None:
    spec = {"text": "hi", "temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"11": 5, 7: -100.0}, "min_tokens": 2,
            "seed": 9, "logprobs": True, "top_logprobs": 3, "priority": -4, "max_new_tokens": 3}
    [row], info = _rows(tok, spec)
    p = row.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.8, 0.9, 40, 0.05)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.3, 0.5, -0.5)
    assert p.logit_bias == ((7, -100.0), (11, 5.0)) and p.min_tokens == 2 and p.seed == 9
    assert p.logprobs == 3 and p.max_new_tokens == 3 and p.grammar is None and row.priority == -4
    assert info.output(0) == RowOutput(input=0, index=0, logprobs=True, deltas=True)


def test_defaults_and_nulls_leave_every_new_option_off(tok: Tokenizer) -> None:
    nulls = {k: None for k in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                                "logit_bias", "min_tokens", "logprobs", "top_logprobs", "n", "response_format",
                                "priority")}
    for spec in ({"text": "hi"}, {"text": "hi", **nulls}):
        [row], info = _rows(tok, spec)
        p = row.params
        assert (p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0, 0, 1, 0, 0)
        assert (p.logit_bias, p.min_tokens, p.logprobs, p.grammar, row.priority) == ((), 0, None, None, 0)
        assert info.output(0) == RowOutput() and len(info.stops) == 1


def test_logprobs_without_top_logprobs_returns_the_chosen_token_only(tok: Tokenizer) -> None:
    assert _rows(tok, {"text": "hi", "logprobs": True})[0][0].params.logprobs == 0
    assert _rows(tok, {"text": "hi", "logprobs": False})[0][0].params.logprobs is None


@pytest.mark.parametrize("key, bad, match", [
    ("top_k", -1, "top_k"), ("top_k", 2.5, "top_k"), ("top_k", True, "top_k"), ("top_k", "5", "top_k"),
    ("min_p", 1.5, "min_p"), ("min_p", -0.1, "min_p"), ("min_p", float("nan"), "min_p"), ("min_p", [0.1], "min_p"),
    ("repetition_penalty", 0, "repetition_penalty"), ("repetition_penalty", float("inf"), "repetition_penalty"),
    ("repetition_penalty", False, "repetition_penalty"),
    ("presence_penalty", 2.5, "presence_penalty"), ("presence_penalty", "0", "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"), ("frequency_penalty", float("nan"), "frequency_penalty"),
    ("logit_bias", [[1, 2]], "logit_bias must be an object"), ("logit_bias", "x", "logit_bias"),
    ("logit_bias", {"abc": 1}, "logit_bias keys"), ("logit_bias", {"-1": 1}, "logit_bias keys"),
    ("logit_bias", {"٣": 1}, "logit_bias keys"),  # a non-ASCII digit
    ("logit_bias", {True: 1}, "logit_bias must be"), ("logit_bias", {1.0: 1}, "logit_bias must be"),
    ("logit_bias", {"151669": 1}, r"logit_bias keys must be token ids in \[0, 151669\)"),
    ("logit_bias", {"1" * 40: 1}, "logit_bias keys"),
    ("logit_bias", {"5": 1, 5: 2}, "logit_bias names token 5 twice"),
    ("logit_bias", {"5": 101}, r"biases numbers in \[-100, 100\]"), ("logit_bias", {"5": float("nan")}, "biases"),
    ("logit_bias", {"5": "1"}, "logit_bias must be"), ("logit_bias", {"5": True}, "logit_bias must be"),
    ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, "at most 1024"),
    ("min_tokens", 5, "min_tokens"), ("min_tokens", -1, "min_tokens"), ("min_tokens", 1.0, "min_tokens"),
    ("logprobs", 1, "logprobs must be true, false or null"), ("logprobs", "true", "logprobs"),
    ("top_logprobs", 21, "top_logprobs"), ("top_logprobs", -1, "top_logprobs"), ("top_logprobs", True, "top_logprobs"),
    ("top_logprobs", 2.0, "top_logprobs"),
    ("n", 0, "n must be"), ("n", 17, "n must be"), ("n", True, "n must be"), ("n", 2.0, "n must be"),
    ("n", "2", "n must be"),
    ("priority", True, "priority"), ("priority", 1.5, "priority"), ("priority", 2**63, "priority"),
    ("priority", "1", "priority"),
    ("response_format", "json", "response_format"), ("response_format", {"type": "nope"}, "response_format"),
    ("response_format", {"type": "json_schema"}, "response_format"),
])
def test_a_bad_value_raises_value_error_naming_the_option(tok: Tokenizer, key: str, bad: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        preprocess({"text": "hi", key: bad}, tok, OPTS)
    with pytest.raises(ValueError, match=f"input 1: .*{match}"):  # a list names the item
        preprocess(["ok", {"messages": HI, key: bad}], tok, OPTS)


def test_top_logprobs_needs_logprobs(tok: Tokenizer) -> None:
    for spec in ({"top_logprobs": 2}, {"top_logprobs": 0, "logprobs": False}):
        with pytest.raises(ValueError, match="top_logprobs needs logprobs: true"):
            preprocess({"text": "hi", **spec}, tok, OPTS)


def test_priority_bounds_and_min_tokens_against_the_request_max_new_tokens(tok: Tokenizer) -> None:
    rows, _ = _rows(tok, [{"text": "a", "priority": -(2**63)}, {"text": "b", "priority": 2**63 - 1}])
    assert [r.priority for r in rows] == [-(2**63), 2**63 - 1]
    assert _rows(tok, {"text": "a", "max_new_tokens": 10, "min_tokens": 10})[0][0].params.min_tokens == 10


# ---- n completions -------------------------------------------------------------------------------

def test_n_completions_become_n_rows_with_derived_distinct_seeds(tok: Tokenizer) -> None:
    rows, info = _rows(tok, {"text": "hi", "n": 3, "seed": 5, "temperature": 1.0})
    seeds = [r.params.seed for r in rows]
    assert seeds == [completion_seed(5, i) for i in range(3)] and len(set(seeds)) == 3
    assert seeds[0] == int(np.random.SeedSequence([5, 0]).generate_state(1, np.uint64)[0])
    assert all(r.ids == rows[0].ids for r in rows)
    assert [(o.input, o.index, o.deltas) for o in info.outputs] == [(0, 0, True), (0, 1, True), (0, 2, True)]
    assert info.input_tokens == (len(rows[0].ids),) * 3 and info.num_inputs == 1


def test_seeds_differ_across_requests_and_unseeded_rows_stay_fresh(tok: Tokenizer) -> None:
    assert len({completion_seed(s, i) for s in (1, 2) for i in (0, 1)}) == 4  # seed + index would collide
    assert completion_seed(2**64 - 1, 15) < 2**64
    rows, _ = _rows(tok, {"text": "hi", "n": 2})
    assert [r.params.seed for r in rows] == [None, None]
    assert _rows(tok, {"text": "hi", "seed": 5})[0][0].params.seed == 5  # n = 1 keeps the seed


def test_a_list_input_expands_each_item_by_its_own_n(tok: Tokenizer) -> None:
    rows, info = _rows(tok, ["a", {"text": "b c", "n": 2, "stop": "x"}, {"text": "d", "n": 3}])
    assert [(o.input, o.index) for o in info.outputs] == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert info.stops == ((), ("x",), ("x",), (), (), ()) and info.num_inputs == 3
    assert [o.deltas for o in info.outputs] == [False, True, True, True, True, True]
    assert len(rows) == 6 and rows[1].ids == rows[2].ids != rows[0].ids


def test_chat_output_flags(tok: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    cases = [({"messages": HI}, (False, False)), ({"messages": HI, "enable_thinking": True}, (True, False)),
             ({"messages": HI, "enable_thinking": False}, (False, False)), ({"messages": HI, "tools": tools}, (False, True)),
             ({"messages": HI, "tools": []}, (False, False))]
    for spec, (reasoning, tools_on) in cases:
        out = _rows(tok, spec)[1].output(0)
        assert (out.reasoning, out.tools, out.deltas) == (reasoning, tools_on, reasoning or tools_on)


# ---- outputs from scripted events ----------------------------------------------------------------

def _events(ids: list[int], last: FinishReason | None, top: int | None = None) -> list[TokenEvent]:
    """Token events as the backend sends them: elapsed 1, 2, ... ms, made-up logprobs when ``top``."""
    out = []
    for k, i in enumerate(ids):
        lp = None if top is None else -0.5 * (k + 1)
        alts = None if top is None else tuple((i + a, lp - a) for a in range(top))
        out.append(TokenEvent(i, float(k + 1), last if k == len(ids) - 1 else None, lp, alts))
    return out


def _run(transducer: GenerationTransducer, feeds: list[tuple[int, TokenEvent]]) -> tuple[list[Any], list[int]]:
    items, stopped = [], []
    for row, ev in feeds:
        items += transducer.feed(row, ev)
        stopped += transducer.stop_rows()
    return items, stopped


def test_logprob_entries_carry_token_text_and_match_num_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(" alpha beta gamma") + [151645]  # ends with <|im_end|> (EOS)
    _, info = _rows(tok, {"text": "hi", "logprobs": True, "top_logprobs": 2})
    items, _ = _run(GenerationTransducer(tok, info), [(0, e) for e in _events(ids, FinishReason.STOP, top=2)])
    deltas, final = items[:-1], items[-1]
    assert all(d["index"] == 0 and len(d["logprobs"]) == 1 for d in deltas) and len(deltas) == len(ids)
    assert final == {"index": 0, "finish_reason": "stop", "num_tokens": len(ids),
                     "token_summary": {"input": info.input_tokens[0], "output": len(ids)}, "timing": final["timing"]}
    result = collect(items, info)["results"]
    assert len(result) == 1 and result[0]["generated_text"] == " alpha beta gamma"
    entries = result[0]["logprobs"]
    assert len(entries) == result[0]["num_tokens"] == len(ids)
    assert [e["token"] for e in entries] == [tok.decode([i]) for i in ids[:-1]] + ["<|im_end|>"]
    assert entries[1] == {"token_id": ids[1], "token": tok.decode([ids[1]]), "logprob": -1.0,
                          "top_logprobs": [{"token_id": ids[1], "token": tok.decode([ids[1]]), "logprob": -1.0},
                                           {"token_id": ids[1] + 1, "token": tok.decode([ids[1] + 1]),
                                            "logprob": -2.0}]}
    assert json.loads(json.dumps(result)) == result


def test_a_partial_character_token_has_replacement_text_and_no_top_logprobs_at_zero(tok: Tokenizer) -> None:
    ids = tok.encode("\U0001fae0")  # one emoji: several byte tokens
    assert len(ids) > 1
    _, info = _rows(tok, {"text": "hi", "logprobs": True})
    items, _ = _run(GenerationTransducer(tok, info), [(0, e) for e in _events(ids, FinishReason.LENGTH, top=0)])
    entries = collect(items, info)["results"][0]["logprobs"]
    assert "\ufffd" in entries[0]["token"] and all(e["top_logprobs"] == [] for e in entries)
    assert "".join(d.get("content", "") for d in items[:-1]) == "\U0001fae0"


def test_stop_string_with_logprobs_counts_up_to_the_stopping_token(tok: Tokenizer) -> None:
    ids = tok.encode(" alpha beta gamma delta")
    _, info = _rows(tok, {"text": "hi", "logprobs": True, "stop": "gamma"})
    transducer = GenerationTransducer(tok, info)
    items, stopped = _run(transducer, [(0, e) for e in _events(ids, None, top=1)])
    r = collect(items, info)["results"][0]
    assert stopped == [0] and r["generated_text"] == " alpha beta " and r["finish_reason"] == "stop"
    assert len(r["logprobs"]) == r["num_tokens"] < len(ids)


def test_n_completions_stream_with_index_and_collect_in_order(tok: Tokenizer) -> None:
    a, b = tok.encode(" one two"), tok.encode(" three")
    _, info = _rows(tok, [{"text": "x", "n": 2}, "plain"])
    transducer = GenerationTransducer(tok, info)
    ea, eb, ec = _events(a, FinishReason.LENGTH), _events(b, FinishReason.STOP), _events(b, FinishReason.STOP)
    feeds = [(1, eb[0]), (0, ea[0]), (2, ec[0]), (0, ea[1])]  # rows interleave; row 2 is input 1
    items, _ = _run(transducer, feeds)
    assert all(isinstance(it, tuple) for it in items)
    plain = [v for i, v in items if i == 1]
    assert plain[0] == " three" and plain[1]["finish_reason"] == "stop" and "index" not in plain[1]
    deltas0 = [v for i, v in items if i == 0 and "finish_reason" not in v]
    assert {d["index"] for d in deltas0} == {0, 1} and "logprobs" not in deltas0[0]
    results = collect(items, info)
    assert [[r["generated_text"] for r in res["results"]] for res in results] == [[" one two", " three"], [" three"]]
    assert [r["finish_reason"] for r in results[0]["results"]] == ["length", "stop"]
    assert all(set(r) == {"generated_text", "num_tokens", "finish_reason", "token_summary", "timing"}
               for res in results for r in res["results"])


def test_a_plain_input_keeps_str_pieces_and_its_result_shape(tok: Tokenizer) -> None:
    ids = tok.encode(" alpha beta")
    _, info = _rows(tok, "hi")
    items, _ = _run(GenerationTransducer(tok, info, profile_timing=False),
                    [(0, e) for e in _events(ids, FinishReason.LENGTH)])
    assert all(isinstance(it, str) for it in items[:-1]) and "index" not in items[-1]
    assert collect(items, info) == {"results": [{"generated_text": " alpha beta", "num_tokens": len(ids),
                                                 "finish_reason": "length",
                                                 "token_summary": {"input": info.input_tokens[0],
                                                                   "output": len(ids)}}]}


# ---- fuzz: any value of a new key is accepted or refused with a ValueError naming the key ----------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70), st.floats(),
                     st.text(max_size=4), st.binary(max_size=3))
_junk = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    st.one_of(st.text(max_size=3), st.integers(-3, 200_000)), c, max_size=3), max_leaves=8)
NEW_KEYS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
            "min_tokens", "logprobs", "top_logprobs", "n", "response_format", "priority")


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(NEW_KEYS), value=_junk, logprobs=st.booleans())
def test_fuzz_new_keys_accept_or_name_the_key(tok: Tokenizer, key: str, value: Any, logprobs: bool) -> None:
    spec = {"text": "hi", key: value}
    if key == "top_logprobs" and logprobs:
        spec["logprobs"] = True
    try:
        batch, info = preprocess(["ok", spec], tok, OPTS)
    except ValueError as e:
        assert str(e).startswith(f"input 1: {key}"), str(e)
        return
    except BaseException as e:  # noqa: BLE001 - anything else is the bug this test looks for
        pytest.fail(f"{key}={value!r:.100} raised {type(e).__name__}: {e}")
    assert batch.size == len(info.stops) >= 2
