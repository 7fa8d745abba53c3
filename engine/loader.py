"""Builds a running engine from a checkpoint dir: the one place where the engine's parts meet.

checkpoint -> tokenizer + chat format -> worker group (weights, KV cache, model-parallel workers)
-> executor (inputs + sampler) -> AsyncEngine. The server reaches this through LocalEngineFactory,
imported lazily so that server/ never imports torch at module level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.loading.progress import ProgressCallback, ProgressEvent
from engine.types import CheckpointError, EngineClient, InvalidRequest

log = logging.getLogger(__name__)

# QUANTIZATION_TYPE spellings Llama Stack's run.yaml templates use for "no quantization", with the
# weights in this dtype (unless DTYPE says otherwise).
UNQUANTIZED_SPELLINGS = {"bf16": "bfloat16"}


def _effective_config(base: EngineConfig, spec: Any) -> EngineConfig:
    """Per-model overrides (model-parallel size, max_seq_len, quantization) on the server's defaults."""
    overrides: dict[str, Any] = {}
    for name in ("model_parallel_size", "max_seq_len", "quantization", "speculative_config"):
        value = getattr(spec, name, None)
        if value is not None:
            overrides[name] = value
    config = dataclasses.replace(base, **overrides) if overrides else base
    if config.quantization in UNQUANTIZED_SPELLINGS:
        config = dataclasses.replace(config, quantization=None, dtype=config.dtype or UNQUANTIZED_SPELLINGS[config.quantization])
    return config


def _with_parallel_size(config: EngineConfig, num_shards: int, source: Any) -> EngineConfig:
    """MODEL_PARALLEL_SIZE=0 (Llama Stack's spelling): as many ranks as the checkpoint has shards
    (1 for the formats that are not sharded by rank: Hugging Face, torchtune, GGUF)."""
    if config.model_parallel_size != 0:
        return config
    log.info("%s: model_parallel_size 0: %d rank(s), one per checkpoint shard", source, num_shards)
    return dataclasses.replace(config, model_parallel_size=num_shards)


def _config_for(base: EngineConfig, spec: Any, checkpoint: Any) -> EngineConfig:
    """The settings a resolved checkpoint loads with, the same on rank 0 and on torchrun's followers."""
    return _with_parallel_size(_effective_config(base, spec), len(checkpoint.shard_paths), checkpoint.checkpoint_dir)


def _resolve(spec: Any, progress: ProgressCallback | None = None):
    """The checkpoint a spec names; a `.gguf` file is converted first (once: engine/loading/gguf_cache.py)."""
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.loading.gguf_cache import ensure_converted, is_gguf_file

    path, roots = Path(spec.checkpoint_dir), tuple(getattr(spec, "allowed_roots", ()))
    if is_gguf_file(path):  # the file is guarded; its conversion is ours, under our cache dir
        path, roots = ensure_converted(path, allowed_roots=roots, progress=progress), ()
    return resolve_checkpoint(path, model_id=spec.model_id, llama_model=getattr(spec, "llama_model", None), allowed_roots=roots)


def _architecture(spec: Any) -> tuple[Any, int, int, Any]:
    """(ModelArgs, the checkpoint's context length, its shard count, its vision encoder's sizes or
    None) without reading weights: a GGUF file not yet converted is read from its header (the
    estimate runs on the event loop: no conversion there)."""
    from engine.loading.checkpoint import checkpoint_vision_dims
    from engine.loading.gguf_cache import converted_dir, gguf_params, is_converted, is_gguf_file

    path = Path(spec.checkpoint_dir)
    if is_gguf_file(path) and not is_converted(converted_dir(path)):
        from engine.models.args import ModelArgs

        params = gguf_params(path, tuple(getattr(spec, "allowed_roots", ())))
        return ModelArgs.from_params(params, source=path.name), int(params["max_seq_len"]), 1, None
    checkpoint = _resolve(spec)
    vision = checkpoint_vision_dims(checkpoint)  # Llama 3.2 Vision: the encoder's sizes, from its shapes
    return checkpoint.model_args, checkpoint.max_seq_len, len(checkpoint.shard_paths), vision


def max_seq_len_for(checkpoint_max_seq_len: int, config: EngineConfig) -> int:
    """MAX_SEQ_LEN caps the family's context; it never extends past what the checkpoint knows."""
    if config.max_seq_len is None:
        return checkpoint_max_seq_len
    return min(config.max_seq_len, checkpoint_max_seq_len)


def planned_kv_cache_bytes(model_args: Any, config: EngineConfig, max_seq_len: int) -> int:
    """Bytes of KV cache the executor will allocate over all ranks, known before loading. On CUDA
    without kv_cache_bytes the executor takes a fraction of free memory, which cannot be known in
    advance, so this counts one full batch of full-length sequences."""
    from engine.backends import resolve_dtype
    from engine.executor.worker import configured_kv_bytes_per_rank, plan_num_blocks
    from engine.models.llama import kv_cache_bytes_per_block

    mp_size = config.model_parallel_size
    per_block = kv_cache_bytes_per_block(model_args, mp_size, config.block_size_tokens, resolve_dtype(config))
    budget = configured_kv_bytes_per_rank(config, mp_size)
    if budget is None:
        budget = per_block * config.max_batch_size * math.ceil(max_seq_len / config.block_size_tokens)
    return plan_num_blocks(config, bytes_per_block=per_block, budget_bytes=budget, max_seq_len=max_seq_len) * per_block * mp_size


def load_engine(spec: Any, config: EngineConfig, *, chat_template_path: Path | None = None,
                progress: ProgressCallback | None = None) -> EngineClient:
    """Blocking: resolve, load weights, start workers, return a ready AsyncEngine. `progress`
    receives each loading stage's advance (engine.loading.progress)."""
    from engine.core.async_engine import AsyncEngine
    from engine.executor.worker_group import WorkerGroup
    from engine.loading.generation_config import read_sampling_defaults
    from engine.executor.executor import ModelExecutor

    started_s = time.monotonic()
    checkpoint = _resolve(spec, progress)
    config = _config_for(config, spec, checkpoint)
    tokenizer, chat_format = load_tokenizer_and_chat_format(checkpoint, chat_template_path)
    max_seq_len = max_seq_len_for(checkpoint.max_seq_len, config)
    sampling_defaults = read_sampling_defaults(checkpoint.checkpoint_dir)
    draft = load_draft(spec, config, tokenizer, max_seq_len) if config.speculative_config is not None else None
    try:
        workers = WorkerGroup(checkpoint, config, max_seq_len=max_seq_len, progress=progress)
    except BaseException:
        if draft is not None:
            draft.shutdown()
        raise
    try:
        image_rows, preprocessor = _vision(workers, tokenizer, checkpoint.model_args)
        executor = ModelExecutor(workers, seed=config.seed, image_rows=image_rows)
        engine = AsyncEngine(spec.model_id, executor, tokenizer, chat_format, config, max_seq_len=max_seq_len,
                             sampling_defaults=sampling_defaults, weights=workers.weights, image_preprocessor=preprocessor,
                             draft_runner=draft)
    except BaseException:
        workers.shutdown()
        if draft is not None:
            draft.shutdown()
        raise
    log.info(
        "loaded %s from %s in %.1f s (%d KV blocks of %d tokens, max_seq_len %d)",
        spec.model_id,
        checkpoint.checkpoint_dir,
        time.monotonic() - started_s,
        workers.num_blocks,
        workers.block_size,
        max_seq_len,
    )
    return engine


def _vision(workers: Any, tokenizer: Any, model_args: Any) -> tuple[Any, Any]:
    """(the executor's ImageRows, the engine's ImagePreprocessor) of a model that takes images, else (None, None).
    Llama 3.2 Vision has no image rows: its images reach the model as cross-attention states
    (engine/executor/cross_attention.py)."""
    if model_args.is_mllama:
        from engine.vision.mllama import mllama_preprocessor

        return None, mllama_preprocessor(model_args)
    if workers.image_encoder is None:
        return None, None
    from engine.executor.images import ImageRows
    from engine.vision.llama4 import Llama4ImagePreprocessor

    vision = workers.vision  # params.json's vision_args
    preprocessor = Llama4ImagePreprocessor(tile_size=vision.image_size, patch_size=vision.patch_size,
                                           pixel_shuffle_ratio=vision.pixel_shuffle_ratio)
    return ImageRows(workers.image_encoder, tokenizer.special_token_id("<|patch|>")), preprocessor


def load_draft(spec: Any, config: EngineConfig, tokenizer: Any, max_seq_len: int) -> Any:
    """The draft model's executor for draft-model speculation (None for prompt lookup): its checkpoint
    is spec.draft (the registry resolves the registered id), its tokenizer must be the target's, and
    it runs on one rank with the target's dtype and KV block size, without speculating itself."""
    from engine.executor.executor import ModelExecutor
    from engine.executor.worker_group import WorkerGroup

    spec_config = config.speculative_config
    if spec_config is None or spec_config.method != "draft_model":
        return None
    draft_spec = getattr(spec, "draft", None)
    if draft_spec is None:
        raise InvalidRequest(f"speculative_config.model {spec_config.model!r} is not a registered model",
                             param="speculative_config.model", code="model_not_found")
    checkpoint = _resolve(draft_spec)
    draft_tokenizer, _ = load_tokenizer_and_chat_format(checkpoint, None)
    reason = tokenizer_difference(tokenizer, draft_tokenizer)
    if reason is not None:
        raise InvalidRequest(f"draft model {spec_config.model!r} cannot draft for {spec.model_id!r}: {reason}; "
                             "a draft needs the same tokenizer", param="speculative_config.model")
    if max_seq_len_for(checkpoint.max_seq_len, draft_config(config)) < max_seq_len:
        raise InvalidRequest(f"draft model {spec_config.model!r} has a shorter context ({checkpoint.max_seq_len}) "
                             f"than {spec.model_id!r} serves ({max_seq_len})", param="speculative_config.model")
    return ModelExecutor(WorkerGroup(checkpoint, draft_config(config), max_seq_len=max_seq_len), seed=config.seed)


def draft_config(config: EngineConfig) -> EngineConfig:
    """The draft model's settings: the target's dtype, KV block size and cache budget, on one rank
    (rank 0 runs it beside the target's step), unquantized, not speculating itself."""
    return dataclasses.replace(config, speculative_config=None, model_parallel_size=1, quantization=None)


def tokenizer_difference(target: Any, draft: Any) -> str | None:
    """Why two tokenizers differ (vocabulary size, stop tokens, any token's bytes), None if they agree."""
    if target.vocab_size != draft.vocab_size:
        return f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}"
    if frozenset(getattr(target, "stop_token_ids", ())) != frozenset(getattr(draft, "stop_token_ids", ())):
        return "its stop tokens differ"
    for token_id in range(target.vocab_size):
        if target.token_bytes(token_id) != draft.token_bytes(token_id):
            return f"token {token_id} differs"
    return None


def load_tokenizer_and_chat_format(checkpoint: Any, chat_template_path: Path | None):
    """Llama descriptors keep their hand-written formats; "hf" checkpoints (and any model served
    with --chat-template) render the checkpoint's Jinja template."""
    from engine.chat.format import make_chat_format
    from engine.loading.checkpoint import check_tokenizer_vocab
    from engine.loading.file_guard import guard_tree
    from engine.tokenizers.tokenizer import load_tokenizer

    tokenizer_path = checkpoint.checkpoint_dir if checkpoint.family == "hf" else checkpoint.tokenizer_path
    if tokenizer_path is None:
        raise CheckpointError(f"{checkpoint.checkpoint_dir}: no tokenizer.model found")
    guard_tree(checkpoint.checkpoint_dir, checkpoint.allowed_roots)  # again: the tokenizer and template are read now
    tokenizer = load_tokenizer(checkpoint.family, tokenizer_path)
    check_tokenizer_vocab(checkpoint, tokenizer.vocab_size)
    if checkpoint.family == "hf" or chat_template_path is not None:
        from engine.chat.jinja import load_chat_format

        return tokenizer, load_chat_format(checkpoint.checkpoint_dir, tokenizer, chat_template_path)
    return tokenizer, make_chat_format(checkpoint.family, tokenizer)


def follow_torchrun(spec: Any, config: EngineConfig) -> None:
    """Ranks > 0 under torchrun: resolve the checkpoint exactly as rank 0 does, then follow its steps."""
    from engine.executor.parallel import follow

    checkpoint = _resolve(spec)
    config = _config_for(config, spec, checkpoint)
    follow(checkpoint, config, max_seq_len=max_seq_len_for(checkpoint.max_seq_len, config))


class LocalEngineFactory:
    """The server's EngineFactory: engines in this process (plus their model-parallel workers)."""

    def __init__(self, config: EngineConfig, *, chat_template_path: Path | None = None) -> None:
        self._config = config
        self._chat_template_path = chat_template_path
        self._loading: dict[str, ProgressEvent] = {}  # model id -> latest event of its load (written by the loading thread)

    def load_progress(self, model_id: str) -> dict[str, Any] | None:
        """The loading stage of `model_id` (stage, done/total, rate), None when it is not loading."""
        event = self._loading.get(model_id)
        return event.as_dict() if event is not None else None

    def estimate_memory_bytes(self, spec: Any) -> int:
        from engine.backends import resolve_dtype
        from engine.executor.cuda_graphs import planned_graph_bytes
        from engine.loading.checkpoint import estimate_weight_bytes

        model_args, checkpoint_max_seq_len, num_shards, vision = _architecture(spec)
        config = _with_parallel_size(_effective_config(self._config, spec), num_shards, spec.checkpoint_dir)
        weights = estimate_weight_bytes(model_args, resolve_dtype(config), vision)
        kv = planned_kv_cache_bytes(model_args, config, max_seq_len_for(checkpoint_max_seq_len, config))
        draft_spec = getattr(spec, "draft", None)
        if draft_spec is not None and config.speculative_config is not None:  # the draft's weights and KV load too
            draft = _resolve(draft_spec)
            weights += estimate_weight_bytes(draft.model_args, resolve_dtype(config))
            kv += planned_kv_cache_bytes(draft.model_args, draft_config(config),
                                         max_seq_len_for(checkpoint_max_seq_len, config))
        return weights + kv + planned_graph_bytes(model_args, config, resolve_dtype(config))

    async def load(self, spec: Any) -> EngineClient:
        config = _effective_config(self._config, spec)

        current = [True]  # a load given up on keeps running on its thread: it must not report after that

        def report(event: ProgressEvent) -> None:
            if current[0]:
                self._loading[spec.model_id] = event

        try:
            return await asyncio.to_thread(load_engine, spec, config, chat_template_path=self._chat_template_path, progress=report)
        finally:
            current[0] = False
            self._loading.pop(spec.model_id, None)
