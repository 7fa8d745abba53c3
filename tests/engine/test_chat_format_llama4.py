"""Llama 4 prompts, token for token. Tool turns as Llama 4 is served: the typo'd tool system prompt
then the definitions, pythonic calls with no <|python_start|>/<|python_end|>, and both the
assistant's tool-call message and each tool result closed by <|eom|>."""

from __future__ import annotations

import json

import pytest

from engine.chat.format import make_chat_format
from engine.chat.llama4 import TOOLS_SYSTEM_PROMPT
from engine.types import ChatMessage, InvalidRequest, ToolCall, ToolDefinition
from tests.engine.tokenizer_fixtures import real_llama4

BOT = 200000  # <|begin_of_text|>
HS, HE = 200005, 200006  # <|header_start|>, <|header_end|>
EOM, EOT = 200007, 200008  # <|eom|>, <|eot|>
PYTHON_START, PYTHON_END = 200016, 200017  # <|python_start|>, <|python_end|>

WEATHER = ToolDefinition(
    "get_weather",
    "Get weather info for places",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


@pytest.fixture(scope="module")
def tok():
    return real_llama4()


@pytest.fixture(scope="module")
def chat(tok):
    return make_chat_format("llama4", tok)


def seq(tok, *parts) -> list[int]:
    ids: list[int] = []
    for part in parts:
        ids.extend([part] if isinstance(part, int) else tok.encode(part))
    return ids


def header(tok, role):
    return seq(tok, HS, role, HE, "\n\n")


def test_the_tool_system_prompt_keeps_its_typos():
    assert TOOLS_SYSTEM_PROMPT == (
        "You are a helpful assisant who can can answer general questions or invoke tools when necessary.\n"
        "In addition to tool calls, you should also augment your responses by using the tool outputs."
    )


def test_system_and_user_exact_ids(chat):
    ids = chat.encode_dialog([ChatMessage("system", "You are a helpful assistant"), ChatMessage("user", "Who are you?")])
    assert ids == [
        200000,  # <|begin_of_text|>
        200005, 15651, 200006, 368,  # <|header_start|>system<|header_end|>\n\n
        4662, 583, 262, 19933, 43910,  # You are a helpful assistant
        200008,  # <|eot|>
        200005, 1556, 200006, 368,  # <|header_start|>user<|header_end|>\n\n
        33267, 583, 650, 43,  # Who are you?
        200008,  # <|eot|>
        200005, 140680, 200006, 368,  # <|header_start|>assistant<|header_end|>\n\n
    ]  # fmt: skip


def test_multi_turn_exact_ids(chat):
    ids = chat.encode_dialog([ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!"), ChatMessage("user", "Hi")])
    assert ids == [
        200000,  # <|begin_of_text|>
        200005, 1556, 200006, 368, 25181, 200008,  # <|header_start|>user<|header_end|>\n\nHi<|eot|>
        200005, 140680, 200006, 368, 19873, 13, 200008,  # ...assistant...\n\nHello!<|eot|>
        200005, 1556, 200006, 368, 25181, 200008,  # ...user...\n\nHi<|eot|>
        200005, 140680, 200006, 368,  # <|header_start|>assistant<|header_end|>\n\n
    ]  # fmt: skip


def test_tools_system_prompt_then_definitions_then_callers_system(tok, chat):
    ids = chat.encode_dialog([ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in SF?")], tools=[WEATHER])
    definitions = json.dumps(
        [{"name": WEATHER.name, "description": WEATHER.description, "parameters": WEATHER.parameters}], indent=4
    )
    system = (
        TOOLS_SYSTEM_PROMPT + "\n\nHere is a list of functions in JSON format that you can invoke.\n\n" + definitions + "\n\nBe brief."
    )
    assert ids == seq(
        tok, BOT, *header(tok, "system"), system, EOT,
        *header(tok, "user"), "Weather in SF?", EOT, *header(tok, "assistant"),
    )  # fmt: skip


def test_multi_turn_tool_use_ends_tool_turns_with_eom(tok, chat):
    calls = [ToolCall("call_a", "get_weather", '{"city": "SF"}'), ToolCall("call_b", "get_weather", '{"city": "Seattle"}')]
    messages = [
        ChatMessage("user", "SF and Seattle?"),
        ChatMessage("assistant", "", tool_calls=calls),
        ChatMessage("tool", "12 C", tool_call_id="call_b"),
        ChatMessage("tool", "25 C", tool_call_id="call_a"),
        ChatMessage("assistant", "SF is 25 C, Seattle 12 C."),
        ChatMessage("user", "And Oslo?"),
        ChatMessage("assistant", "", tool_calls=[ToolCall("call_c", "get_weather", '{"city": "Oslo"}')]),
        ChatMessage("tool", "3 C", tool_call_id="call_c"),
    ]
    ids = chat.encode_dialog(messages, tools=[WEATHER])
    tail = seq(
        tok, *header(tok, "user"), "SF and Seattle?", EOT,
        *header(tok, "assistant"), '[get_weather(city="SF"), get_weather(city="Seattle")]', EOM,
        *header(tok, "ipython"), "25 C", EOM,  # results in call order, each closed by <|eom|>
        *header(tok, "ipython"), "12 C", EOM,
        *header(tok, "assistant"), "SF is 25 C, Seattle 12 C.", EOT,
        *header(tok, "user"), "And Oslo?", EOT,
        *header(tok, "assistant"), '[get_weather(city="Oslo")]', EOM,
        *header(tok, "ipython"), "3 C", EOM,
        *header(tok, "assistant"),
    )  # fmt: skip
    assert ids[-len(tail) :] == tail
    assert PYTHON_START not in ids and PYTHON_END not in ids


def test_assistant_text_before_its_calls_is_kept(tok, chat):
    messages = [
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Checking. ", tool_calls=[ToolCall("c", "get_weather", '{"city": "Rome", "days": [1, 2], "f": true}')]),
    ]
    ids = chat.encode_dialog(messages, tools=[WEATHER], add_generation_prompt=False)
    assert ids[-len(seq(tok, 'Checking. [get_weather(city="Rome", days=[1, 2], f=True)]', EOM)) :] == seq(
        tok, 'Checking. [get_weather(city="Rome", days=[1, 2], f=True)]', EOM
    )


def test_a_tool_message_without_a_call_is_refused(chat):
    with pytest.raises(InvalidRequest) as err:
        chat.encode_dialog([ChatMessage("user", "Hi"), ChatMessage("tool", "x", tool_call_id="c")], tools=[WEATHER])
    assert err.value.param == "messages[1]"
    assert chat.parser_needs_special_tokens and chat.supports_tools
