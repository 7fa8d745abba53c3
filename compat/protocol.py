"""OpenAI wire types: msgspec Structs, decoders built once, encoders for responses and chunks.

Requests are decoded once at the edge with `forbid_unknown_fields=True`, so a name that is no field
is a 400 naming it rather than silently ignored; compat/params.py classifies every field (honoured,
accepted without effect, refused). Bounds live in `Meta`, roles and content part types are tagged
unions, `UNSET` tells "absent" from "null" where OpenAI does, and null in a field with a default
means that default (`_Request.__post_init__`).
Response Structs mirror OpenAI's shapes field for field (order included): SDKs and eval harnesses
parse them, so a renamed or missing key is a bug.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from compat import limits
from engine.types import InvalidRequest

# --------------------------------------------------------------------------- shared bounds
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
TokenId = Annotated[int, Meta(ge=0)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
NumChoices = Annotated[int, Meta(ge=1, le=128)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
StopString = Annotated[str, Meta(max_length=limits.MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Meta(max_length=16)]
ClientPriority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
BadWord = Annotated[str, Meta(min_length=1, max_length=limits.MAX_STOP_CHARS)]
LogitBias = Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=4096)]


class _Request(Struct, forbid_unknown_fields=True, kw_only=True):
    def __post_init__(self) -> None:
        # OpenAI reads null in an optional field as "the default": put back the defaults null replaced.
        for name, default in _null_defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


RequestStruct = _Request  # the base of every request Struct, for the other APIs' wire types (compat/responses.py, ...)


@functools.cache
def _null_defaults(struct_type: type) -> tuple[tuple[str, Any], ...]:
    """(field, default) for each field whose default is a value, not null or absent."""
    return tuple((f.name, f.default) for f in msgspec.structs.fields(struct_type)
                 if f.default not in (None, UNSET, msgspec.NODEFAULT))


# --------------------------------------------------------------------------- chat messages
class ImageUrl(_Request, kw_only=True):
    url: str
    detail: str | UnsetType = UNSET


class TextPart(_Request, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImagePart(_Request, kw_only=True, tag_field="type", tag="image_url"):
    image_url: ImageUrl


class AudioPart(_Request, kw_only=True, tag_field="type", tag="input_audio"):
    input_audio: dict[str, Any]


class FilePart(_Request, kw_only=True, tag_field="type", tag="file"):
    file: dict[str, Any]


ContentPart = TextPart | ImagePart | AudioPart | FilePart
Content = str | list[ContentPart]


class FunctionCall(_Request, kw_only=True):
    name: str
    arguments: str  # a JSON object as text, as OpenAI carries it


class ToolCallIn(_Request, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Request, kw_only=True, tag_field="role", tag="system"):
    content: Content
    name: str | UnsetType = UNSET


class DeveloperMessage(_Request, kw_only=True, tag_field="role", tag="developer"):
    content: Content
    name: str | UnsetType = UNSET


class UserMessage(_Request, kw_only=True, tag_field="role", tag="user"):
    content: Content
    name: str | UnsetType = UNSET


class AssistantMessage(_Request, kw_only=True, tag_field="role", tag="assistant"):
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None
    name: str | UnsetType = UNSET
    refusal: str | None = None


class ToolMessage(_Request, kw_only=True, tag_field="role", tag="tool"):
    content: Content
    tool_call_id: str


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


# --------------------------------------------------------------------------- tools
class FunctionDefinition(_Request, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    strict: bool | None = None  # true: calls of this function are constrained to `parameters`


class Tool(_Request, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class StreamOptions(_Request, kw_only=True):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # no effect: nothing is obfuscated (compat/params.py)


class JsonSchemaFormat(_Request, kw_only=True):
    name: Annotated[str, Meta(max_length=64)] = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # the schema is enforced either way (a token mask)


class ResponseFormat(_Request, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | UnsetType = UNSET


class StructuredOutputs(_Request, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of these."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GuidedFields(_Request, kw_only=True):
    """Constrained decoding as vLLM spells it (compat/structured.py reads these)."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # the older vLLM names
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None


# --------------------------------------------------------------------------- requests
class SamplingFields(GuidedFields, kw_only=True):
    """The sampling knobs chat, completions and the batch endpoints share (OpenAI + vLLM extras)."""

    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: NumChoices | None = 1
    stop: StopString | StopList | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # -1 or 0 disable
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=limits.MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: NonNegativeInt | None = 0
    skip_special_tokens: bool | None = True
    # lower is sooner, among requests of the same kind (online, or Batch API items); vLLM's int field
    priority: ClientPriority | None = 0
    # vLLM: words never generated (each as tokenized with and without a leading space), and the only tokens allowed
    bad_words: Annotated[list[BadWord], Meta(max_length=limits.MAX_BAD_WORDS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None


class ChatFields(SamplingFields, kw_only=True):
    # OpenAI fields a self-hosted server accepts without effect, or refuses unless null or a no-op
    # value: compat/params.py classifies every field and checks the refused ones.
    store: bool | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None

    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked in compat/structured.py
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    functions: list[FunctionDefinition] | None = None  # deprecated OpenAI names of tools / tool_choice
    function_call: str | dict[str, Any] | None = None
    # vLLM's chat extras: how the conversation is rendered, and the last assistant message echoed back
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: Annotated[dict[str, Any], Meta(max_length=64)] | None = None
    echo: bool | None = False


class ChatCompletionRequest(ChatFields, kw_only=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    stream: bool | None = False
    stream_options: StreamOptions | None = None


PromptItem = str | TokenId | list[TokenId]


class CompletionFields(SamplingFields, kw_only=True):
    echo: bool | None = False  # with logprobs: the prompt tokens' logprobs come first (the first one null)
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None
    # vLLM extension: each prompt token's logprob plus the top k, in choices[i].prompt_logprobs
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class CompletionRequest(CompletionFields, kw_only=True):
    model: str
    # str | list[str] | list[int] | list[list[int]]; msgspec allows one array type in a union, so
    # the list's items are a union and `completion_prompts` checks that they agree.
    prompt: str | Annotated[list[PromptItem], Meta(min_length=1)]
    max_tokens: NonNegativeInt | None = 16  # OpenAI's default for legacy completions
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class BatchChatCompletionRequest(ChatFields, kw_only=True):
    """Many conversations with shared sampling parameters (meta-reference batch_chat_completion)."""

    model: str
    messages_batch: Annotated[list[Annotated[list[Message], Meta(min_length=1)]], Meta(min_length=1)]


BatchPrompts = Annotated[list[str | list[TokenId]], Meta(min_length=1)]


class BatchCompletionRequest(CompletionFields, kw_only=True):
    """Many prompts with shared sampling parameters (meta-reference batch_completion); the prompts
    come as `prompts` or, as meta-reference named them, `content_batch` (exactly one of the two)."""

    model: str
    prompts: BatchPrompts | UnsetType = UNSET
    content_batch: BatchPrompts | UnsetType = UNSET
    max_tokens: NonNegativeInt | None = 16


class TokenizeRequest(_Request, kw_only=True):
    model: str | None = None  # may be left out when one model is registered (vLLM serves one)
    prompt: str | UnsetType = UNSET
    messages: list[Message] | UnsetType = UNSET
    tools: list[Tool] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: Annotated[dict[str, Any], Meta(max_length=64)] | None = None
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class DetokenizeRequest(_Request, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


# Built once: a Decoder caches its type's validation plan.
CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
BATCH_CHAT_DECODER = msgspec.json.Decoder(BatchChatCompletionRequest)
BATCH_COMPLETION_DECODER = msgspec.json.Decoder(BatchCompletionRequest)
TOKENIZE_DECODER = msgspec.json.Decoder(TokenizeRequest)
DETOKENIZE_DECODER = msgspec.json.Decoder(DetokenizeRequest)

_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")
_MISSING_FIELD = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """Decode a request body; every failure is an InvalidRequest naming the offending `param`."""
    try:
        request = decoder.decode(body)
    except RecursionError:
        raise limits.too_deep() from None
    except msgspec.ValidationError as exc:
        message, param = validation_param(str(exc))
        raise InvalidRequest(message, param=param, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    limits.check_nesting(request)
    return request


def validation_param(message: str) -> tuple[str, str | None]:
    """msgspec's '... - at `$.messages[0].role`' -> (message, 'messages[0].role').
    Unknown and missing fields name the field itself, which is what a client needs to fix."""
    match = _PATH.search(message)
    path = match.group("path").lstrip(".") if match else ""
    for pattern in (_UNKNOWN_FIELD, _MISSING_FIELD):
        field_match = pattern.match(message)
        if field_match:
            field = field_match.group("field")
            param = f"{path}.{field}" if path else field
            if pattern is _UNKNOWN_FIELD:
                return f"Unrecognized request argument supplied: {param}", param
            return f"Missing required parameter: '{param}'", param
    return message, path or None


# --------------------------------------------------------------------------- responses
class _Response(Struct, kw_only=True):
    """Field order follows OpenAI's; UNSET fields are left out of the JSON, None ones are null."""


ResponseStruct = _Response  # likewise for response Structs


class InputTokensDetails(_Response, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(_Response, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(_Response, kw_only=True):
    """Token usage as the Responses API and the Batch API both report it."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class PromptTokensDetails(_Response, kw_only=True):
    cached_tokens: int = 0


class Usage(_Response, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(_Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class FunctionCallOut(_Response, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(_Response, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallOut


class ChatMessageOut(_Response, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET


class ChatChoice(_Response, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(_Response, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Response, kw_only=True):
    name: str | UnsetType = UNSET
    arguments: str = ""


class ToolCallDeltaOut(_Response, kw_only=True):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionCallDelta | UnsetType = UNSET


class ChatDelta(_Response, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | None | UnsetType = UNSET
    tool_calls: list[ToolCallDeltaOut] | UnsetType = UNSET


class ChatChunkChoice(_Response, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET  # absent unless stream_options.include_usage


class CompletionLogprobs(_Response, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Response, kw_only=True):
    """vLLM's per-token entry of choices[i].prompt_logprobs, keyed by token id."""

    logprob: float
    rank: int | None  # 1-based among the top alternatives; None where it is not among them
    decoded_token: str


class CompletionChoice(_Response, kw_only=True):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # vLLM extension, present when the request set prompt_logprobs: [num_prompt_tokens], the first null
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class CompletionResponse(_Response, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET


class ErrorDetail(_Response, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class BatchItem(_Response, kw_only=True):
    index: int
    response: ChatCompletionResponse | CompletionResponse | None = None
    error: ErrorDetail | None = None


class BatchResponse(_Response, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    data: list[BatchItem]
    usage: Usage


class TokenizeResponse(_Response, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET


class DetokenizeResponse(_Response, kw_only=True):
    prompt: str


ENCODER = msgspec.json.Encoder()
