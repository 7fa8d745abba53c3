"""Engine settings: one plain struct, merged once by server/config.py from flags, env and run.yaml."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from engine.spec.config import SpeculativeConfig
from engine.types import ONLINE_PRIORITY

Device = Literal["cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16", "float64"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    device: Device = "cpu"
    dtype: DType | None = None  # None: the backend decides (engine.backends.resolve_dtype)
    model_parallel_size: int = 1
    max_batch_size: int = 32  # sequences per step (MAX_BATCH_SIZE)
    max_seq_len: int | None = None  # None: the family's default, capped by the checkpoint (MAX_SEQ_LEN)
    max_num_batched_tokens: int = 512  # token budget of one step; prefills are chunked to fit
    # A prompt chunk that a step runs alone (no decodes, no other prompt before it, no prompt logprobs asked)
    # may take up to this many tokens, past that budget (0: never): a lone long prompt prefills in a quarter
    # of the steps (vLLM's CPU budget is 2048 for every step), while decodes keep their 512-token steps and
    # many short prompts still share them (bench/NOTES.md 'A lone prompt's chunk').
    max_prefill_chunk_tokens: int = 2048
    block_size_tokens: int = 16  # KV cache block size
    kv_cache_bytes: int | None = None  # None: derived from the memory budget below
    kv_cache_memory_fraction: float = 0.9  # CUDA: fraction of free memory after weights
    cpu_kv_cache_bytes: int = 2 << 30  # CPU: KV cache size when kv_cache_bytes is None
    # Admission counts sequences (an OpenAI request is n x prompts of them), in two bounds: online
    # work and background (batch-priority) work each wait within their own, so a batch never takes
    # the online queue's room (queue_class). Beyond its bound generate() raises QueueFull.
    max_waiting_requests: int = 1024  # online sequences waiting
    max_waiting_batch_sequences: int = 1024  # batch-priority sequences waiting (preempted ones included)
    max_sequences_per_request: int = 256  # n x prompts of one request; compat answers 400 beyond it
    enable_prefix_caching: bool = True
    # LoRA adapters (engine/lora/): distinct adapters running at once (others wait their turn; 0 serves
    # none and wraps no linear) and the largest rank an adapter may have
    max_loras: int = 4
    max_lora_rank: int = 64
    quantization: str | None = None  # QUANTIZATION_TYPE, e.g. "fp8_mixed"
    # greedy tokens and logprobs independent of what else is batched (vLLM's and SGLang's
    # --batch-invariant): linears row by row, decode attention split per sequence; docs/backends.md
    batch_invariant: bool = False
    # CUDA: pure-decode steps replayed from graphs captured at load for batch sizes up to max_batch_size
    # (engine/executor/cuda_graphs.py), where the backend's decode step allows it; False: every step eager
    cuda_graphs: bool = True
    cpu_kernels: bool = True  # CPU: fused C kernels (engine/kernels/cpu.py) where they build; False: torch ops only
    debug_log_io: bool = False  # LLAMA_MODELS_DEBUG: log raw prompts and raw outputs
    speculative_config: SpeculativeConfig | None = None  # speculative decoding (engine/spec/), None: off
    seed: int = 0  # seed for random weights of test/demo checkpoints and unseeded sampling
    mp_step_timeout_s: float = 120.0  # model parallel: once loaded, rank 0's longest wait in one collective

    def max_waiting_sequences(self, queue: QueueClass) -> int:
        return self.max_waiting_requests if queue == "online" else self.max_waiting_batch_sequences


QueueClass = Literal["online", "batch"]


def queue_class(priority: int) -> QueueClass:
    """Which waiting bound a sequence counts against: ONLINE_PRIORITY and more urgent ones are online;
    any less urgent priority is background work (the Batch API), which the scheduler preempts for
    online work anyway and which must never be what makes an online request wait or fail."""
    return "online" if priority <= ONLINE_PRIORITY else "batch"


def launched_by_torchrun() -> bool:
    """This process is one rank of a torchrun (torch.distributed.run) job: the launcher started every
    rank, and the model-parallel group is fixed for the job's life. Torch-free: the server asks too."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)
