"""RequestOutputs -> OpenAI responses and stream chunks (chat and completions).

One assembler per HTTP request keeps each choice's state (text so far, tool-call parser, token
counts). Streaming asks it for a chunk per engine delta; non-streaming feeds it every delta and
asks for the response at the end. Both paths share the per-choice state, so the two can't drift.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from msgspec import UNSET

from compat import protocol as p
from engine.chat.generic_tools import GenericToolParser
from engine.chat.tool_parser import JsonCallStreamParser
from engine.types import EngineError, RequestOutput, TokenLogprob, ToolCall, ToolDefinition

if TYPE_CHECKING:
    from engine.tokenizers.tokenizer import Tokenizer

SYSTEM_FINGERPRINT = "fp_llamaserve"


class GenerationFailed(EngineError):
    """The engine ended a request with finish_reason "error" or "abort"."""


def _check(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise GenerationFailed(out.error or "the engine failed while generating")
    if out.finish_reason == "abort":
        raise GenerationFailed("the request was aborted by the engine")


# --------------------------------------------------------------------------- token text for logprobs
def token_text(tokenizer: "Tokenizer", token_id: int) -> tuple[str, list[int]]:
    """A token as OpenAI shows it: its text, or `bytes:\\xNN` when it is not valid UTF-8 alone."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "".join(f"bytes:\\x{b:02x}" for b in raw), list(raw)


def chat_logprobs(tokenizer: "Tokenizer", logprobs: Sequence[TokenLogprob]) -> p.ChatLogprobs:
    content = []
    for lp in logprobs:
        text, raw = token_text(tokenizer, lp.token_id)
        top = [p.TopLogprob(token=t, logprob=v, bytes=b) for t, b, v in
               ((*token_text(tokenizer, tid), value) for tid, value in lp.top)]
        content.append(p.ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
    return p.ChatLogprobs(content=content)


def completion_top_logprobs(tokenizer: "Tokenizer", lp: TokenLogprob, top_k: int) -> dict[str, float] | None:
    """One token's top_logprobs entry as OpenAI gives it: the k most likely tokens plus the chosen
    one when it is not among them (up to k+1 entries); None when k is 0."""
    if not top_k:
        return None
    top = {token_text(tokenizer, tid)[0]: value for tid, value in lp.top[:top_k]}
    top.setdefault(token_text(tokenizer, lp.token_id)[0], lp.logprob)
    return top


def completion_logprobs(tokenizer: "Tokenizer", logprobs: Sequence[TokenLogprob], text_offset: int, top_k: int) -> p.CompletionLogprobs:
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)[0]
        tokens.append(text)
        values.append(lp.logprob)
        tops.append(completion_top_logprobs(tokenizer, lp, top_k))
        offsets.append(text_offset)
        text_offset += len(text)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def prompt_completion_logprobs(
    tokenizer: "Tokenizer", logprobs: Sequence[TokenLogprob | None], token_ids: Sequence[int], echo_text: str, top_k: int
) -> p.CompletionLogprobs:
    """The echoed prompt's part of a completion's logprobs: the first token's logprob is null, as
    OpenAI returns it, and text_offset indexes the echoed text."""
    tokens = [token_text(tokenizer, token_id)[0] for token_id in token_ids]
    values: list[float | None] = [lp.logprob if lp is not None else None for lp in logprobs]
    tops = [completion_top_logprobs(tokenizer, lp, top_k) if lp is not None else None for lp in logprobs]
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops,
                                text_offset=prompt_text_offsets(tokenizer, token_ids, tokens, echo_text))


def prompt_text_offsets(tokenizer: "Tokenizer", token_ids: Sequence[int], tokens: Sequence[str], echo_text: str) -> list[int]:
    """Where each prompt token starts in the echoed text. A special token the echo leaves out (the
    BOS the server put before a text prompt) takes no room; offsets never pass the text's end."""
    offsets: list[int] = []
    pos = 0
    for token_id, text in zip(token_ids, tokens):
        offsets.append(min(pos, len(echo_text)))
        if echo_text.startswith(text, pos) or not tokenizer.is_special(token_id):
            pos += len(text)
    return offsets


def vllm_prompt_logprobs(
    tokenizer: "Tokenizer", logprobs: Sequence[TokenLogprob | None], top_k: int
) -> list[dict[str, p.PromptLogprob] | None]:
    """vLLM's choices[i].prompt_logprobs: per prompt token, {token id: logprob, rank, text} for the
    token itself and its top_k best alternatives; null for the first token."""
    out: list[dict[str, p.PromptLogprob] | None] = []
    for lp in logprobs:
        if lp is None:
            out.append(None)
            continue
        top = lp.top[:top_k]
        ranks = {tid: rank for rank, (tid, _) in enumerate(top, start=1)}
        entries = {str(lp.token_id): p.PromptLogprob(logprob=lp.logprob, rank=ranks.get(lp.token_id),
                                                      decoded_token=token_text(tokenizer, lp.token_id)[0])}
        for tid, value in top:
            entries.setdefault(str(tid), p.PromptLogprob(logprob=value, rank=ranks[tid],
                                                         decoded_token=token_text(tokenizer, tid)[0]))
        out.append(entries)
    return out


def _join_logprobs(parts: Sequence[p.CompletionLogprobs]) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(
        tokens=[t for part in parts for t in part.tokens],
        token_logprobs=[v for part in parts for v in part.token_logprobs],
        top_logprobs=[t for part in parts for t in part.top_logprobs],
        text_offset=[o for part in parts for o in part.text_offset],
    )


# --------------------------------------------------------------------------- chat
@dataclass(slots=True)
class _ChatChoice:
    parser: Any = None  # engine.chat.format OutputParser when tools were offered
    content: list[str] = field(default_factory=list)
    logprobs: list[p.ChatTokenLogprob] = field(default_factory=list)
    tool_ids: dict[int, str] = field(default_factory=dict)  # streamed tool-call index -> id
    streamed_tool_calls: int = 0
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class ChatAssembler:
    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        tokenizer: "Tokenizer",
        chat_format: Any,
        tools: Sequence[ToolDefinition],
        n: int,
        num_prompt_tokens: int,
        want_logprobs: bool,
        include_usage: bool = False,
        forced_tools: bool = False,
        max_tool_calls: int | None = None,
        generic_tools: bool = False,
        echo_text: str = "",
    ) -> None:
        """forced_tools: the output was constrained to JSON calls (tool_choice required or named),
        streamed argument piece by argument piece whatever the chat format; max_tool_calls: calls
        past it are dropped (parallel_tool_calls=false); generic_tools: the output is the generic
        tool format's JSON answer (engine/chat/generic_tools.py); echo_text: what each reply starts
        with (vLLM's chat `echo`)."""
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tool_calls = max_tool_calls
        self.echo_text = echo_text

        def parser() -> Any:
            if not tools:
                return None
            if generic_tools:
                return GenericToolParser()
            return JsonCallStreamParser() if forced_tools else chat_format.output_parser(tools)

        self.choices = [_ChatChoice(parser=parser()) for _ in range(n)]

    # ---- streaming
    def _chunk(self, choices: list[p.ChatChunkChoice]) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=None if self.include_usage else UNSET,
        )

    def head_chunks(self) -> list[p.ChatCompletionChunk]:
        """What a stream sends before any output: each choice's role."""
        return [self._chunk([p.ChatChunkChoice(index=i, delta=p.ChatDelta(role="assistant", content=self.echo_text))])
                for i in range(len(self.choices))]

    def chunk(self, index: int, out: RequestOutput) -> p.ChatCompletionChunk | None:
        """The chunk for one engine delta, or None when it carries nothing to send yet."""
        choice = self._update(index, out)
        logprobs = chat_logprobs(self.tokenizer, out.logprobs) if self.want_logprobs and out.logprobs else None
        if choice.parser is None:
            content, tool_deltas = out.text_delta, []
        else:
            parsed = choice.parser.push(out.text_delta)
            content, tool_deltas = parsed.content, [self._tool_delta(choice, d) for d in parsed.tool_calls if self._keeps(d.index)]
            choice.content.append(content)
        if out.finished:
            tail, late_calls = self._finish(choice, out)
            content += tail
            tool_deltas += late_calls
        if not (content or tool_deltas or logprobs or out.finished):
            return None
        delta = p.ChatDelta(content=content if content or logprobs else UNSET, tool_calls=tool_deltas or UNSET)
        return self._chunk([p.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=choice.finish_reason)])

    def _keeps(self, call_index: int) -> bool:
        return self.max_tool_calls is None or call_index < self.max_tool_calls

    def usage_chunk(self) -> p.ChatCompletionChunk:
        chunk = self._chunk([])
        chunk.usage = self.usage()
        return chunk

    def _tool_delta(self, choice: _ChatChoice, delta: Any) -> p.ToolCallDeltaOut:
        first = delta.index not in choice.tool_ids
        if first:
            choice.tool_ids[delta.index] = delta.call_id or _call_id()
            choice.streamed_tool_calls = max(choice.streamed_tool_calls, delta.index + 1)
        return p.ToolCallDeltaOut(
            index=delta.index,
            id=choice.tool_ids[delta.index] if first else UNSET,
            type="function" if first else UNSET,
            function=p.FunctionCallDelta(name=delta.name if delta.name else UNSET, arguments=delta.arguments),
        )

    # ---- shared
    def _update(self, index: int, out: RequestOutput) -> _ChatChoice:
        _check(out)
        choice = self.choices[index]
        choice.num_prompt_tokens = out.num_prompt_tokens or choice.num_prompt_tokens
        choice.num_output_tokens = out.num_output_tokens
        choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
        return choice

    def _finish(self, choice: _ChatChoice, out: RequestOutput) -> tuple[str, list[p.ToolCallDeltaOut]]:
        """Close the parser; return content and tool calls it held back until the end."""
        if choice.parser is None:
            choice.finish_reason = "length" if out.finish_reason == "length" else "stop"
            return "", []
        stop_token = out.stop_reason if isinstance(out.stop_reason, int) else None
        parsed = choice.parser.finish(stop_token)
        choice.tool_calls = [ToolCall(choice.tool_ids.get(i) or c.call_id or _call_id(), c.name, c.arguments)
                             for i, c in enumerate(parsed.tool_calls) if self._keeps(i)]
        streamed = "".join(choice.content)
        tail = ""
        if parsed.content and parsed.content.startswith(streamed):
            tail = parsed.content[len(streamed):]
        late = [
            p.ToolCallDeltaOut(index=i, id=call.call_id, type="function",
                               function=p.FunctionCallDelta(name=call.name, arguments=call.arguments))
            for i, call in enumerate(choice.tool_calls) if i >= choice.streamed_tool_calls
        ]
        if out.finish_reason == "length":
            choice.finish_reason = "length"
        else:
            choice.finish_reason = "tool_calls" if choice.tool_calls else (parsed.finish_reason or "stop")
        choice.content = [parsed.content] if parsed.content is not None else []
        return tail, late

    # ---- non-streaming
    def add(self, index: int, out: RequestOutput) -> None:
        choice = self._update(index, out)
        if self.want_logprobs and out.logprobs:
            choice.logprobs.extend(chat_logprobs(self.tokenizer, out.logprobs).content or ())
        if choice.parser is None:
            choice.content.append(out.text_delta)
        else:
            choice.content.append(choice.parser.push(out.text_delta).content)
        if out.finished:
            if choice.parser is not None:
                choice.content = ["".join(choice.content)]
            self._finish(choice, out)

    def response(self) -> p.ChatCompletionResponse:
        choices = []
        for i, choice in enumerate(self.choices):
            content: str | None = self.echo_text + "".join(choice.content)
            calls = [p.ToolCallOut(id=c.call_id, function=p.FunctionCallOut(name=c.name, arguments=c.arguments))
                     for c in choice.tool_calls]
            if calls and not content:
                content = None
            message = p.ChatMessageOut(content=content, tool_calls=calls or UNSET)
            logprobs = p.ChatLogprobs(content=choice.logprobs) if self.want_logprobs else None
            choices.append(p.ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=choice.finish_reason))
        return p.ChatCompletionResponse(
            id=self.response_id, created=self.created, model=self.model, system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices, usage=self.usage(),
        )

    def usage(self) -> p.Usage:
        completion = sum(c.num_output_tokens for c in self.choices)
        cached = max((c.num_cached_tokens for c in self.choices), default=0)
        return p.Usage(
            prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
        )


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- completions
@dataclass(slots=True)
class _CompletionChoice:
    text: list[str] = field(default_factory=list)
    text_len: int = 0  # characters so far, echo included: the next token's text_offset
    echo_pending: str = ""
    echo_text: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)  # for the echoed prompt's logprobs
    logprobs: list[p.CompletionLogprobs] = field(default_factory=list)  # the parts sent so far
    prompt_logprobs: list[dict[str, p.PromptLogprob] | None] | Any = UNSET  # vLLM's field, once known
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class CompletionAssembler:
    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        tokenizer: "Tokenizer",
        prompt_token_counts: Sequence[int],
        echo_texts: Sequence[str] | None,
        n: int,
        logprobs: int | None,
        include_usage: bool = False,
        prompt_logprobs: int | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """echo_texts with logprobs: each choice's logprobs start with its prompt's (the engine's
        RequestOutput.prompt_logprobs over prompt_token_ids); prompt_logprobs: vLLM's field."""
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.top_k = logprobs
        self.echo = echo_texts is not None
        self.prompt_top_k = prompt_logprobs
        self.include_usage = include_usage
        self.n = n
        self.prompt_tokens = sum(prompt_token_counts)
        self.choices = []
        for k in range(len(prompt_token_counts)):
            echo = echo_texts[k] if echo_texts else ""
            ids = list(prompt_token_ids[k]) if prompt_token_ids else []
            self.choices.extend(_CompletionChoice(echo_pending=echo, text_len=len(echo), echo_text=echo,
                                                  prompt_token_ids=ids) for _ in range(n))

    def head_chunks(self) -> list[p.CompletionResponse]:
        """What a stream sends before any output: nothing (completions have no role)."""
        return []

    def _delta(self, index: int, out: RequestOutput) -> tuple[_CompletionChoice, str, p.CompletionLogprobs | None]:
        _check(out)
        choice = self.choices[index]
        choice.num_output_tokens = out.num_output_tokens
        choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
        text = choice.echo_pending + out.text_delta
        logprobs = None
        if self.top_k is not None:
            parts = []
            if self.echo and out.prompt_logprobs is not None:
                parts.append(prompt_completion_logprobs(self.tokenizer, out.prompt_logprobs, choice.prompt_token_ids,
                                                        choice.echo_text, self.top_k))
            if out.logprobs:
                parts.append(completion_logprobs(self.tokenizer, out.logprobs, choice.text_len, self.top_k))
            if parts:
                logprobs = parts[0] if len(parts) == 1 else _join_logprobs(parts)
                choice.logprobs.append(logprobs)
        if self.prompt_top_k is not None and out.prompt_logprobs is not None:
            choice.prompt_logprobs = vllm_prompt_logprobs(self.tokenizer, out.prompt_logprobs, self.prompt_top_k)
        choice.echo_pending = ""
        choice.text_len += len(out.text_delta)
        if out.finished:
            choice.finish_reason = "length" if out.finish_reason == "length" else "stop"
        return choice, text, logprobs

    def chunk(self, index: int, out: RequestOutput) -> p.CompletionResponse | None:
        choice, text, logprobs = self._delta(index, out)
        prompt_logprobs = choice.prompt_logprobs if out.prompt_logprobs is not None else UNSET
        if not (text or logprobs or out.finished or prompt_logprobs is not UNSET):
            return None
        return p.CompletionResponse(
            id=self.response_id, created=self.created, model=self.model, system_fingerprint=SYSTEM_FINGERPRINT,
            choices=[p.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason,
                                        prompt_logprobs=prompt_logprobs)],
            usage=None if self.include_usage else UNSET,
        )

    def add(self, index: int, out: RequestOutput) -> None:
        choice, text, _ = self._delta(index, out)
        choice.text.append(text)

    def response(self) -> p.CompletionResponse:
        choices = []
        for i, choice in enumerate(self.choices):
            logprobs = _join_logprobs(choice.logprobs) if self.top_k is not None else None
            choices.append(p.CompletionChoice(index=i, text="".join(choice.text), logprobs=logprobs,
                                              finish_reason=choice.finish_reason, prompt_logprobs=choice.prompt_logprobs))
        return p.CompletionResponse(
            id=self.response_id, created=self.created, model=self.model, system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices, usage=self.usage(),
        )

    def usage_chunk(self) -> p.CompletionResponse:
        return p.CompletionResponse(
            id=self.response_id, created=self.created, model=self.model, system_fingerprint=SYSTEM_FINGERPRINT,
            choices=[], usage=self.usage(),
        )

    def usage(self) -> p.Usage:
        completion = sum(c.num_output_tokens for c in self.choices)
        # Each prompt counts once however many choices it has, and so do its cached tokens.
        cached = sum(max(c.num_cached_tokens for c in self.choices[k:k + self.n]) for k in range(0, len(self.choices), self.n))
        return p.Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=min(cached, self.prompt_tokens)),
        )
