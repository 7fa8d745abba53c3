"""A GGUF whose matrices are K-quants (Q4_K, with Q6_K for wv and the output head as a Q4_K_M file
mixes them) imported with --keep-quantized serves the same numbers as its dequantized import: the
engine's logits agree to float32 summation order and the greedy tokens are equal; at MP=2 too
(shards at super-block boundaries)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.loading.gguf_import import QUANTIZED_WEIGHTS_FILE, import_gguf
from engine.quant import kquants
from engine.quant.linear import QuantLinear, StackedLinear
from engine.quant.shard_file import load_shard
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

gguf = pytest.importorskip("gguf")
from tests.engine.test_gguf_import import VOCAB, write_byte_level_vocab  # noqa: E402

DIM, LAYERS, HEADS, KV_HEADS, HIDDEN = 512, 2, 8, 4, 1024  # K-quant rows are whole 256-value super-blocks, per rank at MP=2
HEAD_DIM = DIM // HEADS
Q6_K_TENSORS = ("attn_v.weight", "output.weight")  # what llama.cpp's Q4_K_M keeps at 6 bits


def write_kquant_gguf(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    weights = {"token_embd.weight": rng.standard_normal((VOCAB, DIM)).astype(np.float32),
               "output_norm.weight": np.ones(DIM, np.float32), "output.weight": mat(VOCAB, DIM)}  # fmt: skip
    for i in range(LAYERS):
        p = f"blk.{i}."
        weights.update({
            p + "attn_q.weight": mat(HEADS * HEAD_DIM, DIM), p + "attn_k.weight": mat(KV_HEADS * HEAD_DIM, DIM),
            p + "attn_v.weight": mat(KV_HEADS * HEAD_DIM, DIM), p + "attn_output.weight": mat(DIM, DIM),
            p + "ffn_gate.weight": mat(HIDDEN, DIM), p + "ffn_up.weight": mat(HIDDEN, DIM), p + "ffn_down.weight": mat(DIM, HIDDEN),
            p + "attn_norm.weight": np.ones(DIM, np.float32), p + "ffn_norm.weight": np.ones(DIM, np.float32),
        })  # fmt: skip
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    write_byte_level_vocab(writer)
    for name, value in weights.items():
        if value.ndim == 1:
            writer.add_tensor(name, value)
            continue
        six_bits = name.endswith(Q6_K_TENSORS)
        quantized = (kquants.quantize_q6_k if six_bits else kquants.quantize_q4_k)(torch.from_numpy(value))
        raw = quantized.qweight.numpy()
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q6_K if six_bits else gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kquant_gguf")
    write_kquant_gguf(tmp / "tiny.Q4_K_M.gguf", seed=3)
    dense = import_gguf(tmp / "tiny.Q4_K_M.gguf", tmp / "dense", progress=False)
    native = import_gguf(tmp / "tiny.Q4_K_M.gguf", tmp / "native", progress=False, keep_quantized=True)
    return dense, native


def _run(checkpoint, prompts, **kw):
    executor = make_executor(checkpoint, dtype="float32", **kw)
    try:
        model = executor._shard.model
        formats = {m.weight_q.format for m in model.modules() if isinstance(m, QuantLinear)}
        stacked = sum(isinstance(m, StackedLinear) for m in model.modules())
        return run_random_schedule(executor, prompts, seed=5, max_new=6), formats, stacked, executor.weights
    finally:
        executor.shutdown()


def test_import_keeps_the_super_blocks(checkpoints):
    dense_dir, native_dir = checkpoints
    quantized, _plain = load_shard(native_dir / QUANTIZED_WEIGHTS_FILE)
    dense = torch.load(dense_dir / "consolidated.00.pth", weights_only=True)
    assert {type(w).__name__ for w in quantized.values()} == {"Q4KWeight", "Q6KWeight"}
    assert isinstance(quantized["layers.0.attention.wv"], kquants.Q6KWeight)
    for key, weight in quantized.items():
        assert torch.equal(weight.dequantize(), dense[f"{key}.weight"]), key


@pytest.mark.parametrize("mp_size", [1, 2])
def test_kquant_model_serves_the_dequantized_models_tokens(checkpoints, mp_size):
    dense_dir, native_dir = checkpoints
    prompts = random_prompts(VOCAB, [5, 11, 8], seed=4)
    expected, _, _, _ = _run(dense_dir, prompts)
    got, formats, stacked, report = _run(native_dir, prompts, mp_size=mp_size)
    assert formats == {"q4_k", "q6_k"}
    assert stacked == LAYERS  # wq|wk (Q4_K) with wv (Q6_K): a stack of two linears per layer
    assert {"q4_k", "q6_k"} <= set(report.formats)
    for seq_id, (ref_logits, ref_tokens) in expected.items():
        logits, tokens = got[seq_id]
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4 * float(ref_logits.abs().max()))
