"""Anthropic's Messages API on the chat path: wire types, the request as a chat request, chat
chunks as a Message and as Anthropic's stream events, and Anthropic's error body.

As with the Responses API (compat/responses.py), a Messages request becomes the
ChatCompletionRequest that says the same (`to_chat`): `system` a system message, `tool_use` blocks
an assistant message's tool_calls, `tool_result` blocks tool messages, `tool_choice` any/tool
chat's required/named. It then takes chat's one path to the engine and chat's assembler;
`MessageBuilder` turns that assembler's chunks into Anthropic's events and Message.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta

from compat import limits
from compat import params as policy
from compat import protocol as p
from engine.types import InvalidRequest

RequestStruct = p.RequestStruct
ResponseStruct = p.ResponseStruct


# --------------------------------------------------------------------------- request
class TextBlock(RequestStruct, kw_only=True, tag_field="type", tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None  # no effect: the prefix cache is automatic
    citations: list[Any] | None = None


class ImageBlock(RequestStruct, kw_only=True, tag_field="type", tag="image"):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class DocumentBlock(RequestStruct, kw_only=True, tag_field="type", tag="document"):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None


class ToolUseBlock(RequestStruct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(RequestStruct, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(RequestStruct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class InputMessage(RequestStruct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class CustomTool(RequestStruct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(RequestStruct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class RequestMetadata(RequestStruct, kw_only=True):
    user_id: str | None = None


StopSequences = Annotated[list[p.StopString], Meta(max_length=16)]


class _MessagesFields(RequestStruct, kw_only=True):
    """What count_tokens and create share."""

    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(_MessagesFields, kw_only=True):
    max_tokens: p.PositiveInt
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: p.TopP | None = None
    top_k: p.NonNegativeInt | None = None
    stop_sequences: StopSequences | None = None
    stream: bool | None = False
    metadata: RequestMetadata | None = None
    service_tier: str | None = None
    container: str | dict[str, Any] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None


class CountTokensRequest(_MessagesFields, kw_only=True):
    pass


MESSAGES_DECODER = msgspec.json.Decoder(MessagesRequest)
COUNT_TOKENS_DECODER = msgspec.json.Decoder(CountTokensRequest)


# --------------------------------------------------------------------------- request -> chat
def check_request(req: MessagesRequest | CountTokensRequest) -> None:
    policy.check_request(req, "messages")


def to_chat(req: MessagesRequest) -> p.ChatCompletionRequest:
    if req.messages[-1].role == "assistant":
        # Anthropic continues a final assistant message (a "prefill"); chat would answer after it instead
        raise InvalidRequest("a final assistant message (prefill) is not supported by this server; end with a user "
                             "message", param=f"messages[{len(req.messages) - 1}].role", code="unsupported_parameter")
    tools, tool_choice, parallel = chat_tools(req)
    return p.ChatCompletionRequest(
        model=req.model, messages=chat_messages(req), max_tokens=req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, stop=list(req.stop_sequences) if req.stop_sequences else None,
        tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel,
    )


def chat_tools(req: MessagesRequest | CountTokensRequest) -> tuple[list[p.Tool] | None, Any, bool | None]:
    tools = [p.Tool(function=p.FunctionDefinition(name=t.name, description=t.description or "",
                                                  parameters=t.input_schema, strict=t.strict))
             for t in req.tools or ()] or None
    choice = req.tool_choice
    if choice is None:
        return tools, None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice of type tool needs a name", param="tool_choice.name")
        return tools, {"type": "function", "function": {"name": choice.name}}, parallel
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[p.Message]:
    messages: list[p.Message] = []
    if isinstance(req.system, str) and req.system:
        messages.append(p.SystemMessage(content=req.system))
    elif isinstance(req.system, list) and req.system:
        messages.append(p.SystemMessage(content="".join(block.text for block in req.system)))
    for i, message in enumerate(req.messages):
        param = f"messages[{i}]"
        if isinstance(message.content, str):
            blocks: list[Block] = [TextBlock(text=message.content)]
        else:
            blocks = message.content
        if message.role == "assistant":
            texts, calls = [], []
            for j, block in enumerate(blocks):
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    calls.append(p.ToolCallIn(id=block.id, function=p.FunctionCall(
                        name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
                elif not isinstance(block, ThinkingBlock):  # the model's own earlier thinking: none here to show
                    _refuse(block, f"{param}.content[{j}]")
            messages.append(p.AssistantMessage(content="".join(texts) or None, tool_calls=calls or None))
            continue
        texts = []
        for j, block in enumerate(blocks):
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolResultBlock):
                if texts:  # keep the order the client sent
                    messages.append(p.UserMessage(content="".join(texts)))
                    texts = []
                messages.append(p.ToolMessage(content=_result_text(block, f"{param}.content[{j}]"),
                                              tool_call_id=block.tool_use_id))
            else:
                _refuse(block, f"{param}.content[{j}]")
        if texts:
            messages.append(p.UserMessage(content="".join(texts)))
    return messages


def _result_text(block: ToolResultBlock, param: str) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        parts = []
        for k, part in enumerate(block.content):
            if not isinstance(part, TextBlock):
                _refuse(part, f"{param}.content[{k}]")
            parts.append(part.text)
        text = "".join(parts)
    return f"Error: {text}" if block.is_error else text


def _refuse(block: Block, param: str) -> None:
    """As chat refuses image parts: no model served here reads images or documents yet."""
    kind = type(block).__struct_config__.tag
    raise InvalidRequest(f"content blocks of type '{kind}' are not supported by this server; send text",
                         param=f"{param}.type", code="unsupported_parameter")


CHAT_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "tools": "tools",
               "tool_choice": "tool_choice"}


# --------------------------------------------------------------------------- response
class TextOut(ResponseStruct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ToolUseOut(ResponseStruct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(ResponseStruct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(ResponseStruct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    content: list[TextOut | ToolUseOut]
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(ResponseStruct, kw_only=True):
    input_tokens: int


class ErrorInfo(ResponseStruct, kw_only=True):
    type: str
    message: str


class ErrorBody(ResponseStruct, kw_only=True):
    type: str = "error"
    error: ErrorInfo


# Anthropic's error types by status (its API answers overloaded_error with 529; a 503 here keeps its status)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                409: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> ErrorBody:
    return ErrorBody(error=ErrorInfo(type=_ERROR_TYPES.get(status, "api_error"), message=message))


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class _OpenBlock:
    index: int
    kind: Literal["text", "tool_use"]
    tool_index: int | None = None
    parts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class MessageBuilder:
    """Chat chunks -> Anthropic stream events (name, data) and the Message they add up to."""

    message_id: str
    model: str
    num_input_tokens: int
    content: list[TextOut | ToolUseOut] = field(default_factory=list)
    open: _OpenBlock | None = None
    tool_blocks: dict[int, _OpenBlock] = field(default_factory=dict)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessageUsage | None = None  # known at the end

    def head(self) -> list[tuple[str, dict[str, Any]]]:
        message = MessageObject(id=self.message_id, content=[], model=self.model,
                                usage=MessageUsage(input_tokens=self.num_input_tokens, output_tokens=0))
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def chunk(self, chunk: p.ChatCompletionChunk | None) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if chunk is None or not chunk.choices:
            return events
        delta = chunk.choices[0].delta
        if isinstance(delta.content, str) and delta.content:
            if self.open is None or self.open.kind != "text":
                events += self._close()
                events += self._start("text", {"type": "text", "text": ""})
            self.open.parts.append(delta.content)
            events.append(_delta(self.open.index, {"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or ():
            opened = self.tool_blocks.get(call.index)
            if opened is None:
                events += self._close()
                name = call.function.name if call.function is not UNSET and call.function.name is not UNSET else ""
                call_id = call.id if call.id is not UNSET and str(call.id).startswith("toolu_") else _tool_use_id()
                events += self._start("tool_use", {"type": "tool_use", "id": call_id, "name": name, "input": {}},
                                      tool_index=call.index)
                opened = self.open
            arguments = call.function.arguments if call.function is not UNSET else ""
            if arguments:
                opened.parts.append(arguments)
                events.append(_delta(opened.index, {"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _start(self, kind: Literal["text", "tool_use"], block: dict[str, Any],
               tool_index: int | None = None) -> list[tuple[str, dict[str, Any]]]:
        self.open = _OpenBlock(len(self.content), kind, tool_index)
        if kind == "text":
            self.content.append(TextOut(text=""))
        else:
            self.tool_blocks[tool_index] = self.open
            self.content.append(ToolUseOut(id=block["id"], name=block["name"], input={}))
        return [("content_block_start", {"type": "content_block_start", "index": self.open.index,
                                         "content_block": block})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        opened, self.open = self.open, None
        if opened is None:
            return []
        text = "".join(opened.parts)
        block = self.content[opened.index]
        if isinstance(block, TextOut):
            block.text = text
        else:
            try:
                arguments = limits.decode_json_bounded(text) if text else {}
            except (msgspec.DecodeError, InvalidRequest):
                arguments = None
            block.input = arguments if isinstance(arguments, dict) else {}
        return [("content_block_stop", {"type": "content_block_stop", "index": opened.index})]

    def finish(self, finish_reason: str | None, stop: str | int | None,
               usage: p.Usage) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        if finish_reason == "length":
            self.stop_reason = "max_tokens"
        elif any(isinstance(block, ToolUseOut) for block in self.content):
            self.stop_reason = "tool_use"
        elif isinstance(stop, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", stop
        else:
            self.stop_reason = "end_turn"
        self.usage = MessageUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                  cache_read_input_tokens=usage.prompt_tokens_details.cached_tokens
                                  if usage.prompt_tokens_details else 0)
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                                         "usage": {"output_tokens": usage.completion_tokens}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def message(self) -> MessageObject:
        return MessageObject(id=self.message_id, content=self.content, model=self.model, stop_reason=self.stop_reason,
                             stop_sequence=self.stop_sequence,
                             usage=self.usage or MessageUsage(input_tokens=self.num_input_tokens, output_tokens=0))


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
