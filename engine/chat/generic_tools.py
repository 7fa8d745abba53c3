"""Tools for a model whose chat format or template cannot show them: a generic tool format.

In the spirit of llama.cpp's generic format (common/chat.cpp), which serves tools on any model:
- the tools are described in the system prompt (`tool_prompt`), with the answer's JSON shape;
- the answer is one JSON object, constrained by a grammar (compat/structured.py builds it):
  `{"tool_calls": [{"name": "f", "arguments": {...}}, ...]}` or `{"response": "text"}`;
- earlier turns are shown in the same shape (`generic_dialog`): an assistant's calls as that JSON,
  tool results as user messages `{"tool_response": {...}}`, so a template that knows no tool role
  or tool_calls renders them as plain text;
- `GenericToolParser` turns the answer back into content or calls, streamed: a reply's text as it
  is generated (JSON escapes decoded), a call's name, then its arguments piece by piece.
The prompt depends only on the tools, never on tool_choice or parallel_tool_calls (the grammar
enforces those), so /tokenize renders exactly what chat sends.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Literal, Sequence

from engine.chat.tool_parser import JsonCallStreamParser, ParsedDelta, ParsedOutput, new_call_id
from engine.types import ChatMessage, ToolDefinition

CALLS_HEAD = '{"tool_calls": ['  # the layout the grammar fixes (engine/core/structured.py JSON_OPTIONS)
RESPONSE_HEAD = '{"response": "'

_EXAMPLE = '{"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"}}]}'


def tool_prompt(tools: Sequence[ToolDefinition]) -> str:
    """The system prompt's part that shows the tools and the answer's shape."""
    described = [{"name": t.name, "description": t.description, "parameters": t.parameters or {"type": "object", "properties": {}}}
                 for t in tools]
    return (
        "You can call any of the following tools to satisfy the user's requests: "
        f"{json.dumps(described, ensure_ascii=False)}\n\n"
        f"Example tool call syntax:\n\n{_EXAMPLE}\n\n"
        'Respond in JSON format, either with "tool_calls" (a request to call tools) or with "response" '
        "(a reply to the user's request)."
    )


def generic_dialog(messages: Sequence[ChatMessage], tools: Sequence[ToolDefinition]) -> list[ChatMessage]:
    """The conversation as a template without tool support can render it: the tool prompt in the
    (first) system message, calls and tool results as JSON text."""
    names_by_id = {call.call_id: call.name for m in messages for call in m.tool_calls}
    out: list[ChatMessage] = []
    prompt = tool_prompt(tools)
    if messages and messages[0].role == "system":
        first = messages[0]
        out.append(ChatMessage("system", f"{first.content}\n\n{prompt}" if first.content else prompt, name=first.name))
        rest = messages[1:]
    else:
        out.append(ChatMessage("system", prompt))
        rest = messages
    for message in rest:
        if message.role == "assistant" and message.tool_calls:
            calls = [{"name": c.name, "arguments": _arguments(c.arguments)} for c in message.tool_calls]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append(ChatMessage("assistant", f"{message.content}\n{text}" if message.content else text, name=message.name))
        elif message.role == "tool":
            response = {"tool_call_id": message.tool_call_id, "content": message.content}
            name = names_by_id.get(message.tool_call_id or "")
            if name is not None:
                response = {"name": name, **response}
            text = json.dumps({"tool_response": response}, ensure_ascii=False)
            if out[-1].role == "user" and out[-1].content.startswith('{"tool_response": '):  # results of one turn: one message
                out[-1] = ChatMessage("user", f"{out[-1].content}\n{text}")
            else:
                out.append(ChatMessage("user", text))
        else:
            out.append(message)
    return out


def _arguments(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:  # compat checked they are a JSON object; keep the text if not
        return arguments


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_UNICODE_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")


class GenericToolParser:
    """The OutputParser of the generic format: a reply's text or the calls, as they are generated."""

    def __init__(self, *, new_call_id: Callable[[], str] = new_call_id) -> None:
        self._text = ""  # everything pushed
        self._mode: Literal["head", "response", "calls", "done"] = "head"
        self._pos = 0  # response mode: the next character of _text to decode
        self._content: list[str] = []
        self._calls = JsonCallStreamParser(new_call_id=new_call_id)

    def push(self, text_delta: str) -> ParsedDelta:
        self._text += text_delta
        if self._mode == "head":
            if self._text.startswith(CALLS_HEAD):
                self._mode = "calls"
                return self._calls.push(self._text[len(CALLS_HEAD):])
            if self._text.startswith(RESPONSE_HEAD):
                self._mode, self._pos = "response", len(RESPONSE_HEAD)
            else:
                return ParsedDelta()
        if self._mode == "calls":
            return self._calls.push(text_delta)
        if self._mode == "response":
            return ParsedDelta(self._decode_response())
        return ParsedDelta()

    def finish(self, stop_token_id: int | None) -> ParsedOutput:
        if self._mode == "calls":
            parsed = self._calls.finish(stop_token_id)
            if parsed.tool_calls:
                return parsed
            return ParsedOutput(self._text, [], None if stop_token_id is None else "stop")
        if self._mode == "head":  # cut before the answer's shape was known: what there is, as text
            return ParsedOutput(self._text, [], None if stop_token_id is None else "stop")
        return ParsedOutput("".join(self._content), [], None if stop_token_id is None else "stop")

    def _decode_response(self) -> str:
        """The reply's characters decoded so far; an escape cut in the middle waits for the rest."""
        pieces: list[str] = []
        text, i = self._text, self._pos
        while i < len(text):
            ch = text[i]
            if ch == '"':
                self._mode = "done"
                i += 1
                break
            if ch != "\\":
                j = i
                while j < len(text) and text[j] not in '"\\':
                    j += 1
                pieces.append(text[i:j])
                i = j
                continue
            if i + 1 >= len(text):
                break
            letter = text[i + 1]
            if letter != "u":
                pieces.append(_ESCAPES.get(letter, letter))
                i += 2
                continue
            decoded, used = _unicode_escape(text, i)
            if used == 0:
                break  # incomplete
            pieces.append(decoded)
            i += used
        self._pos = i
        piece = "".join(pieces)
        self._content.append(piece)
        return piece


def _unicode_escape(text: str, i: int) -> tuple[str, int]:
    """`\\uXXXX` (a surrogate pair as two) at text[i:] -> (its text, characters used); (…, 0) when incomplete."""
    first = _UNICODE_ESCAPE.match(text, i)
    if first is None:
        if len(text) - i < 6:
            return "", 0
        return text[i : i + 2], 2  # not a valid escape (the grammar prevents it): keep the characters
    code = int(first.group(1), 16)
    if 0xD800 <= code < 0xDC00:  # a high surrogate: its pair follows
        second = _UNICODE_ESCAPE.match(text, i + 6)
        if second is None:
            return ("", 0) if len(text) - i < 12 else (chr(0xFFFD), 6)
        low = int(second.group(1), 16)
        if 0xDC00 <= low < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return chr(0xFFFD), 6
    return chr(code), 6
