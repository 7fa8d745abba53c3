"""A sequence: ids plus int counters plus a block table. Plain Python; the scheduler, the block
pool and the runner all read it, and only the scheduler writes it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.types import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, blocks freed, recomputed on resume
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time_s: float = 0.0
    priority: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache; one rule schedules them all
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache on admission
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
