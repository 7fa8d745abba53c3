"""The Responses and Messages APIs' parameter tables (compat/params.py) against their Structs, the
installed SDKs' request fields and README; the translation of each into a chat request."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import msgspec
import pytest

from compat import anthropic as a
from compat import params as policy
from compat import responses as r
from engine.types import InvalidRequest

README = Path(__file__).resolve().parents[2] / "README.md"
NESTED = {"text", "stream_options"}  # classified by their own fields, dotted


def struct_fields(struct_type: type) -> set[str]:
    names = set()
    for field in msgspec.structs.fields(struct_type):
        if field.name in NESTED:
            nested = [t for t in typing.get_args(field.type) if isinstance(t, type) and issubclass(t, msgspec.Struct)]
            names |= {f"{field.name}.{f.name}" for f in msgspec.structs.fields(nested[0])}
        else:
            names.add(field.name)
    return names


@pytest.mark.parametrize(("endpoint", "struct_type"), [("responses", r.ResponsesRequest), ("messages", a.MessagesRequest)])
def test_table_and_struct_agree(endpoint, struct_type):
    rows = {row.name for row in policy.rows(endpoint)}
    assert struct_fields(struct_type) == rows


def test_tables_cover_the_installed_sdks():
    import anthropic.resources.messages as messages
    import openai.types.responses.response_create_params as responses

    openai_fields = set(typing.get_type_hints(responses.ResponseCreateParamsBase)) | {"stream"}
    openai_fields = {f"{name}.format" if name == "text" else name for name in openai_fields}
    openai_fields = {f"{name}.include_obfuscation" if name == "stream_options" else name for name in openai_fields}
    assert openai_fields - {row.name for row in policy.rows("responses")} == set()
    sdk = set(inspect.signature(messages.AsyncMessages.create).parameters) - {"self", "extra_headers", "extra_query",
                                                                               "extra_body", "timeout"}
    assert sdk - {row.name for row in policy.rows("messages")} == set()


def test_readme_holds_the_tables():
    text = README.read_text()
    assert policy.markdown_table(policy.RESPONSES_PARAMETERS, policy.RESPONSES_TABLE) in text
    assert policy.markdown_table(policy.MESSAGES_PARAMETERS, policy.MESSAGES_TABLE) in text


@pytest.mark.parametrize(("body", "param"), [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_refused_responses_parameters(body, param):
    req = msgspec.json.decode(msgspec.json.encode({"model": "m", "input": "x", **body}), type=r.ResponsesRequest)
    with pytest.raises(InvalidRequest) as info:
        r.check_request(req)
    assert info.value.param == param and info.value.code == "unsupported_parameter"


@pytest.mark.parametrize("body", [{"reasoning": {}}, {"text": {"verbosity": "medium"}}, {"top_logprobs": 0},
                                  {"truncation": "disabled"}, {"include": ["reasoning.encrypted_content"]}])
def test_no_op_values_pass(body):
    r.check_request(msgspec.json.decode(msgspec.json.encode({"model": "m", "input": "x", **body}),
                                        type=r.ResponsesRequest))


def test_responses_request_as_chat():
    req = msgspec.json.decode(msgspec.json.encode({
        "model": "m", "instructions": "sys", "max_output_tokens": 7, "temperature": 0.5, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "City", "schema": {"type": "object"}, "strict": True}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                      "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "ok"}]}), type=r.ResponsesRequest)
    chat = r.to_chat(req, [], r.input_items(req.input))
    assert [type(m).__name__ for m in chat.messages] == ["SystemMessage", "UserMessage", "AssistantMessage", "ToolMessage"]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.parallel_tool_calls is False
    assert chat.response_format.json_schema.name == "City" and chat.response_format.json_schema.strict is True
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.tools[0].function.strict is True  # the Responses API's default


def test_messages_request_as_chat():
    req = msgspec.json.decode(msgspec.json.encode({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "stop_sequences": ["END"], "top_k": 3, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                   "content": [{"type": "text", "text": "boom"}]}]}]}),
        type=a.MessagesRequest)
    chat = a.to_chat(req)
    assert [(type(m).__name__, m.content) for m in chat.messages] == [
        ("SystemMessage", "ab"), ("UserMessage", "q"), ("AssistantMessage", None), ("ToolMessage", "Error: boom")]
    assert chat.messages[2].tool_calls[0].function.arguments == '{"x": 1}'
    assert (chat.max_tokens, chat.stop, chat.top_k, chat.tool_choice, chat.parallel_tool_calls) == (
        9, ["END"], 3, "required", False)
