"""What every Llama chat format shares: dialog checks, tool-result ordering, rendering of tool
calls and tool definitions, and the prompt as a token list built piece by piece."""

from __future__ import annotations

import json
import keyword
from dataclasses import dataclass
from typing import Any, Sequence

from engine.tokenizers.tokenizer import Tokenizer
from engine.types import ChatMessage, ImagePlacement, InvalidRequest, PreparedImage, ToolCall, ToolDefinition


class PromptBuilder:
    """A prompt as token ids: text is encoded as text, control tokens are appended by name, and
    an image's tokens are appended with the span they fill recorded (`images`)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.images: list[ImagePlacement] = []

    def image(self, image: PreparedImage, ids: list[int]) -> "PromptBuilder":
        self.images.append(ImagePlacement(image, offset=len(self.ids), length=len(ids)))
        self.ids.extend(ids)
        return self

    def text(self, text: str) -> "PromptBuilder":
        if text:
            self.ids.extend(self.tokenizer.encode(text))
        return self

    def special(self, name: str) -> "PromptBuilder":
        self.ids.append(self.tokenizer.special_token_id(name))
        return self



class HeaderTurns:
    """Llama 3 and Llama 4 frame each turn as <header start>role<header end>\n\n content <end token>;
    only the names of the header tokens differ."""

    header_start: str
    header_end: str
    end_of_turn: str  # closes every message but tool calls awaiting results
    tokenizer: Tokenizer
    family_display_name: str  # in error messages: "Llama 3.1"
    supports_tools: bool
    pythonic_tool_calls: bool

    def encode_dialog(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[ToolDefinition] = (), add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode_prompt(messages, tools=tools, add_generation_prompt=add_generation_prompt).ids

    def encode_prompt(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[ToolDefinition] = (), add_generation_prompt: bool = True
    ) -> PromptBuilder:
        """encode_dialog's tokens, with where each image's tokens sit (`.images`)."""
        name, with_tools = self.family_display_name, self.supports_tools
        check_tools(tools, family_name=name, supports_tools=with_tools, pythonic=self.pythonic_tool_calls)
        dialog = check_dialog(messages, family_name=name, supports_tools=with_tools, system_anywhere=True)
        prompt = PromptBuilder(self.tokenizer).special("<|begin_of_text|>")
        system = self._system_text(dialog.system, tools)
        if system is not None:
            self._message(prompt, "system", system, self.end_of_turn)
        self._before_turns(prompt, tools)
        for index, message in enumerate(dialog.messages):
            self._encode_message(prompt, message, dialog, index)
        if add_generation_prompt:
            self._header(prompt, "assistant")
        return prompt

    def _system_text(self, system: str | None, tools: Sequence[ToolDefinition]) -> str | None:
        raise NotImplementedError

    def _before_turns(self, prompt: PromptBuilder, tools: Sequence[ToolDefinition]) -> None:
        """Anything a family puts between the system prompt and the first turn (nothing by default)."""

    def _encode_message(self, prompt: PromptBuilder, message: ChatMessage, dialog: Dialog, index: int) -> None:
        raise NotImplementedError

    def _header(self, prompt: PromptBuilder, role: str) -> None:
        prompt.special(self.header_start).text(role).special(self.header_end).text("\n\n")

    def _message(self, prompt: PromptBuilder, role: str, content: str | Sequence[str | PreparedImage], end: str) -> None:
        """`content` as one text, or as parts each encoded on its own (ChatMessage.parts)."""
        self._header(prompt, role)
        for part in (content,) if isinstance(content, str) else content:
            if isinstance(part, PreparedImage):
                prompt.image(part, self._image_tokens(part))
            else:
                prompt.text(part)
        prompt.special(end)

    def _image_tokens(self, image: PreparedImage) -> list[int]:
        """An image's tokens in the prompt; families whose models take images say how."""
        raise InvalidRequest(f"{self.family_display_name} models take text only", param=image.param,
                             code="images_not_supported")

# --------------------------------------------------------------------------- dialog checks
@dataclass(slots=True)
class Dialog:
    """A checked conversation: the leading system prompt apart, tool results in call order, and
    every tool call's arguments decoded."""

    system: str | None  # the leading system message(s), joined
    messages: list[ChatMessage]  # the rest
    arguments: dict[int, dict[str, Any]]  # id(ToolCall) -> decoded arguments


def check_dialog(
    messages: Sequence[ChatMessage], *, family_name: str, supports_tools: bool, system_anywhere: bool
) -> Dialog:
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    system_parts: list[str] = []
    start = 0
    while start < len(messages) and messages[start].role == "system":
        system_parts.append(messages[start].content)
        start += 1
    rest: list[ChatMessage] = []
    arguments: dict[int, dict[str, Any]] = {}
    i = start
    while i < len(messages):
        message = messages[i]
        if message.role == "system" and not system_anywhere:
            raise InvalidRequest(
                f"{family_name} accepts system messages only at the start of the conversation", param=f"messages[{i}].role"
            )
        if message.role not in ("system", "user", "assistant", "tool"):
            raise InvalidRequest(f"unknown role {message.role!r}", param=f"messages[{i}].role")
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequest("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
        if message.role == "tool" or message.tool_calls:
            if not supports_tools:
                what = "tool messages" if message.role == "tool" else "tool calls"
                raise InvalidRequest(f"{family_name} cannot express {what}", param=f"messages[{i}]")
        if message.role == "tool":
            i = _take_tool_results(messages, i, rest)
            continue
        for j, call in enumerate(message.tool_calls):
            arguments[id(call)] = decode_arguments(call, f"messages[{i}].tool_calls[{j}].function.arguments")
        rest.append(message)
        i += 1
    system = "\n\n".join(system_parts) if system_parts else None
    return Dialog(system, rest, arguments)


def _take_tool_results(messages: Sequence[ChatMessage], i: int, out: list[ChatMessage]) -> int:
    """Check the run of tool messages starting at i against the calls of the assistant message
    before it, and append them in the order of those calls. Returns the index after the run."""
    previous = out[-1] if out else None
    if previous is None or previous.role != "assistant" or not previous.tool_calls:
        raise InvalidRequest(
            "a tool message must answer a call of the assistant message right before it (an assistant "
            "message with tool_calls, then one tool message per call)",
            param=f"messages[{i}]",
        )
    call_ids = [call.call_id for call in previous.tool_calls]
    results: dict[str, ChatMessage] = {}
    j = i
    while j < len(messages) and messages[j].role == "tool":
        call_id = messages[j].tool_call_id
        if call_id is None:
            if len(call_ids) != 1:
                raise InvalidRequest(
                    "tool_call_id is required when the assistant made several calls", param=f"messages[{j}].tool_call_id"
                )
            call_id = call_ids[0]
        if call_id not in call_ids:
            raise InvalidRequest(
                f"tool_call_id {call_id!r} matches no call of the preceding assistant message "
                f"(its calls: {', '.join(repr(c) for c in call_ids)})",
                param=f"messages[{j}].tool_call_id",
            )
        if call_id in results:
            raise InvalidRequest(f"a second result for tool call {call_id!r}", param=f"messages[{j}].tool_call_id")
        results[call_id] = messages[j]
        j += 1
    out.extend(results[c] for c in call_ids if c in results)
    return j


def decode_arguments(call: ToolCall, param: str) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError as exc:
        raise InvalidRequest(f"tool call arguments are not valid JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequest("tool call arguments must be a JSON object", param=param)
    return value


def check_tools(tools: Sequence[ToolDefinition], *, family_name: str, supports_tools: bool, pythonic: bool) -> None:
    if tools and not supports_tools:
        raise InvalidRequest(f"{family_name} does not support tools", param="tools")
    seen: set[str] = set()
    for k, tool in enumerate(tools):
        if pythonic and not (tool.name.isidentifier() and not keyword.iskeyword(tool.name)):
            raise InvalidRequest(
                f"tool name {tool.name!r} cannot be called in {family_name}'s pythonic syntax: use letters, digits and _",
                param=f"tools[{k}].function.name",
            )
        if tool.name in seen:
            raise InvalidRequest(f"tool {tool.name!r} is defined twice", param=f"tools[{k}].function.name")
        seen.add(tool.name)


# --------------------------------------------------------------------------- rendering calls
def python_literal(value: Any) -> str:
    """A JSON value as Python literal text (what the pythonic call syntax carries)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid Python literal
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {python_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def pythonic_call(name: str, arguments: dict[str, Any], param: str) -> str:
    """`name(a=1, b="x")`."""
    for key in arguments:
        if not key.isidentifier() or keyword.iskeyword(key):
            raise InvalidRequest(
                f"argument name {key!r} cannot be written as a Python keyword argument, which this model's "
                "tool-call format needs",
                param=param,
            )
    return f"{name}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in arguments.items()) + ")"


def tool_definitions_json(tools: Sequence[ToolDefinition]) -> str:
    """The offered tools as the JSON list the Llama 3.2+ prompts show."""
    return json.dumps(
        [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools],
        indent=4,
        ensure_ascii=False,
    )
