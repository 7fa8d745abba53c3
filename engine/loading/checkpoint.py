"""Meta-format checkpoints: params.json + consolidated.NN.pth shards, loaded zero-copy and resharded.

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
import pickle
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from engine.quant.formats import QuantizedWeight, cat_rows, concat_cols
from engine.loading.descriptors import LLAMA2_VOCAB_SIZE, LLAMA3_VOCAB_SIZE, Descriptor, find_descriptor, resolve_descriptor
from engine.loading.file_guard import guard_tree, guarded
from engine.loading.progress import Progress, ProgressCallback
from engine.types import CheckpointError, Family, InvalidRequest

log = logging.getLogger(__name__)

PARAMS_FILE = "params.json"
# Keys Meta checkpoints carry that the model does not use (Llama 2 shards hold their RoPE table).
_IGNORED_KEYS = frozenset({"rope.freqs"})
# params.json fields that mean these weights are not plain dense Llama text weights.
_INCOMPATIBLE_FIELDS = {
    "quantization_args": "pre-quantized (QAT/SpinQuant) checkpoints are not supported",
    "lora_args": "checkpoints with unmerged LoRA adapters are not supported",
    "vision_chunk_size": "Llama 3.2 Vision checkpoints are not supported",
    "vision_args": "vision checkpoints are not supported",
}
# Llama 4's params.json has vision_args: its text weights load, the vision weights are skipped.
_LLAMA4_ALLOWED = frozenset({"vision_args"})


# --------------------------------------------------------------------------- architecture
@dataclass(frozen=True, slots=True)
class MoEArgs:
    """params.json's moe_args (llama-models' llama4 MoEArgs, same defaults)."""

    num_experts: int = -1
    capacity_factor: float = 1.0
    auto_scale_F: bool = True  # noqa: N815 (Meta's name) hidden size scaled so active params match a dense layer
    top_k: int = 1
    interleave_moe_layer_step: int = 1  # every n-th layer is MoE (Maverick 2, Scout 1)

    @classmethod
    def from_params(cls, params: Any, *, source: str) -> "MoEArgs":
        if isinstance(params, MoEArgs):
            return params
        if not isinstance(params, dict):
            raise CheckpointError(f"{source}: moe_args must be an object, found {type(params).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - names)
        if unknown:
            log.info("%s: ignoring moe_args keys %s", source, ", ".join(unknown))
        return cls(**{k: v for k, v in params.items() if k in names})


_LLAMA4_FIELDS = frozenset(
    {"ffn_exp", "attention_chunk_size", "rope_high_freq_factor", "nope_layer_interval", "use_qk_norm",
     "attn_temperature_tuning", "floor_scale", "attn_scale", "moe_args"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """params.json, field for field as Meta writes it (llama3 reference `ModelArgs`)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: multi-head attention (n_kv_heads == n_heads)
    vocab_size: int = -1  # -1 (Llama 2): from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False  # Llama 3.1 long-context frequency scaling
    rope_scaling_factor: float | None = None  # with use_scaled_rope; None: 8 (Llama 3.1), 32 for Llama 3.2 1B/3B
    tie_word_embeddings: bool = False  # output.weight may be absent and shares tok_embeddings
    # Llama 4 (llama-models' llama4/args.py; engine/models/llama4/ reads them). Defaults: Llama 3 behaviour.
    ffn_exp: float | None = None  # MoE feed-forward size as a multiple of dim
    attention_chunk_size: int | None = None  # chunked local attention on the RoPE layers
    rope_high_freq_factor: float | None = None  # Llama 4's RoPE scaling (with rope_scaling_factor)
    nope_layer_interval: int | None = None  # every n-th layer has no positional encoding
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False  # on the NoPE layers
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    moe_args: MoEArgs | None = None
    extra: tuple[tuple[str, Any], ...] = ()  # params.json keys this engine does not use, kept for the record

    @classmethod
    def from_params(cls, params: dict[str, Any], *, source: str, defaults: dict[str, Any] | None = None) -> "ModelArgs":
        """Build from params.json content; unknown keys are kept in `extra` and logged."""
        if not isinstance(params, dict):
            raise CheckpointError(f"{source}: expected a JSON object, found {type(params).__name__}")
        llama4 = params.get("moe_args") is not None
        for key, why in _INCOMPATIBLE_FIELDS.items():
            if params.get(key) is not None and not (llama4 and key in _LLAMA4_ALLOWED):
                raise CheckpointError(f"{source}: has {key!r}: {why}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {**(defaults or {}), **{k: v for k, v in params.items() if k in names}}
        if known.get("moe_args") is not None:
            known["moe_args"] = MoEArgs.from_params(known["moe_args"], source=source)
        extra = tuple(sorted((k, v) for k, v in params.items() if k not in names))
        if extra:
            log.info("%s: ignoring params.json keys %s", source, ", ".join(k for k, _ in extra))
        missing = [k for k in ("dim", "n_layers", "n_heads") if k not in known]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")
        try:
            args = cls(**known, extra=extra)
        except TypeError as exc:
            raise CheckpointError(f"{source}: {exc}") from None
        args.validate(source)
        return args

    def validate(self, source: str) -> None:
        def bad(message: str) -> CheckpointError:
            return CheckpointError(f"{source}: {message}")

        for name in ("dim", "n_layers", "n_heads", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad(f"{name} must be a positive integer, found {value!r}")
        if self.dim % self.n_heads or self.head_dim % 2:
            raise bad(f"dim {self.dim} must split into {self.n_heads} heads of even size")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise bad(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise bad("norm_eps and rope_theta must be > 0")
        if self.rope_scaling_factor is not None and not self.rope_scaling_factor >= 1:
            raise bad(f"rope_scaling_factor must be >= 1, found {self.rope_scaling_factor!r}")
        if self.is_llama4:
            from engine.models.llama4.args import validate_llama4_args

            validate_llama4_args(self, dict(self.extra), bad)

    def to_params(self) -> dict[str, Any]:
        """params.json content (the inverse of from_params)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for optional in ("n_kv_heads", "rope_scaling_factor"):
            if out[optional] is None:
                del out[optional]
        if not out["tie_word_embeddings"]:
            del out["tie_word_embeddings"]
        for f in dataclasses.fields(self):  # Llama 4 fields only when they differ from Llama 3's defaults
            if f.name in _LLAMA4_FIELDS and out[f.name] == f.default:
                del out[f.name]
        if self.moe_args is not None:
            out["moe_args"] = dataclasses.asdict(self.moe_args)
        return {**out, **dict(self.extra)}

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def is_llama4(self) -> bool:
        """Llama 4's architecture (engine/models/llama4/): MoE, NoPE layers, chunked attention, qk-norm."""
        return self.moe_args is not None or self.nope_layer_interval is not None or self.attention_chunk_size is not None or self.use_qk_norm

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size, computed exactly as the llama3 reference FeedForward does."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


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


_CONSOLIDATED = re.compile(r"^consolidated\.(\d+)\.pth$")
# our no-pickle layout, quantized weights kept in their formats (engine/quant/shard_file.py)
_CONSOLIDATED_QUANTIZED = re.compile(r"^consolidated\.(\d+)\.safetensors$")
_TORCHTUNE = re.compile(r"^meta_model_(\d+)\.pth?$")  # torchtune's Meta-format output, one file per epoch


def find_shards(checkpoint_dir: Path) -> tuple[Path, ...]:
    """consolidated.NN.pth in rank order; else consolidated.NN.safetensors (quantized weights,
    docs/quantization.md); else torchtune's meta_model_N.pt (the latest epoch);
    else a single *.pth / *.pt file."""
    files = sorted(p for p in checkpoint_dir.iterdir() if p.is_file())
    numbered = sorted((int(m.group(1)), p) for p in files if (m := _CONSOLIDATED.match(p.name)))
    numbered = numbered or sorted((int(m.group(1)), p) for p in files if (m := _CONSOLIDATED_QUANTIZED.match(p.name)))
    if numbered:
        ranks = [rank for rank, _ in numbered]
        if ranks != list(range(len(ranks))):
            raise CheckpointError(f"{checkpoint_dir}: consolidated shards are not numbered 00..{len(ranks) - 1:02d}: {ranks}")
        return tuple(p for _, p in numbered)
    tune = sorted((int(m.group(1)), p) for p in files if (m := _TORCHTUNE.match(p.name)))
    if tune:
        if len(tune) > 1:
            log.info("%s: %d torchtune epoch checkpoints, using the latest, %s", checkpoint_dir, len(tune), tune[-1][1].name)
        return (tune[-1][1],)
    loose = [p for p in files if p.suffix in (".pth", ".pt")]
    if len(loose) == 1:
        return (loose[0],)
    found = ", ".join(p.name for p in files) or "nothing"
    raise CheckpointError(f"{checkpoint_dir}: no consolidated.NN.pth weight shards (found {found})")


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


def _log_mismatch(spec_dir: Path, descriptor: Descriptor, args: ModelArgs) -> None:
    published = descriptor.architecture
    ours = args.to_params()
    diffs = [f"{k}={ours.get(k)!r} (published {v!r})" for k, v in published.items() if ours.get(k) != v]
    if diffs:
        log.warning("%s: params.json differs from %s: %s", spec_dir, descriptor.name, ", ".join(diffs))


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
    if any(checkpoint_dir.glob("fp8_scales_*.pt")):  # cast without its scales it would be garbage
        raise CheckpointError(
            f"{checkpoint_dir}: pre-quantized FP8 checkpoints (fp8_scales_*.pt) are not supported; load the "
            "bf16 release with quantization fp8_mixed instead"
        )
    descriptor = _descriptor_for(model_id, llama_model)
    if descriptor is not None:
        published = descriptor.architecture  # raises for architectures this engine cannot run
    params_path = checkpoint_dir / PARAMS_FILE
    has_tokenizer_json = (checkpoint_dir / "tokenizer.json").exists()
    family: Family
    if descriptor is not None:
        family = descriptor.family
    elif params_path.exists() and has_tokenizer_json:
        family = "hf"
    else:
        raise CheckpointError(
            f"{checkpoint_dir}: {model_id!r} names no known Llama model; set llama_model to its base descriptor "
            "(e.g. Llama3.2-3B-Instruct)"
        )
    defaults: dict[str, Any] = {"rope_theta": 10000.0} if family == "llama2" else {}
    if descriptor is not None and family != "llama2":
        defaults["rope_scaling_factor"] = descriptor.rope_scaling_factor  # params.json never states it
    if params_path.exists():
        args = ModelArgs.from_params(_read_params(params_path), source=str(params_path), defaults=defaults)
        if descriptor is not None:
            _log_mismatch(checkpoint_dir, descriptor, args)
    elif descriptor is not None:
        args = ModelArgs.from_params(published, source=f"{descriptor.name} (published architecture)", defaults=defaults)
    else:  # unreachable: "hf" requires params.json
        raise CheckpointError(f"{params_path}: missing")
    if args.vocab_size <= 0:
        vocab = (dict(descriptor.arch).get("vocab_size") if descriptor else None) or _default_vocab(family)
        if vocab is None:
            raise CheckpointError(f"{params_path}: vocab_size is {args.vocab_size} and no descriptor supplies it")
        args = dataclasses.replace(args, vocab_size=vocab)
    tokenizer_name = "tokenizer.json" if family == "hf" else "tokenizer.model"
    tokenizer_path = checkpoint_dir / tokenizer_name
    max_seq_len = descriptor.max_seq_len if descriptor else _checkpoint_max_seq_len(dict(args.extra), params_path)
    return CheckpointSpec(
        model_id=model_id,
        descriptor=descriptor,
        family=family,
        checkpoint_dir=checkpoint_dir,
        model_args=args,
        shard_paths=find_shards(checkpoint_dir),
        tokenizer_path=tokenizer_path if tokenizer_path.exists() else None,
        max_seq_len=max_seq_len,
        allowed_roots=tuple(allowed_roots),
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
            f"{spec.tokenizer_path}: tokenizer has {tokenizer_vocab_size} tokens but {spec.checkpoint_dir / PARAMS_FILE} "
            f"vocab_size is {spec.model_args.vocab_size}"
        )


# --------------------------------------------------------------------------- parallel layout
@dataclass(frozen=True, slots=True)
class ParamLayout:
    full_shape: tuple[int, ...]
    parallel_dim: int | None  # None: replicated on every rank (norms)
    kv_heads: int = 0  # > 0 for wk/wv: ranks past n_kv_heads repeat heads (Meta's MP > n_kv_heads rule)


def param_layouts(args: ModelArgs) -> dict[str, ParamLayout]:
    """Every weight the model holds, with its full (unsharded) shape and parallel dimension."""
    ffn_layouts = dense_ffn_layouts
    if args.is_llama4:
        from engine.loading.llama4 import llama4_ffn_layouts as ffn_layouts
    d = args.dim
    out = {"tok_embeddings.weight": ParamLayout((args.vocab_size, d), 0)}  # VocabParallelEmbedding
    for i in range(args.n_layers):
        p = f"layers.{i}."
        out.update(attention_layouts(args, p))
        out.update(ffn_layouts(args, i, p))
        out[p + "attention_norm.weight"] = ParamLayout((d,), None)
        out[p + "ffn_norm.weight"] = ParamLayout((d,), None)
    out["norm.weight"] = ParamLayout((d,), None)
    if not args.tie_word_embeddings:
        out["output.weight"] = ParamLayout((args.vocab_size, d), 0)
    return out


def attention_layouts(args: ModelArgs, prefix: str) -> dict[str, ParamLayout]:
    d, q, kv = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    return {
        prefix + "attention.wq.weight": ParamLayout((q, d), 0),
        prefix + "attention.wk.weight": ParamLayout((kv, d), 0, args.kv_heads),
        prefix + "attention.wv.weight": ParamLayout((kv, d), 0, args.kv_heads),
        prefix + "attention.wo.weight": ParamLayout((d, q), 1),
    }


def dense_ffn_layouts(args: ModelArgs, layer_id: int, prefix: str) -> dict[str, ParamLayout]:
    d, f = args.dim, args.ffn_hidden_dim
    return {
        prefix + "feed_forward.w1.weight": ParamLayout((f, d), 0),
        prefix + "feed_forward.w2.weight": ParamLayout((d, f), 1),
        prefix + "feed_forward.w3.weight": ParamLayout((f, d), 0),
    }


def check_parallel_size(args: ModelArgs, mp_size: int) -> None:
    """Raise CheckpointError when the model cannot be cut into mp_size ranks."""
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
        from engine.loading.llama4 import parallel_size_problems

        problems += parallel_size_problems(args, mp_size)
    if problems:
        raise CheckpointError(f"model-parallel size {mp_size} does not divide {', '.join(problems)}")


def _rank_range(layout: ParamLayout, rank: int, size: int) -> tuple[int, int]:
    """[start, end) along the parallel dim that `rank` of `size` holds."""
    total = layout.full_shape[layout.parallel_dim]  # type: ignore[index]
    if layout.kv_heads and size > layout.kv_heads:
        head_dim = total // layout.kv_heads
        head = rank * layout.kv_heads // size
        return head * head_dim, (head + 1) * head_dim
    step = total // size
    return rank * step, (rank + 1) * step


def local_shape(layout: ParamLayout, rank: int, size: int) -> tuple[int, ...]:
    if layout.parallel_dim is None:
        return layout.full_shape
    start, end = _rank_range(layout, rank, size)
    shape = list(layout.full_shape)
    shape[layout.parallel_dim] = end - start
    return tuple(shape)


# --------------------------------------------------------------------------- loading
class _Shards:
    """Old shards opened on demand through mmap; each is validated once when opened."""

    def __init__(self, spec: CheckpointSpec, layouts: dict[str, ParamLayout]) -> None:
        self._spec = spec
        self._layouts = layouts
        self._open: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def num_opened(self) -> int:
        return len(self._open)

    def get(self, old_rank: int) -> dict[str, torch.Tensor]:
        if old_rank not in self._open:
            path = guarded(self._spec.shard_paths[old_rank], self._spec.allowed_roots)  # checked again at open
            state = _torch_load(path)
            if self._spec.model_args.is_llama4:  # Meta's shipped Llama 4 keys -> the reference's names
                from engine.loading.llama4 import normalize_shard

                state = normalize_shard(self._spec.model_args, state, old_rank, len(self._spec.shard_paths))
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
            if not isinstance(tensor, (torch.Tensor, QuantizedWeight)):
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
        if (self._spec.checkpoint_dir / PARAMS_FILE).exists() or self._spec.descriptor is None:
            return "params.json"
        return f"{self._spec.descriptor.name}'s published architecture (no params.json)"

    def _describe(self, key: str) -> str:
        a = self._spec.model_args
        if "tok_embeddings" in key or key.startswith("output"):
            return f"vocab_size={a.vocab_size}, dim={a.dim}"
        return f"dim={a.dim}, n_heads={a.n_heads}, n_kv_heads={a.kv_heads}, ffn hidden={a.ffn_hidden_dim}"


def _torch_load(path: Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    if not path.is_file():
        raise CheckpointError(f"{path}: weight shard is missing")
    if path.suffix == ".safetensors":
        return _load_quantized_shard(path)
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            # Pre-zipfile torch.save format: no mmap, still weights_only.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: refused to load: the file holds objects other than tensors ({first})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable torch checkpoint: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, found {type(state).__name__}")
    if "model" in state and isinstance(state["model"], dict):  # torchtune wraps some outputs in {"model": ...}
        state = state["model"]
    return state


def _load_quantized_shard(path: Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Our no-pickle shard (engine/quant/shard_file.py): plain tensors by name, quantized weights
    under `KEY.weight` as engine.quant weights (mapped copy-on-write, never requantized)."""
    from engine.quant.shard_file import load_shard

    try:
        quantized, plain = load_shard(path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError, struct.error) as exc:
        raise CheckpointError(f"{path}: not a readable quantized shard: {exc}") from None
    return {**plain, **{f"{key}.weight": weight for key, weight in quantized.items()}}


def quantized_formats(spec: CheckpointSpec) -> set[str]:
    """The quantized weight formats the checkpoint's shards declare (our safetensors layout; read
    from the headers only), so a load on a device without their kernels fails before any mapping."""
    from engine.quant.shard_file import read_formats

    formats: set[str] = set()
    for path in spec.shard_paths:
        if path.suffix == ".safetensors":
            try:
                formats |= read_formats(path)
            except (ValueError, KeyError, TypeError, AttributeError, OSError, json.JSONDecodeError, struct.error) as exc:
                raise CheckpointError(f"{path}: not a readable quantized shard: {exc}") from None
    return formats


def _narrow(weight: torch.Tensor | QuantizedWeight, dim: int, start: int, length: int) -> torch.Tensor | QuantizedWeight:
    """A slice along dim 0 (output rows) or 1 (input columns); a quantized weight is sliced in its
    codes (rows() / cols(), at group boundaries), never requantized."""
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, length)
    try:
        return weight.rows(start, start + length) if dim == 0 else weight.cols(start, start + length)
    except ValueError as exc:  # a row-parallel cut inside a quantization group
        raise CheckpointError(f"cannot shard this quantized weight for this model-parallel size: {exc}") from None


def _cat(pieces: list, dim: int) -> torch.Tensor | QuantizedWeight:
    if all(isinstance(p, torch.Tensor) for p in pieces):
        return torch.cat(pieces, dim=dim)
    if dim == 0:
        return cat_rows(pieces)
    try:  # row-parallel shards merged (resharding to fewer ranks): exact, or refused
        return concat_cols(pieces)
    except ValueError as exc:
        raise CheckpointError(f"cannot reshard this quantized checkpoint to this model-parallel size: {exc}; "
                              f"serve it at the model-parallel size it was saved with") from None


def nbytes_of(weight: torch.Tensor | QuantizedWeight) -> int:
    return weight.nbytes() if isinstance(weight, QuantizedWeight) else weight.numel() * weight.element_size()


def _old_ranks(layout: ParamLayout, new_rank: int, new_size: int, old_size: int) -> Iterator[tuple[int, int, int]]:
    """(old_rank, start, end) of the old shards overlapping new_rank's slice, in global coordinates."""
    start, end = _rank_range(layout, new_rank, new_size)
    seen = set()
    for old in range(old_size):
        o_start, o_end = _rank_range(layout, old, old_size)
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
        start, end = _rank_range(layout, rank, size)
        return _narrow(full, dim, start, end - start)
    start, end = _rank_range(layout, rank, size)
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
    check_parallel_size(args, mp_size)
    old_size = len(spec.shard_paths)
    if old_size > 1:
        check_parallel_size(args, old_size)
    layouts = param_layouts(args)
    shards = _Shards(spec, layouts)
    started_s = time.monotonic()
    out: dict[str, torch.Tensor] = {}
    stage = f"rank {mp_rank}: mapping {old_size} shard(s)" + (f", resharding to {mp_size}" if old_size != mp_size else "")
    with Progress(stage, len(layouts), unit="tensor", callback=progress, bar=False) as mapping:
        for key, layout in layouts.items():
            try:
                out[key] = _slice_for_rank(shards, key, layout, mp_rank, mp_size, old_size)
            except CheckpointError as exc:
                if not isinstance(shards.get(0)[key], QuantizedWeight):
                    raise
                raise CheckpointError(f"{spec.checkpoint_dir}: {key} (saved in {old_size} shard(s)), loading at model-parallel size {mp_size}: {exc}") from None
            mapping.update(1)
    nbytes = sum(nbytes_of(t) for t in out.values())
    log.info(
        "rank %d/%d: mapped %.1f MiB of weights from %d shard(s) of %s in %.2f s",
        mp_rank, mp_size, nbytes / 2**20, shards.num_opened, spec.checkpoint_dir, time.monotonic() - started_s,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- writing (tests, demos)
def random_state_dict(args: ModelArgs, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full (unsharded) random weights, scaled so activations stay O(1) through the layers."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, layout in param_layouts(args).items():
        if key.endswith("norm.weight"):  # norm weights near 1
            value = 1.0 + 0.1 * torch.randn(layout.full_shape, generator=gen, dtype=torch.float64)
        elif key == "tok_embeddings.weight":
            value = torch.randn(layout.full_shape, generator=gen, dtype=torch.float64)
        else:
            fan_in = layout.full_shape[1]
            value = torch.randn(layout.full_shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
        out[key] = value.to(dtype)
    return out


def shard_state_dict(full: dict[str, torch.Tensor], args: ModelArgs, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank` of `size` as Meta shards a checkpoint (the layout load_rank_state_dict reads)."""
    out = {}
    for key, layout in param_layouts(args).items():
        tensor = full[key]
        if layout.parallel_dim is not None:
            start, end = _rank_range(layout, rank, size)
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
) -> Path:
    """Write params.json + consolidated.NN.pth with random weights in the real Meta format. The same
    seed gives the same full weights whatever num_shards is."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_parallel_size(args, num_shards)  # past n_kv_heads, shards repeat KV heads as Meta's do
    full = random_state_dict(args, seed=seed, dtype=dtype)
    for rank in range(num_shards):
        shard = shard_state_dict(full, args, rank, num_shards)
        if args.is_llama4:  # written as Meta ships Llama 4 (fused, renamed)
            from engine.loading.llama4 import to_meta_layout

            shard = to_meta_layout(shard, args)
        torch.save(shard, out_dir / f"consolidated.{rank:02d}.pth")
    (out_dir / PARAMS_FILE).write_text(json.dumps(args.to_params(), indent=2))
    if tokenizer_path is not None:
        target = out_dir / Path(tokenizer_path).name
        target.write_bytes(Path(tokenizer_path).read_bytes())
    return out_dir


# --------------------------------------------------------------------------- sizing
def parameter_count(args: ModelArgs) -> int:
    return sum(math.prod(layout.full_shape) for layout in param_layouts(args).values())


def dtype_bytes(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def estimate_weight_bytes(args: ModelArgs, dtype: torch.dtype | str) -> int:
    """Bytes the weights take in `dtype` over all ranks together."""
    return parameter_count(args) * dtype_bytes(dtype)


__all__ = [
    "CheckpointSpec",
    "ModelArgs",
    "ParamLayout",
    "check_parallel_size",
    "check_tokenizer_vocab",
    "estimate_weight_bytes",
    "find_shards",
    "load_rank_state_dict",
    "local_shape",
    "param_layouts",
    "random_state_dict",
    "resolve_checkpoint",
    "shard_state_dict",
    "write_random_checkpoint",
]
