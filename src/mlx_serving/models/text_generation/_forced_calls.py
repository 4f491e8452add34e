"""Forced tool calls: the grammar of a turn that ``tool_choice`` ("required" or a named function)
holds to hermes ``<tool_call>`` blocks (``_parsers``), each tool's ``parameters`` rewritten so that
the calls of every tool compile into one JSON schema.

Two rewrites of a tool's parameters schema (:func:`call_parameters`), done on a copy:

- its local ``$ref`` pointers (``#``, ``#/$defs/City``, ``#/definitions/...``, any ``#/...``) are
  re-rooted under ``#/$defs/<key>``, where the combined schema keeps the tool's whole parameters
  schema (so pydantic's nested models, recursive models included, resolve; two tools whose
  ``$defs`` share a name never clash);
- every object schema that declares ``properties`` and says nothing of further keys
  (``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``) is closed over them
  (``additionalProperties: false``), as OpenAI's strict mode requires: a forced call then ends
  when its object can end instead of inventing keys until ``max_tokens``. Direct members of an
  ``allOf`` stay open (closing each would refuse the others' keys). A tool without parameters
  takes no arguments (``{}``), as OpenAI reads a function without ``parameters``.

Peers: vLLM forces a call with the tool's schema as it is (``vllm/entrypoints/openai/protocol.py``,
``_get_json_schema_from_tool``), which breaks on ``$defs`` the same way; its "required" is a JSON
array of calls with ``minItems: 1``.
"""

from __future__ import annotations

import json
from typing import Any

from ...serving import InvalidInput
from ._parsers import CALL_END, CALL_START

__all__ = ["MAX_PARALLEL_CALLS", "call_parameters", "tool_call_format"]

#: Most calls a forced ``tool_choice: "required"`` allows in one turn: then the grammar is complete
#: and the turn ends (a small model otherwise repeats the same call until max_tokens).
MAX_PARALLEL_CALLS = 4
#: Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_CLOSED_EMPTY: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_format(tools: list[dict[str, Any]], choice: object, parallel: bool) -> dict[str, Any] | None:
    """The ``response_format`` that forces a tool call: None for ``tool_choice`` None, "auto" or
    "none"; for "required" at least one call of any of ``tools``, at most :data:`MAX_PARALLEL_CALLS`
    (exactly one when not ``parallel``); for ``{"type": "function", "function": {"name": N}}`` one
    call of ``N``. After each complete call the grammar may end (EOS allowed). A call is the output
    parser's hermes block, ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``,
    consecutive calls split by one newline, its arguments held to the tool's ``parameters``
    (:func:`call_parameters`).

    Returns:
        ``{"type": "grammar", "grammar": <Lark source>}`` (compiled by
        ``_structured.compile_response_format``), or None.

    Raises:
        InvalidInput: naming ``tool_choice`` (an unknown choice, a name not among ``tools``) or
            ``tools`` (an entry without a function name, parameters that are not an object), in
            its message and as its ``param``.
    """
    if choice in (None, "auto", "none"):
        return None
    specs = [_tool_spec(t, i) for i, t in enumerate(tools)]
    if choice == "required":
        chosen = list(enumerate(specs))
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        chosen = [(i, spec) for i, spec in enumerate(specs) if spec[0] == name][:1]
        if not chosen:
            raise InvalidInput(f"tool_choice names the function {name!r:.80}, which is not in 'tools' "
                               f"({sorted(n for n, _ in specs)})", "tool_choice")
        parallel = False
    else:
        raise InvalidInput("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                           f"{{'name': str}}}}, got {choice!r:.80}", "tool_choice")
    defs = {f"tool{i}": call_parameters(params, f"tool{i}") for i, (_, params) in chosen}
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", "arguments"], "additionalProperties": False} for i, (name, _) in chosen]
    schema: dict[str, object] = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema["$defs"] = defs
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    body = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    start = f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "start: call"
    return {"type": "grammar", "grammar": f'{start}\ncall: "{CALL_START}\\n" args "\\n{CALL_END}"\nargs: %json {body}\n'}


def call_parameters(params: dict[str, Any], key: str) -> dict[str, Any]:
    """A copy of a tool's ``parameters`` schema to be kept at ``#/$defs/<key>`` of a combined
    schema: local ``$ref`` pointers re-rooted there, objects with ``properties`` closed (see the
    module's docstring). ``key`` is used as is in the pointers (no ``~`` or ``/`` escaping)."""
    return _rewrite(params, f"#/$defs/{key}", closable=True)


def _rewrite(schema: Any, root: str, closable: bool) -> Any:
    """One schema node (a dict; booleans and anything else are returned as they are)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = _rewrite(out[k], root, True)
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [_rewrite(s, root, k != "allOf") for s in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: _rewrite(s, root, True) for name, s in out[k].items()}
    if closable and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _tool_spec(tool: object, i: int) -> tuple[str, dict[str, Any]]:
    """``(name, parameters schema)`` of ``tools[i]`` (OpenAI's ``{"type": "function", "function":
    {...}}`` or the bare function object); no parameters: the closed empty object."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(fn, dict) or not isinstance(name, str) or not name:
        raise InvalidInput(f"tools[{i}] needs a function name (a non-empty string) to be forced by tool_choice",
                           "tools")
    params = fn.get("parameters")
    if params is None:
        return name, _CLOSED_EMPTY
    if not isinstance(params, dict):
        raise InvalidInput(f"tools[{i}].function.parameters must be a JSON Schema object, "
                           f"got {type(params).__name__}", "tools")
    return name, params
