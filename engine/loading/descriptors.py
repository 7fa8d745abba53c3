"""Meta's published Llama models: descriptor name, HF repo id, family, architecture, context length.

The architecture of each entry is its params.json as Meta publishes it. A checkpoint's own
params.json wins over this table (finetunes, pruned and test checkpoints); the table supplies the
family (tokenizer, chat format, stop tokens) and the default context length, and the architecture
only when a checkpoint has no params.json.

Plain data, no torch: the server may resolve names without loading the engine.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from engine.types import CheckpointError, Family, InvalidRequest

LLAMA2_VOCAB_SIZE = 32000
LLAMA3_VOCAB_SIZE = 128256


@dataclass(frozen=True, slots=True)
class Descriptor:
    name: str  # llama-models descriptor, e.g. "Llama3.2-3B-Instruct"
    family: Family
    hf_repo: str  # e.g. "meta-llama/Llama-3.2-3B-Instruct"
    max_seq_len: int  # the family's default context length in tokens
    pth_file_count: int  # shards Meta publishes (consolidated.NN.pth)
    arch: tuple[tuple[str, Any], ...] = ()  # params.json items as Meta publishes them (a tuple: picklable, immutable)
    supported_reason: str | None = None  # None: this engine runs it; else why not
    # Llama 3 RoPE scaling factor (use_scaled_rope). Meta's params.json does not carry it: 8 for
    # Llama 3.1 / 3.3, but 32 for Llama 3.2 1B/3B (their HF config.json; meta-llama/llama-models#241).
    rope_scaling_factor: float = 8.0
    # How the release ships its weights (llama-models' CheckpointQuantizationFormat): bf16, fp8_mixed
    # (fp8_scales_N.pt beside the shards), int4 (QLoRA / SpinQuant params.json quantization_args), int8.
    quantization_format: str = "bf16"

    @property
    def architecture(self) -> dict[str, Any]:
        """params.json fields; raises CheckpointError for architectures this engine cannot run."""
        if self.supported_reason is not None:
            raise CheckpointError(f"{self.name}: {self.supported_reason}")
        return dict(self.arch)


def _llama2(dim: int, n_layers: int, n_heads: int, *, n_kv_heads: int | None = None) -> dict[str, Any]:
    # Llama 2 params.json ships vocab_size -1 (the 32000-token sentencepiece model), no n_kv_heads
    # (MHA) for 7B/13B, and the reference default rope_theta of 10000.
    arch: dict[str, Any] = {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "vocab_size": LLAMA2_VOCAB_SIZE,
        "multiple_of": 256 if n_kv_heads is None else 4096,
        "norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "use_scaled_rope": False,
    }
    if n_kv_heads is not None:
        arch.update(n_kv_heads=n_kv_heads, ffn_dim_multiplier=1.3)
    return arch


def _llama3(dim: int, n_layers: int, n_heads: int, ffn: float, multiple_of: int, *, scaled: bool) -> dict[str, Any]:
    return {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": 8,
        "vocab_size": LLAMA3_VOCAB_SIZE,
        "ffn_dim_multiplier": ffn,
        "multiple_of": multiple_of,
        "norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "use_scaled_rope": scaled,
    }


_L3_8B = dict(dim=4096, n_layers=32, n_heads=32, ffn=1.3, multiple_of=1024)
_L3_70B = dict(dim=8192, n_layers=80, n_heads=64, ffn=1.3, multiple_of=4096)
_L3_405B = dict(dim=16384, n_layers=126, n_heads=128, ffn=1.2, multiple_of=4096)
_L32_1B = dict(dim=2048, n_layers=16, n_heads=32, ffn=1.5, multiple_of=256)
_L32_3B = dict(dim=3072, n_layers=28, n_heads=24, ffn=1.0, multiple_of=256)


def _build_table() -> dict[str, Descriptor]:
    entries: list[Descriptor] = []

    def add(name: str, family: Family, hf: str, max_seq_len: int, shards: int, arch: dict, reason=None,
            quantization: str = "bf16") -> None:
        # params.json rarely states it: 32 for Llama 3.2 1B/3B, 16 for Llama 4 (llama4 args.py), else 8
        rope_factor = {"llama3_2": 32.0, "llama4": 16.0}.get(family, 8.0)
        entries.append(Descriptor(name, family, hf, max_seq_len, shards, tuple(arch.items()), reason, rope_factor, quantization))

    for suffix, hf_suffix in (("", ""), ("-chat", "-chat")):
        add(f"Llama-2-7b{suffix}", "llama2", f"meta-llama/Llama-2-7b{hf_suffix}", 4096, 1, _llama2(4096, 32, 32))
        add(f"Llama-2-13b{suffix}", "llama2", f"meta-llama/Llama-2-13b{hf_suffix}", 4096, 2, _llama2(5120, 40, 40))
        add(
            f"Llama-2-70b{suffix}", "llama2", f"meta-llama/Llama-2-70b{hf_suffix}", 4096, 8,
            _llama2(8192, 80, 64, n_kv_heads=8),
        )  # fmt: skip
    for suffix in ("", "-Instruct"):
        add(f"Llama-3-8B{suffix}", "llama3", f"meta-llama/Llama-3-8B{suffix}", 8192, 1, _llama3(**_L3_8B, scaled=False))
        add(f"Llama-3-70B{suffix}", "llama3", f"meta-llama/Llama-3-70B{suffix}", 8192, 8, _llama3(**_L3_70B, scaled=False))
        add(f"Llama3.1-8B{suffix}", "llama3_1", f"meta-llama/Llama-3.1-8B{suffix}", 131072, 1, _llama3(**_L3_8B, scaled=True))
        add(f"Llama3.1-70B{suffix}", "llama3_1", f"meta-llama/Llama-3.1-70B{suffix}", 131072, 8, _llama3(**_L3_70B, scaled=True))
        # the plain 405B names are Meta's default download, the FP8 release (bf16: the :bf16-mp8/16 names)
        add(f"Llama3.1-405B{suffix}", "llama3_1", f"meta-llama/Llama-3.1-405B{suffix}-FP8", 131072, 8,
            _llama3(**_L3_405B, scaled=True), quantization="fp8_mixed")
        add(f"Llama3.2-1B{suffix}", "llama3_2", f"meta-llama/Llama-3.2-1B{suffix}", 131072, 1, _llama3(**_L32_1B, scaled=True))
        add(f"Llama3.2-3B{suffix}", "llama3_2", f"meta-llama/Llama-3.2-3B{suffix}", 131072, 1, _llama3(**_L32_3B, scaled=True))
    add("Llama3.3-70B-Instruct", "llama3_3", "meta-llama/Llama-3.3-70B-Instruct", 131072, 8, _llama3(**_L3_70B, scaled=True))
    for name, max_seq_len in (
        ("Llama-4-Scout-17B-16E", 262144),
        ("Llama-4-Scout-17B-16E-Instruct", 10485760),
        ("Llama-4-Maverick-17B-128E", 262144),
        ("Llama-4-Maverick-17B-128E-Instruct", 1048576),
    ):
        add(name, "llama4", f"meta-llama/{name}", max_seq_len, 8, {})  # params.json states the architecture
    _add_release_variants(add)
    _add_safety_models(add)
    return {d.name: d for d in entries}


def _add_release_variants(add: Any) -> None:
    """The same models in other releases (llama-models' SKU list): Meta's FP8 405B (what the plain
    405B names download), its bf16 downloads at 8 and 16 shards, the Llama 3.2 int4 QLoRA / SpinQuant
    releases and Maverick FP8. Each names its weight format; the checkpoint's own files decide how
    it loads (engine/loading/formats.py)."""
    for suffix in ("", "-Instruct"):
        for shards in (8, 16):
            # at 16 shards, past 8 KV heads, the release states n_kv_heads 16 (each head saved twice)
            arch = {**_llama3(**_L3_405B, scaled=True), "n_kv_heads": max(8, shards)}
            add(f"Llama3.1-405B{suffix}:bf16-mp{shards}", "llama3_1", f"meta-llama/Llama-3.1-405B{suffix}", 131072, shards, arch)
    for size, base in (("1B", _L32_1B), ("3B", _L32_3B)):
        for method, hf_method in (("qlora", "QLORA"), ("spinquant", "SpinQuant")):
            arch = _llama3(**base, scaled=True)
            arch["quantization_args"] = {"group_size": 256}  # int4 weights, groups of 256 (llama-models' sku_list)
            if method == "qlora":
                arch["lora_args"] = {"rank": 16, "scale": 2.0}  # the QLoRA adapters shipped beside them
            add(f"Llama3.2-{size}-Instruct:int4-{method}-eo8", "llama3_2",
                f"meta-llama/Llama-3.2-{size}-Instruct-{hf_method}_INT4_EO8", 8192, 1, arch, quantization="int4")
    add("Llama-4-Maverick-17B-128E-Instruct:fp8", "llama4", "meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8",
        1048576, 8, {}, quantization="fp8_mixed")
    # Llama 3.2 Vision (engine/models/mllama/): Llama 3.1 8B / 70B text layers (RoPE factor 8) with
    # cross-attention layers; the 11B base model tiles images at 448 pixels, the others at 560
    for size, shards in (("11B", 1), ("90B", 8)):
        for suffix in ("", "-Instruct"):
            chunk = 448 if (size, suffix) == ("11B", "") else 560
            add(f"Llama3.2-{size}-Vision{suffix}", "llama3_2", f"meta-llama/Llama-3.2-{size}-Vision{suffix}", 131072, shards,
                _vision(size, chunk))


def _vision(size: str, chunk_size: int) -> dict[str, Any]:
    """Llama 3.2 Vision's params.json as llama-models' sku_list publishes it."""
    text = _llama3(4096, 32, 32, 1.3, 1024, scaled=True) if size == "11B" else _llama3(8192, 80, 64, 1.3, 4096, scaled=True)
    return {**text, "vision_chunk_size": chunk_size, "vision_max_num_chunks": 4,
            "vision_num_cross_attention_layers": 8 if size == "11B" else 20}  # fmt: skip


def _add_safety_models(add: Any) -> None:
    """Llama Guard (Llama text models that answer "safe" / "unsafe" with categories: served like
    any other) and Prompt Guard (classifiers: refused with the reason)."""
    add("Llama-Guard-3-1B", "llama3_2", "meta-llama/Llama-Guard-3-1B", 131072, 1, _llama3(**_L32_1B, scaled=True))
    # llama-models publishes Llama Guard 3 8B without scaled RoPE (a Llama 3.1 8B finetune otherwise)
    add("Llama-Guard-3-8B", "llama3_1", "meta-llama/Llama-Guard-3-8B", 131072, 1, _llama3(**_L3_8B, scaled=False))
    add("Llama-Guard-3-8B:int8", "llama3_1", "meta-llama/Llama-Guard-3-8B-INT8", 131072, 1,
        _llama3(**_L3_8B, scaled=False), quantization="int8")
    # A Llama 3 8B finetune (llama-models lists vocab_size 32000, but its tokenizer is Llama 3's 128256)
    add("Llama-Guard-2-8B", "llama3", "meta-llama/Llama-Guard-2-8B", 4096, 1, _llama3(**_L3_8B, scaled=False))
    add("Llama-Guard-3-1B:int4", "llama3_2", "meta-llama/Llama-Guard-3-1B-INT4", 131072, 1, {},
        "Llama-Guard-3-1B:int4 is a pruned int4 ExecuTorch program (.pte) for on-device use, not a checkpoint this "
        "server loads; serve Llama-Guard-3-1B")
    add("Llama-Guard-3-11B-Vision", "llama3_2", "meta-llama/Llama-Guard-3-11B-Vision", 131072, 1, _vision("11B", 560))
    add("Llama-Guard-4-12B", "llama4", "meta-llama/Llama-Guard-4-12B", 8192, 1, {},
        "Llama Guard 4 12B is a multimodal (dense) Llama 4 shipped only as a Hugging Face folder, which this server "
        "does not load yet; serve Llama-Guard-3-8B or Llama-Guard-3-1B for text")
    classifier = ("{name} is a classifier (mDeBERTa: scores a prompt as benign / injection / jailbreak), not a Llama "
                  "text-generation model; run it with Llama Stack's prompt-guard safety provider")
    for name in ("Prompt-Guard-86M", "Llama-Prompt-Guard-2-86M", "Llama-Prompt-Guard-2-22M"):
        add(name, "llama3", f"meta-llama/{name}", 512, 1, {}, classifier.format(name=name))


DESCRIPTORS: Mapping[str, Descriptor] = MappingProxyType(_build_table())


def _keys() -> dict[str, Descriptor]:
    """Descriptor names first, then HF repo ids (with and without their org) that name no descriptor:
    a repo several releases share (405B bf16 at 8 and 16 shards) names the first of them."""
    keys = {d.name.lower(): d for d in DESCRIPTORS.values()}
    for d in DESCRIPTORS.values():
        for key in (d.hf_repo, d.hf_repo.split("/", 1)[1]):
            keys.setdefault(key.lower(), d)
    return keys


_BY_KEY: Mapping[str, Descriptor] = MappingProxyType(_keys())


def find_descriptor(name: str) -> Descriptor | None:
    """The descriptor named by a llama-models descriptor or an HF repo id (case-insensitive), or None."""
    return _BY_KEY.get(name.strip().lower())


def resolve_descriptor(name: str) -> Descriptor:
    """Like find_descriptor, but an unknown name raises InvalidRequest listing the close matches.
    A known name this engine cannot run resolves too: its `supported_reason` says why (registration
    refuses it with that reason, server/registry.py)."""
    descriptor = find_descriptor(name)
    if descriptor is not None:
        return descriptor
    names = [*DESCRIPTORS, *(d.hf_repo for d in DESCRIPTORS.values())]
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(DESCRIPTORS)}"
    raise InvalidRequest(f"unknown Llama model descriptor {name!r}{hint}", param="llama_model")
