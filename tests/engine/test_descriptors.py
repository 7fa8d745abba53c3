from __future__ import annotations

import pytest

from engine.loading.checkpoint import parameter_count
from engine.models.args import ModelArgs
from engine.loading.descriptors import DESCRIPTORS, find_descriptor, resolve_descriptor
from engine.types import CheckpointError, InvalidRequest

REQUIRED = [
    *(f"Llama3.1-{s}{i}" for s in ("8B", "70B", "405B") for i in ("", "-Instruct")),
    *(f"Llama3.2-{s}{i}" for s in ("1B", "3B") for i in ("", "-Instruct")),
    "Llama3.3-70B-Instruct",
    *(f"Llama-2-{s}{c}" for s in ("7b", "13b") for c in ("", "-chat")),
    *(f"Llama-4-{m}{i}" for m in ("Scout-17B-16E", "Maverick-17B-128E") for i in ("", "-Instruct")),
]


@pytest.mark.parametrize("name", REQUIRED)
def test_table_has_required_descriptors(name):
    assert name in DESCRIPTORS


@pytest.mark.parametrize(
    "name, expected",
    [
        ("Llama3.2-3B-Instruct", "Llama3.2-3B-Instruct"),
        ("meta-llama/Llama-3.2-3B-Instruct", "Llama3.2-3B-Instruct"),
        ("Llama-3.2-3B-Instruct", "Llama3.2-3B-Instruct"),  # the HF name without its org
        ("  meta-llama/llama-3.1-8b  ", "Llama3.1-8B"),  # case and whitespace are not significant
        ("meta-llama/Llama-2-7b-chat", "Llama-2-7b-chat"),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "Llama-4-Scout-17B-16E-Instruct"),
    ],
)
def test_both_naming_styles_resolve(name, expected):
    assert resolve_descriptor(name).name == expected


def test_unknown_name_lists_close_matches():
    with pytest.raises(InvalidRequest, match=r"unknown Llama model descriptor 'Llama3.2-3B-Instrct'.*Llama3.2-3B-Instruct") as info:
        resolve_descriptor("Llama3.2-3B-Instrct")
    assert info.value.param == "llama_model"
    assert find_descriptor("gpt-4") is None


@pytest.mark.parametrize("name", ["Llama-4-Scout-17B-16E", "meta-llama/Llama-4-Maverick-17B-128E-Instruct"])
def test_llama4_descriptors_resolve_to_llama4(name):
    descriptor = resolve_descriptor(name)
    assert descriptor.family == "llama4" and descriptor.rope_scaling_factor == 16.0  # llama4 args.py's default
    assert descriptor.architecture == {}  # params.json states the architecture


@pytest.mark.parametrize(
    "name, family, max_seq_len, ffn_hidden, billions",
    [
        ("Llama3.1-8B-Instruct", "llama3_1", 131072, 14336, 8.03),
        ("Llama3.1-70B", "llama3_1", 131072, 28672, 70.55),
        ("Llama3.1-405B-Instruct", "llama3_1", 131072, 53248, 405.85),
        ("Llama3.2-1B-Instruct", "llama3_2", 131072, 8192, 1.50),  # untied count; Meta ships output.weight
        ("Llama3.2-3B", "llama3_2", 131072, 8192, 3.61),
        ("Llama3.3-70B-Instruct", "llama3_3", 131072, 28672, 70.55),
        ("Llama-2-7b", "llama2", 4096, 11008, 6.74),
        ("Llama-2-13b-chat", "llama2", 4096, 13824, 13.02),
    ],
)
def test_published_architectures(name, family, max_seq_len, ffn_hidden, billions):
    descriptor = resolve_descriptor(name)
    args = ModelArgs.from_params(descriptor.architecture, source=name)
    assert descriptor.family == family and descriptor.max_seq_len == max_seq_len
    assert args.ffn_hidden_dim == ffn_hidden
    assert parameter_count(args) / 1e9 == pytest.approx(billions, abs=0.01)


def test_use_scaled_rope_follows_the_family():
    for d in DESCRIPTORS.values():
        if d.supported_reason is not None or d.name.startswith("Llama-Guard"):  # Llama Guard 3 8B: published unscaled
            continue
        if d.family in ("llama3_1", "llama3_2", "llama3_3"):
            assert d.architecture["use_scaled_rope"] is True
        elif d.family in ("llama2", "llama3"):
            assert d.architecture["use_scaled_rope"] is False


def test_rope_scaling_factor_of_llama_3_2_is_32():
    """meta-llama/llama-models#241: Llama 3.2 1B/3B were trained with factor 32, not 3.1's 8."""
    assert resolve_descriptor("Llama3.2-3B-Instruct").rope_scaling_factor == 32.0
    assert resolve_descriptor("Llama3.1-8B").rope_scaling_factor == 8.0
    assert resolve_descriptor("Llama3.3-70B-Instruct").rope_scaling_factor == 8.0


# --------------------------------------------------------------------------- llama-models' SKU list
def _llama_models_skus() -> list:
    sku_list = pytest.importorskip("llama_models.sku_list")
    from llama_models.cli.safety_models import prompt_guard_model_skus

    return [*sku_list.all_registered_models(), *prompt_guard_model_skus()]


_SKUS = {getattr(m, "descriptor", lambda m=m: m.model_id)(): m for m in _llama_models_skus()}


@pytest.mark.parametrize("name", sorted(_SKUS))
def test_every_llama_models_sku_resolves_or_says_why_not(name):
    """Each SKU is served (same release: HF repo, shard count, context, weight format) or refused with a reason."""
    sku = _SKUS[name]
    descriptor = resolve_descriptor(name)
    assert descriptor.name == name
    if descriptor.supported_reason is not None:
        with pytest.raises(CheckpointError) as refused:
            descriptor.architecture
        assert descriptor.supported_reason in str(refused.value)
        return
    assert descriptor.hf_repo == sku.huggingface_repo and descriptor.max_seq_len == sku.max_seq_length
    assert descriptor.quantization_format == sku.quantization_format.value.replace("-", "_")
    assert descriptor.family in ("llama2", "llama3", "llama3_1", "llama3_2", "llama3_3", "llama4")
    # llama-models' Llama 2 rows carry Llama 3's n_kv_heads / rope_theta and one shard for 13B; ours are
    # what Meta ships (test_published_architectures). Llama Guard 2: see _add_safety_models.
    if descriptor.family not in ("llama2", "llama4") and not name.startswith("Llama-Guard-2"):
        assert descriptor.architecture == dict(sku.arch_args) and descriptor.pth_file_count == sku.pth_file_count


@pytest.mark.parametrize("name, reason", [
    ("Prompt-Guard-86M", "is a classifier"),
    ("Llama-Prompt-Guard-2-22M", "is a classifier"),
    ("Llama-Guard-4-12B", "does not load yet"),
    ("Llama-Guard-3-1B:int4", "ExecuTorch"),
])
def test_refused_skus_name_the_reason(name, reason):
    assert reason in resolve_descriptor(name).supported_reason


def test_llama_3_2_vision_skus_are_served():
    """Llama 3.2 Vision (engine/models/mllama/): served, with llama-models' published architecture."""
    for name in ("Llama3.2-11B-Vision", "Llama3.2-11B-Vision-Instruct", "Llama3.2-90B-Vision",
                 "Llama3.2-90B-Vision-Instruct", "Llama-Guard-3-11B-Vision"):  # fmt: skip
        descriptor = resolve_descriptor(name)
        args = ModelArgs.from_params(descriptor.architecture, source=name)
        assert descriptor.supported_reason is None and args.architecture == "mllama"
        assert args.vision_max_num_chunks == 4 and args.vision_num_cross_attention_layers in (8, 20)


def test_llama_guard_3_is_a_llama_text_model():
    for name in ("Llama-Guard-3-1B", "Llama-Guard-3-8B", "meta-llama/Llama-Guard-3-8B"):
        descriptor = resolve_descriptor(name)
        args = ModelArgs.from_params(descriptor.architecture, source=name)
        assert descriptor.supported_reason is None and args.vocab_size == 128256


def test_405b_names_follow_llama_models():
    """The plain 405B names are Meta's FP8 release; the bf16 download has its own names (and the HF repo)."""
    assert resolve_descriptor("Llama3.1-405B-Instruct").quantization_format == "fp8_mixed"
    assert resolve_descriptor("meta-llama/Llama-3.1-405B-Instruct-FP8").name == "Llama3.1-405B-Instruct"
    assert resolve_descriptor("meta-llama/Llama-3.1-405B-Instruct").name == "Llama3.1-405B-Instruct:bf16-mp8"
    assert resolve_descriptor("Llama3.1-405B:bf16-mp16").pth_file_count == 16
