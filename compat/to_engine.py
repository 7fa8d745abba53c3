"""OpenAI requests -> EngineRequests: prompt tokens, SamplingParams, n fan-out, length checks.

Pure functions over the decoded protocol Structs and an EngineClient (for its tokenizer, chat
format and max_seq_len). Every refusal is an engine.types.InvalidRequest naming the `param`; the
server turns it into a 400.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import msgspec

from compat import params as policy
from compat import limits
from compat import protocol as p
from compat.structured import grammar_spec, tool_plan
from engine.chat.generic_tools import generic_dialog
from engine.types import (
    ONLINE_PRIORITY,
    ChatMessage,
    ContextLengthExceeded,
    EngineClient,
    EngineRequest,
    ImagePlacement,
    InvalidRequest,
    PreparedImage,
    SamplingDefaults,
    SamplingParams,
    ToolCall,
    ToolDefinition,
    check_context_length,
    check_token_ids,
)

if TYPE_CHECKING:
    from engine.tokenizers.tokenizer import Tokenizer


@dataclass(slots=True)
class ChatPlan:
    requests: list[EngineRequest]  # [n]; choice i is requests[i]
    prompt_token_ids: list[int]
    tools: tuple[ToolDefinition, ...]  # what the output parser looks for; empty: plain text
    forced_tools: bool = False  # tool_choice required / named: the output is a JSON call
    max_tool_calls: int | None = None  # parallel_tool_calls=false: 1
    generic_tools: bool = False  # the generic tool format (engine/chat/generic_tools.py): parse its JSON answer
    echo_text: str = ""  # chat `echo`: the last assistant message's content, which the reply starts with


@dataclass(slots=True)
class CompletionPlan:
    requests: list[EngineRequest]  # [num_prompts * n]; choice index == position
    prompt_token_ids: list[list[int]]  # [num_prompts]
    prompt_texts: list[str]  # [num_prompts], for echo
    n: int


# --------------------------------------------------------------------------- chat
def chat_plan(fields: p.ChatFields, messages: Sequence[p.Message], engine: EngineClient, request_id: str, *,
              priority: int = ONLINE_PRIORITY, images: Mapping[str, PreparedImage] | None = None) -> ChatPlan:
    """`images`: each image part's prepared image by its field (`messages[i].content[j]`, see
    compat/images.py), which the server prepared off the event loop; an image part without one is refused."""
    policy.check_request(fields, "chat")
    check_num_sequences(1, fields.n, engine)
    plan = tool_plan(fields, supports_tools=engine.chat_format.supports_tools)
    tools = plan.tools
    grammar = grammar_spec(fields)
    if grammar is not None and plan.grammar is not None:
        if plan.generic:
            raise InvalidRequest(f"{grammar.param} cannot be combined with tools on this model: its chat format cannot "
                                 "show tools, so the generic tool format already constrains the whole answer",
                                 param=grammar.param)
        raise InvalidRequest(f"{grammar.param} cannot be combined with tool_choice {fields.tool_choice!r} or strict tools",
                             param=grammar.param)
    dialog = chat_messages(messages, images)
    check_text_fits(sum(len(m.content) for m in dialog), engine, "messages")
    prompt, placements = render_chat_prompt(
        engine, dialog, tools, generic_tools=plan.generic, add_generation_prompt=fields.add_generation_prompt,
        continue_final_message=fields.continue_final_message, template_kwargs=fields.chat_template_kwargs)
    max_tokens = fields.max_completion_tokens if fields.max_completion_tokens is not None else fields.max_tokens
    param = "max_completion_tokens" if fields.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_context_length(len(prompt), max_tokens, engine.max_seq_len, param=param, prompt_param="messages")
    if fields.top_logprobs is not None and not fields.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (fields.top_logprobs or 0) if fields.logprobs else None
    # Tool calls arrive as special-token tags (<|python_tag|>, <|eom_id|>): the parser must see them.
    skip_special = fields.skip_special_tokens and not tools
    params = sampling_params(fields, max_tokens, logprobs, skip_special, engine.tokenizer, engine.sampling_defaults)
    params = dataclasses.replace(params, grammar=grammar or plan.grammar)
    requests = fan_out(request_id, prompt, params, fields.n, priority=priority, client_priority=fields.priority,
                       images=placements)
    # vLLM's echo: the reply repeats the last message first when it is the assistant's (a continued answer)
    echo_text = dialog[-1].content if fields.echo and dialog[-1].role == "assistant" else ""
    return ChatPlan(requests, prompt, tools, plan.forced, plan.max_calls, plan.generic, echo_text)


# Names the server itself gives a Jinja template; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                                     "unk_token", "pad_token", "range", "raise_exception", "strftime_now"})


def render_chat(
    engine: EngineClient, dialog: list[ChatMessage], tools: Sequence[ToolDefinition], *, generic_tools: bool,
    add_generation_prompt: bool = True, continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    return render_chat_prompt(engine, dialog, tools, generic_tools=generic_tools, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, template_kwargs=template_kwargs)[0]


def render_chat_prompt(
    engine: EngineClient, dialog: list[ChatMessage], tools: Sequence[ToolDefinition], *, generic_tools: bool,
    add_generation_prompt: bool = True, continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], tuple[ImagePlacement, ...]]:
    """The prompt's token ids and where its images sit, as chat and /tokenize both render it (so the two agree): tools in the
    chat format's own way, or the generic tool format's; vLLM's add_generation_prompt,
    continue_final_message (the last assistant message left open: the conversation before it with
    the generation prompt, then its text) and chat_template_kwargs (variables for a Jinja template)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true; send "
                             "add_generation_prompt: false to continue the last message", param="continue_final_message")
    if continue_final_message and dialog[-1].role != "assistant":
        raise InvalidRequest("continue_final_message needs the last message to be the assistant's",
                             param="continue_final_message")
    if continue_final_message and dialog[-1].tool_calls:
        raise InvalidRequest("continue_final_message cannot continue a message of tool calls", param="continue_final_message")
    extra: dict[str, Any] = {}
    for name in template_kwargs or {}:
        if name in RESERVED_TEMPLATE_NAMES:
            raise InvalidRequest(f"chat_template_kwargs may not set {name!r}; the server sets it",
                                 param=f"chat_template_kwargs.{name}")
    if template_kwargs and getattr(engine.chat_format, "accepts_template_kwargs", False):
        extra["template_kwargs"] = template_kwargs  # the built-in Llama formats have no template to give them to
    if any(isinstance(part, PreparedImage) for m in dialog for part in m.parts):
        if generic_tools:  # the generic tool format rewrites messages as text
            raise InvalidRequest("images cannot be combined with tools on this model", param="tools")
        if template_kwargs:
            raise InvalidRequest("chat_template_kwargs cannot be combined with images", param="chat_template_kwargs")
        # a format that records image placements (engine/chat/common.HeaderTurns.encode_prompt)
        encode_prompt = getattr(engine.chat_format, "encode_prompt", None)
        if encode_prompt is None:
            raise InvalidRequest("this model's chat format cannot place images", param="messages",
                                 code="images_not_supported")
        head = dialog[:-1] if continue_final_message else dialog
        built = encode_prompt(head, tools=tools, add_generation_prompt=add_generation_prompt or continue_final_message)
        tail = engine.tokenizer.encode(dialog[-1].content) if continue_final_message else []
        return built.ids + tail, tuple(built.images)
    if generic_tools:
        dialog, tools = generic_dialog(dialog, tools), ()
    if not continue_final_message:
        return engine.chat_format.encode_dialog(dialog, tools=tools, add_generation_prompt=add_generation_prompt, **extra), ()
    head = engine.chat_format.encode_dialog(dialog[:-1], tools=tools, add_generation_prompt=True, **extra)
    return head + engine.tokenizer.encode(dialog[-1].content), ()


def chat_messages(messages: Sequence[p.Message], images: Mapping[str, PreparedImage] | None = None) -> list[ChatMessage]:
    images = images or {}
    dialog: list[ChatMessage] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if isinstance(message, p.AssistantMessage):
            content = message.refusal if message.content is None and message.refusal else message.content
            calls = [_tool_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(message.tool_calls or ())]
            dialog.append(ChatMessage("assistant", _text(content, param), tool_calls=calls, name=_name(message)))
        elif isinstance(message, p.ToolMessage):
            dialog.append(ChatMessage("tool", _text(message.content, param), tool_call_id=message.tool_call_id))
        else:  # system, developer (OpenAI's new name for system) and user
            role = "user" if isinstance(message, p.UserMessage) else "system"
            user_images = images if role == "user" else {}  # OpenAI takes images in user messages only
            dialog.append(ChatMessage(role, _text(message.content, param, user_images), name=_name(message),
                                      parts=_parts(message.content, param, user_images)))
    return dialog


def _parts(content: p.Content | None, param: str, images: Mapping[str, PreparedImage]) -> tuple[str | PreparedImage, ...]:
    """Several parts as sent: llama-models' ChatFormat encodes each on its own (a part boundary is
    a token boundary), which the Llama formats reproduce token for token; an image is a part of its own."""
    if isinstance(content, list) and (len(content) > 1 or any(isinstance(part, p.ImagePart) for part in content)):
        return tuple(images[f"{param}.content[{j}]"] if isinstance(part, p.ImagePart) else part.text
                     for j, part in enumerate(content))
    return ()


def _name(message: p.Message) -> str | None:
    name = getattr(message, "name", msgspec.UNSET)
    return None if name is msgspec.UNSET else name


def _text(content: p.Content | None, param: str, images: Mapping[str, PreparedImage] | None = None) -> str:
    """The text parts joined; an image part passes only where the server prepared it (`images`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, p.ImagePart) and f"{param}.content[{j}]" in (images or {}):
            continue
        if isinstance(part, p.ImagePart):
            raise InvalidRequest("image content is not supported here: images go in user messages, to a model that "
                                 "takes them (see input_modalities in /v1/models)", param=f"{param}.content[{j}]",
                                 code="images_not_supported")
        if not isinstance(part, p.TextPart):
            kind = type(part).__struct_config__.tag
            raise InvalidRequest(
                f"content parts of type '{kind}' are not supported by this server; send text",
                param=f"{param}.content[{j}].type",
            )
        texts.append(part.text)
    return "".join(texts)  # as they are, as llama-models' ChatFormat concatenates text parts


def _tool_call(call: p.ToolCallIn, param: str) -> ToolCall:
    try:
        arguments = limits.decode_json_bounded(call.function.arguments)
    except msgspec.DecodeError:
        arguments = None
    except InvalidRequest as exc:  # nested too deeply
        raise InvalidRequest(str(exc), param=f"{param}.function.arguments", code=exc.code) from None
    if not isinstance(arguments, dict):
        raise InvalidRequest("tool call arguments must be a JSON object", param=f"{param}.function.arguments")
    return ToolCall(call.id, call.function.name, call.function.arguments)


# --------------------------------------------------------------------------- completions
def completion_plan(req: p.CompletionFields, prompt: object, engine: EngineClient, request_id: str, *,
                    priority: int = ONLINE_PRIORITY) -> CompletionPlan:
    """`prompt` is CompletionRequest.prompt (str | list[str] | list[int] | list[list[int]])."""
    policy.check_request(req, "completions")
    check_completion_fields(req)
    grammar = grammar_spec(req)
    tokenizer = engine.tokenizer
    prompts_ids: list[list[int]] = []
    texts: list[str] = []
    prompt_items = completion_prompts(prompt)
    check_num_sequences(len(prompt_items), req.n, engine)
    for prompt_item in prompt_items:
        if isinstance(prompt_item, str):
            check_text_fits(len(prompt_item), engine, "prompt")
            ids = encode_text_prompt(engine, prompt_item, bos=True)
            texts.append(prompt_item)
        else:
            if len(prompt_item) >= engine.max_seq_len:  # refused below; don't scan a huge list first
                check_context_length(len(prompt_item), req.max_tokens, engine.max_seq_len, param="max_tokens",
                                     prompt_param="prompt")
            check_token_ids(prompt_item, tokenizer.vocab_size, "prompt")
            ids = list(prompt_item)
            texts.append(tokenizer.decode(ids) if req.echo else "")
        prompts_ids.append(ids)
    params_by_prompt = []
    prompt_logprobs = completion_prompt_logprobs(req)
    for ids in prompts_ids:
        max_tokens = check_context_length(len(ids), req.max_tokens, engine.max_seq_len, param="max_tokens", prompt_param="prompt")
        params = sampling_params(req, max_tokens, req.logprobs, req.skip_special_tokens, tokenizer, engine.sampling_defaults)
        params_by_prompt.append(dataclasses.replace(params, prompt_logprobs=prompt_logprobs, grammar=grammar))
    requests: list[EngineRequest] = []
    for k, (ids, params) in enumerate(zip(prompts_ids, params_by_prompt)):
        requests.extend(fan_out(request_id, ids, params, req.n, first_index=k * req.n, priority=priority,
                                client_priority=req.priority))
    return CompletionPlan(requests, prompts_ids, texts, req.n)


def batch_prompts(req: p.BatchCompletionRequest) -> tuple[list[str | list[int]], str]:
    """A batch's prompts and the name they came under: `prompts`, or meta-reference's `content_batch`."""
    if (req.prompts is msgspec.UNSET) == (req.content_batch is msgspec.UNSET):
        raise InvalidRequest("send exactly one of 'prompts' or 'content_batch'", param="prompts")
    if req.prompts is msgspec.UNSET:
        return req.content_batch, "content_batch"
    return req.prompts, "prompts"


def encode_text_prompt(engine: EngineClient, text: str, *, bos: bool) -> list[int]:
    """A text prompt as vLLM and llama.cpp read it: the model's special-token spellings are its
    special tokens (people who apply a template themselves send them), and a prompt that already
    starts with BOS gets no second one. Chat message content never comes here: it stays text."""
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(text, parse_special=True)
    if bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids.insert(0, tokenizer.bos_id)
    return ids


def check_completion_fields(req: p.CompletionFields) -> None:
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise InvalidRequest(
            "max_tokens=0 generates nothing: it needs echo or prompt_logprobs to score the prompt", param="max_tokens"
        )


def completion_prompt_logprobs(req: p.CompletionFields) -> int | None:
    """The prompt logprobs the engine computes: echo with logprobs needs them, and so does vLLM's
    prompt_logprobs field; None when neither asks."""
    wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


def completion_prompts(prompt: object) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> one entry per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    kinds = {type(item) for item in prompt} if isinstance(prompt, list) else set()
    if kinds == {str}:
        return list(prompt)
    if kinds == {int}:
        return [list(prompt)]
    if kinds == {list}:
        if any(not item for item in prompt):
            raise InvalidRequest("token-id prompts must not be empty", param="prompt")
        return list(prompt)
    raise InvalidRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", param="prompt"
    )


def check_num_sequences(num_prompts: int, n: int, engine: EngineClient) -> None:
    """Prompts x n of one request, bounded (engine.max_sequences_per_request, well below the engine's
    waiting queue, so one request cannot fill it) before any of them is built. The 400 names the
    factor that makes it too big: n, unless the prompts outnumber it."""
    limit = engine.max_sequences_per_request
    count = num_prompts * n
    if count > limit:
        asked = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts x n={n}"
        raise InvalidRequest(f"this request asks for {count} sequences ({asked}); the limit is {limit} sequences "
                             "per request", param="n" if n >= num_prompts else "prompt", code="too_many_sequences")


def check_text_fits(num_chars: int, engine: EngineClient, param: str) -> None:
    """Refuse text that cannot fit the context before spending time encoding it: no token spans
    more than `limits.CHARS_PER_TOKEN_LIMIT` characters of real text."""
    limit = limits.CHARS_PER_TOKEN_LIMIT * engine.max_seq_len
    if num_chars > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {engine.max_seq_len} tokens; the {num_chars} characters "
            f"of {param} cannot fit (the limit is {limit} characters). Please reduce the length of the prompt.",
            param=param,
        )


# --------------------------------------------------------------------------- shared
def sampling_params(
    fields: p.SamplingFields, max_tokens: int, logprobs: int | None, skip_special_tokens: bool, tokenizer: Tokenizer,
    defaults: SamplingDefaults,
) -> SamplingParams:
    """`defaults` fill what the request leaves out (the checkpoint's generation_config.json)."""
    if fields.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({fields.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    stop = (fields.stop,) if isinstance(fields.stop, str) else tuple(fields.stop or ())
    params = SamplingParams(
        temperature=defaults.temperature if fields.temperature is None else fields.temperature,
        top_p=defaults.top_p if fields.top_p is None else fields.top_p,
        top_k=defaults.top_k if fields.top_k is None else max(fields.top_k, 0),  # vLLM spells "disabled" as -1
        min_p=defaults.min_p if fields.min_p is None else fields.min_p,
        presence_penalty=fields.presence_penalty or 0.0,
        frequency_penalty=fields.frequency_penalty or 0.0,
        repetition_penalty=defaults.repetition_penalty if fields.repetition_penalty is None else fields.repetition_penalty,
        logit_bias=_logit_bias(fields.logit_bias),
        seed=fields.seed,
        max_tokens=max_tokens,
        min_tokens=fields.min_tokens,
        stop=tuple(s for s in stop if s),  # OpenAI ignores empty stop strings
        stop_token_ids=frozenset(fields.stop_token_ids or ()),
        ignore_eos=fields.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=skip_special_tokens,
        allowed_token_ids=None if fields.allowed_token_ids is None else frozenset(fields.allowed_token_ids),
        bad_words_token_ids=bad_words_token_ids(fields.bad_words or (), tokenizer),
    )
    params.validate(tokenizer.vocab_size)  # InvalidRequest naming the parameter
    return params


def bad_words_token_ids(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it is (at the start of the text) and after a
    space (inside it), since a BPE vocabulary spells the two differently."""
    found: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text))
            if ids:
                found.setdefault(ids, None)
    return tuple(found)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (bias or {}).items():
        token_id = limits.token_id_key(key)
        if token_id is None:
            raise InvalidRequest(f"logit_bias keys must be token ids (ASCII digits), got '{key[:32]}'",
                                 param="logit_bias")
        pairs.append((token_id, value))
    return tuple(pairs)


def fan_out(
    request_id: str, prompt: list[int], params: SamplingParams, n: int, *, first_index: int = 0,
    priority: int = ONLINE_PRIORITY, client_priority: int = 0, images: tuple[ImagePlacement, ...] = (),
) -> list[EngineRequest]:
    """OpenAI's n -> n engine requests; seeds seed+i keep choices distinct but reproducible. `priority`
    is the level (online, batch), `client_priority` the request's own `priority` field within it."""
    requests = []
    for i in range(n):
        seeded = params
        if params.seed is not None and i:
            seeded = dataclasses.replace(params, seed=(params.seed + i) % 2**63)
        requests.append(EngineRequest(f"{request_id}-{first_index + i}", prompt, seeded, priority=priority,
                                      client_priority=client_priority, images=images))
    return requests


# --------------------------------------------------------------------------- tokenize
def tokenize(req: p.TokenizeRequest, engine: EngineClient, images: Mapping[str, PreparedImage] | None = None) -> list[int]:
    has_prompt = req.prompt is not msgspec.UNSET
    has_messages = req.messages is not msgspec.UNSET
    if has_prompt == has_messages:
        raise InvalidRequest("send exactly one of 'prompt' or 'messages'", param="prompt")
    if has_prompt:  # as the completions endpoint reads a text prompt, so the ids agree
        check_text_fits(len(req.prompt), engine, "prompt")
        return encode_text_prompt(engine, req.prompt, bos=req.add_special_tokens)
    tools: tuple[ToolDefinition, ...] = ()
    if req.tools:
        tools = tuple(ToolDefinition(t.function.name, t.function.description, t.function.parameters) for t in req.tools)
    dialog = chat_messages(req.messages, images)
    check_text_fits(sum(len(m.content) for m in dialog), engine, "messages")
    # as chat renders it: tools the format cannot show go into the generic tool format's prompt
    return render_chat(engine, dialog, tools, generic_tools=bool(tools) and not engine.chat_format.supports_tools,
                       add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                       template_kwargs=req.chat_template_kwargs)


def detokenize_ids(req: p.DetokenizeRequest, engine: EngineClient) -> str:
    check_token_ids(req.tokens, engine.tokenizer.vocab_size, "tokens")
    return engine.tokenizer.decode(req.tokens)
