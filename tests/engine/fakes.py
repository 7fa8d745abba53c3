"""Fakes that run the engine without torch: a runner over a simulated paged KV cache, a
one-character-per-token tokenizer and a byte tokenizer."""

from __future__ import annotations

from typing import Callable, Iterable

from engine.core.sequence import ScheduledBatch, Sequence, StepOutput
from engine.types import EngineDead, TokenLogprob

EOS, EOT, BOS = 0, 1, 2  # special tokens of the fake family; EOS and EOT stop generation
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
SPECIAL = {EOS: "<eos>", EOT: "<eot>", BOS: "<bos>"}


class FakeTokenizer:
    """Token i >= 3 is one character; 0..2 are special tokens."""

    vocab_size = 3 + len(ALPHABET)
    stop_token_ids = frozenset({EOS, EOT})

    def token_text(self, token_id: int) -> str:
        return SPECIAL.get(token_id) or ALPHABET[token_id - 3]

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_text(token_id).encode()

    first_token_bytes = token_bytes

    def is_special(self, token_id: int) -> bool:
        return token_id in SPECIAL

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            self.token_text(t) for t in token_ids if not (skip_special_tokens and t in SPECIAL)
        )

    def encode(self, text: str) -> list[int]:
        return [3 + ALPHABET.index(ch) for ch in text]


class ByteTokenizer:
    """Token i < 256 is byte i, for tiny real models with a 256-token vocabulary; no stop tokens."""

    vocab_size = 256
    stop_token_ids: frozenset[int] = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    first_token_bytes = token_bytes

    def is_special(self, token_id: int) -> bool:
        return False

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


def default_next_token(context: list[int], vocab_size: int) -> int:
    """A deterministic function of the whole context that never picks a special token."""
    h = 0
    for t in context:
        h = (h * 1000003 + t + 1) % 2147483647
    return 3 + h % (vocab_size - 3)


class FakeRunner:
    """Writes each scheduled token into a simulated paged KV cache through the block table, and
    samples from what it reads back, so a wrong block table, a bad prefix-cache hit or a block
    reused while still in use changes the tokens (and is recorded in `violations`)."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        vocab_size: int = FakeTokenizer.vocab_size,
        *,
        next_token: Callable[[list[int], int], int] = default_next_token,
        fail_seq: Callable[[Sequence], str | None] | None = None,
        raise_on_steps: Iterable[int] = (),
        dead_on_step: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.next_token = next_token
        self.fail_seq = fail_seq
        self.raise_on_steps = set(raise_on_steps)
        self.dead_on_step = dead_on_step
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.num_steps = 0
        self.batches: list[list[tuple[str, int]]] = []  # per step: (request_id, num_new_tokens)
        self.violations: list[str] = []
        self.shut_down = False

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.num_steps += 1
        self.batches.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        if self.dead_on_step is not None and self.num_steps >= self.dead_on_step:
            raise EngineDead("fake worker died")
        if self.num_steps in self.raise_on_steps:
            raise RuntimeError(f"fake failure in step {self.num_steps}")
        out = StepOutput(seq_ids=[], sampled_token_ids=[], logprobs=[])
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            context = self._compute(seq, num_new)
            if not batch.samples(i):
                continue
            error = self.fail_seq(seq) if self.fail_seq else None
            if error is not None:
                out.errors[seq.seq_id] = error
                continue
            token = self.next_token(context, self.vocab_size)
            out.seq_ids.append(seq.seq_id)
            out.sampled_token_ids.append(token)
            out.logprobs.append(TokenLogprob(token, -0.5, [(token, -0.5)]) if seq.params.logprobs is not None else None)
        return out

    def _compute(self, seq: Sequence, num_new: int) -> list[int]:
        start, end, size = seq.num_computed_tokens, seq.num_computed_tokens + num_new, self.block_size
        if num_new < 1 or end > seq.num_tokens or len(seq.block_table) * size < end:
            self.violations.append(f"{seq.request_id}: bad chunk {start}+{num_new} of {seq.num_tokens}")
            return []
        for pos in range(start, end):
            self.kv[seq.block_table[pos // size]][pos % size] = seq.token_ids[pos]
        context = [self.kv[seq.block_table[pos // size]][pos % size] for pos in range(end)]
        if context != seq.token_ids[:end]:
            self.violations.append(f"{seq.request_id}: the KV cache does not hold the sequence's tokens")
        return context  # type: ignore[return-value]

    def shutdown(self) -> None:
        self.shut_down = True
