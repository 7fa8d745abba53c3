"""Structured outputs and tool choice: OpenAI and vLLM request fields -> a GrammarSpec and a tool plan.

- `response_format` json_object / json_schema, vLLM's `structured_outputs` {json, regex, choice,
  grammar, json_object} and its older `guided_*` fields become one GrammarSpec; the engine compiles
  it (engine/core/structured.py), so an invalid or unenforceable schema is a 400 from there. Objects
  that list their properties allow no others unless they say so (`closed_objects`).
- `tools` / `tool_choice` / `parallel_tool_calls` (and the deprecated `functions` / `function_call`)
  become a ToolPlan. `required` and a named function constrain the output to a JSON call, the
  shape engine/chat/tool_parser.py parses in every chat format: `{"name": ..., "arguments": {...}}`,
  a list of them for parallel calls. Under `auto`, functions marked `strict` are constrained the
  same way when the model chooses to call (text that does not start with `{` or `[` stays free).
- A model whose chat format or template cannot show tools gets the generic tool format
  (engine/chat/generic_tools.py): its whole answer is constrained to `{"tool_calls": [...]}` or
  `{"response": "..."}` (`tool_calls` only under required or a named function; one call without
  parallel_tool_calls), the calls' arguments following their functions' parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from compat import limits
from compat import protocol as p
from engine.types import GrammarSpec, InvalidRequest, ToolDefinition

ANY_OBJECT: dict[str, Any] = {"type": "object"}
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as engine/core/structured.py


@dataclass(slots=True)
class ToolPlan:
    tools: tuple[ToolDefinition, ...]  # rendered into the prompt and looked for in the output
    grammar: GrammarSpec | None = None  # the constraint that tool_choice / strict put on the output
    forced: bool = False  # the output is a JSON call: parse it with the JSON parser, whatever the format
    max_calls: int | None = None  # parallel_tool_calls=false: at most one call
    generic: bool = False  # the generic tool format: the prompt shows the tools, the answer is its JSON


# --------------------------------------------------------------------------- response formats
def grammar_spec(fields: p.SamplingFields) -> GrammarSpec | None:
    """The one constraint a request asks for (None: free text); two at once is a 400."""
    found: list[GrammarSpec] = []
    response_format = getattr(fields, "response_format", None)
    if response_format is not None and response_format.type != "text":
        found.append(_response_format(response_format))
    if fields.structured_outputs is not None:
        found.append(_structured_outputs(fields.structured_outputs))
    if fields.guided_json is not None:
        found.append(json_spec(fields.guided_json, "guided_json"))
    if fields.guided_regex is not None:
        found.append(GrammarSpec("regex", fields.guided_regex, "guided_regex"))
    if fields.guided_choice is not None:
        found.append(choice_spec(fields.guided_choice, "guided_choice"))
    if fields.guided_grammar is not None:
        found.append(GrammarSpec("grammar", fields.guided_grammar, "guided_grammar"))
    if len(found) > 1:
        names = ", ".join(spec.param or "?" for spec in found)
        raise InvalidRequest(f"ask for one output constraint at a time, not {names}", param=found[1].param)
    return found[0] if found else None


def _response_format(response_format: p.ResponseFormat) -> GrammarSpec:
    if response_format.type == "json_object":
        return json_spec(ANY_OBJECT, "response_format")
    if response_format.json_schema is msgspec.UNSET:
        raise InvalidRequest("response_format of type json_schema needs a json_schema", param="response_format.json_schema")
    schema = response_format.json_schema.schema
    return json_spec(ANY_OBJECT if schema is None else schema, "response_format.json_schema.schema")


def _structured_outputs(so: p.StructuredOutputs) -> GrammarSpec:
    given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(so, name) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}",
                             param="structured_outputs")
    kind = given[0]
    param = f"structured_outputs.{kind}"
    if kind == "json":
        return json_spec(so.json, param)
    if kind == "json_object":
        return json_spec(ANY_OBJECT, param)
    if kind == "choice":
        return choice_spec(so.choice or [], param)
    return GrammarSpec("regex" if kind == "regex" else "grammar", getattr(so, kind), param)


def json_spec(schema: dict[str, Any] | str | bool, param: str) -> GrammarSpec:
    """A JSON schema (an object, or its JSON text) as a canonical spec, so equal schemas share a grammar;
    objects that list their properties get no others (`closed_objects`)."""
    if isinstance(schema, str):
        schema = _decode_schema(schema, param)
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("a JSON schema must be an object", param=param)
    return GrammarSpec("json", json.dumps(closed_objects(schema), ensure_ascii=False), param)


# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                  "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_LIST_OF_SUBSCHEMAS = ("anyOf", "oneOf", "prefixItems", "items")
_MAP_OF_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, *, in_all_of: bool = False) -> Any:
    """The schema with `"additionalProperties": false` on every object schema that lists `properties`
    and says nothing of others, as xgrammar and outlines (vLLM's defaults) read schemas: a model
    then writes the keys the schema names, instead of inventing more until max_tokens. An object
    that says `additionalProperties` (true or a schema) or `unevaluatedProperties` keeps its word, and
    the parts of an `allOf` stay open, since each lists only some of the properties the whole allows."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE_SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _LIST_OF_SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(item) for item in out[key]]
    for key in _MAP_OF_SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(item, in_all_of=True) for item in out["allOf"]]
    lists_properties = isinstance(out.get("properties"), dict)
    if (lists_properties and not in_all_of and "allOf" not in out
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def _decode_schema(text: str, param: str) -> Any:
    """A schema sent as JSON text, decoded with the same depth bound as the request body's objects."""
    try:
        return limits.decode_json_bounded(text)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}", param=param) from None
    except InvalidRequest as exc:  # nested too deeply
        raise InvalidRequest(str(exc), param=param, code=exc.code) from None


def choice_spec(choices: list[str], param: str) -> GrammarSpec:
    if not choices or any(not isinstance(c, str) for c in choices):
        raise InvalidRequest("choice must be a non-empty list of strings", param=param)
    return GrammarSpec("choice", json.dumps(choices, ensure_ascii=False), param)


# --------------------------------------------------------------------------- tools
def tool_plan(fields: p.ChatFields, *, supports_tools: bool) -> ToolPlan:
    tools, tools_param = _tools(fields)
    choice, choice_param = _tool_choice(fields)
    if choice == "none" or not tools:
        if choice not in ("none", "auto"):
            raise InvalidRequest(f"{choice_param} needs tools to choose from", param=choice_param)
        return ToolPlan(())
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param=tools_param)
    single = fields.parallel_tool_calls is False
    if not supports_tools:
        return _generic_plan(tools, choice, choice_param, single)
    if isinstance(choice, dict):
        name = choice["name"]
        if name not in names:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the tools", param=choice_param)
        tool = tools[names.index(name)]
        return ToolPlan(tools, json_spec(_call_schema([tool]), choice_param), forced=True, max_calls=1)
    if choice == "required":
        schema = _calls_schema(_call_schema(tools), single)
        return ToolPlan(tools, json_spec(schema, choice_param), forced=True, max_calls=1 if single else None)
    strict = [tool for tool, given in zip(tools, _given_tools(fields)) if given.strict]
    grammar = _auto_strict_grammar(tools, strict, single) if strict else None
    return ToolPlan(tools, grammar, max_calls=1 if single else None)


def _generic_plan(tools: tuple[ToolDefinition, ...], choice: str | dict[str, str], choice_param: str,
                  single: bool) -> ToolPlan:
    """The generic format's grammar: a reply or calls under auto, calls only under required, one
    call of the named function; every call's arguments follow its function's parameters."""
    if isinstance(choice, dict):
        if choice["name"] not in [tool.name for tool in tools]:
            raise InvalidRequest(f"tool_choice names function {choice['name']!r}, which is not among the tools",
                                 param=choice_param)
        called, single = [tool for tool in tools if tool.name == choice["name"]], True
    else:
        called = list(tools)
    call = _call_schema(called)
    defs = call.pop("$defs", None)
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if single else {})}
    options = [{"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                "additionalProperties": False}]
    if choice == "auto":
        options.append({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                        "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return ToolPlan(tools, json_spec(schema, "tools"), forced=choice != "auto", max_calls=1 if single else None,
                    generic=True)


def _given_tools(fields: p.ChatFields) -> list[p.FunctionDefinition]:
    if fields.tools:
        return [tool.function for tool in fields.tools]
    return list(fields.functions or ())


def _tools(fields: p.ChatFields) -> tuple[tuple[ToolDefinition, ...], str]:
    if fields.tools and fields.functions:
        raise InvalidRequest("send tools or the deprecated functions, not both", param="functions")
    param = "functions" if fields.functions else "tools"
    tools = tuple(ToolDefinition(f.name, f.description, f.parameters) for f in _given_tools(fields))
    return tools, param


def _tool_choice(fields: p.ChatFields) -> tuple[str | dict[str, str], str]:
    """"none" | "auto" | "required" | {"name": f}, and the field it came from."""
    if fields.tool_choice is not None and fields.function_call is not None:
        raise InvalidRequest("send tool_choice or the deprecated function_call, not both", param="function_call")
    if fields.function_call is not None:
        value, param = fields.function_call, "function_call"
        default = "auto"
    else:
        value, param = fields.tool_choice, "tool_choice"
        default = "auto"
    if value is None:
        return default, param
    if isinstance(value, str):
        allowed = ("none", "auto") if param == "function_call" else ("none", "auto", "required")
        if value not in allowed:
            raise InvalidRequest(f"{param} must be one of {', '.join(allowed)} or a named function", param=param)
        return value, param
    function = value.get("function") if param == "tool_choice" else value
    if param == "tool_choice" and value.get("type", "function") != "function":
        raise InvalidRequest("tool_choice type must be 'function'", param="tool_choice.type")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or set(function) - {"name"}:
        where = "tool_choice.function" if param == "tool_choice" else param
        raise InvalidRequest(f"{where} must be {{\"name\": <function name>}}", param=where)
    if param == "tool_choice" and set(value) - {"type", "function"}:
        raise InvalidRequest("tool_choice may hold only type and function", param="tool_choice")
    return {"name": function["name"]}, param


def _rebased(value: Any, base: str) -> Any:
    """A schema moved under `base` (a JSON pointer): its local `$ref`s ("#/$defs/X", "#") follow it."""
    if isinstance(value, dict):
        out = {k: _rebased(v, base) for k, v in value.items()}
        ref = value.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = "#" + base + ref[1:]
        return out
    if isinstance(value, list):
        return [_rebased(v, base) for v in value]
    return value


def _call_schema(tools: Sequence[ToolDefinition], constrained: Sequence[ToolDefinition] | None = None) -> dict[str, Any]:
    """One call of any of the tools: {"name": <its name>, "arguments": <its parameters>}. Each
    tool's parameters live under $defs (their own $refs rebased), so pydantic's nested models
    resolve. Tools outside `constrained` (default: all) take any object."""
    constrained = tools if constrained is None else constrained
    defs: dict[str, Any] = {}
    options = []
    for k, tool in enumerate(tools):
        arguments: dict[str, Any] = ANY_OBJECT
        if tool in constrained and tool.parameters:
            defs[f"tool{k}"] = _rebased(tool.parameters, f"/$defs/tool{k}")
            arguments = {"$ref": f"#/$defs/tool{k}"}
        options.append({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


def _calls_schema(call: dict[str, Any], single: bool, *, either: bool = False) -> dict[str, Any]:
    """One call, or a non-empty list of calls (either: one or a list); $defs stay at the root."""
    if single:
        return call
    defs = call.get("$defs")
    item = {k: v for k, v in call.items() if k != "$defs"}
    many: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    schema = {"anyOf": [item, many]} if either else many
    return {**schema, "$defs": defs} if defs else schema


def _auto_strict_grammar(tools: tuple[ToolDefinition, ...], strict: list[ToolDefinition], single: bool) -> GrammarSpec:
    """Text that does not open a JSON value, or calls whose arguments follow their schemas (the
    schemas of strict tools; any object for the others)."""
    calls = closed_objects(_calls_schema(_call_schema(tools, strict), single, either=True))
    # %json takes its layout options from the schema (the engine's JSON_OPTIONS apply to "json" specs only)
    schema = json.dumps({**calls, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
    lark = f"start: calls | text\ncalls: %json {schema}\ntext: /([^\\[{{\\s][\\s\\S]*)?/\n"
    return GrammarSpec("lark", lark, "tools")
