"""Every shipped checkpoint layout loads to the same model (engine/loading/formats.py, hf_checkpoint.py).

One tiny random Llama 3 is written as Meta ships it (consolidated.NN.pth), as torchtune's Meta
checkpointer writes it (epoch_N/model-0000K-of-0000M.bin beside a LoRA run's adapter_model.pt), and as
Hugging Face folders (single and sharded safetensors with an index, pytorch_model.bin, tied
embeddings), with q/k permuted the way transformers' convert_llama_weights_to_hf.py permutes them,
and as an F32 GGUF file converted by the GGUF importer.
Each loads through engine.loader.load_engine (what the registry calls) and must give the greedy
tokens and logprobs of llama-models' reference Transformer on the Meta original; in float64 every
layout gives exactly the Meta layout's logprobs (un-permuting moves rows, it computes nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.loading.checkpoint import random_state_dict, resolve_checkpoint, write_random_checkpoint
from engine.loading.hf_checkpoint import unpermute_rotary
from engine.models.args import ModelArgs
from engine.types import CheckpointError, EngineRequest, SamplingParams
from tests.engine.test_hf_tokenizer import byte_level_tokenizer_json

safetensors_torch = pytest.importorskip("safetensors.torch")

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=384, multiple_of=32, ffn_dim_multiplier=1.3,
                 norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True)
TIED = dataclasses.replace(ARGS, tie_word_embeddings=True)
PROMPT = [5, 77, 130, 9, 251, 18, 42, 300, 11, 64, 3]
NEW_TOKENS = 6
MAX_SEQ_LEN = 64
TOKENIZER_CONFIG = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}


# --------------------------------------------------------------------------- writers
def add_tokenizer(folder: Path) -> Path:
    """Every layout carries the same small byte-level tokenizer.json (267 tokens <= vocab_size)."""
    (folder / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return folder


def hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers' convert_llama_weights_to_hf.py permute: Meta's adjacent RoPE pairs -> rotate_half halves."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def hf_state(meta: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Meta names -> HF names, q/k permuted, as the HF converter writes them."""
    out = {"model.embed_tokens.weight": meta["tok_embeddings.weight"], "model.norm.weight": meta["norm.weight"]}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = meta["output.weight"]
    for i in range(args.n_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        out[h + "self_attn.q_proj.weight"] = hf_permute(meta[m + "attention.wq.weight"], args.n_heads)
        out[h + "self_attn.k_proj.weight"] = hf_permute(meta[m + "attention.wk.weight"], args.kv_heads)
        out[h + "self_attn.v_proj.weight"] = meta[m + "attention.wv.weight"]
        out[h + "self_attn.o_proj.weight"] = meta[m + "attention.wo.weight"]
        out[h + "mlp.gate_proj.weight"] = meta[m + "feed_forward.w1.weight"]
        out[h + "mlp.down_proj.weight"] = meta[m + "feed_forward.w2.weight"]
        out[h + "mlp.up_proj.weight"] = meta[m + "feed_forward.w3.weight"]
        out[h + "input_layernorm.weight"] = meta[m + "attention_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = meta[m + "ffn_norm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(args: ModelArgs) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "hidden_act": "silu",
        "max_position_embeddings": 131072, "tie_word_embeddings": args.tie_word_embeddings, "torch_dtype": "float32",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False,
    }


def write_hf(folder: Path, args: ModelArgs, layout: str) -> Path:
    folder.mkdir(parents=True)
    state = hf_state(random_state_dict(args, seed=0), args)
    (folder / "config.json").write_text(json.dumps(hf_config(args)))
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    if layout == "safetensors":
        safetensors_torch.save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    elif layout == "sharded":
        names = sorted(state)
        parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                 "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for file, keys in parts.items():
            safetensors_torch.save_file({k: state[k] for k in keys}, folder / file, metadata={"format": "pt"})
        weight_map = {k: file for file, keys in parts.items() for k in keys}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    elif layout == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    elif layout == "bin_sharded":
        names = sorted(state)
        parts = {"pytorch_model-00001-of-00002.bin": names[:5], "pytorch_model-00002-of-00002.bin": names[5:]}
        for file, keys in parts.items():
            torch.save({k: state[k] for k in keys}, folder / file)
        weight_map = {k: file for file, keys in parts.items() for k in keys}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return add_tokenizer(folder)


def write_torchtune(out: Path) -> Path:
    """torchtune's output dir after two epochs of a LoRA run with the Meta checkpointer: epoch_0 holds
    other weights, epoch_1 the ones under test, split by key over two .bin files, plus the adapter."""
    for epoch, seed in ((0, 1), (1, 0)):
        folder = out / f"epoch_{epoch}"
        folder.mkdir(parents=True)
        state = random_state_dict(ARGS, seed=seed)
        names = sorted(state)
        torch.save({k: state[k] for k in names[:7]}, folder / "model-00001-of-00002.bin")
        torch.save({k: state[k] for k in names[7:]}, folder / "model-00002-of-00002.bin")
        torch.save({"layers.0.attention.wq.lora_a.weight": torch.zeros(8, ARGS.dim)}, folder / "adapter_model.pt")
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
        (folder / "params.json").write_text(json.dumps(ARGS.to_params()))
        add_tokenizer(folder)
    return out


def write_gguf_imported(folder: Path) -> Path:
    """The Meta original as an F32 GGUF file the way llama.cpp's converter writes one (q/k rows in
    ggml's adjacent-pair order, which is Meta's; Llama 3.1's rope_freqs), converted by `llamaserve
    import-gguf` (engine/loading/gguf_import.py)."""
    gguf = pytest.importorskip("gguf")
    from engine.loading.gguf_import import import_gguf, meta_rope_factors
    from tests.engine.test_gguf_import import write_byte_level_vocab

    folder.mkdir(parents=True)
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), arch="llama")
    for add, value in ((writer.add_block_count, ARGS.n_layers), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, ARGS.dim), (writer.add_feed_forward_length, ARGS.ffn_hidden_dim),
                       (writer.add_head_count, ARGS.n_heads), (writer.add_head_count_kv, ARGS.kv_heads),
                       (writer.add_rope_freq_base, ARGS.rope_theta), (writer.add_layer_norm_rms_eps, ARGS.norm_eps),
                       (writer.add_rope_dimension_count, ARGS.head_dim), (writer.add_vocab_size, ARGS.vocab_size)):
        add(value)
    write_byte_level_vocab(writer)
    names = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "output.weight": "output.weight"}
    layer = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v", "attention.wo": "attn_output",
             "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down", "feed_forward.w3": "ffn_up",
             "attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}
    for key, value in random_state_dict(ARGS, seed=0).items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            name = f"blk.{i}.{layer[rest.removesuffix('.weight')]}.weight"
        else:
            name = names[key]
        writer.add_tensor(name, value.numpy())
    writer.add_tensor("rope_freqs.weight", meta_rope_factors(ARGS.head_dim, ARGS.rope_theta, 8.0).astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return import_gguf(folder / "model.gguf", folder / "imported", progress=False)


def write_meta(folder: Path, args: ModelArgs, num_shards: int = 1) -> Path:
    return add_tokenizer(write_random_checkpoint(folder, args, num_shards=num_shards, seed=0))


LAYOUTS = {
    "meta": lambda d: write_meta(d, ARGS),
    "meta_2_shards": lambda d: write_meta(d, ARGS, 2),
    "torchtune_epochs": write_torchtune,
    "hf_safetensors": lambda d: write_hf(d, ARGS, "safetensors"),
    "hf_sharded_index": lambda d: write_hf(d, ARGS, "sharded"),
    "hf_pytorch_bin": lambda d: write_hf(d, ARGS, "bin"),
    "hf_pytorch_bin_sharded": lambda d: write_hf(d, ARGS, "bin_sharded"),
    "gguf_f32_imported": write_gguf_imported,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    return {name: write(root / name) for name, write in LAYOUTS.items()}


# --------------------------------------------------------------------------- the oracle
def reference_greedy(args: ModelArgs, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """llama-models' llama3 reference Transformer on the Meta original: greedy tokens and their logprobs."""
    reference = pytest.importorskip("llama_models.llama3.model")
    from llama_models.llama3.args import ModelArgs as MetaArgs

    from engine.executor.parallel import destroy_group, init_group

    state = random_state_dict(args, seed=0)
    if args.tie_word_embeddings:  # the reference always has an output head: the tied one is the embedding
        state["output.weight"] = state["tok_embeddings.weight"]
    params = {k: v for k, v in args.to_params().items() if k != "tie_word_embeddings"}
    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    try:
        model = reference.Transformer(MetaArgs(**params, max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
        model.load_state_dict(state, strict=True)
        tokens, logprobs = list(prompt), []
        with torch.no_grad():
            for _ in range(steps):
                last = torch.log_softmax(model(torch.tensor([tokens]), 0)[0, -1].double(), dim=-1)
                token = int(last.argmax())
                tokens.append(token)
                logprobs.append(float(last[token]))
    finally:
        destroy_group()
    return tokens[len(prompt):], logprobs


@pytest.fixture(scope="module")
def expected() -> tuple[list[int], list[float]]:
    return reference_greedy(ARGS, PROMPT, NEW_TOKENS)


def serve(folder: Path, *, mp_size: int = 1, quantization: str | None = None, dtype: str | None = "float64",
          llama_model: str | None = None) -> tuple[list[int], list[float], SimpleNamespace]:
    """load_engine (the registry's loader) on `folder`, then one greedy request with logprobs."""
    from engine.loader import load_engine

    spec = SimpleNamespace(model_id="tiny", checkpoint_dir=folder, llama_model=llama_model, allowed_roots=(),
                           model_parallel_size=None, max_seq_len=None, quantization=None)
    config = EngineConfig(dtype=dtype, model_parallel_size=mp_size, max_seq_len=MAX_SEQ_LEN, block_size_tokens=4,
                          max_batch_size=4, cpu_kv_cache_bytes=4 << 20, quantization=quantization)

    async def run() -> tuple[list[int], list[float], SimpleNamespace]:
        engine = await asyncio.to_thread(load_engine, spec, config)
        try:
            request = EngineRequest("r", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0))
            tokens, logprobs = [], []
            async for out in engine.generate(request):
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.logprobs or []]
            return tokens, logprobs, SimpleNamespace(sampling_defaults=engine.sampling_defaults)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def assert_logprobs_close(got: list[float], want: list[float]) -> None:
    """Ours in float64 against the reference in float32."""
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=2e-4, rtol=0)


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "meta_2_shards"])
def test_every_layout_serves_the_reference_tokens_and_logprobs(folders, expected, layout):
    tokens, logprobs, _ = serve(folders[layout])
    assert tokens == expected[0]
    assert_logprobs_close(logprobs, expected[1])


@pytest.mark.parametrize("layout", ["torchtune_epochs", "hf_safetensors", "hf_sharded_index", "hf_pytorch_bin",
                                    "hf_pytorch_bin_sharded", "gguf_f32_imported"])
def test_every_layout_equals_the_meta_layout_exactly(folders, layout):
    """float64, the same weights: any slip in naming or un-permuting would change the bits."""
    assert serve(folders[layout])[:2] == serve(folders["meta"])[:2]


def test_hf_tied_embeddings(tmp_path):
    expected = reference_greedy(TIED, PROMPT, NEW_TOKENS)
    tokens, logprobs, _ = serve(write_hf(tmp_path / "tied", TIED, "safetensors"))
    assert tokens == expected[0]
    assert_logprobs_close(logprobs, expected[1])


def test_hf_folder_at_model_parallel_2_equals_1(folders):
    tokens2, logprobs2, _ = serve(folders["hf_sharded_index"], mp_size=2)
    tokens1, logprobs1, _ = serve(folders["hf_sharded_index"])
    assert tokens2 == tokens1 and len(tokens1) == NEW_TOKENS
    torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-9, rtol=0)  # sums split over ranks


def test_model_parallel_size_0_takes_one_rank_per_shard(folders, expected):
    """Llama Stack's MODEL_PARALLEL_SIZE=0: the 2-shard Meta checkpoint runs on 2 ranks, HF on 1."""
    from engine.loader import _with_parallel_size

    config = EngineConfig(model_parallel_size=0)
    for layout, ranks in (("meta_2_shards", 2), ("hf_safetensors", 1), ("torchtune_epochs", 1)):
        checkpoint = resolve_checkpoint(folders[layout], model_id="tiny")
        assert _with_parallel_size(config, len(checkpoint.shard_paths), layout).model_parallel_size == ranks
    tokens, logprobs, _ = serve(folders["meta_2_shards"], mp_size=0)
    assert tokens == expected[0]
    assert_logprobs_close(logprobs, expected[1])


def test_quantization_type_bf16_means_unquantized_bfloat16(folders, expected):
    """Llama Stack's QUANTIZATION_TYPE=bf16: no quantization, bfloat16 weights."""
    from engine.loader import _effective_config

    spec = SimpleNamespace(model_parallel_size=None, max_seq_len=None, quantization=None)
    config = _effective_config(EngineConfig(quantization="bf16"), spec)
    assert (config.quantization, config.dtype) == (None, "bfloat16")
    assert _effective_config(EngineConfig(quantization="bf16", dtype="float32"), spec).dtype == "float32"
    registered = SimpleNamespace(model_parallel_size=None, max_seq_len=None, quantization="bf16")  # metadata.quantization
    assert _effective_config(EngineConfig(quantization="int8"), registered).quantization is None
    tokens, logprobs, _ = serve(folders["hf_safetensors"], quantization="bf16", dtype=None)
    assert len(tokens) == NEW_TOKENS
    assert tokens[0] == expected[0][0]  # bf16 rounding may part ways later; the first token is far from a tie
    assert abs(logprobs[0] - expected[1][0]) < 0.1


# --------------------------------------------------------------------------- resolution
def test_hf_folder_resolution(folders):
    spec = resolve_checkpoint(folders["hf_sharded_index"], model_id="tiny")
    assert spec.format == "hf" and spec.family == "hf" and spec.max_seq_len == 131072
    args = spec.model_args
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.vocab_size) == (64, 2, 4, 2, 384)
    assert args.ffn_hidden_dim == ARGS.ffn_hidden_dim and args.use_scaled_rope and args.rope_scaling_factor == 8.0
    assert spec.shard_paths == (folders["hf_sharded_index"] / "model.safetensors.index.json",)


def test_hf_generation_config_defaults_are_served(folders):
    _, _, info = serve(folders["hf_safetensors"])
    assert (info.sampling_defaults.temperature, info.sampling_defaults.top_p) == (0.6, 0.9)


def test_unpermute_inverts_the_hf_permutation():
    w = torch.arange(8 * 16 * 3, dtype=torch.float64).reshape(8 * 16, 3)
    assert torch.equal(unpermute_rotary(hf_permute(w, 8), 8), w)
    assert not torch.equal(hf_permute(w, 8), w)


def test_torchtune_output_dir_takes_the_latest_epoch_never_the_adapter(folders, caplog):
    with caplog.at_level("INFO"):
        spec = resolve_checkpoint(folders["torchtune_epochs"], model_id="tiny")
    assert spec.format == "torchtune" and spec.checkpoint_dir.name == "epoch_1"
    assert spec.shard_paths == (spec.checkpoint_dir / "model-00001-of-00002.bin",)
    assert "serving the latest, epoch_1" in caplog.text


def test_torchtune_hf_checkpointer_output_dir_takes_the_latest_epoch(tmp_path, expected):
    """torchtune's HF checkpointer writes HF folders into epoch_N: the output dir resolves the same way."""
    out = tmp_path / "tt_hf"
    write_hf(out / "epoch_0", TIED, "safetensors")  # another model: must not be the one served
    write_hf(out / "epoch_1", ARGS, "sharded")
    spec = resolve_checkpoint(out, model_id="tiny")
    assert (spec.format, spec.checkpoint_dir.name) == ("hf", "epoch_1")
    tokens, logprobs, _ = serve(out)
    assert tokens == expected[0]
    assert_logprobs_close(logprobs, expected[1])


def test_torchtune_run_that_saved_only_its_adapter_is_refused_as_an_adapter(tmp_path):
    epoch = tmp_path / "out" / "epoch_0"
    epoch.mkdir(parents=True)
    torch.save({"layers.0.attention.wq.lora_a.weight": torch.zeros(8, ARGS.dim)}, epoch / "adapter_model.pt")
    (epoch / "adapter_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"epoch_0/adapter_model.pt: this folder holds a LoRA adapter"):
        resolve_checkpoint(tmp_path / "out", model_id="tiny")


def test_torchtune_missing_part_names_the_file(tmp_path):
    out = write_torchtune(tmp_path / "tt")
    (out / "epoch_1" / "model-00002-of-00002.bin").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.bin: missing \(2 weight files expected, 1 found\)"):
        resolve_checkpoint(out / "epoch_1", model_id="tiny")


@pytest.mark.parametrize("name", ["adapter_model.pt", "adapter_model.safetensors", "adapter_0.pt"])
def test_adapter_only_folder_is_refused_as_an_adapter(tmp_path, name):
    folder = tmp_path / "lora"
    folder.mkdir()
    (folder / name).write_bytes(b"\0" * 16)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "params.json").write_text(json.dumps(ARGS.to_params()))
    with pytest.raises(CheckpointError, match=rf"{name}: this folder holds a LoRA adapter, not a model's weights; "
                                              r"serve it on its base model: .*base_model"):
        resolve_checkpoint(folder, model_id="tiny", llama_model="Llama3.1-8B-Instruct")


def test_hf_index_naming_a_file_outside_the_folder_is_refused(tmp_path):
    folder = write_hf(tmp_path / "hf", ARGS, "sharded")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    spec = resolve_checkpoint(folder, model_id="tiny")
    from engine.loading.checkpoint import load_rank_state_dict

    with pytest.raises(CheckpointError, match=r"weight_map names '../elsewhere.safetensors', not a file in this folder"):
        load_rank_state_dict(spec, 0, 1)


def test_hf_index_naming_a_missing_file(tmp_path):
    folder = write_hf(tmp_path / "hf", ARGS, "sharded")
    (folder / "model-00002-of-00002.safetensors").unlink()
    spec = resolve_checkpoint(folder, model_id="tiny")
    from engine.loading.checkpoint import load_rank_state_dict

    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: missing \(named in model.safetensors.index.json\)"):
        load_rank_state_dict(spec, 0, 1)


def test_hf_missing_tensor_names_the_file_and_key(tmp_path):
    folder = tmp_path / "hf"
    write_hf(folder, ARGS, "safetensors")
    state = safetensors_torch.load_file(folder / "model.safetensors")
    del state["lm_head.weight"]
    safetensors_torch.save_file(state, folder / "model.safetensors")
    from engine.loading.checkpoint import load_rank_state_dict

    with pytest.raises(CheckpointError, match=r"model.safetensors: missing key 'output.weight', expected by config.json"):
        load_rank_state_dict(resolve_checkpoint(folder, model_id="tiny"), 0, 1)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["MistralForCausalLM"]}, r"is not a Llama text model"),
        ({"architectures": ["Llama4ForConditionalGeneration"], "text_config": {}}, r"missing 'hidden_size'"),  # test_hf_llama4.py has more
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling type 'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}}, r"high_freq_factor 2.0"),
        ({"attention_bias": True}, r"attention_bias is true"),
        ({"quantization_config": {"quant_method": "gptq"}}, r"pre-quantized Hugging Face weights \(quantization_config 'gptq'\)"),
        ({"head_dim": 32}, r"head_dim 32 differs"),
    ],
)
def test_hf_config_it_cannot_run_is_refused_naming_the_field(tmp_path, change, message):
    folder = write_hf(tmp_path / "hf", ARGS, "safetensors")
    config = {**json.loads((folder / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: .*" + message):
        resolve_checkpoint(folder, model_id="tiny")


def test_hf_missing_config_field_names_it(tmp_path):
    folder = write_hf(tmp_path / "hf", ARGS, "safetensors")
    config = json.loads((folder / "config.json").read_text())
    del config["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: missing 'intermediate_size'"):
        resolve_checkpoint(folder, model_id="tiny")


def test_meta_layout_wins_over_a_copy_of_its_hf_conversion(folders, tmp_path):
    """Hub repos of Meta models hold both: the Meta files (here, side by side) are read."""
    both = tmp_path / "both"
    shutil.copytree(folders["hf_safetensors"], both)
    for file in folders["meta"].iterdir():
        shutil.copy(file, both / file.name)
    assert resolve_checkpoint(both, model_id="tiny").format == "meta"
