"""A FakeEngine implementing EngineClient that replays scripted outputs, for server tests and bench.

Tokenizer: one token per UTF-8 byte (ids 0..255) plus a few specials. Chat format: renders
"<|role|>content\n" per message. Output parser: `<tool>NAME|ARGS</tool>` in the text is a tool
call, streamed as deltas (name first, then argument pieces), the way Llama's parsers report them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

from engine.config import EngineConfig
from engine.types import (
    ChatMessage,
    EngineDead,
    EngineRequest,
    EngineStats,
    InvalidRequest,
    RequestOutput,
    SamplingDefaults,
    TokenLogprob,
    ToolCall,
    ToolDefinition,
)
from server.model_spec import ModelSpec

BOS, EOS, EOT, PYTHON_TAG = 256, 257, 258, 259
SPECIALS = {BOS: b"<|begin_of_text|>", EOS: b"<|end_of_text|>", EOT: b"<|eot_id|>", PYTHON_TAG: b"<|python_tag|>"}
VOCAB_SIZE = 260


class FakeTokenizer:
    vocab_size = VOCAB_SIZE
    bos_id = BOS
    eos_id = EOS
    stop_token_ids = frozenset({EOS, EOT})

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, parse_special: bool = False) -> list[int]:
        data = text.encode()
        ids = list(data)
        if parse_special:  # the spellings of SPECIALS become their ids
            ids = []
            while data:
                special = next((i for i, spelling in SPECIALS.items() if data.startswith(spelling)), None)
                ids.append(data[0] if special is None else special)
                data = data[1 if special is None else len(SPECIALS[special]):]
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        data = b"".join(b"" if skip_special_tokens and t in SPECIALS else self.token_bytes(t) for t in token_ids)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in SPECIALS:
            return SPECIALS[token_id]
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def first_token_bytes(self, token_id: int) -> bytes:
        return self.token_bytes(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in SPECIALS


@dataclass
class ToolCallDelta:
    index: int
    call_id: str | None
    name: str | None
    arguments: str


@dataclass
class ParsedDelta:
    content: str
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


class FakeOutputParser:
    """Streams `<tool>NAME|ARGS</tool>`; each tag must arrive whole within one text delta."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.in_call = False

    def push(self, text: str) -> ParsedDelta:
        out = ParsedDelta("")
        while text:
            if not self.in_call:
                start = text.find("<tool>")
                if start < 0:
                    out.content += text
                    break
                out.content += text[:start]
                text = text[start + len("<tool>"):]
                name, _, text = text.partition("|")
                self.in_call = True
                self.calls.append(ToolCall(f"call_fake{len(self.calls)}", name, ""))
                out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, self.calls[-1].call_id, name, ""))
            else:
                end = text.find("</tool>")
                piece = text if end < 0 else text[:end]
                self.calls[-1].arguments += piece
                out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, None, None, piece))
                text = "" if end < 0 else text[end + len("</tool>"):]
                self.in_call = end < 0
        self.content.append(out.content)
        return out

    def finish(self, stop_token_id: int | None) -> ParsedOutput:
        content = "".join(self.content)
        return ParsedOutput(content or (None if self.calls else ""), list(self.calls),
                            "tool_calls" if self.calls else "stop")


class FakeChatFormat:
    supports_tools = True  # as the ChatFormat protocol has it

    def __init__(self, tokenizer: FakeTokenizer) -> None:
        self.tokenizer = tokenizer
        self.dialogs: list[tuple[list[ChatMessage], tuple[ToolDefinition, ...]]] = []

    def encode_dialog(self, messages: Sequence[ChatMessage], *, tools: Sequence[ToolDefinition] = (),
                      add_generation_prompt: bool = True) -> list[int]:
        self.dialogs.append((list(messages), tuple(tools)))
        ids = [BOS]
        if tools:
            ids += self.tokenizer.encode("<|tools|>" + ",".join(t.name for t in tools) + "\n")
        for i, message in enumerate(messages):
            if message.role == "tool" and not message.tool_call_id:
                raise InvalidRequest("tool messages need a tool_call_id", param=f"messages[{i}].tool_call_id")
            calls = "".join(f"<tool>{c.name}|{c.arguments}</tool>" for c in message.tool_calls)
            ids += self.tokenizer.encode(f"<|{message.role}|>{message.content}{calls}\n")
        if add_generation_prompt:
            ids += self.tokenizer.encode("<|assistant|>")
        return ids

    def output_parser(self, tools: Sequence[ToolDefinition]) -> FakeOutputParser:
        return FakeOutputParser()


Script = Callable[[EngineRequest], Sequence[str]]


def default_script(request: EngineRequest) -> list[str]:
    return ["Hello", " world", "!"]


@dataclass
class Hold:
    """Make generate() wait after `after` outputs until `release` is set (disconnect tests)."""

    after: int = 1
    release: asyncio.Event = field(default_factory=asyncio.Event)
    reached: asyncio.Event = field(default_factory=asyncio.Event)


class FakeEngine:
    """EngineClient over scripted text pieces: one piece per RequestOutput, one token per byte."""

    def __init__(self, model_id: str = "fake", *, max_seq_len: int = 256, script: Script = default_script) -> None:
        self.model_id = model_id
        self.max_seq_len = max_seq_len
        self.tokenizer = FakeTokenizer()
        self.chat_format = FakeChatFormat(self.tokenizer)
        self.sampling_defaults = SamplingDefaults()
        self.max_sequences_per_request = EngineConfig().max_sequences_per_request
        self.script = script
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.abort_seen = asyncio.Event()
        self.raise_on_generate: Exception | None = None
        self.fail_after: int | None = None  # finish with "error" after this many outputs
        self.hold: Hold | None = None
        self.cached_tokens = 0
        self.is_shut_down = False
        self.is_dead = False
        self._stats = EngineStats()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self.raise_on_generate is not None:
            self.is_dead = isinstance(self.raise_on_generate, EngineDead)  # as the real engine: dead from then on
            raise self.raise_on_generate
        self.requests.append(request)
        pieces = list(self.script(request))
        max_tokens = request.params.max_tokens or 1 << 30
        finished = False
        produced = 0
        start_s = time.perf_counter()
        try:
            for i, piece in enumerate(pieces):
                if self.hold is not None and i == self.hold.after:
                    self.hold.reached.set()
                    await self.hold.release.wait()
                ids = self.tokenizer.encode(piece)[: max_tokens - produced]
                produced += len(ids)
                is_last = i == len(pieces) - 1 or produced >= max_tokens
                failing = self.fail_after is not None and i + 1 >= self.fail_after
                reason = "error" if failing else ("length" if produced >= max_tokens else "stop") if is_last else None
                yield RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=ids,
                    text_delta=self.tokenizer.decode(ids),
                    logprobs=self._logprobs(ids, request.params.logprobs),
                    finish_reason=reason,
                    stop_reason=EOT if reason == "stop" else None,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_output_tokens=produced,
                    num_cached_tokens=self.cached_tokens,
                    error="fake engine failure" if failing else None,
                )
                if reason is not None:
                    finished = True
                    self._finished(request, produced, reason, time.perf_counter() - start_s)
                    return
        finally:
            if not finished:
                self.aborted.append(request.request_id)
                self.abort_seen.set()

    def _logprobs(self, ids: list[int], k: int | None) -> list[TokenLogprob] | None:
        if k is None:
            return None
        return [TokenLogprob(t, -0.25, [(t, -0.25), (ord("?"), -2.0), (0xE2, -3.0)][:k]) for t in ids]

    def _finished(self, request: EngineRequest, produced: int, reason: str, e2e_s: float) -> None:
        stats = self._stats
        stats.prompt_tokens_total += len(request.prompt_token_ids)
        stats.generation_tokens_total += produced
        stats.requests_finished_total[reason] = stats.requests_finished_total.get(reason, 0) + 1
        stats.observations_e2e_s.append(e2e_s)
        stats.observations_ttft_s.append(e2e_s)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.abort_seen.set()

    def stats(self) -> EngineStats:
        snapshot = dataclasses.replace(self._stats, requests_finished_total=dict(self._stats.requests_finished_total))
        self._stats.observations_ttft_s = []
        self._stats.observations_e2e_s = []
        return snapshot

    async def shutdown(self) -> None:
        self.is_shut_down = True


class FakeEngineFactory:
    """EngineFactory handing out FakeEngines; `engines[model_id]` is the latest one loaded."""

    def __init__(self, *, max_seq_len: int = 256, script: Script = default_script) -> None:
        self.max_seq_len = max_seq_len
        self.script = script
        self.engines: dict[str, FakeEngine] = {}
        self.fail: dict[str, Exception] = {}

    def estimate_memory_bytes(self, spec: ModelSpec) -> int:
        return 1 << 20

    async def load(self, spec: ModelSpec) -> FakeEngine:
        if spec.model_id in self.fail:
            raise self.fail[spec.model_id]
        engine = FakeEngine(spec.model_id, max_seq_len=self.max_seq_len, script=self.script)
        self.engines[spec.model_id] = engine
        return engine


def fake_spec(model_id: str, checkpoint_dir: Path, **metadata: object) -> ModelSpec:
    return ModelSpec(model_id=model_id, checkpoint_dir=checkpoint_dir, metadata=dict(metadata), trusted=True)
