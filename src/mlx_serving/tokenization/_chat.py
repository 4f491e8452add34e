"""Chat template rendering: the checkpoint's own Jinja ``chat_template`` in a bounded sandbox.

The environment mirrors the one Hugging Face transformers documents for chat templates
(https://huggingface.co/docs/transformers/chat_templating_writing): ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
keeps non-ASCII text (``ensure_ascii=False``), and the globals ``raise_exception(message)`` and
``strftime_now(format)``. With it, ``ChatTemplate.apply`` gives the same text as transformers'
``apply_chat_template(..., tokenize=False)``.

A template from a checkpoint is untrusted code, so the sandbox is also bounded in time and memory
(:class:`_BoundedEnvironment`; the limits are the module constants below): every render has a
CPU-time budget and a loop-iteration budget (each ``for`` loop's iterable is wrapped at parse time), every
value the template builds (``*``, ``+``, ``%``, ``~``, ``str`` methods, filters, captured blocks,
macro output) is size-checked *before* it is built where the size is predictable and counted
against a total, integers are kept small, ``range`` / ``lipsum`` / ``strftime_now`` take bounded
arguments, and the output is streamed and capped. Exceeding any limit raises ``ChatTemplateError``.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
import types
from collections import abc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2 import filters as jinja_filters
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum, pass_environment, pass_eval_context
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

from ._errors import ChatTemplateError

Message = Mapping[str, Any]
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

#: CPU time of the rendering thread one render may take (``time.thread_time``: other processes
#: and threads competing for the cores do not count, so a busy machine never refuses a legitimate
#: render; checked at every call, intercepted operator and filter and every 256 loop iterations,
#: so no loop or recursion escapes it; a single bounded operation may overrun it slightly). Qwen3's
#: template renders a 2,000-turn conversation in ~0.04 s.
RENDER_CPU_S = 0.5
#: Characters of rendered prompt (about 1M tokens of English), and the largest string, list or
#: other value a template may build or stringify along the way.
MAX_OUTPUT_CHARS = 4 * 2**20
#: Characters (list / dict items for containers) of all values one render builds, in total.
MAX_WORK_CHARS = 64 * 2**20
#: Items of the largest list, tuple or dict a template may build (sorting or deduplicating that
#: many costs about 0.2 s).
MAX_ITEMS = 2**18
#: ``for``-loop iterations of one render, all loops together.
MAX_LOOP_ITERATIONS = 1_000_000
#: Items of one ``range(...)`` (jinja2's own sandbox limit); also ``batch`` / ``slice`` counts.
MAX_RANGE = 100_000
#: Bits of an integer built by an operator, a call or a filter (about 1,233 decimal digits).
MAX_INT_BITS = 4096
#: Characters of template source (compiling costs about 3.5 us per character).
MAX_TEMPLATE_CHARS = 256 * 2**10
#: Characters of a ``strftime_now`` format.
MAX_STRFTIME_FORMAT = 256
#: ``lipsum(n, html, min, max)``: at most this many paragraphs, of at most ``MAX_LIPSUM_WORDS`` words.
MAX_LIPSUM_PARAGRAPHS = 100
MAX_LIPSUM_WORDS = 1000
#: ``tojson(indent=...)`` and each of its ``separators``: at most this many characters.
MAX_JSON_INDENT = 16

_ITER, _CONCAT = "__chat_guard_iter", "__chat_guard_concat"


class _Budget:
    """What one render (or one compile's constant folding) may still spend."""

    __slots__ = ("deadline", "work", "iterations")

    def __init__(self, seconds: float = RENDER_CPU_S) -> None:
        self.deadline = time.thread_time() + seconds
        self.work = 0
        self.iterations = 0


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _fail(what: str) -> NoReturn:
    raise ChatTemplateError(f"chat template exceeded a limit: {what}")


def _tick() -> None:
    budget = _BUDGET.get()
    if budget is not None and time.thread_time() > budget.deadline:
        _fail(f"rendering took more than {RENDER_CPU_S} s of CPU time")


def _size(n: int, what: str = "a value") -> None:
    if n > MAX_OUTPUT_CHARS:
        _fail(f"{what} of {n:,} characters (at most {MAX_OUTPUT_CHARS:,})")


def _items(n: int, what: str = "a list") -> None:
    if n > MAX_ITEMS:
        _fail(f"{what} of {n:,} items (at most {MAX_ITEMS:,})")


def _spend(n: int) -> None:
    """Count ``n`` more characters (or items) the template built against the render's total."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.work += n
        if budget.work > MAX_WORK_CHARS:
            _fail(f"values built in total exceed {MAX_WORK_CHARS:,} characters")


_TEXTS = (str, bytes)
_CONTAINERS = (list, tuple, dict, set, frozenset)


def _account(value: Any) -> Any:
    """Check and count a value an operation just built."""
    cls = type(value)
    if cls is bool or value is None or cls is float:
        return value
    if cls is int:
        if value.bit_length() > MAX_INT_BITS:
            _fail(f"an integer of more than {MAX_INT_BITS} bits")
    elif isinstance(value, _TEXTS):
        _size(len(value))
        _spend(len(value))
    elif isinstance(value, _CONTAINERS):
        _items(len(value))
        _spend(len(value))
    elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        _fail(f"an integer of more than {MAX_INT_BITS} bits")
    return value


_VIEWS = (abc.KeysView, abc.ValuesView, abc.ItemsView)


def _measure(value: Any, limit: int = MAX_OUTPUT_CHARS, indent: int = 0) -> int:
    """About how many characters ``str(value)`` (or its JSON, each nested item indented by
    ``indent`` per level) has; stops counting once past ``limit``. Iterative and linear in
    what it visits, so a deeply nested, shared or self-containing value costs at most about
    ``limit / 4`` steps."""
    total = steps = 0
    stack: list[Any] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        cls = type(v)
        if cls is str or cls is bytes:
            total += len(v) + 2
        elif cls in _CONTAINERS or (cls is not Namespace and isinstance(v, (*_CONTAINERS, *_VIEWS))):
            n = len(v)
            total += 2 + (4 + indent * (depth + 1)) * n
            if total > limit:
                return total
            items = itertools.chain.from_iterable(v.items()) if isinstance(v, dict) else v
            stack.extend(zip(items, itertools.repeat(depth + 1)))
        elif cls is int:
            total += v.bit_length() // 3 + 2
        elif cls is Namespace:
            total += 16
            stack.append((object.__getattribute__(v, "_Namespace__attrs"), depth))
        elif isinstance(v, (str, bytes)):
            total += len(v) + 2
        else:
            total += 8
        steps += 1
        if not steps & 0xFFFF:
            _tick()
        if total > limit:
            return total
    return total


def _text(value: Any) -> str:
    """``str(value)``, refused before building it when it would be too long."""
    if not isinstance(value, str):
        _size(_measure(value), "a stringified value")
        value = str(value)
    return value


# ---- operators, calls, formatting ------------------------------------------------------------

_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def _check_percent(fmt: str, args: Any) -> None:
    """Refuse ``fmt % args`` when its result could exceed the value limit."""
    specs = _PERCENT.findall(fmt)
    extra = 0
    for width, precision, _ in specs:
        for n in (width, precision):
            if n == "*" or len(n) > 8:
                _fail("a %-format width or precision that is '*' or too large")
            extra += int(n or 0)
    args_size = _measure(args) * (len(specs) if isinstance(args, Mapping) else 1)
    _size(len(fmt) + extra + args_size, "a %-formatted string")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    sequences = (str, bytes, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sequences) and isinstance(n, int):
                check = _size if isinstance(seq, (str, bytes)) else _items
                check(len(seq) * max(n, 0), f"a repeated {type(seq).__name__}")
                return
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            _fail(f"an integer product of more than {MAX_INT_BITS} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if right > MAX_INT_BITS or right * left.bit_length() > MAX_INT_BITS:
                _fail(f"an integer power of more than {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, sequences) and isinstance(right, sequences):
            check = _size if isinstance(left, (str, bytes)) else _items
            check(len(left) + len(right), f"a concatenated {type(left).__name__}")
    elif operator == "%" and isinstance(left, str):
        _check_percent(left, right)


_STR_METHOD_INT_ARGS = (str, bytes, int, float)


def _check_call(obj: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """Refuse a method call on a builtin value that would build something too large; returns
    the arguments to call with (``join``'s iterable materialized)."""
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, _STR_METHOD_INT_ARGS):
        return args
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and abs(a) > MAX_OUTPUT_CHARS:
            _fail(f"argument {a} of {type(owner).__name__}.{obj.__name__}() is too large")
    if not isinstance(owner, (str, bytes)):
        return args
    name, n = obj.__name__, len(owner)
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _size(n * max(tab, 1))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], type(owner)) and isinstance(args[1], type(owner)):
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        old: Any = args[0]  # owner's own type (checked above), which mypy cannot tie to owner's
        k = owner.count(old) if old else n + 1
        if isinstance(count, int) and count >= 0:
            k = min(k, count)
        _size(n + k * len(args[1]))
    elif name == "join" and args:
        items = list(args[0])
        _size(sum(len(x) if isinstance(x, (str, bytes)) else 0 for x in items) + n * max(len(items) - 1, 0))
        args = (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _size(n * max(longest, 1))
    return args


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` in the sandbox: every field counted, widths and precisions bounded."""

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, str]:
        obj, first = super().get_field(field_name, args, kwargs)
        n = _measure(obj)
        _size(n, "a formatted field")
        _spend(n)
        return obj, first

    def format_field(self, value: Any, format_spec: str) -> Any:
        for number in re.findall(r"\d+", format_spec):
            if len(number) > 8 or int(number) > MAX_OUTPUT_CHARS:
                _fail(f"format width or precision {number[:20]} is too large")
        return _account(super().format_field(value, format_spec))


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


# ---- globals and filters ---------------------------------------------------------------------

def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"chat template refused the input: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    width = 0
    if indent is not None:
        width = len(indent) if isinstance(indent, str) else indent
        if isinstance(indent, bool) or not isinstance(indent, (int, str)) or not 0 <= width <= MAX_JSON_INDENT:
            _fail(f"tojson indent must be None, 0..{MAX_JSON_INDENT} or a string that long, got {indent!r:.40}")
    if separators is not None:
        if (not isinstance(separators, (list, tuple)) or len(separators) != 2
                or not all(isinstance(x, str) and len(x) <= MAX_JSON_INDENT for x in separators)):
            _fail("tojson separators must be two short strings")
        width += max(len(x) for x in separators)
    _size(_measure(value, indent=width), "a JSON value")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > MAX_STRFTIME_FORMAT:
        _fail(f"strftime_now takes a format string of at most {MAX_STRFTIME_FORMAT} characters")
    return datetime.now().strftime(fmt)


def _range(*args: int) -> range:
    if not all(isinstance(a, int) for a in args):
        raise ChatTemplateError("range() takes integers")
    r = range(*args)
    try:
        n = len(r)
    except OverflowError:
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        _fail(f"range() of more than {MAX_RANGE:,} items")
    return r


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    if not (isinstance(n, int) and isinstance(min, int) and isinstance(max, int)
            and 0 <= n <= MAX_LIPSUM_PARAGRAPHS and 1 <= min <= max <= MAX_LIPSUM_WORDS):
        _fail(f"lipsum() takes n <= {MAX_LIPSUM_PARAGRAPHS} and 1 <= min <= max <= {MAX_LIPSUM_WORDS}")
    return generate_lorem_ipsum(n, html, min, max)


def _guard_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """What every ``for`` loop iterates: ``iterable``, counted against the render's budget."""
    budget = _BUDGET.get()
    it = iter(iterable)
    return it if budget is None else _counted(it, budget)


def _counted(it: Iterator[Any], budget: _Budget) -> Iterator[Any]:
    for item in it:
        budget.iterations += 1
        if budget.iterations > MAX_LOOP_ITERATIONS:
            _fail(f"more than {MAX_LOOP_ITERATIONS:,} loop iterations")
        if not budget.iterations & 255 and time.thread_time() > budget.deadline:
            _fail(f"rendering took more than {RENDER_CPU_S} s of CPU time")
        yield item


def _guard_concat(*parts: Any) -> str:
    """The ``~`` operator."""
    texts = [_text(p) for p in parts]
    _size(sum(map(len, texts)), "a ~ concatenation")
    return _account("".join(texts))


def _finalize(value: Any) -> Any:
    """Every ``{{ ... }}`` value before it is turned into text."""
    if not isinstance(value, (str, int, float)) and value is not None:
        _size(_measure(value), "a printed value")
    return value


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    text = _text(s)
    w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    _size(len(text) + (text.count("\n") + 2) * w, "an indented string")
    return jinja_filters.do_indent(text, width, first, blank)


@pass_eval_context
def _replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: int | None = None) -> str:
    text, old, new = _text(s), _text(old), _text(new)
    k = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        k = min(k, count)
    _size(len(text) + k * len(new), "a replaced string")
    return jinja_filters.do_replace(eval_ctx, text, old, new, count)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    _check_percent(_text(value), kwargs or args)
    return jinja_filters.do_format(value, *args, **kwargs)


@pass_eval_context
def _join(eval_ctx: Any, value: Iterable[Any], d: str = "", attribute: str | int | None = None) -> str:
    if attribute is not None:
        value = map(jinja_filters.make_attrgetter(eval_ctx.environment, attribute), value)
    items = list(value)
    sep = _text(d)
    _size(sum(len(x) if isinstance(x, str) else _measure(x) for x in items) + len(sep) * max(len(items) - 1, 0),
          "a joined string")
    return jinja_filters.sync_do_join(eval_ctx, items, sep)


@pass_environment
def _wordwrap(env: Any, s: Any, width: int = 79, break_long_words: bool = True, wrapstring: str | None = None,
              break_on_hyphens: bool = True) -> str:
    text = _text(s)
    sep = wrapstring if wrapstring is not None else env.newline_sequence
    lines = len(text) // max(width, 1) + text.count("\n") + 1 if isinstance(width, int) else 1
    _size(len(text) + lines * len(_text(sep)), "a wrapped string")
    return jinja_filters.do_wordwrap(env, text, width, break_long_words, wrapstring, break_on_hyphens)


@pass_eval_context
def _urlize(eval_ctx: Any, value: Any, *args: Any, **kwargs: Any) -> str:
    text = _text(value)
    extra = sum(_measure(a) for a in (*args, *kwargs.values()))
    _size(len(text) * (16 + extra), "an urlized string")
    return jinja_filters.do_urlize(eval_ctx, text, *args, **kwargs)


def _batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
    if fill_with is not None and isinstance(linecount, int) and linecount > MAX_RANGE:
        _fail(f"batch() filling more than {MAX_RANGE:,} items")
    return jinja_filters.do_batch(value, linecount, fill_with)


def _slice(value: Any, slices: int, fill_with: Any = None) -> Any:
    if isinstance(slices, int) and slices > MAX_RANGE:
        _fail(f"slice() into more than {MAX_RANGE:,} slices")
    return jinja_filters.sync_do_slice(value, slices, fill_with)


@pass_environment
def _sum(env: Any, iterable: Iterable[Any], attribute: str | int | None = None, start: Any = 0) -> Any:
    if attribute is not None:
        iterable = map(jinja_filters.make_attrgetter(env, attribute), iterable)
    items = list(iterable)
    if not all(isinstance(x, (int, float)) for x in (start, *items)):
        raise ChatTemplateError("sum() adds numbers only")
    return sum(items, start)


def _pprint(value: Any) -> str:
    _size(_measure(value, indent=1), "a pretty-printed value")
    return jinja_filters.do_pprint(value)


#: Filters replaced by bounded versions (same signatures and results).
_BOUNDED_FILTERS: dict[str, Callable[..., Any]] = {
    "tojson": _tojson, "indent": _indent, "replace": _replace, "format": _format, "join": _join,
    "wordwrap": _wordwrap, "urlize": _urlize, "batch": _batch, "slice": _slice, "sum": _sum,
    "pprint": _pprint,
}
#: Filters that turn their input into text (its size is checked before).
_STRINGIFYING = frozenset({"string", "e", "escape", "forceescape", "safe", "trim", "upper", "lower", "title",
                           "capitalize", "center", "truncate", "striptags", "urlencode", "wordcount",
                           "xmlattr", "filesizeformat", "reverse"})


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the deadline checked, oversized integer arguments refused, a
    stringified input measured first, and its result counted."""
    value_at = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    stringifies = name in _STRINGIFYING

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        for a in (*args[value_at + 1:], *kwargs.values()):
            if isinstance(a, int) and abs(a) > MAX_OUTPUT_CHARS:
                _fail(f"argument {a} of the {name} filter is too large")
        if stringifies and len(args) > value_at and not isinstance(args[value_at], str):
            _size(_measure(args[value_at]), f"the input of the {name} filter")
        return _account(func(*args, **kwargs))

    return guarded


class _GuardNodes(NodeTransformer):
    """Parse-time rewrite: every ``for`` loop iterates ``__chat_guard_iter(iterable)`` and every
    ``a ~ b`` becomes ``__chat_guard_concat(a, b)``, so both are bounded at render time."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name(_ITER, "load"), [node.iter], [], None, None).set_lineno(node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.Name(_CONCAT, "load"), list(node.nodes), [], None, None).set_lineno(node.lineno)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, bounded in time and memory (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                         finalize=_finalize)
        self.filters = {name: _guard_filter(name, f) for name, f in {**self.filters, **_BOUNDED_FILTERS}.items()}
        self.globals.update({
            "range": _range, "lipsum": _lipsum, "raise_exception": _raise_exception,
            "strftime_now": _strftime_now, _ITER: _guard_iter, _CONCAT: _guard_concat,
        })

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _GuardNodes().visit(super()._parse(source, name, filename))

    def concat(self, parts: Iterable[str]) -> str:
        """Joins captured output ({% set %} blocks, macros, caller(), filter blocks)."""
        parts = list(parts)
        _size(sum(map(len, parts)), "captured output")
        return _account("".join(parts))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "+" and type(left) is str and type(right) is str:  # fast path: templates do this a lot
            n = len(left) + len(right)
            _size(n, "a concatenated str")
            _spend(n)
            return left + right
        _check_binop(operator, left, right)
        return _account(super().call_binop(context, operator, left, right))

    def getitem(self, obj: Any, argument: Any) -> Any:
        value = super().getitem(obj, argument)
        return _account(value) if isinstance(argument, slice) else value

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        if args and type(__obj) is LoopContext:  # a recursive loop's loop(children)
            args = (_guard_iter(args[0]), *args[1:])
        if (args or kwargs) and isinstance(getattr(__obj, "__self__", None), _STR_METHOD_INT_ARGS):
            args = _check_call(__obj, args, kwargs)
        return _account(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` / ``format_map`` through :class:`_BoundedFormatter` (jinja2's own
        wrapper with the bounded formatter)."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or value.__name__ not in (
                "format", "format_map"):
            return None
        f_self = value.__self__
        if not isinstance(f_self, str):
            return None
        str_type = type(f_self)
        is_format_map = value.__name__ == "format_map"
        formatter: _BoundedFormatter = (_BoundedEscapeFormatter(self, escape=f_self.escape)
                                        if isinstance(f_self, Markup) else _BoundedFormatter(self))

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            return str_type(formatter.vformat(f_self, args, kwargs))

        return functools.update_wrapper(wrapper, value)


def _environment() -> _BoundedEnvironment:
    return _BoundedEnvironment()


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
        ChatTemplateError: ``source`` is not a string, is longer than ``MAX_TEMPLATE_CHARS``,
            or is not a valid template.
    """

    def __init__(self, source: str, variables: Mapping[str, Any] | None = None) -> None:
        if not isinstance(source, str):
            raise ChatTemplateError(f"chat template must be a string, got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"chat template of {len(source):,} characters is longer than the "
                                    f"{MAX_TEMPLATE_CHARS:,} allowed")
        token = _BUDGET.set(_Budget())  # bounds constant folding at compile time
        try:
            self._compiled = _environment().from_string(source)
        except Exception as exc:  # noqa: BLE001 - untrusted source: any failure is the template's
            raise ChatTemplateError(f"chat template does not compile: {type(exc).__name__}: {exc}") from exc
        finally:
            _BUDGET.reset(token)
        self.source = source
        self.variables = dict(variables or {})

    def apply(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: object,
    ) -> str:
        """Render ``messages`` (dicts with ``role``, ``content`` and optionally ``reasoning_content``,
        ``tool_calls``...) into the prompt text.

        ``enable_thinking=None`` leaves the variable undefined (the template's default; Qwen3 then
        thinks); ``tools`` are JSON-schema dicts. Other keyword arguments become template variables.

        Raises:
            ChatTemplateError: an input value is not JSON-like, or the template failed
                (its own ``raise_exception``, a missing key, a sandbox violation, or any
                limit of the bounded sandbox: time, loop iterations, value or output size).
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
        token = _BUDGET.set(_Budget())
        stream = self._compiled.generate(context)
        try:
            out: list[str] = []
            size = 0
            for chunk in stream:
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    _fail(f"output longer than {MAX_OUTPUT_CHARS:,} characters")
                out.append(chunk)
            return "".join(out)
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - untrusted code: any failure is the template's
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        finally:
            stream.close()  # type: ignore[attr-defined]  # jinja2 types generate() as Iterator; it is a generator
            _BUDGET.reset(token)
