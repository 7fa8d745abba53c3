"""OpenAI's Responses API on the chat path: wire types, the request as a chat request, chat chunks
as Responses objects and stream events.

A Responses request becomes the ChatCompletionRequest that says the same (`to_chat`): items become
messages (`instructions` a system message first, `function_call` items an assistant message's
tool_calls, `function_call_output` items tool messages), `text.format` becomes `response_format`,
`max_output_tokens` `max_completion_tokens`. It then takes chat's one path to the engine (prompt,
sampling, tools, grammar, length checks) and chat's assembler; `ResponseBuilder` turns that
assembler's chunks into Responses events and the final Response object, streamed or not, so the
two cannot drift.

Items arrive with or without `type` (a bare `{"role", "content"}` is a message), which a msgspec
tagged union cannot read: `input` decodes as raw objects and `input_items` converts each by its
type, naming `input[i]` in any error.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from compat import params as policy
from compat import protocol as p
from engine.types import InvalidRequest

RequestStruct = p.RequestStruct
ResponseStruct = p.ResponseStruct


# --------------------------------------------------------------------------- request: content parts
class InputText(RequestStruct, kw_only=True, tag_field="type", tag="input_text"):
    text: str


class InputImage(RequestStruct, kw_only=True, tag_field="type", tag="input_image"):
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputFile(RequestStruct, kw_only=True, tag_field="type", tag="input_file"):
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class OutputText(RequestStruct, kw_only=True, tag_field="type", tag="output_text"):
    """An earlier answer's text, sent back as part of the conversation."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(RequestStruct, kw_only=True, tag_field="type", tag="refusal"):
    refusal: str


InputPart = InputText | InputImage | InputFile | OutputText | Refusal


# --------------------------------------------------------------------------- request: items
class MessageItem(RequestStruct, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(RequestStruct, kw_only=True):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestStruct, kw_only=True):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[InputPart]
    id: str | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                                "function_call_output": FunctionCallOutputItem}
_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


class FunctionTool(RequestStruct, kw_only=True):
    type: Literal["function"] = "function"
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = True  # OpenAI's Responses default: calls follow `parameters`


class TextFormat(RequestStruct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Annotated[str, Meta(max_length=64)] | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestStruct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesStreamOptions(RequestStruct, kw_only=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(RequestStruct, kw_only=True):
    model: str
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools; `function_tools` refuses the other types by name
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    temperature: p.Temperature | None = None
    top_p: p.TopP | None = None
    max_output_tokens: p.PositiveInt | None = None
    metadata: Annotated[dict[str, Annotated[str, Meta(max_length=512)]], Meta(max_length=16)] | None = None
    user: str | None = None
    # vLLM's integer: lower is sooner; passed to chat's own field (its bounds; p.ClientPriority once that lands)
    priority: p.ClientPriority | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    background: bool | None = False
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: p.TopLogprobs | None = None
    max_tool_calls: p.PositiveInt | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[Any] | None = None
    moderation: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: list[Any] | None = None
    background_options: dict[str, Any] | None = None


RESPONSES_DECODER = msgspec.json.Decoder(ResponsesRequest)

# What `include` may name: outputs that never occur here (no reasoning, images or hosted tools), so
# asking for them asks for nothing. Logprobs are not returned: that one is refused.
_VACUOUS_INCLUDES = frozenset({
    "reasoning.encrypted_content", "message.input_image.image_url", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
})


# --------------------------------------------------------------------------- request -> chat
def new_item_id(kind: str) -> str:
    return f"{_ITEM_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}"


def input_items(value: str | list[dict[str, Any]] | None, param: str = "input") -> list[Item]:
    """`input` as items: a string is one user message; each object converts by its `type`."""
    if value is None:
        return []
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    items: list[Item] = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message")
        item_type = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if item_type is None:
            shown = kind if isinstance(kind, str) else type(kind).__name__
            raise InvalidRequest(f"input items of type '{shown[:64]}' are not supported by this server; send "
                                 "message, function_call or function_call_output items", param=f"{param}[{i}].type",
                                 code="unsupported_parameter")
        try:
            items.append(msgspec.convert(raw, item_type))
        except msgspec.ValidationError as exc:
            message, where = p.validation_param(str(exc))
            raise InvalidRequest(message, param=f"{param}[{i}]" + (f".{where}" if where else ""),
                                 code="invalid_value") from None
    return items


def with_ids(items: list[Item]) -> list[Item]:
    """The items as OpenAI lists them back: each with an id (the client's, or a new one), a
    message's text content as one text part."""
    for item in items:
        if item.id is None:
            item.id = new_item_id(item.type)
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            item.content = [OutputText(text=item.content) if item.role == "assistant" else InputText(text=item.content)]
    return items


def check_request(req: ResponsesRequest) -> None:
    """The refused parameters (compat/params.py), and combinations this server cannot serve."""
    policy.check_request(req, "responses")
    for value in req.include or ():
        if value not in _VACUOUS_INCLUDES:
            raise InvalidRequest(f"Unsupported parameter: include '{value[:64]}' is not supported by this server "
                                 "(no logprobs or hosted-tool outputs are returned)", param="include",
                                 code="unsupported_parameter")
    if req.background and not req.store:
        raise InvalidRequest("background responses must be stored: send store true (or leave it out)",
                             param="background")
    if req.background and req.stream:
        raise InvalidRequest("this server streams only foreground responses: send background or stream, not both",
                             param="background", code="unsupported_parameter")
    if req.input is None and req.previous_response_id is None:
        raise InvalidRequest("Missing required parameter: 'input'", param="input")


def to_chat(req: ResponsesRequest, history: list[Item], items: list[Item]) -> p.ChatCompletionRequest:
    """The chat request that asks for what `req` asks, over `history` (the previous response's
    conversation) then `items`."""
    messages = chat_messages(req.instructions, history, items)
    if not messages:
        raise InvalidRequest("input holds no messages", param="input")
    response_format = _response_format(req.text)
    extra: dict[str, Any] = {} if req.priority is None else {"priority": req.priority}  # chat's, one way in
    return p.ChatCompletionRequest(
        model=req.model, messages=messages, temperature=req.temperature, top_p=req.top_p,
        max_completion_tokens=req.max_output_tokens, tools=function_tools(req.tools) or None,
        tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format, user=req.user, **extra,
    )


def chat_messages(instructions: str | None, history: list[Item], items: list[Item]) -> list[p.Message]:
    messages: list[p.Message] = [p.SystemMessage(content=instructions)] if instructions else []
    for param, group in (("previous_response_id", history), ("input", items)):
        for i, item in enumerate(group):
            where = f"{param}[{i}]" if param == "input" else param
            if isinstance(item, MessageItem):
                text = _text(item.content, where)
                if item.role == "assistant":
                    messages.append(p.AssistantMessage(content=text))
                elif item.role == "user":
                    messages.append(p.UserMessage(content=text))
                elif item.role == "developer":
                    messages.append(p.DeveloperMessage(content=text))
                else:
                    messages.append(p.SystemMessage(content=text))
            elif isinstance(item, FunctionCallItem):
                call = p.ToolCallIn(id=item.call_id, function=p.FunctionCall(name=item.name, arguments=item.arguments))
                last = messages[-1] if messages else None
                if isinstance(last, p.AssistantMessage):  # an answer's text and calls are one chat message
                    last.tool_calls = [*(last.tool_calls or ()), call]
                else:
                    messages.append(p.AssistantMessage(content=None, tool_calls=[call]))
            else:
                messages.append(p.ToolMessage(content=_text(item.output, f"{where}.output"), tool_call_id=item.call_id))
    return messages


def _text(content: str | list[InputPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, (InputText, OutputText)):
            texts.append(part.text)
        elif isinstance(part, Refusal):
            texts.append(part.refusal)
        else:  # as chat refuses image_url parts: no model served here reads images yet
            kind = type(part).__struct_config__.tag
            raise InvalidRequest(f"content parts of type '{kind}' are not supported by this server; send text",
                                 param=f"{param}.content[{j}].type", code="unsupported_parameter")
    return "".join(texts)


def function_tools(tools: list[dict[str, Any]] | None) -> list[p.Tool]:
    out = []
    for i, raw in enumerate(tools or ()):
        kind = raw.get("type")
        if kind != "function":
            shown = kind if isinstance(kind, str) else "?"
            raise InvalidRequest(f"tools of type '{shown[:64]}' are not supported by this server; send function tools",
                                 param=f"tools[{i}].type", code="unsupported_parameter")
        try:
            tool = msgspec.convert(raw, FunctionTool)
        except msgspec.ValidationError as exc:
            message, where = p.validation_param(str(exc))
            raise InvalidRequest(message, param=f"tools[{i}]" + (f".{where}" if where else ""),
                                 code="invalid_value") from None
        out.append(p.Tool(function=p.FunctionDefinition(name=tool.name, description=tool.description or "",
                                                        parameters=tool.parameters or {}, strict=tool.strict)))
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) - {"type", "name"}:
        raise InvalidRequest("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                             param="tool_choice", code="unsupported_parameter")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> p.ResponseFormat | None:
    if text is None or text.format is None or text.format.type == "text":
        return None
    fmt = text.format
    if fmt.type == "json_object":
        return p.ResponseFormat(type="json_object")
    return p.ResponseFormat(type="json_schema", json_schema=p.JsonSchemaFormat(
        name=fmt.name or "response", description=fmt.description, schema=fmt.schema, strict=fmt.strict))


# Chat's parameter names, as this API spells them (errors from chat's path name what the client sent)
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text.format", "response_format.json_schema.schema": "text.format.schema"}


# --------------------------------------------------------------------------- response objects
class OutputTextPart(ResponseStruct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(ResponseStruct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputTextPart]


class OutputFunctionCall(ResponseStruct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    status: str
    arguments: str
    call_id: str
    name: str


OutputItem = OutputMessage | OutputFunctionCall


InputTokensDetails, OutputTokensDetails, ResponseUsage = p.InputTokensDetails, p.OutputTokensDetails, p.ResponseUsage


class ResponseErrorInfo(ResponseStruct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(ResponseStruct, kw_only=True):
    reason: str


class ResponseObject(ResponseStruct, kw_only=True):
    """OpenAI's Response, field for field (those a self-hosted server has a value for)."""

    id: str
    object: str = "response"
    created_at: int
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    background: bool
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None = None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any] = msgspec.field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int = 0
    top_p: float | None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    completed_at: int | None | UnsetType = UNSET


class DeletedResponse(ResponseStruct, kw_only=True):
    id: str
    object: str = "response"
    deleted: bool = True


def response_shell(req: ResponsesRequest, response_id: str, *, status: str) -> ResponseObject:
    """The Response with no output yet: what response.created shows and what a background request stores first."""
    text_format: dict[str, Any] = {"type": "text"}
    if req.text is not None and req.text.format is not None:
        text_format = msgspec.to_builtins(req.text.format)
    tools = [msgspec.to_builtins(msgspec.convert(tool, FunctionTool)) for tool in req.tools or ()]
    tool_choice: str | dict[str, Any] = req.tool_choice if req.tool_choice is not None else "auto"
    return ResponseObject(
        id=response_id, created_at=int(time.time()), status=status, background=bool(req.background),
        instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=dict(req.metadata or {}),
        model=req.model, output=[], parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id, store=bool(req.store), temperature=req.temperature,
        text={"format": text_format}, tool_choice=tool_choice, tools=tools, top_p=req.top_p, user=req.user,
    )


def output_as_items(output: list[OutputItem]) -> list[Item]:
    """A response's output as input items: the next turn's history (previous_response_id)."""
    return [msgspec.convert(msgspec.to_builtins(item), _ITEM_TYPES[_tag(item)]) for item in output]


def _tag(struct: msgspec.Struct) -> str:
    return type(struct).__struct_config__.tag


# --------------------------------------------------------------------------- chat chunks -> events
@dataclass(slots=True)
class _Open:
    """The output item being streamed."""

    output_index: int
    item: OutputItem
    tool_index: int | None = None  # the chat tool-call index of a function_call item
    parts: list[str] = field(default_factory=list)  # its text or arguments so far, joined when it closes


@dataclass(slots=True)
class ResponseBuilder:
    """Chat chunks (ChatAssembler.chunk) -> Responses stream events, and the Response they add up
    to. Used for every Responses request: a stream sends the events, the others only the Response."""

    response: ResponseObject
    sequence_number: int = 0
    open: _Open | None = None
    tool_items: dict[int, _Open] = field(default_factory=dict)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": self._next(), **fields}

    def _next(self) -> int:
        self.sequence_number += 1
        return self.sequence_number - 1

    def head(self) -> list[dict[str, Any]]:
        self.response.status = "in_progress"
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def chunk(self, chunk: p.ChatCompletionChunk | None) -> list[Any]:
        """The events of one chat chunk: dicts, and Structs for the deltas (each has `type`)."""
        events: list[Any] = []
        if chunk is None or not chunk.choices:
            return events
        delta = chunk.choices[0].delta
        if isinstance(delta.content, str) and delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls or ():
            events += self._call(call)
        return events

    def _text(self, text: str) -> list[Any]:
        events = []
        if self.open is None or not isinstance(self.open.item, OutputMessage):
            events += self._close()
            item = OutputMessage(id=new_item_id("message"), status="in_progress", content=[])
            events += self._add(item)
            part = OutputTextPart(text="")
            item.content.append(part)
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=self.open.output_index,
                                     content_index=0, part=OutputTextPart(text="")))
        self.open.parts.append(text)
        events.append(TextDeltaEvent(sequence_number=self._next(), item_id=self.open.item.id,
                                     output_index=self.open.output_index, delta=text))
        return events

    def _call(self, call: p.ToolCallDeltaOut) -> list[Any]:
        events = []
        opened = self.tool_items.get(call.index)
        if opened is None:
            events += self._close()
            name = call.function.name if call.function is not UNSET and call.function.name is not UNSET else ""
            item = OutputFunctionCall(id=new_item_id("function_call"), status="in_progress", arguments="",
                                      call_id=call.id if call.id is not UNSET else new_item_id("call"), name=name)
            events += self._add(item, tool_index=call.index)
            opened = self.open
        arguments = call.function.arguments if call.function is not UNSET else ""
        if arguments:
            opened.parts.append(arguments)
            events.append(ArgumentsDeltaEvent(sequence_number=self._next(), item_id=opened.item.id,
                                              output_index=opened.output_index, delta=arguments))
        return events

    def _add(self, item: OutputItem, tool_index: int | None = None) -> list[dict[str, Any]]:
        self.open = _Open(len(self.response.output), item, tool_index)
        if tool_index is not None:
            self.tool_items[tool_index] = self.open
        self.response.output.append(item)
        snapshot = msgspec.structs.replace(item, content=[]) if isinstance(item, OutputMessage) else \
            msgspec.structs.replace(item)
        return [self.event("response.output_item.added", output_index=self.open.output_index, item=snapshot)]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        opened, self.open = self.open, None
        if opened is None:
            return []
        item, index = opened.item, opened.output_index
        item.status = status
        events: list[Any] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.text = "".join(opened.parts)
            events.append(self.event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                                     text=part.text, logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                     content_index=0, part=part))
        else:
            item.arguments = "".join(opened.parts)
            events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                     arguments=item.arguments, name=item.name))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self, finish_reason: str | None, usage: p.Usage) -> list[dict[str, Any]]:
        """Close what is open; the final event (completed, or incomplete when cut at max_output_tokens)."""
        incomplete = finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        response = self.response
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
            total_tokens=usage.total_tokens)
        if incomplete:
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        else:
            response.status = "completed"
            response.completed_at = int(time.time())
        events.append(self.event("response.incomplete" if incomplete else "response.completed", response=response))
        return events

    def end(self, status: Literal["failed", "cancelled"], code: str, message: str) -> None:
        """A response that did not finish: what is open stays incomplete."""
        self._close("incomplete")
        self.response.status = status
        if status == "failed":
            self.response.error = ResponseErrorInfo(code=code, message=message)


class TextDeltaEvent(ResponseStruct, kw_only=True):
    """response.output_text.delta: one per streamed piece, the hot path (a Struct encodes faster than a dict)."""

    type: str = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ArgumentsDeltaEvent(ResponseStruct, kw_only=True):
    type: str = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


def error_event(sequence_number: int, code: str | None, message: str, param: str | None) -> dict[str, Any]:
    return {"type": "error", "sequence_number": sequence_number, "code": code, "message": message, "param": param}
