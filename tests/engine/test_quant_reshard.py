"""Resharding our quantized checkpoints (issue 18): row-parallel shards merge exactly
(concat_cols), column-parallel ones by rows; a checkpoint written at MP=2 serves at MP=1 and one
written at MP=1 at MP=2 with the greedy tokens of its MP-native serving; what has no exact form
(a cut inside a group) is refused with a clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.loading.checkpoint import CheckpointError, load_rank_state_dict, resolve_checkpoint, write_random_checkpoint
from engine.kernels.quant import load_quant_kernels
from engine.quant.formats import QuantizedWeight, concat_cols, quantize, quantize_fp8, quantize_int4, quantize_int8
from engine.quant.linear import QuantLinear
from engine.quant.shard_file import save_shard
from tests.conftest import TINY_DESCRIPTOR
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule
from tests.engine.test_quant_checkpoint import _block_linear_names

PROMPT_LENGTHS = [4, 9]
QUANTIZERS = {
    "int4": lambda w: quantize_int4(w),
    "int4_g64": lambda w: quantize_int4(w, 64),
    "int8": lambda w: quantize_int8(w),
    "int8_g32": lambda w: quantize_int8(w, 32),
    "fp8": lambda w: quantize_fp8(w),
}


def _weight(out=16, cols=256, seed=0):
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_concat_cols_undoes_cols(fmt):
    q = quantize(_weight(), fmt)
    merged = concat_cols([q.cols(0, 64), q.cols(64, 128), q.cols(128, 256)] if fmt == "int4" else [q.cols(0, 128), q.cols(128, 256)])
    assert merged.shape == q.shape and merged.group_size == q.group_size
    assert torch.equal(merged.dequantize(), q.dequantize())


def test_concat_cols_of_shards_quantized_separately():
    """Each rank quantized its own columns (per-row scales per shard): int8 becomes group-wise with
    one float32 scale per shard, exactly; group-wise formats concatenate their groups; fp8 too
    (a Meta FP8 release's w2, scaled per row on each rank): group-wise fp8, one scale per shard."""
    w = _weight()
    halves = [w[:, :128], w[:, 128:]]
    for quantizer in (quantize_int8, lambda t: quantize_int8(t, 32), quantize_int4, quantize_fp8):
        parts = [quantizer(h) for h in halves]
        merged = concat_cols(parts)
        assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in parts], dim=1))
    merged = concat_cols([quantize_int8(h) for h in halves])
    assert merged.group_size == 128 and merged.scales.shape == (16, 2) and merged.scales.dtype == torch.float32
    merged = concat_cols([quantize_fp8(h) for h in halves])
    assert merged.group_size == 128 and merged.scales.shape == (16, 2)
    kernels = load_quant_kernels()
    if kernels is not None:  # the C kernels read the per-shard scales too
        out = torch.empty(16, 256)
        assert torch.equal(kernels.dequantize(merged.contiguous(), 0, 16, out, 1), merged.dequantize())
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(kernels.linear(x, merged.contiguous(), 1), x @ merged.dequantize().T, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no common group size"):
        concat_cols([quantize_int8(w[:, :100]), quantize_int8(w[:, 100:])])


def _write_quantized(float_dir, out_dir, num_shards: int, quantizer) -> object:
    """Our layout at `num_shards` ranks: each rank's block linears quantized from its own float
    shard (as quantizing at load at that MP size does), the rest as it is."""
    spec = resolve_checkpoint(float_dir, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    out_dir.mkdir()
    (out_dir / "params.json").write_bytes((float_dir / "params.json").read_bytes())
    for rank in range(num_shards):
        state = {k: v.clone() for k, v in load_rank_state_dict(spec, rank, num_shards).items()}
        quantized = {key: quantizer(state.pop(f"{key}.weight")) for key in _block_linear_names(spec.model_args.n_layers)}
        save_shard(out_dir / f"consolidated.{rank:02d}.safetensors", quantized, state)
    return out_dir


def _schedule(checkpoint, mp_size):
    executor = make_executor(checkpoint, dtype="float32", mp_size=mp_size)
    try:
        formats = {m.weight_q.format for m in executor._shard.model.modules() if isinstance(m, QuantLinear)}
        return run_random_schedule(executor, random_prompts(256, PROMPT_LENGTHS, seed=3), seed=3, max_new=4), formats
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def float_checkpoints(tmp_path_factory, tiny_model_args):
    """The same float weights saved at MP=1 and MP=2 (ffn width 256: 128-wide w2 shards)."""
    args = dataclasses.replace(tiny_model_args, multiple_of=64)
    root = tmp_path_factory.mktemp("reshard")
    return {n: write_random_checkpoint(root / f"float{n}", args, num_shards=n, seed=6) for n in (1, 2)}


@pytest.mark.parametrize("name", ["int4", "int8"])
@pytest.mark.parametrize("saved, served", [(2, 1), (1, 2)])
def test_quantized_checkpoint_served_at_another_mp_size(tmp_path, float_checkpoints, name, saved, served):
    quant_dir = _write_quantized(float_checkpoints[saved], tmp_path / name, saved, QUANTIZERS[name])
    native, formats = _schedule(quant_dir, saved)
    resharded, resharded_formats = _schedule(quant_dir, served)
    assert formats == resharded_formats == {name[:4]}
    for seq_id, (logits, tokens) in native.items():
        assert resharded[seq_id][1] == tokens
        torch.testing.assert_close(resharded[seq_id][0], logits, atol=1e-4, rtol=1e-4)


def test_resharding_refuses_what_has_no_exact_form(tmp_path, float_checkpoints):
    """A row-parallel cut inside an int4 group (MP=4: wo, 64 wide in groups of 32, cut every 16
    columns) is refused, naming the group boundary; fp8 shards quantized per rank merge at MP=1
    into group-wise fp8 (one scale per shard)."""
    fp8_dir = _write_quantized(float_checkpoints[2], tmp_path / "fp8", 2, QUANTIZERS["fp8"])
    spec = resolve_checkpoint(fp8_dir, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    merged = load_rank_state_dict(spec, 0, 1)["layers.0.attention.wo.weight"]
    assert merged.format == "fp8" and merged.scales.shape[1] == 2
    assert isinstance(load_rank_state_dict(spec, 1, 2)["layers.0.attention.wo.weight"], QuantizedWeight)  # native MP is fine
    int4_dir = _write_quantized(float_checkpoints[1], tmp_path / "int4", 1, QUANTIZERS["int4"])
    spec = resolve_checkpoint(int4_dir, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    with pytest.raises(CheckpointError, match=r"layers.0.attention.wo.weight \(saved in 1 shard\(s\)\), loading at model-parallel size 4: cannot shard.*columns \[0, 16\) do not fall on"):
        load_rank_state_dict(spec, 0, 4)
    whole_rows = _write_quantized(float_checkpoints[1], tmp_path / "whole_rows", 1, lambda w: quantize_int4(w, w.shape[1]))
    spec = resolve_checkpoint(whole_rows, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    load_rank_state_dict(spec, 0, 2)  # one group a row: any cut at a 32-column block keeps its scale
    with pytest.raises(CheckpointError, match=r"columns \[0, 16\) do not fall on 32-column block boundaries"):
        load_rank_state_dict(spec, 0, 4)
