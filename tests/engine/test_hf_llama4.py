"""Llama 4 Hugging Face folders (engine/loading/hf_llama4.py) against transformers' own Llama 4.

A tiny random Llama4ForCausalLM with every Llama 4 feature on (MoE with 4 experts, top 2,
interleaved with dense layers; a NoPE layer; chunked attention with a chunk shorter than the
prompt; qk-norm; temperature tuning that changes every 4 positions; llama3 RoPE scaling with a
smooth band) is written by transformers' save_pretrained, registered through the loader, and its
greedy tokens and logprobs compared with transformers' eager forward on the same weights. The
Llama4ForConditionalGeneration folder (text_config, language_model. names, vision weights) serves
the same text model, and model-parallel size 2 equals 1.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine.loading.hf_llama4 import llama4_config_params, llama4_ffn_params
from engine.types import CheckpointError
from tests.engine.test_checkpoint_formats import NEW_TOKENS, PROMPT, add_tokenizer, serve

transformers = pytest.importorskip("transformers")

TEXT_CONFIG = dict(
    vocab_size=384, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    interleave_moe_layer_step=2, no_rope_layer_interval=3, attention_chunk_size=8, use_qk_norm=True,
    attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, max_position_embeddings=64, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip


def random_weights_(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations through the layers (transformers' init, std 0.02, would give near-uniform
    logits and greedy near-ties): norms near 1, embeddings N(0, 1), linears and experts 1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif "embed_tokens" in name:
                value = noise
            else:  # [out, in] linears; experts [E, in, out]
                value = noise / (p.shape[1] ** 0.5)
            p.copy_(value.to(p.dtype))


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.Llama4TextConfig(**TEXT_CONFIG)
    config._attn_implementation = "eager"
    model = transformers.Llama4ForCausalLM(config).eval()
    random_weights_(model, seed=0)
    return model


@pytest.fixture(scope="module")
def causal_folder(tmp_path_factory, hf_model):
    folder = tmp_path_factory.mktemp("hf_llama4") / "causal"
    hf_model.save_pretrained(folder)
    return add_tokenizer(folder)


def transformers_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' forward on the whole sequence at each step (no cache): greedy tokens, logprobs."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
            last = torch.log_softmax(logits.double(), dim=-1)
            tokens.append(int(last.argmax()))
            logprobs.append(float(last[tokens[-1]]))
    return tokens[len(prompt):], logprobs


@pytest.fixture(scope="module")
def expected(hf_model):
    return transformers_greedy(hf_model, PROMPT, NEW_TOKENS)


def test_config_maps_to_llama4_params(causal_folder):
    source = causal_folder / "config.json"
    config = json.loads(source.read_text())
    params = llama4_config_params(config, source)
    assert params["nope_layer_interval"] == 3 and params["attention_chunk_size"] == 8
    assert params["moe_args"]["interleave_moe_layer_step"] == 2 and params["moe_args"]["top_k"] == 2
    assert params["use_scaled_rope"] and params["rope_scaling_factor"] == 8.0 and params["rope_high_freq_factor"] == 4.0
    assert params["floor_scale"] == 4.0 and params["use_qk_norm"] and params["attn_temperature_tuning"]
    # an explicit null chunk is no chunking; a missing one is transformers' default, 8192
    unchunked = {**config, "attention_chunk_size": None, "layer_types": None}
    assert llama4_config_params(unchunked, source)["attention_chunk_size"] is None
    missing = {k: v for k, v in config.items() if k not in ("attention_chunk_size", "layer_types")}
    assert llama4_config_params(missing, source)["attention_chunk_size"] == 8192
    # transformers 4.x wrote rope_scaling beside rope_theta (Maverick's: null, no scaling)
    old = {**config, "rope_parameters": None, "rope_scaling": None, "rope_theta": 10000.0}
    assert llama4_config_params(old, source)["use_scaled_rope"] is False and llama4_config_params(old, source)["rope_theta"] == 10000.0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_serves_transformers_greedy_tokens_and_logprobs(causal_folder, expected, dtype):
    """The prompt (11 tokens) and the answer span two chunks of 8 and the temperature's steps of 4."""
    tokens, logprobs, _ = serve(causal_folder, dtype=dtype)
    assert tokens == expected[0]
    # transformers rotates and qk-normalises in float32 whatever the dtype: ~1e-6 apart here
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), torch.tensor(expected[1], dtype=torch.float64), atol=2e-5, rtol=0)


def test_prompt_logits_match_transformers_at_every_position(causal_folder, hf_model):
    """Every position's logits (prefill, float32), not only the sampled ones."""
    from engine.config import EngineConfig
    from engine.executor.worker_group import WorkerGroup
    from engine.loading.checkpoint import resolve_checkpoint
    from tests.engine.test_llama4 import prefill_logits

    spec = resolve_checkpoint(causal_folder, model_id="tiny")
    assert spec.format == "hf" and spec.model_args.is_llama4
    group = WorkerGroup(spec, EngineConfig(dtype="float32", block_size_tokens=4, max_batch_size=4), max_seq_len=64)
    try:
        prompt = PROMPT + [7, 200, 33, 91, 150, 2]  # 17 tokens: three chunks
        ours = prefill_logits(group, prompt)
    finally:
        group.shutdown()
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt]), use_cache=False).logits[0]
    torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-4, rtol=1e-4)


def test_conditional_generation_folder_serves_its_text_model(tmp_path, hf_model, causal_folder, caplog):
    """Llama4ForConditionalGeneration: text_config, language_model.model.* names, vision weights skipped (logged)."""
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                             vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32,
                                             projector_output_dim=32)  # fmt: skip
    config = transformers.Llama4Config(text_config=transformers.Llama4TextConfig(**TEXT_CONFIG), vision_config=vision)
    model = transformers.Llama4ForConditionalGeneration(config)
    model.language_model.load_state_dict(hf_model.state_dict())
    folder = tmp_path / "conditional"
    model.save_pretrained(folder)
    add_tokenizer(folder)
    with caplog.at_level(logging.INFO, logger="engine.loading.hf_checkpoint"):
        got = serve(folder, dtype="float64")[:2]
    assert got == serve(causal_folder, dtype="float64")[:2]
    assert "vision encoder / projector tensors" in caplog.text


def test_model_parallel_2_equals_1(causal_folder):
    """Experts split along their hidden size, heads and the dense FFN over two ranks."""
    tokens2, logprobs2, _ = serve(causal_folder, mp_size=2)
    tokens1, logprobs1, _ = serve(causal_folder)
    assert tokens2 == tokens1 and len(tokens1) == NEW_TOKENS
    torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-9, rtol=0)


def test_tied_embeddings(tmp_path):
    config = transformers.Llama4TextConfig(**TEXT_CONFIG, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    model = transformers.Llama4ForCausalLM(config).eval()
    random_weights_(model, seed=1)
    model.tie_weights()
    folder = tmp_path / "tied"
    model.save_pretrained(folder)
    add_tokenizer(folder)
    expected = transformers_greedy(model, PROMPT, NEW_TOKENS)
    tokens, logprobs, _ = serve(folder, dtype="float32")
    assert tokens == expected[0]
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), torch.tensor(expected[1], dtype=torch.float64), atol=2e-5, rtol=0)


def test_published_sizes_take_meta_form_and_others_are_exact():
    """Scout / Maverick (hidden 5120, experts 8192, dense 16384): Meta's ffn_exp 4 and multiplier 1.2."""
    from engine.models.args import ModelArgs, MoEArgs
    from engine.models.llama4.args import moe_hidden_dim

    scout = llama4_ffn_params(5120, 16384, 8192)
    assert (scout["ffn_exp"], scout["ffn_dim_multiplier"]) == (4.0, 1.2)
    for dim, dense, moe in ((64, 96, 32), (64, 100, 36), (48, 200, 90), (64, 96, None), (5120, 16384, 8192)):
        params = llama4_ffn_params(dim, dense, moe)
        moe_args = params.pop("moe_args")
        args = ModelArgs(dim=dim, n_layers=1, n_heads=1, **params, moe_args=MoEArgs(num_experts=2, **moe_args))
        assert args.ffn_hidden_dim == dense
        assert moe is None or moe_hidden_dim(args) == moe


@pytest.mark.parametrize("change, message", [
    ({"no_rope_layers": [1, 0, 0, 1]}, "no_rope_layers .* is not every n-th layer"),
    ({"moe_layers": [0, 3]}, "moe_layers .* is not every n-th layer"),
    ({"head_dim": 32}, "head_dim 32 differs"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types .* differ"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])  # fmt: skip
def test_configs_it_cannot_run_are_refused_naming_the_field(causal_folder, tmp_path, change, message):
    from engine.loading.checkpoint import resolve_checkpoint

    folder = tmp_path / "bad"
    folder.mkdir()
    config = {**json.loads((causal_folder / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").symlink_to(causal_folder / "model.safetensors")
    add_tokenizer(folder)
    with pytest.raises(CheckpointError, match=message):
        resolve_checkpoint(folder, model_id="tiny")


def test_mapped_weights_in_llama_models_reference_match_transformers(causal_folder, hf_model):
    """The mapping itself against both references: the folder's tensors under our names, written in
    Meta's shipped layout, run by llama-models' own llama4 Transformer (its load hooks), give
    transformers' logits at every position."""
    reference = pytest.importorskip("llama_models.llama4.model")
    from llama_models.llama4.args import ModelArgs as MetaArgs
    from llama_models.llama4.datatypes import TransformerInput

    from engine.executor.parallel import destroy_group, init_group
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.loading.detect import reader_for
    from engine.loading.llama4 import to_meta_layout

    spec = resolve_checkpoint(causal_folder, model_id="tiny")
    state = reader_for(spec.format).read_shard(spec.shard_paths[0], spec.model_args, ())
    shipped = to_meta_layout({k: v.contiguous() for k, v in state.items()}, spec.model_args)
    prompt = PROMPT + [7, 200, 33, 91, 150, 2]
    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # the reference's KV caches call .cuda()
    try:
        params = {k: v for k, v in spec.model_args.to_params().items() if k != "max_seq_len"}  # config.json's, kept in extra
        model = reference.Transformer(MetaArgs(**params, max_batch_size=1, max_seq_len=64))
        missing, unexpected = model.load_state_dict(shipped, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
        with torch.inference_mode():
            meta = model(TransformerInput(tokens=torch.tensor([prompt]), tokens_position=0)).logits[0].float()
    finally:
        torch.Tensor.cuda = cuda
        destroy_group()
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt]), use_cache=False).logits[0]
    torch.testing.assert_close(meta, theirs.float(), atol=1e-4, rtol=1e-4)
