"""The model side of the engine: weights, the paged KV cache and model-parallel workers.

WorkerGroup runs on rank 0 and is what the runner drives: execute(StepInputs) -> logits.
It holds rank 0's Worker (engine/executor/worker.py: weights + KV cache + forward, the same code
every follower runs, engine/executor/parallel.py) and drives the followers.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from engine.loading.checkpoint import CheckpointSpec, check_parallel_size, quantized_formats
from engine.config import EngineConfig, launched_by_torchrun
from engine.kernels.cpu import CpuKernels, load_cpu_kernels
from engine.quant.policy import WeightsReport, check_formats, check_quantization
from engine.executor.worker import Worker, without_omp_team
from engine.loading.progress import ProgressCallback
from engine.executor.step_inputs import StepInputs
from engine.executor.cross_attention import CrossAttentionUpdate
from engine.models.llama4.args import VisionConfig
from engine.types import EngineDead, InvalidRequest
from engine.executor.parallel import ParallelGroup, group_in_use, rank_device

log = logging.getLogger(__name__)


def _capability(config: EngineConfig) -> tuple[int, int] | None:
    """The first rank's CUDA compute capability (ranks are assumed alike); None off CUDA."""
    from engine.backends.cuda import device_capability

    return device_capability(rank_device(config, 0))


class Workers(Protocol):
    """What ModelExecutor drives: one forward step on every model-parallel rank. WorkerGroup below is
    the real one; tests use fakes."""

    vocab_size: int
    num_blocks: int
    block_size: int
    argmax_kernels: CpuKernels | None  # the fused CPU kernels for the sampler's greedy rows; None: numpy

    @property
    def decode_graph_sizes(self) -> list[int]:
        """The batch sizes whose pure-decode steps replay a captured CUDA graph (empty: every step eager)."""
        graphs = self._shard.decode_graphs
        return [] if graphs is None else list(graphs.sizes)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """[num_logits, vocab] logits (in the model dtype) of the rows inputs.logits_indices names, in order."""
        ...

    def shutdown(self) -> None: ...


class WorkerGroup:
    """Rank 0: loads weights, sizes and allocates the KV cache, starts and drives followers."""

    def __init__(self, spec: CheckpointSpec, config: EngineConfig, *, max_seq_len: int, progress: ProgressCallback | None = None) -> None:
        device_type = rank_device(config, 0).type
        capability = _capability(config)
        check_quantization(config.quantization, device_type, capability)
        # a quantized checkpoint is served in its own formats, whatever QUANTIZATION_TYPE says
        check_formats(quantized_formats(spec), device_type, capability, what=f"checkpoint {spec.checkpoint_dir}")
        check_parallel_size(spec.model_args, config.model_parallel_size)
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.vocab_size = spec.model_args.vocab_size
        self.model_args = spec.model_args  # what adapters are checked against
        self.max_lora_rank = config.max_lora_rank
        self.block_size = config.block_size_tokens
        # logits come back to the CPU (execute), so the sampler's greedy argmax can be the C one
        self.argmax_kernels = load_cpu_kernels() if config.cpu_kernels else None
        self._group: ParallelGroup | None = None
        self._closed = False
        mp_size = config.model_parallel_size
        if mp_size > 1:
            if not launched_by_torchrun() and group_in_use():
                raise InvalidRequest(
                    "another model with model_parallel_size > 1 is loaded in this process; unload it first "
                    "(torch.distributed and fairscale keep one model-parallel group per process)",
                    param="model_parallel_size",
                    code="model_parallel_busy",
                )
            if launched_by_torchrun():
                self._group = ParallelGroup.join_launched(config)
            else:
                self._group = ParallelGroup.spawn(config, spec, max_seq_len=max_seq_len)
        try:
            device = self._group.device if self._group else rank_device(config, 0)
            with without_omp_team(device):  # the KV cache's zero fill too
                self._shard = Worker.load(spec, config, rank=0, device=device, max_seq_len=max_seq_len,
                                             progress=progress)
                num_blocks = self._shard.plan_num_blocks(config)
                if self._group is not None:
                    num_blocks = self._group.agree_min(num_blocks)
                self._shard.allocate_kv_cache(num_blocks)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = num_blocks
        # Llama 4 images: every rank encodes each image with its slice of the vision encoder (encode_image)
        encoder = self._shard.image_encoder
        self.vision: VisionConfig | None = encoder.config if encoder is not None else None
        self.image_encoder = self.encode_image if encoder is not None else None
        self.weight_bytes = self._shard.weight_bytes * mp_size  # all ranks (norms are replicated: close enough)
        self.weights = WeightsReport(config.quantization, self._shard.model.weight_formats(), self.weight_bytes)
        self.kv_cache_bytes = num_blocks * self._shard.bytes_per_block * mp_size
        log.info(
            "executor ready: %d KV blocks of %d tokens (%.1f MiB), weights %.1f MiB, model_parallel_size %d",
            num_blocks, self.block_size, self.kv_cache_bytes / 2**20, self.weight_bytes / 2**20, mp_size,
        )  # fmt: skip

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """[num_logits, vocab] logits for inputs.logits_indices rows, left on the model's device: the
        sampler picks on the device there and copies back only ids and logprobs (Sampler.sample)."""
        if self._closed:
            raise EngineDead("the model executor was shut down")
        if self._group is None:
            return self._shard.forward(inputs)
        self._group.broadcast_step(inputs)
        return self._group.collective(lambda: self._shard.forward(inputs))

    def load_adapter(self, lora_id: int, adapter: Any, path: str) -> int:
        """Install an adapter (engine.lora.adapters.LoraAdapter, read and checked from `path`) on
        every rank under lora_id, between steps; the bytes it holds over all ranks."""
        if self._closed:
            raise EngineDead("the model executor was shut down")
        num_bytes = self._shard.load_adapter(lora_id, adapter)  # rank 0 first: a refusal reaches no follower
        if self._group is not None:
            self._group.broadcast_lora_load(lora_id, path)
        return num_bytes * self._shard.mp_size

    def unload_adapter(self, lora_id: int) -> None:
        if self._closed:
            return
        self._shard.unload_adapter(lora_id)
        if self._group is not None:
            self._group.broadcast_lora_unload(lora_id)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """Llama 4: one image's tiles [chunks, 3, tile, tile] -> its rows [image tokens, dim], run by
        every rank on its slice of the vision encoder (the pixels go to the followers first, as float32,
        which is what the preprocessor makes); rank 0's rows, which the step then carries."""
        if self._closed:
            raise EngineDead("the model executor was shut down")
        pixels = pixels.to(torch.float32)  # what the followers receive: every rank encodes the same values
        if self._group is None:
            return self._shard.encode_image(pixels)
        self._group.broadcast_image(pixels)
        return self._group.collective(lambda: self._shard.encode_image(pixels))

    def update_cross_attention(self, update: CrossAttentionUpdate) -> None:
        """Llama 3.2 Vision: apply a cross-attention update on every rank (rank 0 encodes its share
        of the new images while the followers encode theirs)."""
        if self._closed:
            raise EngineDead("the model executor was shut down")
        if self._group is None:
            self._shard.update_cross_attention(update)
            return
        self._group.broadcast_cross(update)
        self._group.collective(lambda: self._shard.update_cross_attention(update))

    @property
    def cross_attention(self):
        """Rank 0's per-sequence cross-attention states (None: a text model), for stats and tests."""
        return self._shard.cross_attention

    def shutdown(self) -> None:
        """Stop followers and free the process group; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._group is not None:
            self._group.shutdown()
            self._group = None
