"""Meta's FP8 release layout (Llama 3.1 405B-Instruct FP8: float8_e4m3fn feed-forward weights of the
middle layers in consolidated.NN.pth, fp8_scales_N.pt beside them) loads as shipped and computes
as llama-models' reference quantized path does (llama3/quantization/loader.py: fbgemm's row-wise
fp8 x fp8 matmul, activations quantized per row with their amax capped at 1200). fbgemm has no CPU
build, so its two ops are emulated here from their definitions (quantize_fp8_per_row,
f8f8bf16_rowwise, float32 output) inside llama-models' own Transformer; a release saved at MP=2
serves at MP=2 and at MP=1 with the same greedy tokens."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint, write_random_checkpoint
from engine.quant.formats import Fp8Weight
from tests.conftest import TINY_DESCRIPTOR
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

FP8_MAX = 448.0
SCALE_UB = 1200.0


def fbgemm_quantize_fp8_per_row(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's quantize_fp8_per_row: per row, amax (capped at scale_ub) maps to 448; returns
    (e4m3 codes, float32 scale per row [rows]) with value = code * scale."""
    amax = x.float().abs().amax(dim=-1)
    amax = torch.clamp(amax, min=1e-12, max=scale_ub) if scale_ub is not None else torch.clamp(amax, min=1e-12)
    inverse = FP8_MAX / amax
    codes = (x.float() * inverse[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, 1.0 / inverse


def write_fp8_release(out_dir, args, num_shards: int, seed: int):
    """A tiny release in the layout llama-models' convert_to_fp8_quantized_model reads."""
    write_random_checkpoint(out_dir, args, num_shards=num_shards, seed=seed, dtype=torch.bfloat16)
    for rank in range(num_shards):
        path = out_dir / f"consolidated.{rank:02d}.pth"
        shard = torch.load(path, weights_only=True)
        scales = {}
        for layer in range(1, args.n_layers - 1):  # the reference skips the first and the last layer
            for w in ("w1", "w3", "w2"):
                key = f"layers.{layer}.feed_forward.{w}.weight"
                shard[key], scales[f"{layer}_feed_forward.{w}_{rank}"] = fbgemm_quantize_fp8_per_row(shard[key])
        torch.save(shard, path)
        torch.save(scales, out_dir / f"fp8_scales_{rank}.pt")
    return out_dir


@pytest.fixture(scope="module")
def args(tiny_model_args):
    # w2 shards at MP=2: whole 32-column blocks; no RoPE scaling: the engine takes the descriptor's
    # factor (32 for Llama 3.2), the reference hard-codes Llama 3.1's 8
    return dataclasses.replace(tiny_model_args, n_layers=4, multiple_of=64, use_scaled_rope=False)


@pytest.fixture(scope="module")
def releases(tmp_path_factory, args):
    tmp = tmp_path_factory.mktemp("meta_fp8")
    return {n: write_fp8_release(tmp / f"mp{n}", args, n, seed=3) for n in (1, 2)}


def _release_state(release, args, num_shards: int):
    """The release's full weights in float32 (its fp8 weights dequantized: code * its shard's row
    scale) and the quantized layers' ids."""
    from engine.loading.layout import param_layouts

    shards = [torch.load(release / f"consolidated.{r:02d}.pth", weights_only=True) for r in range(num_shards)]
    scales = [torch.load(release / f"fp8_scales_{r}.pt", weights_only=True) for r in range(num_shards)]
    for r, (shard, scale) in enumerate(zip(shards, scales)):
        for name, s in scale.items():
            layer, w = name.split("_feed_forward.")
            key = f"layers.{layer}.feed_forward.{w.split('_')[0]}.weight"
            shard[key] = shard[key].float() * s[:, None]
    state = {}
    for key, layout in param_layouts(args).items():
        parts = [shard[key].float() for shard in shards]
        state[key] = parts[0] if layout.parallel_dim is None else torch.cat(parts, dim=layout.parallel_dim)
    return state, range(1, args.n_layers - 1)


def reference_logits(release, args, tokens: list[int], *, num_shards: int = 1, w2_slices: int | None = None,
                     round_activations: bool = True) -> torch.Tensor:
    """llama-models' llama3 Transformer on the release, its quantized layers' feed-forward replaced
    as convert_to_fp8_quantized_model replaces it (ffn_swiglu_dynamic over fbgemm's ops, emulated:
    xq * x_scale @ (w * w_scale)^T is f8f8bf16_rowwise's product up to summation order; float32
    out). `w2_slices`: in how many column slices w2's input is rounded, each with its own amax (the
    reference at MP=N rounds each rank's slice; default: the release's shard count)."""
    reference = pytest.importorskip("llama_models.llama3.model")
    from llama_models.llama3.args import ModelArgs as MetaArgs

    from engine.executor.parallel import destroy_group, init_group

    state, quantized_layers = _release_state(release, args, num_shards)
    slices = w2_slices or num_shards

    def fc(x, w):
        if not round_activations:
            return x @ w.T
        xq, xs = fbgemm_quantize_fp8_per_row(x, SCALE_UB)
        return (xq.float() * xs[:, None]) @ w.T

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        z = torch.nn.functional.silu(fc(flat, self.w1.weight)) * fc(flat, self.w3.weight)
        width = z.shape[-1] // slices
        out = sum(fc(z[:, i * width : (i + 1) * width], self.w2.weight[:, i * width : (i + 1) * width]) for i in range(slices))
        return out.reshape(x.shape)

    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    try:
        meta_args = MetaArgs(**dataclasses.replace(args, rope_scaling_factor=None).to_params(), max_batch_size=1, max_seq_len=64)
        model = reference.Transformer(meta_args)
        model.load_state_dict(state, strict=True)
        for layer in quantized_layers:
            block = model.layers[layer].feed_forward
            block.forward = types.MethodType(forward, block)
        with torch.inference_mode():
            return model(torch.tensor([tokens]), 0)[0].float()
    finally:
        destroy_group()


def _run(release, prompts, **kw):
    executor = make_executor(release, dtype="float32", **kw)
    try:
        return run_random_schedule(executor, prompts, seed=5, max_new=6), executor.weights
    finally:
        executor.shutdown()


def test_release_loads_as_fp8_weights_with_their_scales(releases, args):
    spec = resolve_checkpoint(releases[2], model_id="tiny", llama_model=TINY_DESCRIPTOR)
    for rank in (0, 1):
        state = load_rank_state_dict(spec, rank, 2)
        w2 = state["layers.1.feed_forward.w2.weight"]
        assert isinstance(w2, Fp8Weight) and w2.activation_scale_ub == SCALE_UB
        assert w2.scales.shape == (args.dim, 1)  # this rank's own per-row scales: sharded with its rows
        assert torch.equal(w2.scales.reshape(-1), torch.load(releases[2] / f"fp8_scales_{rank}.pt")[f"1_feed_forward.w2_{rank}"])
        assert not isinstance(state["layers.0.feed_forward.w2.weight"], Fp8Weight)  # first and last layer: bf16
    merged = load_rank_state_dict(spec, 0, 1)["layers.1.feed_forward.w2.weight"]
    assert merged.scales.shape == (args.dim, 2)  # at MP=1: one scale per saved shard, exactly


def mean_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean())


# Rounding activations to fp8 (3 mantissa bits) is discontinuous: where the engine's float32 sums
# and the reference's differ in the last bit at a rounding boundary, one activation moves by an fp8
# step and later positions inherit it through attention. So the end-to-end checks compare mean
# logit errors against what a wrong computation gives (weight-only fp8, or the other MP split),
# and argmax agreement; the linear itself is checked tightly in test_linear_matches_fbgemms_product.
def test_linear_matches_fbgemms_product():
    """One Meta FP8 linear on fixed inputs (one row past the 1200 bound) == the emulated fbgemm fc."""
    from engine.kernels.quant import load_quant_kernels
    from engine.quant.linear import QuantLinear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * 0.05
    codes, scales = fbgemm_quantize_fp8_per_row(w)
    x = torch.randn(5, 256, generator=g)
    x[2] *= 2000.0  # amax past SCALE_UB: capped, its largest values clamp at 448
    xq, xs = fbgemm_quantize_fp8_per_row(x, SCALE_UB)
    expected = (xq.float() @ codes.float().T) * xs[:, None] * scales[None, :]
    weight = Fp8Weight(codes, scales[:, None], 256, SCALE_UB)
    for kernels in (load_quant_kernels(), None):
        got = QuantLinear(weight, kernels)(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    weight_only = QuantLinear(Fp8Weight(codes, scales[:, None], 256), None)(x)
    assert not torch.allclose(weight_only, expected, rtol=1e-3, atol=0)


def test_greedy_tokens_and_logits_match_the_reference_quantized_path(releases, args):
    prompts = random_prompts(args.vocab_size, [5, 9, 7], seed=4)
    results, weights = _run(releases[1], prompts)
    assert "fp8" in weights.formats
    assert_matches_quantized_reference(results, lambda tokens, **kw: reference_logits(releases[1], args, tokens, **kw))


def assert_matches_quantized_reference(results, reference) -> None:
    """Served logits (results: seq -> (logits, tokens)) against the reference's quantized path
    (reference(tokens, round_activations=...) -> logits): most rows exact up to 1e-4 of the
    largest logit (rows before any rounding flip), far closer than the reference without its
    activation rounding (weight-only), argmax agreeing. The fp8 releases (Llama 3 here, Llama 4 in
    test_meta_fp8_llama4.py) and the int4 ones (test_meta_int4.py) share it."""
    exact = agree = total = 0
    ours_error = weight_only_error = 0.0
    for logits, tokens in results.values():
        expected = reference(tokens)[: logits.shape[0]]
        weight_only = reference(tokens, round_activations=False)[: logits.shape[0]]
        scale = float(expected.abs().max())
        exact += int(((logits - expected).abs().amax(dim=-1) < 1e-4 * scale).sum())
        ours_error += mean_error(logits, expected)
        weight_only_error += mean_error(weight_only, expected)
        agree += int((logits.argmax(-1) == expected.argmax(-1)).sum())
        total += logits.shape[0]
    assert exact >= 0.6 * total
    assert ours_error < 0.3 * weight_only_error
    assert agree >= 0.9 * total


def test_mp2_release_at_mp2_and_mp1(releases, args):
    """A release saved at MP=2 served at MP=2 and at MP=1, teacher-forced on MP=2's greedy
    sequences, each against the reference quantized path split the same way: each rank rounds its
    own slice of w2's input to fp8 (its own row amax, as the reference does at MP=2) while MP=1
    rounds whole rows. The two are close (about 1% of a logit), not equal; each is much closer to
    its own split of the reference than to the other's."""
    prompts = random_prompts(args.vocab_size, [5, 11, 8], seed=7)
    at_mp2, _ = _run(releases[2], prompts, mp_size=2)
    at_mp1, _ = _run(releases[2], [tokens for _, tokens in at_mp2.values()])
    agree = total = 0
    errors = {"mp2-split": 0.0, "mp1-whole": 0.0, "split-whole": 0.0}
    for seq_id, (logits, tokens) in at_mp2.items():
        other = at_mp1[seq_id][0][: logits.shape[0]]
        split = reference_logits(releases[2], args, tokens, num_shards=2)[: logits.shape[0]]
        whole = reference_logits(releases[2], args, tokens, num_shards=2, w2_slices=1)[: logits.shape[0]]
        errors["mp2-split"] += mean_error(logits, split)
        errors["mp1-whole"] += mean_error(other, whole)
        errors["split-whole"] += mean_error(split, whole)
        agree += int((logits.argmax(-1) == other.argmax(-1)).sum())
        total += logits.shape[0]
    assert errors["mp2-split"] < 0.3 * errors["split-whole"] and errors["mp1-whole"] < 0.3 * errors["split-whole"]
    assert agree >= 0.85 * total


def test_missing_scales_file_is_refused(tmp_path, args):
    release = write_fp8_release(tmp_path / "r", args, 1, seed=1)
    (release / "fp8_scales_0.pt").rename(tmp_path / "elsewhere.pt")
    spec = resolve_checkpoint(release, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    from engine.types import CheckpointError

    with pytest.raises(CheckpointError, match="holds float8 weights .* but fp8_scales_0.pt is missing"):
        load_rank_state_dict(spec, 0, 1)
