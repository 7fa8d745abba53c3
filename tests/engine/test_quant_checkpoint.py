"""Quantized checkpoints served by the engine (issue 18): our consolidated.NN.safetensors layout
loads without requantizing (model-parallel through rows()/cols()), and a GGUF imported with
--keep-quantized (Q4_0 / Q4_1 / Q8_0 blocks kept, a quantized token embedding, tied or not) runs
through the engine model and gives the GGUF's own model's logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint, write_random_checkpoint
from engine.config import EngineConfig
from engine.executor.worker_group import WorkerGroup
from engine.models.llama import FUSED_LINEARS
from engine.quant.formats import QuantizedWeight, quantize_int4
from engine.quant.linear import QuantEmbedding, QuantLinear
from engine.quant.shard_file import save_shard
from tests.conftest import TINY_DESCRIPTOR
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

gguf = pytest.importorskip("gguf")

PROMPT_LENGTHS = [4, 9]


def _block_linear_names(n_layers: int) -> list[str]:
    parts = [p for fused in FUSED_LINEARS.values() for p in fused] + ["attention.wo", "feed_forward.w2"]
    return [f"layers.{i}.{p}" for i in range(n_layers) for p in parts]


def _write_int4_checkpoint(float_dir, out_dir):
    """Our quantized layout of a float checkpoint: every block linear int4 (group 32, mins), as
    int4_mixed quantizes it at load; the rest as it is."""
    spec = resolve_checkpoint(float_dir, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    state = {k: v.clone() for k, v in load_rank_state_dict(spec, 0, 1).items()}
    quantized = {key: quantize_int4(state.pop(f"{key}.weight")) for key in _block_linear_names(spec.model_args.n_layers)}
    out_dir.mkdir()
    (out_dir / "params.json").write_bytes((float_dir / "params.json").read_bytes())
    save_shard(out_dir / "consolidated.00.safetensors", quantized, state)
    return out_dir


def _schedule(checkpoint, **kw):
    executor = make_executor(checkpoint, dtype="float32", **kw)
    try:
        return run_random_schedule(executor, random_prompts(256, PROMPT_LENGTHS, seed=3), seed=3, max_new=4)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("mp_size", [1, 2])
def test_our_quantized_checkpoint_loads_without_requantizing(tmp_path, tiny_model_args, mp_size):
    """Loading the int4 file (no quantization configured) computes what quantizing the float
    checkpoint at load does; at MP=2 each rank slices the codes (the ffn width is a multiple of 64,
    so w2's column cut falls on a group boundary)."""
    float_dir = write_random_checkpoint(tmp_path / "float", dataclasses.replace(tiny_model_args, multiple_of=64), seed=6)
    quant_dir = _write_int4_checkpoint(float_dir, tmp_path / "int4")
    expected = _schedule(float_dir, quantization="int4_mixed")
    got = _schedule(quant_dir, mp_size=mp_size)
    for seq_id, (logits, tokens) in expected.items():
        assert got[seq_id][1] == tokens
        torch.testing.assert_close(got[seq_id][0], logits, atol=1e-4, rtol=1e-4)


def test_requantizing_is_never_done(tmp_path, tiny_model_args):
    """An already-quantized weight keeps its format even when another type is configured."""
    quant_dir = _write_int4_checkpoint(write_random_checkpoint(tmp_path / "float", tiny_model_args, seed=6), tmp_path / "int4")
    executor = make_executor(quant_dir, dtype="float32", quantization="int8")
    try:
        formats = {m.weight_q.format for m in executor._shard.model.modules() if isinstance(m, QuantLinear)}
    finally:
        executor.shutdown()
    assert formats == {"int4"}


def _imported(tmp_path, qtype_name: str, tied: bool):
    from engine.loading.gguf_import import import_gguf
    from tests.engine.test_gguf_import import hf_weights, write_gguf

    reference = write_gguf(tmp_path / "tiny.gguf", hf_weights(seed=1, tied=tied), qtype=gguf.GGMLQuantizationType[qtype_name])
    dense = import_gguf(tmp_path / "tiny.gguf", tmp_path / "dense", progress=False)
    native = import_gguf(tmp_path / "tiny.gguf", tmp_path / "native", progress=False, keep_quantized=True)
    return reference, dense, native


def _last_logits(checkpoint_dir, prompt: list[int]):
    from engine.executor.executor import build_step_inputs
    from engine.core.sequence import ScheduledBatch, Sequence
    from engine.types import SamplingParams

    spec = resolve_checkpoint(checkpoint_dir, model_id="tiny-gguf")
    config = EngineConfig(dtype="float32", block_size_tokens=4, max_batch_size=2, kv_cache_bytes=1 << 20)
    executor = WorkerGroup(spec, config, max_seq_len=64)
    try:
        seq = Sequence(0, "r0", list(prompt), len(prompt), SamplingParams(temperature=0.0))
        seq.block_table.extend(range((len(prompt) + 3) // 4))
        inputs, _ = build_step_inputs(ScheduledBatch([seq], [len(prompt)]), 4)
        model = executor._shard.model
        kept = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
        return executor.execute(inputs)[-1], executor.weight_bytes, kept, model
    finally:
        executor.shutdown()


@pytest.mark.parametrize("qtype_name, tied", [("Q4_1", True), ("Q4_0", False), ("Q8_0", True)])
def test_keep_quantized_gguf_runs_through_the_engine(tmp_path, qtype_name, tied):
    from tests.engine.test_gguf_import import PROMPT, _forward, hf_named, hf_rope

    reference, dense_dir, native_dir = _imported(tmp_path, qtype_name, tied)
    expected = _forward(hf_named(reference), PROMPT, hf_rope)[-1]
    got, native_bytes, kept, model = _last_logits(native_dir, PROMPT)
    _, dense_bytes, dense_kept, _ = _last_logits(dense_dir, PROMPT)
    assert not dense_kept
    # the GGUF's numbers, computed in float32 (the reference runs in float64)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
    assert isinstance(model.tok_embeddings.lookup, QuantEmbedding)  # the embedding stays in its blocks
    assert isinstance(model.output, QuantLinear)  # the head as the file stores it (tied: the embedding)
    assert all(isinstance(m.weight_q if isinstance(m, QuantLinear) else m.table, QuantizedWeight) for m in kept)
    assert native_bytes * 2.5 < dense_bytes, (native_bytes, dense_bytes)  # vs float32: ~3.8x (8-bit), ~6x (4-bit)
