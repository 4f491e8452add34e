"""Bad requests at a started text-generation serving (tiny seeded 4-bit Qwen3): hypothesis draws
requests with a wrong value for each option (wrong types, NaN / inf, out of range, huge strings,
nested junk, unknown keys, bad chat roles and messages, junk at the top level) and sends them
concurrently with good requests. Each bad one gets its ValueError in its own caller; each good one
gets exactly its solo greedy result; the serving ends idle with nothing failed (issue 12)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_serving.models.text_generation import from_mlx4bit
from mlx_serving.models.text_generation._inputs import ROLES

MAX_LEN, MAX_NEW, MAX_BATCH = 96, 4, 4
OPTIONS = {"max_new_tokens": MAX_NEW, "max_len": MAX_LEN, "max_batch": MAX_BATCH}
HUGE = 384 * MAX_LEN + 1  # more UTF-8 bytes than any prompt that fits (384 bytes per Qwen3 token)

#: Good requests, greedy (a temperature below 1e-5 is greedy too), some with other valid options.
GOOD: list[Any] = [
    "The pool says",
    {"text": "Hello", "max_new_tokens": 3},
    {"text": "1 2 3 4 5 6 7 8 9 10 11 12", "temperature": 1e-38},
    {"messages": [{"role": "user", "content": "Hi there"}], "enable_thinking": False},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}], "stop": ["zzz"]},
    {"text": "Once upon a time, in a land far away, there lived", "top_p": 0.5, "seed": 2**64 - 1,
     "temperature": None},
]
TEXT: dict[str, Any] = {"text": "Hello"}
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]}
KEYS = {"text", "messages", "stop", "enable_thinking", "tools", "max_new_tokens", "temperature", "top_p", "seed",
        "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens",
        "logprobs", "top_logprobs", "n", "response_format", "priority"}
MESSAGE_KEYS = {"role", "content", "reasoning_content", "thinking", "reasoning", "tool_calls", "name", "tool_call_id"}

# ---- strategies: every value drawn here is invalid where it is put ----------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4), st.binary(max_size=4))
junk = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                    max_leaves=8)
junk_dict = st.dictionaries(st.text(max_size=4), junk, max_size=3)  # a dict is wrong for every option
huge_text = st.sampled_from(["x", "a b ", "中", "\U0001f600", "\u1100\u1161\u11a8"]).map(lambda s: s * HUGE)
non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"k": [value]}
    return value


bad_max_new = st.one_of(st.booleans(), st.floats(), st.text(max_size=4), st.integers(max_value=0),
                        st.integers(min_value=MAX_LEN, max_value=10**30), st.just(10**400), junk_dict,
                        st.lists(st.integers(1, 3), min_size=1, max_size=2))
bad_temperature = st.one_of(st.booleans(), st.text(max_size=4), non_finite, st.floats(max_value=-1e-9),
                            st.integers(max_value=-1), st.just(10**400), junk_dict,
                            st.lists(st.floats(0, 1), min_size=1))
bad_top_p = st.one_of(st.booleans(), st.text(max_size=4), non_finite, st.floats(max_value=0.0),
                      st.floats(min_value=1.0, exclude_min=True), st.integers(min_value=2), st.integers(max_value=0),
                      junk_dict)
bad_seed = st.one_of(st.booleans(), st.floats(), st.text(max_size=4), st.integers(max_value=-1),
                     st.integers(min_value=2**64), junk_dict, st.lists(st.integers(0, 9), min_size=1, max_size=2))
bad_stop_item = st.one_of(st.just(""), st.integers(), st.none(), st.binary(max_size=3), st.floats(), junk_dict,
                          st.integers(257, 2_000).map(lambda n: "s" * n))
bad_stop = st.one_of(
    st.integers(), st.floats(), st.booleans(), st.binary(min_size=1, max_size=4), junk_dict, st.just(""),
    st.integers(257, 5_000).map(lambda n: "s" * n),
    st.tuples(st.lists(st.text(min_size=1, max_size=3), max_size=3), bad_stop_item).map(lambda t: [*t[0], t[1]]),
    st.lists(st.text(min_size=1, max_size=2), min_size=17, max_size=24),
)
bad_thinking = st.one_of(st.integers(), st.floats(), st.text(max_size=4), junk_dict,
                         st.lists(st.booleans(), min_size=1))
bad_tools = st.one_of(
    st.text(max_size=4), st.integers(), st.booleans(), junk_dict,
    st.lists(st.one_of(st.integers(), st.text(max_size=3), st.none(), st.lists(junk, max_size=2)),
             min_size=1, max_size=3),
    st.integers(33, 60).map(lambda d: [_deep(d)]),
    st.dictionaries(st.integers(), st.text(max_size=3), min_size=1, max_size=2).map(lambda d: [d]),
    st.binary(max_size=3).map(lambda b: [{"name": "f", "parameters": {"x": b}}]),
    huge_text.map(lambda s: [{"description": s}]),
)
bad_role = st.one_of(st.text(max_size=10).filter(lambda r: r not in ROLES), st.integers(), st.none(), st.booleans(),
                     junk_dict)
not_a_str = st.one_of(st.integers(), st.none(), st.floats(), st.booleans(), st.binary(max_size=3), junk_dict,
                      st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)}),
                               max_size=2))
bad_message = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, bad_role, st.text(max_size=5)),
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(ROLES), not_a_str),
    st.builds(lambda r, k, v: {"role": r, "content": "x", k: v}, st.sampled_from(ROLES),
              st.text(min_size=1, max_size=6).filter(lambda k: k not in MESSAGE_KEYS),
              junk),
    st.sampled_from(ROLES).map(lambda r: {"role": r}), st.just({"content": "x"}), st.just({}),
    st.builds(lambda r: {"role": r, "content": "x", "tool_calls": [{"name": "f", "arguments": "{}"}]},
              st.sampled_from([r for r in ROLES if r != "assistant"])),
    st.builds(lambda calls: {"role": "assistant", "content": "", "tool_calls": calls},
              st.one_of(st.text(max_size=3), junk_dict, st.lists(st.one_of(st.integers(), st.none()), min_size=1),
                        st.just([{"function": {"name": 1, "arguments": "{}"}}]), st.just([{"name": "f"}]))),
    st.builds(lambda k, v: {"role": "user", "content": "x", k: v},
              st.sampled_from(["reasoning_content", "name", "tool_call_id"]),
              not_a_str.filter(lambda v: v is not None)),
    st.one_of(st.integers(), st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=2)),  # not a dict
    huge_text.map(lambda s: {"role": "user", "content": s}),
)
bad_messages = st.one_of(
    st.none(), st.text(max_size=4), st.integers(), junk_dict, st.just([]),
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=4)}), max_size=2).flatmap(
        lambda ok: bad_message.map(lambda bad: [*ok, bad])),
)
bad_text = st.one_of(st.integers(), st.none(), st.binary(max_size=4), st.lists(st.text(max_size=3), max_size=2),
                     junk_dict, st.just(""), huge_text, st.text(max_size=4).map(lambda s: s + "\ud800"))


def _with(key: str, values: st.SearchStrategy[Any], base: dict[str, Any] = TEXT) -> st.SearchStrategy[Any]:
    return values.map(lambda v: {**base, key: v})


bad_request = st.one_of(
    _with("max_new_tokens", bad_max_new), _with("max_new_tokens", bad_max_new, CHAT),
    _with("temperature", bad_temperature), _with("top_p", bad_top_p), _with("seed", bad_seed, CHAT),
    _with("seed", bad_seed), _with("stop", bad_stop), _with("stop", bad_stop, CHAT),
    _with("enable_thinking", bad_thinking, CHAT), _with("enable_thinking", st.booleans()),  # text: not chat
    _with("tools", bad_tools, CHAT), _with("tools", st.lists(st.just({"name": "f"}), max_size=2)),
    _with("messages", bad_messages, {}), _with("text", bad_text, {}),
    st.builds(lambda k, v, base: {**base, k: v}, st.one_of(st.text(max_size=8).filter(lambda k: k not in KEYS),
                                                         st.integers(), st.none(), st.booleans()),
              junk, st.sampled_from([TEXT, CHAT])),  # an unknown key
    st.just({**TEXT, **CHAT}), st.just({"max_new_tokens": 2}),  # both / neither of text and messages
    st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=3), st.just([]), st.just(""),
              st.lists(st.integers(), min_size=1, max_size=2)),  # junk at the top level
)
#: a list input fails as a whole when one item is bad (ValueError "input i: ...").
bad_input = st.one_of(
    bad_request,
    st.tuples(st.lists(st.sampled_from(GOOD), max_size=2), bad_request).map(lambda t: [*t[0], t[1]]),
)


def _key(result: Any) -> tuple[str, int, str]:
    r = result["results"][0]
    return r["generated_text"], r["num_tokens"], r["finish_reason"]


def _wait_idle(stats: Any, timeout: float = 5.0) -> Any:
    end = time.monotonic() + timeout
    s = stats()
    while (s.running or s.queued) and time.monotonic() < end:
        time.sleep(0.01)
        s = stats()
    return s


def fire(call: Any, bad: list[Any], good: list[int], check: Any) -> dict[int, Any]:
    """Send every bad and good request at once, each from its own thread. ``check(value, exc)``
    says what is wrong with the exception a bad ``value`` raised (None: as it should be); a bad
    request that is accepted is an error. Returns the good ones' results by slot."""
    errors: list[BaseException] = []
    answers: dict[int, Any] = {}

    def bad_call(value: Any) -> None:
        try:
            call(value, 60)
        except BaseException as exc:  # noqa: BLE001 - checked below
            problem = check(value, exc)
            if problem is not None:
                errors.append(AssertionError(f"{value!r:.200}: {problem}"))
            return
        errors.append(AssertionError(f"{value!r:.200} was accepted"))

    def good_call(slot: int, index: int) -> None:
        try:
            answers[slot] = _key(call(GOOD[index], 60))
        except BaseException as exc:  # noqa: BLE001
            errors.append(AssertionError(f"good request {GOOD[index]!r:.100} failed: {exc!r:.300}"))

    threads = [threading.Thread(target=bad_call, args=(b,)) for b in bad]
    threads += [threading.Thread(target=good_call, args=(i, g)) for i, g in enumerate(good)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return answers


def _value_error(value: Any, exc: BaseException) -> str | None:
    return None if isinstance(exc, ValueError) else f"raised {type(exc).__name__}: {exc!s:.300}"


@pytest.fixture(scope="module")
def handle(tiny_ckpt):
    with from_mlx4bit(tiny_ckpt, **OPTIONS).start() as h:
        yield h


@pytest.fixture(scope="module")
def solo(handle) -> list[tuple[str, int, str]]:
    return [_key(handle.run(g, deadline=60)) for g in GOOD]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(bad=st.lists(bad_input, min_size=1, max_size=5), good=st.lists(st.integers(0, len(GOOD) - 1), min_size=1,
                                                                       max_size=3))
def test_bad_requests_fail_alone(handle, solo, bad, good):
    answers = fire(lambda value, deadline: handle.run(value, deadline=deadline), bad, good, _value_error)
    assert answers == {i: solo[g] for i, g in enumerate(good)}
    stats = _wait_idle(handle.stats)
    assert (stats.running, stats.queued, stats.failed) == (0, 0, 0), stats
