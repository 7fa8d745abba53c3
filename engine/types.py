"""The engine's vocabulary: what crosses the compat <-> engine seam.

This module imports neither torch nor numpy: compat/ and server/ import it, and they must
stay free of torch. Everything here is plain data; behaviour lives in the modules that own it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterable, Literal, Protocol

if TYPE_CHECKING:  # protocols only; no import at run time keeps compat/ free of engine internals
    from engine.chat.format import ChatFormat
    from engine.tokenizers.tokenizer import Tokenizer
    from engine.vision import ImagePreprocessor

FinishReason = Literal["stop", "length", "abort", "error"]

# Which tokenizer and chat format a checkpoint speaks. Llama descriptors name one of the llama*
# families; "hf" is a checkpoint that carries its own tokenizer.json and Jinja chat template.
Family = Literal["llama2", "llama3", "llama3_1", "llama3_2", "llama3_3", "llama4", "hf"]


# --------------------------------------------------------------------------- sampling
GrammarKind = Literal["json", "regex", "choice", "grammar", "lark"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the generated text, enforced by a token mask (engine/core/structured.py).

    kind "json": `source` is a JSON schema as canonical JSON text; "regex": a regular expression;
    "choice": a JSON list of the allowed strings; "grammar": a Lark or GBNF grammar as users send it;
    "lark": a Lark grammar the server built itself (tool calls). Equal specs share one compiled
    grammar, so `param` (which request field it came from, for errors) is not part of the key."""

    kind: GrammarKind
    source: str
    param: str | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves these out (or sends null) gets: the checkpoint's
    generation_config.json where it sets them, as vLLM does, else OpenAI's (and vLLM's) defaults:
    the values below, which SamplingParams' fields default to as well (OPENAI_SAMPLING_DEFAULTS)."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0, CTRL/HF semantics, over prompt and output tokens


OPENAI_SAMPLING_DEFAULTS = SamplingDefaults()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one sequence. Validated at the edge (compat); the engine re-checks
    only what would corrupt a batch (see `validate`)."""

    temperature: float = OPENAI_SAMPLING_DEFAULTS.temperature
    top_p: float = OPENAI_SAMPLING_DEFAULTS.top_p
    top_k: int = OPENAI_SAMPLING_DEFAULTS.top_k
    min_p: float = OPENAI_SAMPLING_DEFAULTS.min_p
    presence_penalty: float = 0.0  # [-2, 2], OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI semantics, over output tokens
    repetition_penalty: float = OPENAI_SAMPLING_DEFAULTS.repetition_penalty
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token_id, bias) pairs
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    max_tokens: int | None = None  # None: until the context ends; 0: finish "length" after the prompt pass (scoring)
    min_tokens: int = 0  # stop tokens are masked until this many tokens were generated
    stop: tuple[str, ...] = ()  # stop strings; text is never emitted past one
    stop_token_ids: frozenset[int] = frozenset()  # extra stop tokens beside the family's (a set: checked per token)
    ignore_eos: bool = False  # keep generating past the family's stop tokens
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's logprob + top k
    # None: off; k >= 0: each prompt token's logprob given the tokens before it, plus the top k.
    # Such a request computes its whole prompt (no prefix-cache hit) the first time through.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # leave special tokens out of the text
    grammar: GrammarSpec | None = None  # constrained decoding: only tokens the grammar allows
    allowed_token_ids: frozenset[int] | None = None  # None: every token; else only these are sampled
    # Token sequences never generated: a sequence's last token is masked whenever the output ends
    # with the rest of it (a one-token sequence: always). vLLM's bad_words, tokenized by compat.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest, naming the parameter, for one that the sampler cannot apply."""
        if self.temperature < 0:
            raise InvalidRequest("temperature must be >= 0", param="temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
        if self.top_k < 0:
            raise InvalidRequest("top_k must be >= 0", param="top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest("min_p must be in [0, 1]", param="min_p")
        if self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty must be > 0", param="repetition_penalty")
        if self.max_tokens is not None and self.max_tokens < 0:  # 0: score the prompt, generate nothing
            raise InvalidRequest("max_tokens must be >= 0", param="max_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequest("logprobs must be >= 0", param="logprobs")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise InvalidRequest("prompt_logprobs must be >= 0", param="prompt_logprobs")
        for token_id, _ in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequest(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                                     param="logit_bias")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequest(f"stop token id {token_id} is outside the vocabulary [0, {vocab_size})",
                                     param="stop_token_ids")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequest("allowed_token_ids must not be empty", param="allowed_token_ids")
            bad = [t for t in self.allowed_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(f"allowed token id {min(bad)} is outside the vocabulary [0, {vocab_size})",
                                     param="allowed_token_ids")
        if any(not word or not all(0 <= t < vocab_size for t in word) for word in self.bad_words_token_ids):
            raise InvalidRequest("bad_words must tokenize to ids in the vocabulary", param="bad_words")


# --------------------------------------------------------------------------- requests and outputs
ONLINE_PRIORITY = 0  # requests from the online endpoints; background work (the Batch API) passes a larger one


@dataclass(slots=True)
class EngineRequest:
    """One sequence to generate. compat fans an OpenAI `n > 1` out into n of these."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time_s: float = field(default_factory=time.monotonic)
    priority: int = ONLINE_PRIORITY  # the level (online, batch): lower runs first, and preempts higher ones
    # vLLM's request `priority` within the level: lower is admitted sooner (and preempted later); FCFS among equals
    client_priority: int = 0
    lora_name: str | None = None  # the LoRA adapter to run with (loaded on this engine); None: the base alone
    # The request's images in prompt order, each with the span of prompt tokens it fills (engine/vision/)
    images: tuple["ImagePlacement", ...] = ()


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [k] (token_id, logprob), best first


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request: a delta, not the whole text."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprob] | None = None  # [len(new_token_ids)] when asked for
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set with finish_reason == "error"
    # [num_prompt_tokens] when params.prompt_logprobs is set, in the request's first output only;
    # the first entry is None (nothing precedes the first token).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# --------------------------------------------------------------------------- images (engine/vision/)
@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Bounds on the images one request may carry, checked before and while decoding (server flags)."""

    max_image_bytes: int = 20 * 1024 * 1024  # the encoded image as sent (after base64 decoding)
    max_image_pixels: int = 4096 * 4096  # width x height, checked from the header before pixels are decoded
    max_images_per_request: int = 8  # over the whole conversation (or each prompt of a batch item)


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImage:
    """One decoded, preprocessed image, ready for a model family's vision encoder.

    Built off the event loop by `engine.vision.decode.prepare_image` with the model's
    `ImagePreprocessor`; the chat format reads the layout fields to place the image's tokens; the
    model reads `pixels`. Compared by identity: equal content is `content_hash`'s business."""

    content_hash: bytes  # sha256 of the encoded bytes: keys the prefix cache of blocks holding its tokens
    aspect_ratio: tuple[int, int]  # (tiles high, tiles wide) of the canvas it was cut into
    num_chunks: int  # tiles, plus the whole-image view where the family adds one (Llama 4: when tiles > 1)
    tokens_per_chunk: int  # image tokens each chunk becomes (Llama 4: <|patch|> tokens), 0 if the family uses one marker
    pixels: object  # the family's tensor, e.g. [num_chunks, 3, H, W] float32; opaque above the engine (no torch here)
    param: str = "messages"  # the request field it came from, for errors: "messages[0].content[1]"


@dataclass(frozen=True, slots=True)
class ImagePlacement:
    """Where one image's tokens sit in a prompt: [offset, offset + length) of prompt_token_ids,
    the family's start and end markers included (the chat format that rendered it says which)."""

    image: PreparedImage
    offset: int
    length: int


# --------------------------------------------------------------------------- chat (engine-side shapes)
@dataclass(slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str  # a JSON object, as text, as OpenAI carries it


@dataclass(slots=True)
class ToolDefinition:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)  # JSON schema


@dataclass(slots=True)
class ChatMessage:
    role: Literal["system", "user", "assistant", "tool"]  # OpenAI "developer" arrives as "system"
    content: str = ""  # text parts are joined by compat; other part types are refused there
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # for role == "tool"
    name: str | None = None
    # The parts of `content` when it came as several: text, and images where the model takes them
    # (compat refuses images otherwise). Formats that encode parts one by one (llama-models' Llama 3
    # and 4) read them; others read `content`, the text parts joined.
    parts: tuple["str | PreparedImage", ...] = ()


# --------------------------------------------------------------------------- errors
class EngineError(Exception):
    """Base of every error the engine raises towards its callers."""


class InvalidRequest(EngineError):
    """The request cannot be served as given (the server answers 400)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthExceeded(InvalidRequest):
    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class QueueFull(EngineError):
    """Too many requests are waiting (the server answers 429 with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDead(EngineError):
    """The engine or one of its model-parallel workers stopped (the server answers 503)."""


class CheckpointError(EngineError):
    """A checkpoint that cannot be loaded; the message names the file, key and shapes."""


# --------------------------------------------------------------------------- request checks
# compat checks every request once, naming the user's parameters; the engine core's guard
# (engine.core.engine_core.check_request) calls the same functions, so each message exists once.
def check_context_length(
    num_prompt_tokens: int, max_tokens: int | None, max_seq_len: int, *, param: str = "max_tokens", prompt_param: str = "prompt"
) -> int:
    """The completion budget; a prompt that leaves no room, or a request past the context, is 400."""
    if num_prompt_tokens >= max_seq_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_seq_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion. Please reduce the length "
            "of the prompt.",
            param=prompt_param,
        )
    if max_tokens is None:
        return max_seq_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_seq_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the length of the prompt or {param}.",
            param=param,
        )
    return max_tokens


def check_token_ids(ids: "Iterable[int]", vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})", param=param)


def request_id_in_use(request_id: str) -> InvalidRequest:
    return InvalidRequest(f"request id {request_id!r} is already in use")


# --------------------------------------------------------------------------- stats
@dataclass(slots=True)
class EngineStats:
    """A snapshot for /metrics. Counters are cumulative; histograms are raw observations the
    server drains (`observations_*` lists are swapped out each time stats are taken)."""

    num_running: int = 0
    num_waiting: int = 0
    num_preempted_total: int = 0
    num_preempted_by_priority: dict[int, int] = field(default_factory=dict)  # of the preempted sequences
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0  # prompt tokens found
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: dict[str, int] = field(default_factory=dict)  # by finish reason
    observations_ttft_s: list[float] = field(default_factory=list)
    observations_tpot_s: list[float] = field(default_factory=list)
    observations_e2e_s: list[float] = field(default_factory=list)
    observations_queue_s: list[float] = field(default_factory=list)  # arrival -> first scheduled
    observations_prefill_s: list[float] = field(default_factory=list)  # first scheduled -> first token
    observations_decode_s: list[float] = field(default_factory=list)  # first token -> last token
    observations_itl_s: list[float] = field(default_factory=list)  # between consecutive tokens of a request
    observations_step_s: list[float] = field(default_factory=list)
    observations_batch_size: list[int] = field(default_factory=list)
    # speculative decoding (engine/spec/), vLLM's spec_decode counters; all 0 when it is off
    spec_decode_num_drafts_total: int = 0  # sequence-steps that carried draft tokens
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [num_speculative_tokens]


# --------------------------------------------------------------------------- the engine as the server sees it
class EngineClient(Protocol):
    """One loaded model. The server holds these through the registry and never imports torch."""

    model_id: str
    max_seq_len: int
    tokenizer: "Tokenizer"
    chat_format: "ChatFormat"
    sampling_defaults: SamplingDefaults
    max_sequences_per_request: int  # n x prompts one request may ask for (compat refuses more with 400)
    # How this model turns an image into pixels and tokens; None: it takes text only (images are 400)
    image_preprocessor: "ImagePreprocessor | None"

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Queue the request and yield its deltas; the last one has finish_reason set.
        Raises QueueFull / InvalidRequest before yielding anything. Closing the iterator early
        aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    @property
    def is_dead(self) -> bool:
        """The engine failed (a worker exited, a step crashed) and will serve nothing more: the
        registry retires it (when a lease ends, on the next lease or on /ready) and reloads the model
        in the background."""
        ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...
