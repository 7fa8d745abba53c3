"""compat/structured.py: which request fields become which constraint, and the tool-call grammars."""

from __future__ import annotations

import json

import msgspec
import pytest

from compat import protocol as p
from compat.structured import grammar_spec, tool_plan
from engine.core.structured import GrammarCompiler, _TokenizerView
from engine.types import InvalidRequest
from tests.engine.tokenizer_fixtures import tiny_llama2

ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "parameters": {}}}]


def chat(**fields) -> p.ChatCompletionRequest:
    return p.CHAT_DECODER.decode(json.dumps({**ASK, **fields}).encode())


@pytest.mark.parametrize("fields,kind,param", [
    ({"response_format": {"type": "json_object"}}, "json", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}},
     "json", "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": WEATHER}}, "json", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, "grammar", "structured_outputs.grammar"),
    ({"guided_json": json.dumps(WEATHER)}, "json", "guided_json"),
    ({"guided_regex": "a+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a"]}, "choice", "guided_choice"),
    ({"guided_grammar": "start: \"a\""}, "grammar", "guided_grammar"),
])
def test_each_field_becomes_one_spec(fields, kind, param):
    spec = grammar_spec(chat(**fields))
    assert (spec.kind, spec.param) == (kind, param)
    if kind == "json":
        assert isinstance(json.loads(spec.source), dict)


def test_equal_schemas_are_equal_specs_and_text_is_free():
    assert grammar_spec(chat()) is None and grammar_spec(chat(response_format={"type": "text"})) is None
    a = grammar_spec(chat(guided_json=WEATHER))
    b = grammar_spec(chat(structured_outputs={"json": json.dumps(WEATHER)}))
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "time", "x": 1}}}, "tool_choice.function"),
    ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "auto", "function_call": "auto"}, "function_call"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
])
def test_bad_tool_choices_name_their_field(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        tool_plan(chat(**fields), supports_tools=True)
    assert caught.value.param == param


def test_tool_plans():
    assert tool_plan(chat(tools=TOOLS, tool_choice="none"), supports_tools=False).tools == ()
    generic = tool_plan(chat(tools=TOOLS), supports_tools=False)  # a format that cannot show tools: the generic one
    assert generic.generic and len(generic.tools) == 2 and generic.grammar is not None and not generic.forced
    auto = tool_plan(chat(tools=TOOLS), supports_tools=True)
    assert len(auto.tools) == 2 and auto.grammar is None and not auto.forced and auto.max_calls is None
    required = tool_plan(chat(tools=TOOLS, tool_choice="required"), supports_tools=True)
    assert required.forced and json.loads(required.grammar.source)["type"] == "array"
    single = tool_plan(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), supports_tools=True)
    assert single.max_calls == 1 and "anyOf" in json.loads(single.grammar.source)
    named = tool_plan(chat(functions=[t["function"] for t in TOOLS], function_call={"name": "weather"}), supports_tools=True)
    schema = json.loads(named.grammar.source)
    assert named.forced and schema["properties"]["name"] == {"const": "weather"}
    assert schema["$defs"]["tool0"] == WEATHER


def test_strict_tools_under_auto_constrain_calls_only():
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    plan = tool_plan(chat(tools=strict), supports_tools=True)
    assert plan.grammar is not None and not plan.forced
    tokenizer = tiny_llama2()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    view = _TokenizerView(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    for text, allowed in [
        ("It is sunny.", True),
        ('{"name": "weather", "arguments": {"city": "Oslo"}}', True),
        ('[{"name": "time", "arguments": {"any": 1}}]', True),  # not strict: any object
        ('{"name": "weather", "arguments": {"town": "Oslo"}}', False),  # strict: the schema holds
        ('{"name": "sing", "arguments": {}}', False),
        (" {", False),  # JSON after blanks would escape the schema
    ]:
        matcher = compiler.new_state(compiler.compile(plan.grammar)).matcher
        ok = all(matcher.consume_token(t) for t in view._greedy(text.encode())) and matcher.is_accepting()
        assert ok == allowed, text


def test_response_format_type_is_checked_at_decode():
    with pytest.raises(msgspec.ValidationError):
        p.CHAT_DECODER.decode(json.dumps({**ASK, "response_format": {"type": "xml"}}).encode())


def test_forced_calls_stream_their_arguments_in_pieces():
    from engine.chat.tool_parser import JsonCallStreamParser

    text = '[{"name": "weather", "arguments": {"city": "x}\\"{", "days": [1, {"n": 2}]}}, {"name": "time", "arguments": {}}]'
    ids = iter(f"call_{i}" for i in range(100))
    parser = JsonCallStreamParser(new_call_id=lambda: next(ids))
    deltas = [d for ch in text for d in parser.push(ch).tool_calls]
    parsed = parser.finish(stop_token_id=7)
    assert [(c.call_id, c.name, c.arguments) for c in parsed.tool_calls] == [
        ("call_0", "weather", '{"city": "x}\\"{", "days": [1, {"n": 2}]}'), ("call_1", "time", "{}")]
    assert parsed.finish_reason == "tool_calls" and parsed.content is None
    firsts = [d for d in deltas if d.name is not None]
    assert [(d.index, d.call_id, d.name, d.arguments) for d in firsts] == [(0, "call_0", "weather", ""), (1, "call_1", "time", "")]
    assert "".join(d.arguments for d in deltas if d.index == 0) == parsed.tool_calls[0].arguments
    assert sum(1 for d in deltas if d.index == 0 and d.arguments) > 10  # piece by piece, as generated
    cut = JsonCallStreamParser()
    cut.push(text[:40])
    [partial] = cut.finish(stop_token_id=None).tool_calls  # finish_reason length: the partial call stays
    assert partial.name == "weather" and text[:40].endswith(partial.arguments)


def _accepts(compiler: GrammarCompiler, view: _TokenizerView, spec, text: str) -> bool:
    matcher = compiler.new_state(compiler.compile(spec)).matcher
    return all(matcher.consume_token(t) for t in view._greedy(text.encode())) and matcher.is_accepting()


def test_undeclared_properties_are_not_generated_unless_the_schema_allows_them():
    """As xgrammar and outlines: a schema without additionalProperties gets only the keys it lists
    (nested objects, $defs and array items too); additionalProperties true or a schema keeps others."""
    person = {"type": "object", "properties": {"first_name": {"type": "string"}, "address": {"$ref": "#/$defs/a"}},
              "required": ["first_name"], "$defs": {"a": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    people = {"type": "array", "items": {k: v for k, v in person.items() if k != "$defs"}, "$defs": person["$defs"]}
    open_ = {**person, "additionalProperties": True}
    typed = {**person, "additionalProperties": {"type": "integer"}}
    tokenizer = tiny_llama2()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    view = _TokenizerView(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    spec = grammar_spec(chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}}))
    for text, allowed in [
        ('{"first_name": "Michael"}', True),
        ('{"first_name": "Michael", "address": {"city": "Chicago"}}', True),
        ('{"first_name": "Michael", "family_name": "Jordan"}', False),
        ('{"first_name": "Michael", "address": {"city": "Chicago", "zip": "60601"}}', False),
    ]:
        assert _accepts(compiler, view, spec, text) == allowed, text
    assert not _accepts(compiler, view, grammar_spec(chat(guided_json=people)), '[{"first_name": "a", "x": 1}]')
    assert _accepts(compiler, view, grammar_spec(chat(guided_json=open_)), '{"first_name": "a", "x": "y"}')
    assert _accepts(compiler, view, grammar_spec(chat(guided_json=typed)), '{"first_name": "a", "x": 1}')
    assert not _accepts(compiler, view, grammar_spec(chat(guided_json=typed)), '{"first_name": "a", "x": "y"}')
    # json_object and schemas that list no properties stay any object
    assert _accepts(compiler, view, grammar_spec(chat(response_format={"type": "json_object"})), '{"k": 1}')
    assert _accepts(compiler, view, grammar_spec(chat(guided_json={"type": "object"})), '{"k": 1}')


@pytest.mark.parametrize("fields,texts", [
    ({}, [('{"response": "It is \\"sunny\\"."}', True),
          ('{"tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]}', True),
          ('{"tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "time", "arguments": {}}]}', True),
          ('{"tool_calls": [{"name": "weather", "arguments": {"town": "Oslo"}}]}', False),  # arguments follow parameters
          ('{"tool_calls": []}', False), ('{"tool_calls": [{"name": "sing", "arguments": {}}]}', False),
          ("It is sunny.", False), ('{"response": "a", "x": 1}', False)]),
    ({"tool_choice": "required"}, [('{"response": "no"}', False),
                                   ('{"tool_calls": [{"name": "time", "arguments": {}}]}', True)]),
    ({"parallel_tool_calls": False}, [
        ('{"tool_calls": [{"name": "time", "arguments": {}}, {"name": "time", "arguments": {}}]}', False),
        ('{"tool_calls": [{"name": "time", "arguments": {}}]}', True), ('{"response": "ok"}', True)]),
    ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, [
        ('{"tool_calls": [{"name": "time", "arguments": {}}]}', False), ('{"response": "no"}', False),
        ('{"tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]}', True)]),
])
def test_generic_tool_format_grammar_allows_a_reply_or_calls_as_tool_choice_says(fields, texts):
    plan = tool_plan(chat(tools=TOOLS, **fields), supports_tools=False)
    assert plan.generic and plan.forced == ("tool_choice" in fields)
    tokenizer = tiny_llama2()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    view = _TokenizerView(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    for text, allowed in texts:
        assert _accepts(compiler, view, plan.grammar, text) == allowed, text
