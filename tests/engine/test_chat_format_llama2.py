"""Llama 2 prompts, token for token, on a tiny sentencepiece model with Llama 2's settings."""

from __future__ import annotations

import pytest

from engine.chat.format import make_chat_format
from engine.types import ChatMessage, InvalidRequest, ToolCall, ToolDefinition
from tests.engine.tokenizer_fixtures import tiny_llama2

BOS, EOS = 1, 2  # <s>, </s>


@pytest.fixture(scope="module")
def tok():
    return tiny_llama2()


@pytest.fixture(scope="module")
def chat(tok):
    return make_chat_format("llama2", tok)


def test_system_and_multi_turn_exact_ids(chat):
    ids = chat.encode_dialog(
        [
            ChatMessage("system", "Be nice."),
            ChatMessage("user", "Hi"),
            ChatMessage("assistant", "Hello!"),
            ChatMessage("user", "Bye"),
        ]
    )
    assert ids == [
        1,  # <s>
        # "[INST] <<SYS>>\nBe nice.\n<</SYS>>\n\nHi [/INST] Hello! " in the tiny vocabulary
        272, 273, 375, 266, 265, 263, 13, 69, 344, 343, 355, 354, 363, 344, 366, 13, 262, 362, 265, 263, 13, 13,
        75, 354, 336, 273, 375, 343, 75, 344, 279, 396, 343,
        2,  # </s>
        1,  # <s>
        272, 273, 375, 343, 69, 368, 344, 336, 273, 375,  # "[INST] Bye [/INST]"
    ]  # fmt: skip


def test_matches_the_reference_construction(tok, chat):
    # Meta's llama/generation.py chat_completion: pairs with BOS/EOS, contents stripped
    dialog = [("user", " What? "), ("assistant", " This. "), ("user", "Ok\n")]
    expected = tok.encode("[INST] What? [/INST] This. ", bos=True, eos=True) + tok.encode("[INST] Ok [/INST]", bos=True)
    assert chat.encode_dialog([ChatMessage(r, c) for r, c in dialog]) == expected


def test_consecutive_messages_of_one_role_are_joined(tok, chat):
    ids = chat.encode_dialog([ChatMessage("system", "A"), ChatMessage("system", "B"), ChatMessage("user", "x"), ChatMessage("user", "y")])
    assert ids == tok.encode("[INST] <<SYS>>\nA\n\nB\n<</SYS>>\n\nx\n\ny [/INST]", bos=True)


@pytest.mark.parametrize(
    ("messages", "tools", "param"),
    [
        ([ChatMessage("user", "Hi")], [ToolDefinition("f")], "tools"),
        ([ChatMessage("user", "Hi"), ChatMessage("assistant", "Yo")], [], "messages"),
        ([ChatMessage("assistant", "Yo"), ChatMessage("user", "Hi")], [], "messages"),
        ([ChatMessage("user", "Hi"), ChatMessage("system", "late"), ChatMessage("user", "x")], [], "messages[1].role"),
        ([ChatMessage("user", "Hi"), ChatMessage("assistant", "", tool_calls=[ToolCall("c", "f", "{}")])], [], "messages[1]"),
        ([ChatMessage("user", "Hi"), ChatMessage("tool", "x", tool_call_id="c")], [], "messages[1]"),
    ],
)
def test_what_llama2_cannot_express_is_refused(chat, messages, tools, param):
    with pytest.raises(InvalidRequest) as err:
        chat.encode_dialog(messages, tools=tools)
    assert err.value.param == param


def test_parser_is_content_only(chat):
    parser = chat.output_parser(())
    assert parser.push("[f()]").content == "[f()]"
    assert parser.finish(2).finish_reason == "stop"
    assert not chat.supports_tools and not chat.parser_needs_special_tokens
