"""engine/chat/generic_tools.py: the generic tool format's prompt, dialog and streamed parser."""

from __future__ import annotations

import itertools
import json

import pytest

from engine.chat.generic_tools import GenericToolParser, generic_dialog, tool_prompt
from engine.types import ChatMessage, ToolCall, ToolDefinition

WEATHER = ToolDefinition("weather", "Current weather", {"type": "object", "properties": {"city": {"type": "string"}}})


def parse(text: str, pieces: int) -> tuple[str, list, object]:
    """Feed text in pieces of `pieces` characters; (streamed content, streamed call deltas, final output)."""
    counter = itertools.count()
    parser = GenericToolParser(new_call_id=lambda: f"call_{next(counter)}")
    content, deltas = "", []
    for i in range(0, len(text), pieces):
        out = parser.push(text[i : i + pieces])
        content += out.content
        deltas += out.tool_calls
    return content, deltas, parser.finish(None)


@pytest.mark.parametrize("pieces", [1, 2, 3, 7, 1000])
def test_a_reply_streams_as_decoded_text(pieces):
    reply = 'Say "hi" \\ to Zoë 😀\n\ttab/slash'
    text = json.dumps({"response": reply}, ensure_ascii=True)  # \\u escapes and a surrogate pair
    content, deltas, final = parse(text, pieces)
    assert content == reply and deltas == []
    assert final.content == reply and final.tool_calls == []


@pytest.mark.parametrize("pieces", [1, 4, 1000])
def test_calls_stream_name_then_arguments(pieces):
    text = json.dumps({"tool_calls": [{"name": "weather", "arguments": {"city": "Oslo {x}"}},
                                      {"name": "time", "arguments": {}}]})
    content, deltas, final = parse(text, pieces)
    assert content == ""
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in final.tool_calls] == [
        ("call_0", "weather", {"city": "Oslo {x}"}), ("call_1", "time", {})]
    assert final.content is None
    assert [d.name for d in deltas if d.name] == ["weather", "time"]
    streamed = {i: "".join(d.arguments for d in deltas if d.index == i) for i in (0, 1)}
    assert streamed == {0: final.tool_calls[0].arguments, 1: final.tool_calls[1].arguments}


def test_an_answer_cut_before_its_shape_is_known_is_text():
    content, deltas, final = parse('{"to', 1)
    assert (content, deltas, final.content, final.tool_calls) == ("", [], '{"to', [])
    cut = parse('{"response": "half \\u00', 2)[2]  # a cut escape is left out, not garbled
    assert cut.content == "half "


def test_prompt_and_dialog_show_tools_calls_and_results_as_text():
    dialog = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Oslo and Rome?"),
        ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "weather", '{"city": "Oslo"}'),
                                                 ToolCall("c2", "weather", '{"city": "Rome"}')]),
        ChatMessage("tool", "cold", tool_call_id="c1"),
        ChatMessage("tool", "warm", tool_call_id="c2"),
    ]
    out = generic_dialog(dialog, [WEATHER])
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert out[0].content == "Be brief.\n\n" + tool_prompt([WEATHER]) and '"name": "weather"' in out[0].content
    assert json.loads(out[2].content) == {"tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}},
                                                         {"name": "weather", "arguments": {"city": "Rome"}}]}
    assert [json.loads(line) for line in out[3].content.splitlines()] == [
        {"tool_response": {"name": "weather", "tool_call_id": "c1", "content": "cold"}},
        {"tool_response": {"name": "weather", "tool_call_id": "c2", "content": "warm"}}]
    assert all(not m.tool_calls and m.tool_call_id is None for m in out)
    assert generic_dialog(dialog[1:2], [WEATHER])[0] == ChatMessage("system", tool_prompt([WEATHER]))
