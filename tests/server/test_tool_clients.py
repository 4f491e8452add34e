"""Forced tool calls as agent frameworks send them (issue 40 items 1-3), against a real uvicorn
server over the real default model (SmolLM2-135M-Instruct, greedy: ``temperature`` 0): the
official ``openai`` client's ``parse`` with a nested pydantic model under ``tool_choice:
"required"`` (``$defs``, strict), instructor's TOOLS mode (a nested model, ``Iterable[...]``) and
LangChain's ``with_structured_output(method="function_calling")`` (a schema that does not close
its objects) each return a parsed object; a forced call cut off by ``max_tokens`` finishes
"length" with neither content nor calls."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from mlx_serving import Serving, text_generation
from mlx_serving.server import create_app

from server_helpers import serve

# The work is bounded by max_tokens (at most ~120 tokens a request); the cap only catches a hang on a
# machine shared by many test runs, where one request of the real model takes tens of seconds.
pytestmark = pytest.mark.timeout(600)
MODEL = "smol"
TRIP_PROMPT = "Plan a trip from Paris, France to Rome, Italy."


class City(BaseModel):
    name: str
    country: str


class Trip(BaseModel):
    origin: City
    destination: City


class Capital(BaseModel):
    name: Literal["Paris", "Rome", "London"]  # bounded: greedy SmolLM2 loops inside a free list of strings


@pytest.fixture(scope="module")
def url(smollm2_dir: Path) -> Iterator[str]:
    serving = text_generation.from_mlx4bit(smollm2_dir, max_new_tokens=128, max_len=512, max_batch=4)
    try:
        with Serving.start(serving) as handle, serve(create_app({MODEL: handle})) as base:
            yield base
    finally:
        serving.close()


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _user(text: str) -> list:
    return [{"role": "user", "content": text}]


def test_openai_parse_required_with_nested_models(client: openai.OpenAI) -> None:
    """``$defs`` under a forced "required" call compile; the turn ends (here at the repeat of its
    call) with ``finish_reason`` "tool_calls", not "length"."""
    done = client.chat.completions.parse(model=MODEL, messages=_user(TRIP_PROMPT), temperature=0, max_tokens=120,
                                         tools=[openai.pydantic_function_tool(Trip)], tool_choice="required")
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    trips = [call.function.parsed_arguments for call in choice.message.tool_calls or ()]
    assert trips and all(isinstance(t, Trip) for t in trips)
    assert trips[0].origin.name == "Paris" and trips[0].destination.name == "Rome"


def test_a_cut_off_forced_call_leaks_no_markup(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=_user(TRIP_PROMPT), temperature=0, max_tokens=6,
                      tools=[openai.pydantic_function_tool(Trip)], tool_choice="required")
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert content == "" and not calls and finish == ["length"]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "length" and not choice.message.content and not choice.message.tool_calls


def _instructor(url: str):
    instructor = pytest.importorskip("instructor")
    return instructor.from_openai(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0),
                                  mode=instructor.Mode.TOOLS)


def test_instructor_tools_mode_nested_model(url: str) -> None:
    trip = _instructor(url).chat.completions.create(model=MODEL, response_model=Trip, messages=_user(TRIP_PROMPT),
                                                    temperature=0, max_tokens=80, max_retries=0)
    assert isinstance(trip, Trip) and trip.origin.name == "Paris"


def test_instructor_tools_mode_iterable(url: str) -> None:
    client = _instructor(url)
    cities = client.chat.completions.create(model=MODEL, response_model=Iterable[Capital], temperature=0,
                                            messages=_user("Extract the cities: Paris, Rome."),
                                            max_tokens=60, max_retries=0)
    assert [c.name for c in cities] == ["Paris", "Rome"]  # a list of nested models ($defs) under a named call


def test_langchain_function_calling_structured_output(url: str) -> None:
    """LangChain's schema does not close its objects (no ``additionalProperties: false``): the
    forced call is closed over the declared keys, so it ends and parses (it returned None)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", temperature=0,
                                      max_tokens=80, max_retries=0)
    trip = llm.with_structured_output(Trip, method="function_calling").invoke(TRIP_PROMPT)
    assert isinstance(trip, Trip) and trip.origin.name == "Paris"
