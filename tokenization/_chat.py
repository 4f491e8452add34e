"""Chat template rendering: the checkpoint's own Jinja ``chat_template`` in a sandbox.

The environment mirrors the one Hugging Face transformers documents for chat templates
(https://huggingface.co/docs/transformers/chat_templating_writing): ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
keeps non-ASCII text (``ensure_ascii=False``), and the globals ``raise_exception(message)`` and
``strftime_now(format)``. With it, ``ChatTemplate.apply`` gives the same text as transformers'
``apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ._errors import ChatTemplateError

Message = Mapping[str, Any]
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"chat template refused the input: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain(value: Any, text: Callable[[str], str]) -> Any:
    """Copy of ``value`` made of plain JSON types only (the sandbox then sees no foreign methods),
    with ``text`` applied to every string, keys included."""
    if isinstance(value, str):
        return text(str.__str__(value))
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {_plain(k, text): _plain(v, text) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, text) for v in value]
    raise ChatTemplateError(f"chat input holds a {type(value).__name__}; only JSON-like values are allowed")


def _with_reasoning_alias(message: dict[str, Any]) -> dict[str, Any]:
    """Fill ``reasoning_content`` (and ``thinking``) from whichever reasoning key is set, as
    transformers does, so templates that read one name see reasoning sent under another."""
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja source (``chat_template`` of ``tokenizer_config.json``).
        variables: extra names the template sees, e.g. ``{"eos_token": "<|im_end|>"}``
            (``Tokenizer`` passes the tokenizer's special-token strings).

    Raises:
        ChatTemplateError: ``source`` is not a valid template.
    """

    def __init__(self, source: str, variables: Mapping[str, Any] | None = None) -> None:
        try:
            self._compiled = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.variables = dict(variables or {})

    def apply(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (dicts with ``role``, ``content`` and optionally ``reasoning_content``,
        ``tool_calls``...) into the prompt text.

        ``enable_thinking=None`` leaves the variable undefined (the template's default; Qwen3 then
        thinks); ``tools`` are JSON-schema dicts. Other keyword arguments become template variables.

        Raises:
            ChatTemplateError: an input value is not JSON-like, or the template failed
                (its own ``raise_exception``, a missing key, a sandbox violation).
        """
        return self._render(messages, add_generation_prompt, enable_thinking, tools, kwargs, str)

    def _render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        enable_thinking: bool | None,
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any],
        text: Callable[[str], str],
    ) -> str:
        """Render with ``text`` applied to every string of the caller's data (see ``_plain``)."""
        if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
            raise ChatTemplateError("messages must be a list of message dicts")
        if not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("every message must be a dict")
        context = {
            **self.variables,
            "documents": None,
            **_plain(dict(kwargs), text),
            "messages": [_with_reasoning_alias(m) for m in _plain(list(messages), text)],
            "tools": None if tools is None else _plain(list(tools), text),
            "add_generation_prompt": add_generation_prompt,
        }
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        try:
            return self._compiled.render(context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
