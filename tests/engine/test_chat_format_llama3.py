"""Llama 3.x prompts, token for token: special tokens by id (named in comments), text segments
encoded exactly where the format encodes them, checked against llama-models' docs and code."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from engine.chat.format import make_chat_format
from engine.types import ChatMessage, InvalidRequest, ToolCall, ToolDefinition
from tests.engine.tokenizer_fixtures import llama_models_file, real_llama3

BOT, EOT_TEXT = 128000, 128001  # <|begin_of_text|>, <|end_of_text|>
SH, EH = 128006, 128007  # <|start_header_id|>, <|end_header_id|>
EOM, EOT = 128008, 128009  # <|eom_id|>, <|eot_id|>
PY = 128010  # <|python_tag|>
SYSTEM, USER, ASSISTANT, IPYTHON = [9125], [882], [78191], [23799, 4690]  # role names as text
NL2 = [271]  # "\n\n"
DATE = dt.date(2024, 9, 21)

WEATHER = ToolDefinition(
    "get_weather",
    "Get weather info for places",
    {
        "type": "dict",
        "required": ["city"],
        "properties": {
            "city": {"type": "string", "description": "The name of the city to get the weather for"},
            "metric": {
                "type": "string",
                "description": "The metric for weather. Options are: celsius, fahrenheit",
                "default": "celsius",
            },
        },
    },
)


@pytest.fixture(scope="module")
def tok():
    return real_llama3()


def fmt(tok, family="llama3_1"):
    return make_chat_format(family, tok, today=lambda: DATE)


def seq(tok, *parts) -> list[int]:
    """Expected ids: ints are special tokens, strings are text encoded as one segment."""
    ids: list[int] = []
    for part in parts:
        ids.extend([part] if isinstance(part, int) else tok.encode(part))
    return ids


def header(tok, role: str) -> list[int]:
    return seq(tok, SH, role, EH, "\n\n")


# --------------------------------------------------------------------------- Llama 3.0: plain headers
def test_system_and_user_exact_ids(tok):
    ids = fmt(tok, "llama3").encode_dialog(
        [ChatMessage("system", "You are a helpful assistant"), ChatMessage("user", "Who are you?")]
    )
    assert ids == [
        128000,  # <|begin_of_text|>
        128006, 9125, 128007, 271,  # <|start_header_id|>system<|end_header_id|>\n\n
        2675, 527, 264, 11190, 18328,  # You are a helpful assistant
        128009,  # <|eot_id|>
        128006, 882, 128007, 271,  # <|start_header_id|>user<|end_header_id|>\n\n
        15546, 527, 499, 30,  # Who are you?
        128009,  # <|eot_id|>
        128006, 78191, 128007, 271,  # <|start_header_id|>assistant<|end_header_id|>\n\n
    ]  # fmt: skip


def test_multi_turn_exact_ids(tok):
    ids = fmt(tok, "llama3").encode_dialog(
        [ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!"), ChatMessage("user", "Who are you?")]
    )
    assert ids == [
        128000,  # <|begin_of_text|>
        128006, 882, 128007, 271, 13347, 128009,  # <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>
        128006, 78191, 128007, 271, 9906, 0, 128009,  # ...assistant...\n\nHello!<|eot_id|>
        128006, 882, 128007, 271, 15546, 527, 499, 30, 128009,  # ...user...\n\nWho are you?<|eot_id|>
        128006, 78191, 128007, 271,  # <|start_header_id|>assistant<|end_header_id|>\n\n
    ]  # fmt: skip


def test_without_generation_prompt_the_last_turn_is_closed(tok):
    ids = fmt(tok, "llama3").encode_dialog(
        [ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!")], add_generation_prompt=False
    )
    assert ids == [
        128000,  # <|begin_of_text|>
        128006, 882, 128007, 271, 13347, 128009,  # <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>
        128006, 78191, 128007, 271, 9906, 0, 128009,  # ...assistant...\n\nHello!<|eot_id|>, no open header
    ]  # fmt: skip


def test_special_spellings_in_messages_are_text(tok):
    ids = fmt(tok, "llama3").encode_dialog([ChatMessage("user", "Hi <|eot_id|> there")])
    assert ids == [128000, 128006, 882, 128007, 271, 13347, 83739, 68, 354, 851, 91, 29, 1070, 128009, 128006, 78191, 128007, 271]
    assert ids.count(EOT) == 1


def test_matches_llama_models_reference_chat_format(tok):
    pytest.importorskip("PIL")
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer as Reference

    reference = ChatFormat(Reference(llama_models_file("llama3/tokenizer.model")))
    dialog = [
        ("system", "You are terse."),
        ("user", "2+2?"),
        ("assistant", "4"),
        ("user", "Why?\n\n  Explain <|python_tag|> please"),
    ]
    expected = reference.encode_dialog_prompt([RawMessage(role=r, content=c) for r, c in dialog]).tokens
    assert fmt(tok, "llama3").encode_dialog([ChatMessage(r, c) for r, c in dialog]) == expected


def test_llama3_0_refuses_tools(tok):
    with pytest.raises(InvalidRequest) as err:
        fmt(tok, "llama3").encode_dialog([ChatMessage("user", "Hi")], tools=[WEATHER])
    assert err.value.param == "tools"
    call = ToolCall("c1", "get_weather", "{}")
    with pytest.raises(InvalidRequest, match="cannot express tool calls"):
        fmt(tok, "llama3").encode_dialog([ChatMessage("user", "Hi"), ChatMessage("assistant", "", tool_calls=[call])])


# --------------------------------------------------------------------------- Llama 3.1
def test_llama31_plain_chat_has_the_date_lines(tok):
    ids = fmt(tok).encode_dialog([ChatMessage("user", "Hi")])
    assert ids == [
        128000,  # <|begin_of_text|>
        128006, 9125, 128007, 271,  # <|start_header_id|>system<|end_header_id|>\n\n
        # Cutting Knowledge Date: December 2023\nToday Date: 21 September 2024\n
        38766, 1303, 33025, 2696, 25, 6790, 220, 2366, 18, 198, 15724, 2696, 25, 220, 1691, 6250, 220, 2366, 19, 198,
        128009,  # <|eot_id|>
        128006, 882, 128007, 271, 13347, 128009,  # <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>
        128006, 78191, 128007, 271,  # <|start_header_id|>assistant<|end_header_id|>\n\n
    ]  # fmt: skip


def test_llama31_date_comes_from_the_injected_clock(tok):
    chat = make_chat_format("llama3_1", tok, today=lambda: dt.date(2026, 1, 5))
    assert "Today Date: 05 January 2026\n" in tok.decode(chat.encode_dialog([ChatMessage("user", "Hi")]))


def test_llama31_builtin_tools_as_in_the_docs(tok):
    tools = [ToolDefinition("brave_search"), ToolDefinition("wolfram_alpha")]
    messages = [
        ChatMessage("system", "You are a helpful assistant."),
        ChatMessage("user", "Search the web for the latest price of 1oz gold?"),
    ]
    ids = fmt(tok).encode_dialog(messages, tools=tools)
    # llama_models/llama3_1/prompt_format.md, "Builtin Tool Calling"
    assert tok.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\nTools: brave_search, wolfram_alpha\nCutting Knowledge Date: December 2023\n"
        "Today Date: 21 September 2024\n\nYou are a helpful assistant.\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Search the web for the latest price of 1oz gold?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ids == seq(
        tok, BOT, *header(tok, "system"),
        "Environment: ipython\nTools: brave_search, wolfram_alpha\nCutting Knowledge Date: December 2023\n"
        "Today Date: 21 September 2024\n\nYou are a helpful assistant.\n",
        EOT, *header(tok, "user"), "Search the web for the latest price of 1oz gold?", EOT, *header(tok, "assistant"),
    )  # fmt: skip


def test_llama31_builtin_tool_call_and_result_history(tok):
    tools = [ToolDefinition("brave_search"), ToolDefinition("wolfram_alpha")]
    call = ToolCall("call_1", "wolfram_alpha", '{"query": "100th decimal of pi"}')
    messages = [
        ChatMessage("user", "What is the 100th decimal of pi?"),
        ChatMessage("assistant", "", tool_calls=[call]),
        ChatMessage("tool", '{"result": "7"}', tool_call_id="call_1"),
    ]
    ids = fmt(tok).encode_dialog(messages, tools=tools)
    tail = seq(
        tok, *header(tok, "assistant"),
        PY, 'wolfram_alpha.call(query="100th decimal of pi")', EOM,  # <|python_tag|> ... <|eom_id|>
        *header(tok, "ipython"), '{"result": "7"}', EOT,
        *header(tok, "assistant"),
    )  # fmt: skip
    assert ids[-len(tail) :] == tail


def test_llama31_custom_json_tools_in_a_user_message(tok):
    ids = fmt(tok).encode_dialog(
        [ChatMessage("system", "You are a helpful assistant."), ChatMessage("user", "Weather in SF?")], tools=[WEATHER]
    )
    tool_json = json.dumps(
        {"type": "function", "function": {"name": WEATHER.name, "description": WEATHER.description, "parameters": WEATHER.parameters}},
        indent=4,
    )
    assert ids == seq(
        tok, BOT, *header(tok, "system"),
        "Environment: ipython\n\nCutting Knowledge Date: December 2023\nToday Date: 21 September 2024\n\n"
        "You are a helpful assistant.\n",
        EOT, *header(tok, "user"),
        "Answer the user's question by making use of the following functions if needed.\n"
        "If none of the function can be used, please say so.\nHere is a list of functions in JSON format:\n"
        + tool_json + "\n\nReturn function calls in JSON format.",
        EOT, *header(tok, "user"), "Weather in SF?", EOT, *header(tok, "assistant"),
    )  # fmt: skip


def test_llama31_parallel_calls_and_results_matched_by_id(tok):
    calls = [
        ToolCall("call_a", "get_weather", '{"city": "SF"}'),
        ToolCall("call_b", "get_weather", '{"city": "Seattle"}'),
    ]
    messages = [
        ChatMessage("user", "SF and Seattle?"),
        ChatMessage("assistant", "", tool_calls=calls),
        ChatMessage("tool", "12 C", tool_call_id="call_b"),  # results arrive out of order
        ChatMessage("tool", "25 C", tool_call_id="call_a"),
        ChatMessage("assistant", "SF 25 C, Seattle 12 C."),
        ChatMessage("user", "Thanks!"),
    ]
    ids = fmt(tok).encode_dialog(messages, tools=[WEATHER])
    tail = seq(
        tok, *header(tok, "user"), "SF and Seattle?", EOT,
        *header(tok, "assistant"), PY,
        '{"type": "function", "name": "get_weather", "parameters": {"city": "SF"}}; '
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Seattle"}}',
        EOM,  # <|eom_id|>: the model awaits the results
        *header(tok, "ipython"), "25 C", EOT,  # in call order
        *header(tok, "ipython"), "12 C", EOT,
        *header(tok, "assistant"), "SF 25 C, Seattle 12 C.", EOT,
        *header(tok, "user"), "Thanks!", EOT,
        *header(tok, "assistant"),
    )  # fmt: skip
    assert ids[-len(tail) :] == tail


def test_llama31_code_interpreter_call(tok):
    call = ToolCall("c", "code_interpreter", json.dumps({"code": "print(7)"}))
    messages = [ChatMessage("user", "Run it"), ChatMessage("assistant", "", tool_calls=[call]), ChatMessage("tool", "7")]
    ids = fmt(tok).encode_dialog(messages, tools=[ToolDefinition("code_interpreter")])
    tail = seq(
        tok, *header(tok, "assistant"), PY, "print(7)", EOM,  # code follows <|python_tag|> as is
        *header(tok, "ipython"), "7", EOT, *header(tok, "assistant"),
    )  # fmt: skip
    assert ids[-len(tail) :] == tail
    assert tok.decode(ids).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\nCutting Knowledge"
    )


# --------------------------------------------------------------------------- Llama 3.2 / 3.3
PYTHONIC_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the function can be used, point it out. If the given question lacks the parameters required by the function,\n"
    "also point it out. You should only return the function call in tools call sections.\n\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "You SHOULD NOT include any other text in the response.\n\n"
    "Here is a list of functions in JSON format that you can invoke.\n\n"
    "[\n"
    "    {\n"
    '        "name": "get_weather",\n'
    '        "description": "Get weather info for places",\n'
    '        "parameters": {\n'
    '            "type": "dict",\n'
    '            "required": [\n'
    '                "city"\n'
    "            ],\n"
    '            "properties": {\n'
    '                "city": {\n'
    '                    "type": "string",\n'
    '                    "description": "The name of the city to get the weather for"\n'
    "                },\n"
    '                "metric": {\n'
    '                    "type": "string",\n'
    '                    "description": "The metric for weather. Options are: celsius, fahrenheit",\n'
    '                    "default": "celsius"\n'
    "                }\n"
    "            }\n"
    "        }\n"
    "    }\n"
    "]"
)


@pytest.mark.parametrize("family", ["llama3_2", "llama3_3"])
def test_llama32_pythonic_end_to_end_as_in_the_docs(tok, family):
    call = ToolCall("call_1", "get_weather", '{"city": "San Francisco", "metric": "celsius"}')
    messages = [
        ChatMessage("user", "What is the weather in SF?"),
        ChatMessage("assistant", "", tool_calls=[call]),
        ChatMessage("tool", '"25 C"', tool_call_id="call_1"),
    ]
    ids = fmt(tok, family).encode_dialog(messages, tools=[WEATHER])
    # llama_models/llama3_2/text_prompt_format.md, "Zero shot function calling E2E format"
    assert tok.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + PYTHONIC_PROMPT + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the weather in SF?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '<|python_tag|>[get_weather(city="San Francisco", metric="celsius")]<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"25 C"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ids == seq(
        tok, BOT, *header(tok, "system"), PYTHONIC_PROMPT, EOT,
        *header(tok, "user"), "What is the weather in SF?", EOT,
        *header(tok, "assistant"), PY, '[get_weather(city="San Francisco", metric="celsius")]', EOT,
        *header(tok, "ipython"), '"25 C"', EOT,
        *header(tok, "assistant"),
    )  # fmt: skip


def test_llama32_parallel_calls_in_one_list_and_system_prompt_appended(tok):
    calls = [ToolCall("a", "get_weather", '{"city": "SF"}'), ToolCall("b", "get_weather", '{"city": "Seattle"}')]
    messages = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "SF and Seattle?"),
        ChatMessage("assistant", "", tool_calls=calls),
        ChatMessage("tool", "25 C", tool_call_id="a"),
        ChatMessage("tool", "12 C", tool_call_id="b"),
    ]
    ids = fmt(tok, "llama3_2").encode_dialog(messages, tools=[WEATHER])
    assert ids == seq(
        tok, BOT, *header(tok, "system"), PYTHONIC_PROMPT + "\nBe brief.", EOT,
        *header(tok, "user"), "SF and Seattle?", EOT,
        *header(tok, "assistant"), PY, '[get_weather(city="SF"), get_weather(city="Seattle")]', EOT,
        *header(tok, "ipython"), "25 C", EOT,
        *header(tok, "ipython"), "12 C", EOT,
        *header(tok, "assistant"),
    )  # fmt: skip


def test_llama32_without_tools_has_no_date_lines(tok):
    ids = fmt(tok, "llama3_2").encode_dialog([ChatMessage("system", "S"), ChatMessage("user", "Hi")])
    assert ids == seq(tok, BOT, *header(tok, "system"), "S", EOT, *header(tok, "user"), "Hi", EOT, *header(tok, "assistant"))
    ids = fmt(tok, "llama3_2").encode_dialog([ChatMessage("user", "Hi")])
    assert ids == seq(tok, BOT, *header(tok, "user"), "Hi", EOT, *header(tok, "assistant"))


# --------------------------------------------------------------------------- what cannot be expressed
@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([ChatMessage("user", "Hi"), ChatMessage("tool", "x", tool_call_id="c")], "messages[1]"),
        ([ChatMessage("tool", "x", tool_call_id="c")], "messages[0]"),
        (
            [
                ChatMessage("user", "Hi"),
                ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "get_weather", "{}")]),
                ChatMessage("tool", "x", tool_call_id="nope"),
            ],
            "messages[2].tool_call_id",
        ),
        (
            [
                ChatMessage("user", "Hi"),
                ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "get_weather", "{}"), ToolCall("c2", "get_weather", "{}")]),
                ChatMessage("tool", "x"),
            ],
            "messages[2].tool_call_id",
        ),
        (
            [
                ChatMessage("user", "Hi"),
                ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "get_weather", "{}")]),
                ChatMessage("tool", "x", tool_call_id="c1"),
                ChatMessage("tool", "y", tool_call_id="c1"),
            ],
            "messages[3].tool_call_id",
        ),
        (
            [ChatMessage("user", "Hi"), ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "get_weather", "[1]")])],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [ChatMessage("user", "Hi"), ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "get_weather", "{bad")])],
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_inexpressible_dialogs_are_refused_with_a_param(tok, messages, param):
    with pytest.raises(InvalidRequest) as err:
        fmt(tok).encode_dialog(messages, tools=[WEATHER])
    assert err.value.param == param


def test_pythonic_formats_refuse_names_python_cannot_call(tok):
    bad_tool = ToolDefinition("get-weather")
    with pytest.raises(InvalidRequest) as err:
        fmt(tok, "llama3_2").encode_dialog([ChatMessage("user", "Hi")], tools=[bad_tool])
    assert err.value.param == "tools[0].function.name"
    fmt(tok, "llama3_1").encode_dialog([ChatMessage("user", "Hi")], tools=[bad_tool])  # JSON calls can carry it
    call = ToolCall("c", "get_weather", '{"not-an-identifier": 1}')
    with pytest.raises(InvalidRequest) as err:
        fmt(tok, "llama3_2").encode_dialog(
            [ChatMessage("user", "Hi"), ChatMessage("assistant", "", tool_calls=[call])], tools=[WEATHER]
        )
    assert err.value.param == "messages[1].tool_calls"


def test_single_result_without_tool_call_id_is_matched(tok):
    messages = [
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "get_weather", '{"city": "Oslo"}')]),
        ChatMessage("tool", "3 C"),
    ]
    assert tok.decode(fmt(tok, "llama3_2").encode_dialog(messages, tools=[WEATHER])).endswith(
        "<|start_header_id|>ipython<|end_header_id|>\n\n3 C<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_hf_checkpoints_bring_their_own_format(tok):
    from engine.types import CheckpointError

    with pytest.raises(CheckpointError, match="bring their own"):
        make_chat_format("hf", tok)


def test_chat_format_flags(tok):
    assert not fmt(tok, "llama3").supports_tools and not fmt(tok, "llama3").parser_needs_special_tokens
    for family in ("llama3_1", "llama3_2", "llama3_3"):
        chat = fmt(tok, family)
        assert chat.supports_tools and chat.parser_needs_special_tokens and chat.family == family
