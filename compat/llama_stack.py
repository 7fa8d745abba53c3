"""Llama Stack's native inference API (llama-stack-client 0.2.x, meta-reference's wire shapes).

A second translation beside the OpenAI one, onto the same engine requests: a Llama Stack request
is decoded once into the Structs below, then rewritten as the OpenAI request it means (messages,
tools, sampling), which `compat.to_engine` plans exactly as it plans the OpenAI API's. The OpenAI
assemblers' responses and chunks are then reshaped into Llama Stack's. So a conversation renders
the same tokens through both APIs, and sampling and tool-call parsing live in one place.

What maps where:
- `sampling_params.strategy`: greedy -> temperature 0; top_p -> temperature (default 1) and top_p
  (default 0.95); top_k -> temperature 1 and top_k. `max_tokens` 0 or absent: until the context ends.
  `repetition_penalty` (0 or 1: off), `stop`.
- `logprobs.top_k` -> logprobs with that many alternatives (at least the sampled token).
- `tool_config.tool_prompt_format` must be the one the model's chat format speaks (python_list for
  Llama 3.2 / 3.3 / 4, json for Llama 3.1); `system_message_behavior: replace` puts the caller's
  system prompt in place of the default tool prompt, with `{{function_definitions}}` replaced by
  the tools as JSON (python_list formats only).
- stop_reason: out_of_tokens at max_tokens; end_of_message when the model ended with its
  end-of-message token (<|eom_id|>, <|eom|>: a call awaiting its result); end_of_turn otherwise.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Sequence

import msgspec
from msgspec import Meta, Struct

from compat import protocol as p
from engine.types import InvalidRequest, ToolDefinition

ToolName = Annotated[str, Meta(min_length=1, max_length=64)]
TopK = Annotated[int, Meta(ge=1)]
MaxTokens = Annotated[int, Meta(ge=0)]  # 0: Llama Stack's "no limit"
# Llama Stack's default is 1.0; 0 is how its vLLM adapter spells "off" too.
LsRepetitionPenalty = Annotated[float, Meta(ge=0.0, le=10.0)]
EOM_TOKENS = frozenset(("<|eom_id|>", "<|eom|>"))  # Llama 3.x and Llama 4 end-of-message tokens
PYTHON_LIST_FAMILIES = frozenset(("llama3_2", "llama3_3", "llama4"))
FUNCTION_DEFINITIONS = "{{function_definitions}}"
MAX_COMPLETION_TOP_K = 5  # OpenAI completions' logprobs bound, which the completion plan shares


class _Request(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# --------------------------------------------------------------------------- content and messages
class TextItem(_Request, tag_field="type", tag="text", kw_only=True):
    text: str


class ImageItem(_Request, tag_field="type", tag="image", kw_only=True):
    image: dict[str, Any]


Item = TextItem | ImageItem
Content = str | list[Item] | Item


class ToolCallIn(_Request, kw_only=True):
    call_id: str
    tool_name: ToolName
    arguments: str | dict[str, Any]
    arguments_json: str | None = None


class UserMessage(_Request, tag_field="role", tag="user", kw_only=True):
    content: Content
    context: Content | None = None


class SystemMessage(_Request, tag_field="role", tag="system", kw_only=True):
    content: Content


class CompletionMessage(_Request, tag_field="role", tag="assistant", kw_only=True):
    content: Content = ""
    stop_reason: Literal["end_of_turn", "end_of_message", "out_of_tokens"] | None = None
    tool_calls: list[ToolCallIn] | None = None


class ToolResponseMessage(_Request, tag_field="role", tag="tool", kw_only=True):
    call_id: str
    content: Content
    tool_name: str | None = None  # sent by older clients; the call id already names the call


Message = UserMessage | SystemMessage | CompletionMessage | ToolResponseMessage


# --------------------------------------------------------------------------- sampling and tools
class Greedy(_Request, tag_field="type", tag="greedy", kw_only=True):
    pass


class TopPStrategy(_Request, tag_field="type", tag="top_p", kw_only=True):
    temperature: p.Temperature | None = None
    top_p: p.TopP | None = None


class TopKStrategy(_Request, tag_field="type", tag="top_k", kw_only=True):
    top_k: TopK


class SamplingParams(_Request, kw_only=True):
    strategy: Greedy | TopPStrategy | TopKStrategy = msgspec.field(default_factory=Greedy)
    max_tokens: MaxTokens | None = None
    repetition_penalty: LsRepetitionPenalty | None = None
    stop: p.StopList | None = None


class ToolParamDefinition(_Request, kw_only=True):
    param_type: str
    description: str | None = None
    required: bool = True  # Llama Stack's default
    default: Any = msgspec.UNSET
    items: Any = msgspec.UNSET
    title: str | None = None


class ToolDefinitionIn(_Request, kw_only=True):
    tool_name: ToolName
    description: str | None = None
    parameters: dict[str, ToolParamDefinition] | None = None
    input_schema: dict[str, Any] | None = None  # later Llama Stack releases send a JSON schema here


class ToolConfig(_Request, kw_only=True):
    tool_choice: str = "auto"
    tool_prompt_format: Literal["json", "function_tag", "python_list"] | None = None
    system_message_behavior: Literal["append", "replace"] = "append"


class Logprobs(_Request, kw_only=True):
    top_k: Annotated[int, Meta(ge=0, le=20)] = 0


class _Fields(_Request, kw_only=True):
    model_id: Annotated[str, Meta(min_length=1)]
    sampling_params: SamplingParams | None = None
    response_format: dict[str, Any] | None = None
    logprobs: Logprobs | None = None


class _ChatFields(_Fields, kw_only=True):
    tools: list[ToolDefinitionIn] | None = None
    tool_config: ToolConfig | None = None
    tool_choice: str | None = None  # deprecated top-level spellings of tool_config's fields
    tool_prompt_format: Literal["json", "function_tag", "python_list"] | None = None


class ChatCompletionRequest(_ChatFields, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    stream: bool = False


class BatchChatCompletionRequest(_ChatFields, kw_only=True):
    messages_batch: Annotated[list[Annotated[list[Message], Meta(min_length=1)]], Meta(min_length=1)]


class CompletionRequest(_Fields, kw_only=True):
    content: Content
    stream: bool = False


class BatchCompletionRequest(_Fields, kw_only=True):
    content_batch: Annotated[list[Content], Meta(min_length=1)]


CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
BATCH_CHAT_DECODER = msgspec.json.Decoder(BatchChatCompletionRequest)
COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
BATCH_COMPLETION_DECODER = msgspec.json.Decoder(BatchCompletionRequest)


# --------------------------------------------------------------------------- requests -> OpenAI requests
def content_text(content: Content | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    items = content if isinstance(content, list) else [content]
    texts = []
    for j, item in enumerate(items):
        if isinstance(item, ImageItem):
            where = f"{param}[{j}]" if isinstance(content, list) else param
            raise InvalidRequest("image content is not supported by this server; send text", param=f"{where}.type")
        texts.append(item.text)
    return "".join(texts)  # as Llama Stack's interleaved_content_as_str joins items


def user_content(content: Content, param: str) -> p.Content:
    """A user message's content as OpenAI parts: text items, and images as image_url parts (base64
    `data` as a data URL, `url.uri` as it is), so that one image path serves both APIs. The OpenAI
    field names (`messages[i].content[j]`) are Llama Stack's own."""
    if isinstance(content, str):
        return content
    items = content if isinstance(content, list) else [content]
    if not any(isinstance(item, ImageItem) for item in items):
        return content_text(content, param)
    if not isinstance(content, list):
        raise InvalidRequest("send an image as a list of content items", param=param)
    parts: list[p.ContentPart] = []
    for j, item in enumerate(items):
        if isinstance(item, TextItem):
            parts.append(p.TextPart(text=item.text))
            continue
        image, where = item.image, f"{param}[{j}].image"
        url = image.get("url")
        if isinstance(image.get("data"), str) and url is None:
            parts.append(p.ImagePart(image_url=p.ImageUrl(url="data:image/*;base64," + image["data"])))
        elif isinstance(url, dict) and isinstance(url.get("uri"), str) and "data" not in image:
            parts.append(p.ImagePart(image_url=p.ImageUrl(url=url["uri"])))
        else:
            raise InvalidRequest("an image item needs exactly one of 'data' (base64) or 'url': {'uri': ...}", param=where)
    return parts


def _sampling_fields(params: SamplingParams | None, logprobs: Logprobs | None) -> dict[str, Any]:
    params = params or SamplingParams()
    strategy = params.strategy
    fields: dict[str, Any] = {}
    if isinstance(strategy, Greedy):
        fields["temperature"] = 0.0
    elif isinstance(strategy, TopPStrategy):
        fields["temperature"] = 1.0 if strategy.temperature is None else strategy.temperature
        fields["top_p"] = 0.95 if strategy.top_p is None else strategy.top_p
    else:
        fields.update(temperature=1.0, top_k=strategy.top_k)
    fields["max_tokens"] = params.max_tokens or None
    if params.repetition_penalty not in (None, 0.0):
        fields["repetition_penalty"] = params.repetition_penalty
    fields["stop"] = params.stop
    if logprobs is not None:
        fields.update(logprobs=True, top_logprobs=logprobs.top_k)
    return fields


def _check_response_format(fields: _Fields) -> None:
    if fields.response_format is not None:
        raise InvalidRequest("response_format (structured output) is not supported: there is no constrained decoding",
                             param="response_format")


def tool_schema(tool: ToolDefinitionIn) -> dict[str, Any]:
    """Llama Stack's per-parameter definitions as the JSON schema an OpenAI client sends."""
    if tool.input_schema is not None:
        return tool.input_schema
    properties: dict[str, Any] = {}
    for name, definition in (tool.parameters or {}).items():
        prop: dict[str, Any] = {"type": definition.param_type}
        if definition.description:
            prop["description"] = definition.description
        if definition.items is not msgspec.UNSET:
            prop["items"] = definition.items
        if definition.default is not msgspec.UNSET:
            prop["default"] = definition.default
        properties[name] = prop
    required = [name for name, definition in (tool.parameters or {}).items() if definition.required]
    return {"type": "object", "properties": properties, "required": required}


def _tools(req: _ChatFields) -> list[p.Tool] | None:
    if not req.tools:
        return None
    return [p.Tool(function=p.FunctionDefinition(name=t.tool_name, description=t.description or "",
                                                 parameters=tool_schema(t))) for t in req.tools]


def _tool_config(req: _ChatFields) -> ToolConfig:
    config = req.tool_config or ToolConfig()
    if req.tool_choice is not None:
        config = msgspec.structs.replace(config, tool_choice=req.tool_choice)
    if req.tool_prompt_format is not None:
        config = msgspec.structs.replace(config, tool_prompt_format=req.tool_prompt_format)
    return config


def check_tool_prompt_format(config: ToolConfig, family: str) -> None:
    """The format is the chat format's: a Llama family was tuned on one; refuse another."""
    wanted = config.tool_prompt_format
    if wanted is None:
        return
    spoken = "python_list" if family in PYTHON_LIST_FAMILIES else "json" if family == "llama3_1" else None
    if wanted != spoken:
        what = f"speaks {spoken!r}" if spoken else "has no tool prompt format"
        raise InvalidRequest(f"tool_prompt_format {wanted!r} is not served: this model's chat format ({family}) {what}",
                             param="tool_config.tool_prompt_format")


def openai_messages(messages: Sequence[Message], param: str = "messages") -> list[p.Message]:
    out: list[p.Message] = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if isinstance(message, UserMessage):
            if message.context is not None:
                raise InvalidRequest("user message context (RAG) is not supported; put it in content",
                                     param=f"{where}.context")
            out.append(p.UserMessage(content=user_content(message.content, f"{where}.content")))
        elif isinstance(message, SystemMessage):
            out.append(p.SystemMessage(content=content_text(message.content, f"{where}.content")))
        elif isinstance(message, ToolResponseMessage):
            out.append(p.ToolMessage(content=content_text(message.content, f"{where}.content"), tool_call_id=message.call_id))
        else:
            calls = [p.ToolCallIn(id=call.call_id, function=p.FunctionCall(name=call.tool_name, arguments=_arguments(call)))
                     for call in message.tool_calls or ()]
            out.append(p.AssistantMessage(content=content_text(message.content, f"{where}.content"), tool_calls=calls or None))
    return out


def _arguments(call: ToolCallIn) -> str:
    if call.arguments_json is not None:
        return call.arguments_json
    return call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)


def chat_request(req: _ChatFields, messages: Sequence[Message], family: str, param: str = "messages") -> tuple[
        p.ChatCompletionRequest, tuple[ToolDefinition, ...] | None]:
    """The OpenAI request this Llama Stack chat means, and, for system_message_behavior=replace,
    the tools the output parser must still look for (the prompt then carries none of its own)."""
    _check_response_format(req)
    config = _tool_config(req)
    tools = _tools(req)
    if tools:
        check_tool_prompt_format(config, family)
    converted = openai_messages(messages, param)
    chat = p.ChatCompletionRequest(model=req.model_id, messages=converted, tools=tools, tool_choice=config.tool_choice,
                                   stream=getattr(req, "stream", False), **_sampling_fields(req.sampling_params, req.logprobs))
    if config.system_message_behavior == "append" or not tools or config.tool_choice == "none":
        return chat, None
    return _replace_system_prompt(chat, family)


def _replace_system_prompt(chat: p.ChatCompletionRequest, family: str) -> tuple[p.ChatCompletionRequest, tuple[ToolDefinition, ...]]:
    from compat.structured import tool_plan
    from engine.chat.common import tool_definitions_json

    if family not in PYTHON_LIST_FAMILIES:
        raise InvalidRequest(f"system_message_behavior 'replace' is served for python_list tool formats, not {family}",
                             param="tool_config.system_message_behavior")
    parser_tools = tool_plan(chat, supports_tools=True).tools
    definitions = tool_definitions_json(parser_tools)
    messages = [msgspec.structs.replace(m, content=m.content.replace(FUNCTION_DEFINITIONS, definitions))
                if isinstance(m, p.SystemMessage) and isinstance(m.content, str) else m for m in chat.messages]
    # No tools in the prompt (the caller's system prompt replaces the tool prompt); special tokens
    # stay in the output, as with tools, so that the parser sees the call tags.
    plain = msgspec.structs.replace(chat, messages=messages, tools=None, skip_special_tokens=False)
    return plain, parser_tools


def completion_request(req: _Fields, content: Content, param: str = "content") -> p.CompletionRequest:
    _check_response_format(req)
    logprobs = req.logprobs.top_k if req.logprobs is not None else None
    if logprobs is not None and logprobs > MAX_COMPLETION_TOP_K:
        raise InvalidRequest(f"logprobs.top_k must be at most {MAX_COMPLETION_TOP_K} for completions",
                             param="logprobs.top_k")
    return p.CompletionRequest(model=req.model_id, prompt=content_text(content, param), stream=getattr(req, "stream", False),
                               logprobs=logprobs, **_sampling_fields(req.sampling_params, None))


# --------------------------------------------------------------------------- OpenAI responses -> Llama Stack
def stop_reason(finish_reason: str | None, stop_token: str | None) -> str:
    if finish_reason == "length":
        return "out_of_tokens"
    return "end_of_message" if stop_token in EOM_TOKENS else "end_of_turn"


def metrics(usage: p.Usage) -> list[dict[str, Any]]:
    return [{"metric": name, "value": value, "unit": None} for name, value in
            (("prompt_tokens", usage.prompt_tokens), ("completion_tokens", usage.completion_tokens),
             ("total_tokens", usage.total_tokens))]


def chat_logprobs(logprobs: p.ChatLogprobs | None) -> list[dict[str, Any]] | None:
    if logprobs is None or logprobs.content is None:
        return None
    return [{"logprobs_by_token": {top.token: top.logprob for top in lp.top_logprobs} or {lp.token: lp.logprob}}
            for lp in logprobs.content]


def completion_logprobs(logprobs: p.CompletionLogprobs | None) -> list[dict[str, Any]] | None:
    if logprobs is None:
        return None
    return [{"logprobs_by_token": top or {token: value}}
            for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)]


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        decoded = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        decoded = arguments
    return {"call_id": call_id, "tool_name": name, "arguments": decoded, "arguments_json": arguments}


def chat_response(response: p.ChatCompletionResponse, stop_token: str | None) -> dict[str, Any]:
    choice = response.choices[0]
    calls = [tool_call(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    message = {"role": "assistant", "content": choice.message.content or "",
               "stop_reason": stop_reason(choice.finish_reason, stop_token), "tool_calls": calls}
    return {"completion_message": message, "logprobs": chat_logprobs(choice.logprobs), "metrics": metrics(response.usage)}


def completion_response(response: p.CompletionResponse, stop_token: str | None) -> dict[str, Any]:
    choice = response.choices[0]
    return {"content": choice.text, "stop_reason": stop_reason(choice.finish_reason, stop_token),
            "logprobs": completion_logprobs(choice.logprobs), "metrics": metrics(response.usage)}


class ChatEvents:
    """OpenAI chat chunks -> Llama Stack stream chunks: start, a progress event per text delta,
    each tool call as one `succeeded` tool_call delta once its arguments are complete, complete."""

    def __init__(self) -> None:
        self.calls: dict[int, list[str]] = {}  # index -> [id, name, arguments so far]

    @staticmethod
    def start() -> dict[str, Any]:
        return _event("start", {"type": "text", "text": ""})

    def progress(self, chunk: p.ChatCompletionChunk) -> list[dict[str, Any]]:
        events = []
        for choice in chunk.choices:
            delta = choice.delta
            text = delta.content if isinstance(delta.content, str) else ""
            if text or choice.logprobs is not None:
                events.append(_event("progress", {"type": "text", "text": text}, logprobs=chat_logprobs(choice.logprobs)))
            for call in delta.tool_calls or ():
                slot = self.calls.setdefault(call.index, ["", "", ""])
                if isinstance(call.id, str):
                    slot[0] = call.id
                if call.function is not msgspec.UNSET:
                    if isinstance(call.function.name, str):
                        slot[1] = call.function.name
                    slot[2] += call.function.arguments
        return events

    def complete(self, finish_reason: str | None, stop_token: str | None, usage: p.Usage) -> list[dict[str, Any]]:
        events = [_event("progress", {"type": "tool_call", "parse_status": "succeeded", "tool_call": tool_call(*self.calls[i])})
                  for i in sorted(self.calls)]
        done = _event("complete", {"type": "text", "text": ""}, stop_reason=stop_reason(finish_reason, stop_token))
        done["metrics"] = metrics(usage)
        return [*events, done]


def _event(kind: str, delta: dict[str, Any], *, logprobs: Any = None, stop_reason: str | None = None) -> dict[str, Any]:
    return {"event": {"event_type": kind, "delta": delta, "logprobs": logprobs, "stop_reason": stop_reason}}


def completion_chunk(chunk: p.CompletionResponse, stop_token: str | None) -> dict[str, Any]:
    choice = chunk.choices[0]
    finished = choice.finish_reason is not None
    return {"delta": choice.text, "stop_reason": stop_reason(choice.finish_reason, stop_token) if finished else None,
            "logprobs": completion_logprobs(choice.logprobs)}
