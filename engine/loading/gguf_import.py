"""Convert a Llama-architecture GGUF file into one of our Meta-format checkpoint dirs.

Out come `params.json` (architecture from the GGUF metadata), `consolidated.00.pth` (Meta key names,
dequantized weights), `tokenizer.json` (HF `tokenizers` format, built from `tokenizer.ggml.*`) and
`tokenizer_config.json` (chat template, bos/eos spellings and our stop-token ids).

q/k layout: llama.cpp's convert script permutes HF's q_proj/k_proj rows back into Meta's interleaved
RoPE layout (ggml's "normal" RoPE rotates adjacent pairs, like Meta's complex-number RoPE), so GGUF
q/k rows are copied as they are. tests/engine/test_gguf_import.py checks this on logits: a HF-layout
model written the way llama.cpp's converter writes it gives the same logits after import.

Usage: `llamaserve import-gguf FILE OUT_DIR` (the CLI calls `main`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from engine.tokenizers.hf import END_OF_GENERATION_SPELLINGS, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from engine.types import CheckpointError

if TYPE_CHECKING:
    from engine.loading.progress import ProgressCallback
    from engine.quant.formats import QuantizedWeight

log = logging.getLogger(__name__)

WEIGHTS_FILE = "consolidated.00.pth"
# --keep-quantized: GGUF Q4_0/Q4_1/Q8_0 weights kept in their blocks (engine/quant, docs/quantization.md)
QUANTIZED_WEIGHTS_FILE = "consolidated.00.safetensors"

# GGUF tensor name (after the "blk.N." prefix) -> Meta key (after the "layers.N." prefix).
_LAYER_TENSORS = {
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_output.weight": "attention.wo.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "attn_norm.weight": "attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 scaled-RoPE factors; checked, not stored
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# ggml token types (gguf.TokenType): which GGUF vocab entries become added tokens.
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# The split regexes of the Llama 3 and Qwen 2 tokenizer.json files (llama.cpp reproduces them by name).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True, slots=True)
class _PreTokenizer:
    """How llama.cpp splits text before BPE for one `tokenizer.ggml.pre` value, as HF JSON."""

    pre_tokenizer: dict[str, Any]
    ignore_merges: bool = False  # Llama 3 style: a whole pre-token found in the vocab skips merging


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


_DIGITS_THEN_GPT2 = _PreTokenizer(
    {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)]}
)
_GPT2 = _PreTokenizer(_byte_level(True))
_LLAMA3 = _PreTokenizer({"type": "Sequence", "pretokenizers": [_split(_LLAMA3_SPLIT), _byte_level(False)]}, True)
_QWEN2 = _PreTokenizer({"type": "Sequence", "pretokenizers": [_split(_QWEN2_SPLIT), _byte_level(False)]})

# tokenizer.ggml.pre -> pre-tokenizer, grouped as llama.cpp's llama-vocab.cpp groups them.
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _DIGITS_THEN_GPT2),
    **dict.fromkeys(("default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion"), _GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2),
}


# --------------------------------------------------------------------------- reading GGUF
def _open_gguf(path: Path):
    """A GGUFReader, with every way a file can be unreadable turned into CheckpointError."""
    from gguf import GGUFReader

    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file does not exist")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, OverflowError) as exc:
        # The reader raises plain ValueError/IndexError for a truncated header, bad magic or an
        # unknown tensor type id; say which file and what it said.
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise CheckpointError(
                f"{path}: truncated: tensor {tensor.name!r} needs bytes up to {end} but the file has {size}"
            )
    return reader


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _required(reader, path: Path, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise CheckpointError(f"{path}: GGUF metadata lacks {key!r}")
    return value


def _uniform(value: Any, path: Path, key: str) -> int:
    """Per-layer arrays (some GGUFs store head counts per layer) must hold one value here."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise CheckpointError(f"{path}: {key} differs between layers ({value}); only uniform layers are supported")
        value = value[0]
    return int(value)


# --------------------------------------------------------------------------- architecture
def ffn_params(dim: int, hidden_dim: int) -> dict[str, Any]:
    """multiple_of / ffn_dim_multiplier that make the llama3 reference FeedForward formula give exactly
    `hidden_dim`: the published Meta values when they fit, else multiple_of = hidden_dim itself."""
    from engine.models.args import ModelArgs

    base = int(2 * (4 * dim) / 3)
    candidates: list[dict[str, Any]] = [{"multiple_of": m, "ffn_dim_multiplier": None} for m in (256, 1024, 4096)]
    candidates.append({"multiple_of": hidden_dim, "ffn_dim_multiplier": None if base <= hidden_dim else hidden_dim / base})
    for candidate in candidates:
        args = ModelArgs(dim=dim, n_layers=1, n_heads=1, **candidate)
        if args.ffn_hidden_dim == hidden_dim:
            return candidate
    raise CheckpointError(f"cannot express FFN size {hidden_dim} for dim {dim} in params.json")  # pragma: no cover


def meta_rope_factors(head_dim: int, theta: float, scale_factor: float = 8.0) -> np.ndarray:
    """freqs / scaled freqs of Meta's Llama 3.x `apply_scaling` (what llama.cpp stores as rope_freqs)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low, high, old_context = 1.0, 4.0, 8192
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    scaled = np.where(
        wavelen < old_context / high,
        freqs,
        np.where(wavelen > old_context / low, freqs / scale_factor, (1 - smooth) * freqs / scale_factor + smooth * freqs),
    )
    return freqs / scaled


def read_params(reader, path: Path) -> dict[str, Any]:
    """params.json content from GGUF metadata; unsupported architectures fail naming the reason."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: general.architecture is {arch!r}; only 'llama' GGUF files can be imported")
    if _field(reader, "llama.expert_count", 0):
        raise CheckpointError(f"{path}: mixture-of-experts GGUF (llama.expert_count) is not supported")
    dim = int(_required(reader, path, "llama.embedding_length"))
    n_layers = int(_required(reader, path, "llama.block_count"))
    n_heads = _uniform(_required(reader, path, "llama.attention.head_count"), path, "llama.attention.head_count")
    n_kv_heads = _uniform(_field(reader, "llama.attention.head_count_kv", n_heads), path, "llama.attention.head_count_kv")
    hidden_dim = _uniform(_required(reader, path, "llama.feed_forward_length"), path, "llama.feed_forward_length")
    if dim % n_heads:
        raise CheckpointError(f"{path}: embedding_length {dim} is not a multiple of head_count {n_heads}")
    head_dim = dim // n_heads
    for key in ("llama.attention.key_length", "llama.attention.value_length", "llama.rope.dimension_count"):
        value = _field(reader, key)
        if value is not None and int(value) != head_dim:
            raise CheckpointError(f"{path}: {key} is {value}, expected dim / head_count = {head_dim}; not supported")
    scaling = _field(reader, "llama.rope.scaling.type")
    factor = float(_field(reader, "llama.rope.scaling.factor", 1.0) or 1.0)
    if scaling not in (None, "none") and factor != 1.0:
        raise CheckpointError(f"{path}: RoPE scaling {scaling!r} (factor {factor}) is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab_size = int(_field(reader, "llama.vocab_size", 0) or (int(embd.shape[1]) if embd is not None else len(tokens)))
    params: dict[str, Any] = {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "vocab_size": vocab_size,
        **ffn_params(dim, hidden_dim),
        "norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "use_scaled_rope": False,
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "hidden_dim": hidden_dim,  # the FFN size as the GGUF states it (multiple_of above reproduces it)
        "max_seq_len": int(_field(reader, "llama.context_length", 4096)),
    }
    # llama.cpp's float32 rounding of the epsilon (9.9999997e-06) is noise; keep the decimal value.
    params["norm_eps"] = float(f"{params['norm_eps']:.6g}")
    params["use_scaled_rope"] = _check_rope_freqs(reader, path, head_dim, params["rope_theta"])
    return params


def _check_rope_freqs(reader, path: Path, head_dim: int, theta: float) -> bool:
    """A rope_freqs tensor means Llama 3.1 frequency scaling; accept it only when it is Meta's."""
    tensor = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if tensor is None:
        return False
    found = _dequantize(tensor, path).astype(np.float64).reshape(-1)
    for factor in (8.0, 16.0, 32.0):  # 8: Llama 3.1 (the one the engine runs); 32: Llama 3.2 1B/3B
        expected = meta_rope_factors(head_dim, theta, factor)
        if found.shape == expected.shape and np.allclose(found, expected, rtol=1e-3):
            if factor != 8.0:
                raise CheckpointError(f"{path}: Llama 3 RoPE scaling with factor {factor:g} is not supported (only 8, Llama 3.1's)")
            return True
    raise CheckpointError(f"{path}: {_ROPE_FREQS} holds RoPE factors other than Llama 3's scaling; not supported")


def read_gguf_params(path: Path) -> dict[str, Any]:
    """params.json's fields for a GGUF file, from its header alone (no tensor is read)."""
    return read_params(_open_gguf(Path(path)), Path(path))


# --------------------------------------------------------------------------- weights
def _dequantize(tensor, path: Path) -> np.ndarray:
    from gguf import quants

    try:
        array = quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be dequantized ({exc})"
        ) from None
    # GGUF shapes are ggml's (innermost first); torch wants [rows, cols].
    return array.reshape(tuple(int(n) for n in reversed(tensor.shape)))


def _native(tensor, path: Path) -> "QuantizedWeight | None":
    """The tensor in its own GGUF blocks if its type is kept native (engine.quant.gguf_blocks), else None."""
    from engine.quant.gguf_blocks import from_reader_tensor

    try:
        return from_reader_tensor(tensor)
    except ValueError as exc:
        raise CheckpointError(f"{path}: tensor {tensor.name!r}: {exc}") from None


def _meta_key(name: str, n_layers: int, path: Path) -> str | None:
    """Meta key for a GGUF tensor name; None for tensors read elsewhere; unknown names fail."""
    if name == _ROPE_FREQS:
        return None
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _BLOCK.match(name)
    if match and match.group(2) in _LAYER_TENSORS and int(match.group(1)) < n_layers:
        return f"layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    raise CheckpointError(f"{path}: unexpected tensor {name!r} for a Llama model with {n_layers} layers")


def _expected_shapes(params: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from engine.loading.layout import param_layouts
    from engine.models.args import ModelArgs

    known = {k: v for k, v in params.items() if k not in ("hidden_dim", "max_seq_len")}
    args = ModelArgs(**known)
    return {key: layout.full_shape for key, layout in param_layouts(args).items()}


def iter_weights(
    reader, path: Path, params: dict[str, Any], dtype: torch.dtype, *, keep_quantized: bool = False
) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
    """(Meta key, dequantized tensor) for every weight, shapes checked against params. With
    keep_quantized, 2-D Q4_0/Q4_1/Q8_0 tensors come as engine.quant weights with their own blocks."""
    expected = _expected_shapes(params)
    seen: set[str] = set()
    for tensor in reader.tensors:
        key = _meta_key(tensor.name, params["n_layers"], path)
        if key is None:
            continue
        if key == "output.weight" and params["tie_word_embeddings"]:  # pragma: no cover - tie is derived from it
            continue
        native = _native(tensor, path) if keep_quantized else None
        array = _dequantize(tensor, path) if native is None else None
        shape = tuple(array.shape) if native is None else native.shape
        if shape != expected[key]:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} has shape {list(shape)}, expected {list(expected[key])} for {key}"
            )
        seen.add(key)
        if native is not None:
            yield key, native
            continue
        yield key, torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(dtype)  # a copy: GGUF data is a read-only mmap
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) for {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))


# --------------------------------------------------------------------------- tokenizer
def build_tokenizer_files(reader, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) contents from `tokenizer.ggml.*`."""
    model = _field(reader, "tokenizer.ggml.model")
    tokens: list[str] = list(_required(reader, path, "tokenizer.ggml.tokens"))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    if model == "gpt2":
        pre = _field(reader, "tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZERS:
            raise CheckpointError(
                f"{path}: unknown pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        merges = [_split_merge(m) for m in _field(reader, "tokenizer.ggml.merges") or []]
        tokenizer_json = _tokenizer_json(tokens, types, merges, PRE_TOKENIZERS[pre])
    elif model == "llama":
        scores = list(_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))
        tokenizer_json = _sentencepiece_json(tokens, types, scores, bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)))
    else:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') and sentencepiece ('llama') vocabularies can be imported"
        )
    return tokenizer_json, _tokenizer_config(reader, tokens, types, default_add_bos=model == "llama")


def _split_merge(merge: str) -> list[str]:
    cut = merge.find(" ", 1)  # as llama.cpp splits: a merge's left side may itself start with a space
    return [merge[:cut], merge[cut + 1 :]]


def _tokenizer_json(tokens: list[str], types: list[int], merges: list[list[str]], pre: _PreTokenizer) -> dict[str, Any]:
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": types[i] == _TOKEN_CONTROL}
        for i, tok in enumerate(tokens)
        if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]  # fmt: skip
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicate spelling keeps its first id, as llama.cpp's lookup does
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre.pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre.ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _sentencepiece_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[list[str]]:
    """BPE merges that reproduce sentencepiece's score-driven merging (as HF's LlamaConverter does):
    every split of a piece into two pieces is a merge, ranked by the score of the merged piece."""
    vocab = {tok: i for i, tok in enumerate(tokens) if types[i] in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def _sentencepiece_json(tokens: list[str], types: list[int], scores: list[float], add_space_prefix: bool) -> dict[str, Any]:
    """A Llama-2-style HF tokenizer: "▁" for spaces, <0xNN> byte fallback, merges from scores."""
    unknown = next((tok for i, tok in enumerate(tokens) if types[i] == _TOKEN_UNKNOWN), None)
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": types[i] in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)}
        for i, tok in enumerate(tokens)
        if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNKNOWN)
    ]  # fmt: skip
    normalizers = [{"type": "Prepend", "prepend": "\u2581"}] if add_space_prefix else []
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})
    decoders = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unknown,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": _sentencepiece_merges(tokens, types, scores),
        },
    }


def _tokenizer_config(reader, tokens: list[str], types: list[int], *, default_add_bos: bool) -> dict[str, Any]:
    """HF's tokenizer_config.json conventions plus our explicit stop-token ids."""

    def spelling(key: str) -> str | None:
        token_id = _field(reader, key)
        return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None

    stop_ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token_id = _field(reader, key)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            stop_ids.add(int(token_id))
    stop_ids.update(
        i for i, tok in enumerate(tokens) if tok in END_OF_GENERATION_SPELLINGS and types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spelling("tokenizer.ggml.bos_token_id"),
        "eos_token": spelling("tokenizer.ggml.eos_token_id"),
        "unk_token": spelling("tokenizer.ggml.unknown_token_id"),
        "pad_token": spelling("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", default_add_bos)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "stop_token_ids": sorted(stop_ids),
        "model_max_length": int(_field(reader, "llama.context_length", 4096)),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


# --------------------------------------------------------------------------- writing
def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".partial")
    write(tmp)
    os.replace(tmp, path)


def _stored_bytes(weight: Any) -> int:
    """Bytes of a float tensor or of a quantized weight's codes and scales (engine.quant)."""
    return weight.nbytes() if hasattr(weight, "nbytes") and callable(weight.nbytes) else weight.numel() * weight.element_size()


def import_gguf(
    gguf_path: Path, out_dir: Path, *, progress: bool = True, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
    callback: "ProgressCallback | None" = None,
) -> Path:
    """Convert `gguf_path` into a checkpoint dir at `out_dir` (created; existing files replaced).

    params.json is written last, so an interrupted import leaves no loadable-looking checkpoint.
    keep_quantized: Q4_0/Q4_1/Q8_0 matrices stay in their GGUF blocks (engine.quant int4/int8) and
    all weights go to QUANTIZED_WEIGHTS_FILE (docs/quantization.md) instead of WEIGHTS_FILE.
    `callback` receives each stage's advance (a server showing a registered GGUF's conversion)."""
    from engine.loading.progress import Progress

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open_gguf(gguf_path)
    params = read_params(reader, gguf_path)
    tokenizer_json, tokenizer_config = build_tokenizer_files(reader, gguf_path)
    if len(tokenizer_json["model"]["vocab"]) > params["vocab_size"] or len(_field(reader, "tokenizer.ggml.tokens")) > params["vocab_size"]:
        raise CheckpointError(f"{gguf_path}: the tokenizer has more tokens than vocab_size {params['vocab_size']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "params.json").unlink(missing_ok=True)
    state: dict[str, Any] = {}
    total_bytes = sum(int(t.n_elements) for t in reader.tensors) * torch.empty((), dtype=dtype).element_size()
    with Progress(f"converting {gguf_path.name}", total_bytes, callback=callback, bar=progress and sys.stderr.isatty(), logger=log) as converting:
        for key, tensor in iter_weights(reader, gguf_path, params, dtype, keep_quantized=keep_quantized):
            state[key] = tensor
            converting.update(_stored_bytes(tensor))
    weights_file = QUANTIZED_WEIGHTS_FILE if keep_quantized else WEIGHTS_FILE
    with Progress(f"writing {weights_file}", sum(map(_stored_bytes, state.values())), callback=callback, bar=False, logger=log) as writing:
        if keep_quantized:
            _write_quantized(out_dir, state)
        else:
            (out_dir / QUANTIZED_WEIGHTS_FILE).unlink(missing_ok=True)
            _write_atomic(out_dir / WEIGHTS_FILE, lambda p: torch.save(state, p))
        writing.update(writing.total)
    _write_atomic(out_dir / TOKENIZER_FILE, lambda p: p.write_text(json.dumps(tokenizer_json, ensure_ascii=False)))
    _write_atomic(out_dir / TOKENIZER_CONFIG_FILE, lambda p: p.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False)))
    _write_atomic(out_dir / "params.json", lambda p: p.write_text(json.dumps(params, indent=2)))
    log.info("imported %s -> %s (%d tensors)", gguf_path, out_dir, len(state))
    return out_dir


def _write_quantized(out_dir: Path, state: dict[str, Any]) -> None:
    """The no-pickle shard file: quantized weights under their key without ".weight"."""
    from engine.quant.formats import QuantizedWeight
    from engine.quant.shard_file import save_shard

    quantized = {k.removesuffix(".weight"): v for k, v in state.items() if isinstance(v, QuantizedWeight)}
    plain = {k: v for k, v in state.items() if not isinstance(v, QuantizedWeight)}
    (out_dir / WEIGHTS_FILE).unlink(missing_ok=True)  # one weights file per dir: the loader must not pick a stale one
    save_shard(out_dir / QUANTIZED_WEIGHTS_FILE, quantized, plain)


def main(argv: list[str]) -> int:
    """`llamaserve import-gguf FILE OUT_DIR`: 0 on success, 1 with a one-line error otherwise."""
    parser = argparse.ArgumentParser(prog="llamaserve import-gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf_file", type=Path, help="a Llama-architecture .gguf file")
    parser.add_argument("out_dir", type=Path, help="checkpoint directory to write (params.json, consolidated.00.pth, ...)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weight dtype to store (float32 holds dequantized values exactly)")  # fmt: skip
    parser.add_argument("--keep-quantized", action="store_true",
                        help=f"keep Q4_0/Q4_1/Q8_0 weights in their GGUF blocks (int4/int8, {QUANTIZED_WEIGHTS_FILE}; docs/quantization.md)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not args.quiet and not logging.getLogger().handlers:  # the CLI alone: progress lines when stderr is no terminal
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if (args.out_dir / "params.json").exists() and args.out_dir.resolve() != args.gguf_file.parent.resolve():
        print(f"note: replacing the checkpoint in {args.out_dir}", file=sys.stderr)
    try:
        out = import_gguf(
            args.gguf_file, args.out_dir, progress=not args.quiet, dtype=getattr(torch, args.dtype), keep_quantized=args.keep_quantized
        )
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot write {args.out_dir}: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


__all__ = ["PRE_TOKENIZERS", "build_tokenizer_files", "ffn_params", "import_gguf", "main", "read_gguf_params", "read_params"]
