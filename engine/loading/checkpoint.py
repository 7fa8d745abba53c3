"""Checkpoints in, per-rank weights out: resolution (architecture, family, tokenizer) and resharding.

Each shipped format (Meta shards, torchtune epochs, Hugging Face folders) is a reader in
engine/loading/formats.py, detected by engine/loading/detect.py; every reader yields shards under
Meta's names and layout, which this module validates and cuts for each rank.

A checkpoint saved with K model-parallel shards runs at any size N where K | N or N | K: each
weight is cut along its parallel dimension (column-parallel: output rows; row-parallel: input
columns; the vocab-parallel embedding: vocab rows) and every rank reads only the old shards that
overlap its slice, through mmap. Nothing is unpickled but tensors (torch.load(weights_only=True)).
Every bad checkpoint raises CheckpointError naming the file, key and expected vs found shape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from engine.loading.meta_quantized import as_shipped, release_formats
from engine.quant.formats import ExpertWeights, QuantizedWeight, cat_rows, concat_cols
from engine.loading.descriptors import LLAMA2_VOCAB_SIZE, LLAMA3_VOCAB_SIZE, Descriptor, find_descriptor, resolve_descriptor
from engine.loading.detect import detect_format, reader_for
from engine.loading.file_guard import guard_tree, guarded
from engine.loading.formats import architecture_file
from engine.loading.layout import ParamLayout, local_shape, param_layouts, rank_range
from engine.loading.llama4 import normalize_shard, parallel_size_problems, to_meta_layout
from engine.loading.mllama import TEXT_PREFIX, normalize_shard as normalize_mllama_shard, vision_dims
from engine.models.mllama.args import IMAGE_TOKEN_ROWS, VISION_HEADS, VisionDims
from engine.models.llama4.args import VISION_PREFIXES as LLAMA4_VISION_PREFIXES, VisionConfig, vision_config
from engine.loading.progress import Progress, ProgressCallback
from engine.models.args import ModelArgs
from engine.types import CheckpointError, Family, InvalidRequest

log = logging.getLogger(__name__)

PARAMS_FILE = "params.json"
# Keys Meta checkpoints carry that the model does not use (Llama 2 shards hold their RoPE table).
_IGNORED_KEYS = frozenset({"rope.freqs"})


# --------------------------------------------------------------------------- checkpoint description
@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    model_id: str
    descriptor: Descriptor | None  # None for "hf" checkpoints named by no descriptor
    family: Family
    checkpoint_dir: Path
    model_args: ModelArgs
    shard_paths: tuple[Path, ...]  # [K] in model-parallel rank order
    tokenizer_path: Path | None  # tokenizer.model (llama families) or tokenizer.json ("hf")
    max_seq_len: int  # the family's default context length in tokens
    allowed_roots: tuple[Path, ...] = ()  # non-empty: every file must resolve inside these when opened
    format: str = "meta"  # the reader of shard_paths (engine/loading/detect.py): meta, torchtune, hf


def find_shards(checkpoint_dir: Path) -> tuple[Path, ...]:
    """The model-parallel shards of a checkpoint folder, whatever its format (engine/loading/formats.py)."""
    return detect_format(Path(checkpoint_dir)).shard_paths


def _default_vocab(family: Family) -> int | None:
    if family == "llama2":
        return LLAMA2_VOCAB_SIZE
    if family.startswith("llama3"):
        return LLAMA3_VOCAB_SIZE
    return None


def _descriptor_for(model_id: str, llama_model: str | None) -> Descriptor | None:
    if llama_model is None:
        return find_descriptor(model_id)
    try:
        return resolve_descriptor(llama_model)
    except InvalidRequest as exc:  # one error type for everything that stops a checkpoint loading
        raise CheckpointError(str(exc)) from None


def _read_params(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read params.json: {exc}") from None


def _log_mismatch(params_path: Path, descriptor: Descriptor, args: ModelArgs) -> None:
    published = descriptor.architecture
    ours = args.to_params()
    diffs = [f"{k}={ours.get(k)!r} (published {v!r})" for k, v in published.items() if ours.get(k) != v]
    if diffs:
        log.warning("%s: %s differs from %s: %s", params_path.parent, params_path.name, descriptor.name, ", ".join(diffs))


def resolve_checkpoint(
    checkpoint_dir: Path, *, model_id: str, llama_model: str | None = None, allowed_roots: tuple[Path, ...] = ()
) -> CheckpointSpec:
    """Describe a checkpoint dir without reading weights: architecture, family, shards, tokenizer.
    With `allowed_roots`, every file in the dir must resolve inside them (engine/loading/file_guard.py)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory does not exist")
    guard_tree(checkpoint_dir, allowed_roots)
    # HF repos of Meta models keep the Meta-format files under original/.
    original = checkpoint_dir / "original"
    if not (checkpoint_dir / PARAMS_FILE).exists() and (original / PARAMS_FILE).exists():
        checkpoint_dir = original
    found = detect_format(checkpoint_dir)  # raises naming what is missing
    checkpoint_dir = found.folder  # a torchtune output dir resolves to its latest epoch
    descriptor = _descriptor_for(model_id, llama_model)
    if descriptor is not None:
        published = descriptor.architecture  # raises for architectures this engine cannot run
    params_path = found.params_source or checkpoint_dir / PARAMS_FILE
    has_params = found.params is not None or params_path.exists()
    family = _tokenizer_family(checkpoint_dir, descriptor, has_params, model_id)
    arch_family = descriptor.family if descriptor is not None else family
    defaults: dict[str, Any] = {"rope_theta": 10000.0} if arch_family == "llama2" else {}
    if descriptor is not None and arch_family != "llama2":
        defaults["rope_scaling_factor"] = descriptor.rope_scaling_factor  # params.json never states it
    if has_params:
        params = found.params if found.params is not None else _read_params(params_path)
        args = ModelArgs.from_params(params, source=str(params_path), defaults=defaults)
        if descriptor is not None:
            _log_mismatch(params_path, descriptor, args)
    elif descriptor is not None:
        args = ModelArgs.from_params(published, source=f"{descriptor.name} (published architecture)", defaults=defaults)
    else:  # unreachable: "hf" requires an architecture file
        raise CheckpointError(f"{params_path}: missing")
    if args.vocab_size <= 0:
        vocab = (dict(descriptor.arch).get("vocab_size") if descriptor else None) or _default_vocab(arch_family)
        if vocab is None:
            raise CheckpointError(f"{params_path}: vocab_size is {args.vocab_size} and no descriptor supplies it")
        args = dataclasses.replace(args, vocab_size=vocab)
    tokenizer_name = "tokenizer.json" if family == "hf" else "tokenizer.model"
    tokenizer_path = checkpoint_dir / tokenizer_name
    max_seq_len = descriptor.max_seq_len if descriptor else _checkpoint_max_seq_len(dict(args.extra), params_path)
    log.info("%s: %s checkpoint, %d shard(s), %s tokenizer", checkpoint_dir, found.format, len(found.shard_paths), family)
    return CheckpointSpec(
        model_id=model_id,
        descriptor=descriptor,
        family=family,
        checkpoint_dir=checkpoint_dir,
        model_args=args,
        shard_paths=found.shard_paths,
        tokenizer_path=tokenizer_path if tokenizer_path.exists() else None,
        max_seq_len=max_seq_len,
        allowed_roots=tuple(allowed_roots),
        format=found.format,
    )


def _tokenizer_family(checkpoint_dir: Path, descriptor: Descriptor | None, has_params: bool, model_id: str) -> Family:
    """The family whose tokenizer and chat format serve the checkpoint: the descriptor's, with its
    tokenizer.model; a folder with only tokenizer.json (Hugging Face, GGUF imports) is "hf": its
    tokenizer.json and its tokenizer_config.json's chat template."""
    has_tokenizer_json = (checkpoint_dir / "tokenizer.json").exists()
    if descriptor is not None and ((checkpoint_dir / "tokenizer.model").exists() or not has_tokenizer_json):
        return descriptor.family
    if has_params and has_tokenizer_json:
        return "hf"
    raise CheckpointError(
        f"{checkpoint_dir}: {model_id!r} names no known Llama model; set llama_model to its base descriptor "
        "(e.g. Llama3.2-3B-Instruct)"
    )


MAX_CHECKPOINT_SEQ_LEN = 1 << 21  # tokens; a params.json claiming more is refused, not allocated for


def _checkpoint_max_seq_len(extra: dict[str, Any], params_path: Path) -> int:
    value = extra.get("max_seq_len", 4096)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHECKPOINT_SEQ_LEN:
        raise CheckpointError(f"{params_path.name}: max_seq_len must be an integer in 1..{MAX_CHECKPOINT_SEQ_LEN}, "
                              f"got {str(value)[:32]}")
    return value


def check_tokenizer_vocab(spec: CheckpointSpec, tokenizer_vocab_size: int) -> None:
    """A tokenizer that emits ids past the embedding table would index out of range mid-request."""
    if tokenizer_vocab_size > spec.model_args.vocab_size:
        raise CheckpointError(
            f"{spec.tokenizer_path}: tokenizer has {tokenizer_vocab_size} tokens but "
            f"{spec.checkpoint_dir / architecture_file(spec.format)} "
            f"vocab_size is {spec.model_args.vocab_size}"
        )


# --------------------------------------------------------------------------- parallel layout
def check_parallel_size(args: ModelArgs, mp_size: int, vision: VisionDims | VisionConfig | None = None) -> None:
    """Raise CheckpointError when the model cannot be cut into mp_size ranks (with a Llama 4
    checkpoint's vision encoder, `vision`, when it ships one)."""
    kv = args.kv_heads
    problems = []
    if args.n_heads % mp_size:
        problems.append(f"n_heads {args.n_heads}")
    if kv % mp_size and mp_size % kv:
        problems.append(f"n_kv_heads {kv}")
    if args.ffn_hidden_dim % mp_size:
        problems.append(f"ffn hidden size {args.ffn_hidden_dim}")
    if args.vocab_size % mp_size:
        problems.append(f"vocab_size {args.vocab_size}")
    if args.is_llama4:
        problems += parallel_size_problems(args, mp_size)
    if args.is_mllama:  # the image encoder's heads and the image-token rows are split over the ranks
        if VISION_HEADS % mp_size:
            problems.append(f"the image encoder's {VISION_HEADS} heads")
        if IMAGE_TOKEN_ROWS % mp_size:
            problems.append(f"the {IMAGE_TOKEN_ROWS} image-token embedding rows")
    if isinstance(vision, VisionConfig):
        problems += vision.parallel_size_problems(mp_size)
    if problems:
        raise CheckpointError(f"model-parallel size {mp_size} does not divide {', '.join(problems)}")


# --------------------------------------------------------------------------- loading
class _Shards:
    """Old shards opened on demand through mmap; each is validated once when opened."""

    def __init__(self, spec: CheckpointSpec, layouts: dict[str, ParamLayout]) -> None:
        self._spec = spec
        self._layouts = layouts
        self._open: dict[int, dict[str, torch.Tensor]] = {}
        # Llama 4: the vision weights are kept when the model loads them (checkpoint_vision_dims)
        self._llama4_vision = any(key.startswith(LLAMA4_VISION_PREFIXES) for key in layouts)

    @property
    def num_opened(self) -> int:
        return len(self._open)

    def get(self, old_rank: int) -> dict[str, torch.Tensor]:
        if old_rank not in self._open:
            path = guarded(self._spec.shard_paths[old_rank], self._spec.allowed_roots)  # checked again at open
            state = reader_for(self._spec.format).read_shard(path, self._spec.model_args, self._spec.allowed_roots)
            # Meta's pre-quantized releases, FP8 and int4 (engine/loading/meta_quantized.py); others pass through
            state = as_shipped(self._spec.checkpoint_dir, self._spec.model_args, path, state, old_rank, self._spec.allowed_roots)
            if self._spec.model_args.is_llama4:  # Meta's shipped Llama 4 keys -> the reference's names
                state = normalize_shard(self._spec.model_args, state, old_rank, len(self._spec.shard_paths),
                                        vision=self._llama4_vision)
            if self._spec.model_args.is_mllama:  # Llama 3.2 Vision's text_model. prefix dropped
                state = normalize_mllama_shard(state)
            self._validate(path, state, old_rank)
            self._open[old_rank] = state
        return self._open[old_rank]

    def old_layout(self, key: str) -> ParamLayout:
        """The layout the checkpoint was saved in. Llama 2 shards split the embedding along dim
        (fairscale ParallelEmbedding); Llama 3 along the vocab (VocabParallelEmbedding)."""
        layout = self._layouts[key]
        size = len(self._spec.shard_paths)
        if key == "tok_embeddings.weight" and size > 1:
            found = tuple(self.get(0)[key].shape)
            by_dim = (layout.full_shape[0], layout.full_shape[1] // size)
            if found == by_dim and found != local_shape(layout, 0, size):
                return ParamLayout(layout.full_shape, 1)
        return layout

    def _validate(self, path: Path, state: dict[str, torch.Tensor], old_rank: int) -> None:
        size = len(self._spec.shard_paths)
        missing = [k for k in self._layouts if k not in state]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{path}: missing key {missing[0]!r}{more}, expected by {self._arch_source()}")
        unexpected = [k for k in state if k not in self._layouts and k not in _IGNORED_KEYS]
        if unexpected:
            raise CheckpointError(f"{path}: unexpected key {unexpected[0]!r}" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
        for key, layout in self._layouts.items():
            tensor = state[key]
            if not isinstance(tensor, (torch.Tensor, QuantizedWeight, ExpertWeights)):
                raise CheckpointError(f"{path}: key {key!r} holds {type(tensor).__name__}, not a tensor")
            expected = local_shape(layout, old_rank, size)
            if key == "tok_embeddings.weight" and size > 1 and tuple(tensor.shape) == (layout.full_shape[0], layout.full_shape[1] // size):
                continue  # Llama 2's dim-split embedding; see old_layout
            if tuple(tensor.shape) != expected:
                raise CheckpointError(
                    f"{path}: key {key!r} has shape {list(tensor.shape)}, expected {list(expected)} "
                    f"(shard {old_rank} of {size}, {self._arch_source()} {self._describe(key)})"
                )

    def _arch_source(self) -> str:
        source = architecture_file(self._spec.format)
        if (self._spec.checkpoint_dir / source).exists() or self._spec.descriptor is None:
            return source
        return f"{self._spec.descriptor.name}'s published architecture (no params.json)"

    def _describe(self, key: str) -> str:
        a = self._spec.model_args
        if "tok_embeddings" in key or key.startswith("output"):
            return f"vocab_size={a.vocab_size}, dim={a.dim}"
        return f"dim={a.dim}, n_heads={a.n_heads}, n_kv_heads={a.kv_heads}, ffn hidden={a.ffn_hidden_dim}"


def quantized_formats(spec: CheckpointSpec) -> set[str]:
    """The quantized weight formats the checkpoint's shards declare (our safetensors layout; read
    from the headers only), so a load on a device without their kernels fails before any mapping."""
    from engine.quant.shard_file import read_formats

    formats: set[str] = release_formats(spec.checkpoint_dir, spec.model_args)  # Meta's pre-quantized releases
    for path in spec.shard_paths:
        if spec.format == "meta" and path.suffix == ".safetensors":
            try:
                formats |= read_formats(path)
            except (ValueError, KeyError, TypeError, AttributeError, OSError, json.JSONDecodeError, struct.error) as exc:
                raise CheckpointError(f"{path}: not a readable quantized shard: {exc}") from None
    return formats


def _narrow(weight: torch.Tensor | QuantizedWeight | ExpertWeights, dim: int, start: int, length: int) -> torch.Tensor | QuantizedWeight | ExpertWeights:
    """A slice along dim 0 (output rows) or 1 (input columns); a quantized weight is sliced in its
    codes (rows() / cols(), at group boundaries), never requantized; quantized experts along the
    reference's dims like a tensor (ExpertWeights.narrow)."""
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, length)
    try:
        if isinstance(weight, ExpertWeights):
            return weight.narrow(dim, start, length)
        return weight.rows(start, start + length) if dim == 0 else weight.cols(start, start + length)
    except ValueError as exc:  # a row-parallel cut inside a quantization group
        raise CheckpointError(f"cannot shard this quantized weight for this model-parallel size: {exc}") from None


def _cat(pieces: list, dim: int) -> torch.Tensor | QuantizedWeight:
    if all(isinstance(p, torch.Tensor) for p in pieces):
        return torch.cat(pieces, dim=dim)
    if isinstance(pieces[0], ExpertWeights):
        try:  # a Meta Llama 4 FP8 release's experts at another model-parallel size: exact, or refused
            return ExpertWeights.cat(pieces, dim)
        except ValueError as exc:
            raise CheckpointError(f"cannot reshard these quantized experts to this model-parallel size: {exc}; "
                                  f"serve it at the model-parallel size it was saved with") from None
    if dim == 0:
        return cat_rows(pieces)
    try:  # row-parallel shards merged (resharding to fewer ranks): exact, or refused
        return concat_cols(pieces)
    except ValueError as exc:
        raise CheckpointError(f"cannot reshard this quantized checkpoint to this model-parallel size: {exc}; "
                              f"serve it at the model-parallel size it was saved with") from None


def nbytes_of(weight: torch.Tensor | QuantizedWeight | ExpertWeights) -> int:
    return weight.nbytes() if isinstance(weight, (QuantizedWeight, ExpertWeights)) else weight.numel() * weight.element_size()


def _old_ranks(layout: ParamLayout, new_rank: int, new_size: int, old_size: int) -> Iterator[tuple[int, int, int]]:
    """(old_rank, start, end) of the old shards overlapping new_rank's slice, in global coordinates."""
    start, end = rank_range(layout, new_rank, new_size)
    seen = set()
    for old in range(old_size):
        o_start, o_end = rank_range(layout, old, old_size)
        # Saved past n_kv_heads, neighbouring shards hold the same KV head: read it once.
        if o_start < end and start < o_end and (o_start, o_end) not in seen:
            seen.add((o_start, o_end))
            yield old, o_start, o_end


def _slice_for_rank(shards: _Shards, key: str, layout: ParamLayout, rank: int, size: int, old_size: int) -> torch.Tensor:
    if layout.parallel_dim is None:
        return shards.get(0)[key]
    dim = layout.parallel_dim
    old = shards.old_layout(key)
    if old.parallel_dim != dim:  # saved split along another dim: rebuild the full weight, then cut
        full = _cat([shards.get(o)[key] for o in range(old_size)], old.parallel_dim)
        start, end = rank_range(layout, rank, size)
        return _narrow(full, dim, start, end - start)
    start, end = rank_range(layout, rank, size)
    pieces = []
    for old, o_start, o_end in _old_ranks(layout, rank, size, old_size):
        lo, hi = max(start, o_start), min(end, o_end)
        pieces.append(_narrow(shards.get(old)[key], dim, lo - o_start, hi - lo))
    return pieces[0] if len(pieces) == 1 else _cat(pieces, dim)


def load_rank_state_dict(spec: CheckpointSpec, mp_rank: int, mp_size: int, *, progress: ProgressCallback | None = None) -> dict[str, torch.Tensor]:
    """The weights model-parallel rank `mp_rank` of `mp_size` holds, in the checkpoint's dtype.
    Tensors are views of the mmapped shards where no merge was needed (no copy until the caller
    converts dtype or device)."""
    args = spec.model_args
    vision = checkpoint_vision_dims(spec)
    check_parallel_size(args, mp_size, vision)
    old_size = len(spec.shard_paths)
    if old_size > 1:
        check_parallel_size(args, old_size, vision)
    layouts = param_layouts(args, vision)
    shards = _Shards(spec, layouts)
    started_s = time.monotonic()
    out: dict[str, torch.Tensor] = {}
    stage = f"rank {mp_rank}: mapping {old_size} shard(s)" + (f", resharding to {mp_size}" if old_size != mp_size else "")
    with Progress(stage, len(layouts), unit="tensor", callback=progress, bar=False) as mapping:
        for key, layout in layouts.items():
            try:
                out[key] = _slice_for_rank(shards, key, layout, mp_rank, mp_size, old_size)
            except CheckpointError as exc:
                if not isinstance(shards.get(0)[key], (QuantizedWeight, ExpertWeights)):
                    raise
                raise CheckpointError(f"{spec.checkpoint_dir}: {key} (saved in {old_size} shard(s)), loading at model-parallel size {mp_size}: {exc}") from None
            mapping.update(1)
    nbytes = sum(nbytes_of(t) for t in out.values())
    log.info(
        "rank %d/%d: mapped %.1f MiB of weights from %d shard(s) of %s in %.2f s",
        mp_rank, mp_size, nbytes / 2**20, shards.num_opened, spec.checkpoint_dir, time.monotonic() - started_s,
    )  # fmt: skip
    return out


def checkpoint_vision_dims(spec: CheckpointSpec) -> VisionDims | VisionConfig | None:
    """A Llama 3.2 Vision checkpoint's image encoder sizes, from its first shard's shapes (mmapped:
    no weight is read); a Llama 4 checkpoint's vision_args when its Meta shards ship the vision
    weights (params.json with vision_args over text-only shards loads as text); None for a text model."""
    if spec.model_args.is_llama4:
        return _llama4_vision(spec)
    if not spec.model_args.is_mllama:
        return None
    path = guarded(spec.shard_paths[0], spec.allowed_roots)
    state = normalize_mllama_shard(reader_for(spec.format).read_shard(path, spec.model_args, spec.allowed_roots))
    return vision_dims(state, spec.model_args, source=str(path))


def _llama4_vision(spec: CheckpointSpec) -> VisionConfig | None:
    if spec.format != "meta" or "vision_args" not in dict(spec.model_args.extra):
        return None
    path = guarded(spec.shard_paths[0], spec.allowed_roots)
    state = reader_for(spec.format).read_shard(path, spec.model_args, spec.allowed_roots)  # mmapped: keys only
    if not any(key.startswith(LLAMA4_VISION_PREFIXES) for key in state):
        log.info("%s: params.json has vision_args but the shards hold no vision weights: text only", spec.checkpoint_dir)
        return None
    return vision_config(dict(spec.model_args.extra), source=str(spec.checkpoint_dir / PARAMS_FILE))


# --------------------------------------------------------------------------- writing (tests, demos)
def random_state_dict(
    args: ModelArgs, *, seed: int = 0, dtype: torch.dtype = torch.float32, vision: VisionDims | None = None
) -> dict[str, torch.Tensor]:
    """Full (unsharded) random weights, scaled so activations stay O(1) through the layers."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, layout in param_layouts(args, vision).items():
        if key.endswith("norm.weight") or (key.endswith(".weight") and ".ln_" in key):  # norm weights near 1
            value = 1.0 + 0.1 * torch.randn(layout.full_shape, generator=gen, dtype=torch.float64)
        elif key in ("tok_embeddings.weight", "learnable_embedding.weight"):
            value = torch.randn(layout.full_shape, generator=gen, dtype=torch.float64)
        elif len(layout.full_shape) != 2:  # gates, biases, Llama 3.2 Vision's position tables: O(1)
            value = 0.5 * torch.randn(layout.full_shape, generator=gen, dtype=torch.float64)
        else:
            fan_in = layout.full_shape[1]
            value = torch.randn(layout.full_shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
        out[key] = value.to(dtype)
    return out


def shard_state_dict(
    full: dict[str, torch.Tensor], args: ModelArgs, rank: int, size: int, vision: VisionDims | None = None
) -> dict[str, torch.Tensor]:
    """Rank `rank` of `size` as Meta shards a checkpoint (the layout load_rank_state_dict reads)."""
    out = {}
    for key, layout in param_layouts(args, vision).items():
        tensor = full[key]
        if layout.parallel_dim is not None:
            start, end = rank_range(layout, rank, size)
            tensor = tensor.narrow(layout.parallel_dim, start, end - start)
        out[key] = tensor.clone()
    return out


def write_random_checkpoint(
    out_dir: Path,
    args: ModelArgs,
    *,
    num_shards: int = 1,
    seed: int = 0,
    tokenizer_path: Path | None = None,
    dtype: torch.dtype = torch.float32,
    vision: VisionDims | None = None,
    unnumbered: bool = False,
) -> Path:
    """Write params.json + consolidated.NN.pth with random weights in the real Meta format. The same
    seed gives the same full weights whatever num_shards is. A Llama 3.2 Vision model's encoder has
    the sizes `vision` gives; `unnumbered` writes one consolidated.pth (the 11B Vision release's name)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_parallel_size(args, num_shards)  # past n_kv_heads, shards repeat KV heads as Meta's do
    if unnumbered and num_shards != 1:
        raise ValueError("an unnumbered consolidated.pth holds one shard")
    full = random_state_dict(args, seed=seed, dtype=dtype, vision=vision)
    for rank in range(num_shards):
        shard = shard_state_dict(full, args, rank, num_shards, vision)
        if args.is_llama4:  # written as Meta ships Llama 4 (fused, renamed)
            shard = to_meta_layout(shard, args)
        if args.is_mllama:  # the text weights under text_model., as CrossAttentionTransformer names them
            shard = {k if k.startswith("vision_model.") else TEXT_PREFIX + k: v for k, v in shard.items()}
        torch.save(shard, out_dir / ("consolidated.pth" if unnumbered else f"consolidated.{rank:02d}.pth"))
    (out_dir / PARAMS_FILE).write_text(json.dumps(args.to_params(), indent=2))
    if tokenizer_path is not None:
        target = out_dir / Path(tokenizer_path).name
        target.write_bytes(Path(tokenizer_path).read_bytes())
    return out_dir


# --------------------------------------------------------------------------- sizing
def parameter_count(args: ModelArgs, vision: VisionDims | None = None) -> int:
    return sum(math.prod(layout.full_shape) for layout in param_layouts(args, vision).values())


def dtype_bytes(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def estimate_weight_bytes(args: ModelArgs, dtype: torch.dtype | str, vision: VisionDims | None = None) -> int:
    """Bytes the weights take in `dtype` over all ranks together (a Llama 3.2 Vision encoder at
    `vision`'s sizes, checkpoint_vision_dims; else the released one's)."""
    return parameter_count(args, vision) * dtype_bytes(dtype)


__all__ = [
    "CheckpointSpec",
    "check_parallel_size",
    "check_tokenizer_vocab",
    "checkpoint_vision_dims",
    "estimate_weight_bytes",
    "find_shards",
    "load_rank_state_dict",
    "random_state_dict",
    "resolve_checkpoint",
    "shard_state_dict",
    "write_random_checkpoint",
]
