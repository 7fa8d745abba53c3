"""Meta's Llama 4 FP8 release layout (Llama-4-Maverick-17B-128E-Instruct-fp8: float8_e4m3fn routed
experts in the MoE layers but the first and the last, fp8_scales_N.pt with a float32 scale per
expert and output row) loads as shipped and computes as llama-models' reference quantized path does
(llama4/quantization/loader.py: each expert's bmm_nt through fbgemm's row-wise fp8 x fp8 batched
kernel, input rows quantized to e4m3 with amax capped at 1200). The release is written here as
llama4/scripts/quantize.py writes it (quantize_fp8_per_row on each expert's [out, in] transpose,
the codes transposed back into the bf16 2-D layout, scales [e, out] not transposed); fbgemm has no
CPU build, so its ops are emulated from their definitions inside llama-models' own llama4
Transformer, fed the release's dequantized weights. The end-to-end criteria are test_meta_fp8's
(rounding activations is discontinuous: see its note)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint
from engine.loading.llama4 import SHIPPED_EXPERT_NAMES
from engine.models.args import ModelArgs
from engine.models.llama4.args import is_moe_layer
from engine.quant.formats import ExpertWeights, Fp8Weight
from engine.types import CheckpointError
from tests.engine.test_llama4 import executor_of
from tests.engine.test_meta_fp8 import SCALE_UB, assert_matches_quantized_reference, fbgemm_quantize_fp8_per_row, mean_error
from tests.engine.test_model import random_prompts, run_random_schedule
from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR, write_tiny_llama4_checkpoint

# 5 layers: MoE layers 1 and 3 (neither first nor last) are quantized, dense 0, 2 (NoPE) and 4 not;
# multiple_of 64: experts' F = 128, so an MP=2 release's w2 shards (64 columns) merge exactly at MP=1
OVERRIDES = dict(n_layers=5, multiple_of=64)
QUANTIZED_LAYERS = (1, 3)


def _quantize_rows(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's quantize_fp8_per_row on [..., in]: codes [..., in], scales x.shape[:-1]."""
    codes, scales = fbgemm_quantize_fp8_per_row(x.reshape(-1, x.shape[-1]), scale_ub)
    return codes.reshape(x.shape), scales.reshape(x.shape[:-1])


def _reference_view(shipped: torch.Tensor, which: str, args: ModelArgs) -> torch.Tensor:
    """The shipped 2-D expert tensor as the reference's [e, in, out] parameter (its load hook's view)."""
    e, d = args.moe_args.num_experts, args.dim
    return shipped.view(e, -1, d) if which == "w2" else shipped.view(e, d, -1)


def write_llama4_fp8_release(out_dir, num_shards: int, seed: int = 0, **overrides):
    """A tiny Llama 4 release in the layout llama-models' quantize.py writes (module docstring)."""
    write_tiny_llama4_checkpoint(out_dir, num_shards=num_shards, seed=seed, dtype=torch.bfloat16, **{**OVERRIDES, **overrides})
    args = ModelArgs.from_params(json.loads((out_dir / "params.json").read_text()), source="params.json")
    for rank in range(num_shards):
        path = out_dir / f"consolidated.{rank:02d}.pth"
        shard = torch.load(path, weights_only=True)
        scales = {}
        for layer in range(1, args.n_layers - 1):
            if not is_moe_layer(args, layer):
                continue
            for which, shipped in SHIPPED_EXPERT_NAMES.items():
                key = f"layers.{layer}.feed_forward.experts.{shipped}"
                param = _reference_view(shard[key], which, args)  # [e, in, out]
                codes, scale = _quantize_rows(param.transpose(1, 2).contiguous())  # [e, out, in], [e, out]
                shard[key] = codes.transpose(1, 2).reshape(-1, param.shape[-1]).contiguous()
                scales[f"layers.{layer}.feed_forward.experts.{which}"] = scale
        torch.save(shard, path)
        torch.save(scales, out_dir / f"fp8_scales_{rank}.pt")
    return out_dir, args


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama4_fp8")
    return {n: write_llama4_fp8_release(tmp / f"mp{n}", n, seed=3) for n in (1, 2)}


def _dequantized_experts(release, args: ModelArgs, num_shards: int) -> dict[str, torch.Tensor]:
    """Each quantized expert tensor in the shipped 2-D layout, whole (shards joined along F), float32: code * scale."""
    out = {}
    shards = [torch.load(release / f"consolidated.{r:02d}.pth", weights_only=True) for r in range(num_shards)]
    scales = [torch.load(release / f"fp8_scales_{r}.pt", weights_only=True) for r in range(num_shards)]
    for layer in QUANTIZED_LAYERS:
        for which, shipped in SHIPPED_EXPERT_NAMES.items():
            key = f"layers.{layer}.feed_forward.experts.{shipped}"
            parts = []
            for shard, scale in zip(shards, scales):
                codes = _reference_view(shard[key], which, args).float()  # [e, in, out]
                parts.append(codes * scale[f"layers.{layer}.feed_forward.experts.{which}"][:, None, :])
            whole = torch.cat(parts, dim=1 if which == "w2" else 2)
            out[key] = whole.reshape(-1, whole.shape[-1])
    return out


def reference_logits(release, args: ModelArgs, tokens: list[int], *, num_shards: int = 1, w2_slices: int | None = None,
                     round_activations: bool = True) -> torch.Tensor:
    """llama-models' llama4 Transformer (float32) on the release, the quantized layers' experts
    replaced as convert_to_quantized_model replaces them (experts_batched_swiglu_wrapper over
    bmm_nt, fbgemm emulated: each expert's input rows rounded to e4m3, then times the dequantized
    weight). Everything but the quantized experts comes from the MP=1 bf16 shard of the same seed.
    `w2_slices`: in how many slices of F w2's input is rounded (the reference at MP=N rounds each
    rank's slice); default the release's shard count."""
    reference = pytest.importorskip("llama_models.llama4.model")
    from llama_models.llama4.args import ModelArgs as MetaArgs
    from llama_models.llama4.datatypes import TransformerInput

    from engine.executor.parallel import destroy_group, init_group

    state = {k: v.float() for k, v in torch.load(release.parent / "mp1" / "consolidated.00.pth", weights_only=True).items()}
    state.update(_dequantized_experts(release, args, num_shards))
    slices = w2_slices or num_shards

    def rounded(x: torch.Tensor) -> torch.Tensor:
        if not round_activations:
            return x
        codes, scales = _quantize_rows(x, SCALE_UB)
        return codes.float() * scales[..., None]

    def batched_swiglu(self, x, w1, w3, w2):  # x [e, g, D]; w [e, in, out]
        middle = torch.nn.functional.silu(torch.bmm(rounded(x), w1)) * torch.bmm(rounded(x), w3)
        width = middle.shape[-1] // slices
        return sum(torch.bmm(rounded(middle[..., i * width:(i + 1) * width]), w2[:, i * width:(i + 1) * width]) for i in range(slices))

    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # the reference's KV caches call .cuda()
    try:
        model = reference.Transformer(MetaArgs(**args.to_params(), max_batch_size=1, max_seq_len=64))
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
        for layer in QUANTIZED_LAYERS:
            experts = model.layers[layer].feed_forward.experts
            experts.batched_swiglu = types.MethodType(batched_swiglu, experts)
        with torch.inference_mode():
            return model(TransformerInput(tokens=torch.tensor([tokens]), tokens_position=0)).logits[0].float()
    finally:
        torch.Tensor.cuda = cuda
        destroy_group()


def _run(release, prompts, **kw):
    with executor_of(release, dtype="float32", **kw) as executor:
        return run_random_schedule(executor, prompts, seed=5, max_new=6), executor.weights


def test_release_loads_its_experts_as_fp8_with_their_scales(releases):
    release, args = releases[2]
    spec = resolve_checkpoint(release, model_id="tiny-llama4", llama_model=TINY_LLAMA4_DESCRIPTOR)
    file_scales = torch.load(release / "fp8_scales_1.pt", weights_only=True)
    state = load_rank_state_dict(spec, 1, 2)
    for layer in QUANTIZED_LAYERS:
        for which in ("w1", "w3", "w2"):
            experts = state[f"layers.{layer}.feed_forward.experts.{which}"]
            assert isinstance(experts, ExpertWeights) and len(experts.parts) == args.moe_args.num_experts
            assert all(isinstance(w, Fp8Weight) and w.activation_scale_ub == SCALE_UB for w in experts.parts)
            scale = file_scales[f"layers.{layer}.feed_forward.experts.{which}"]  # [e, out]: this rank's own
            assert torch.equal(torch.stack([w.scales.reshape(-1) for w in experts.parts]), scale)
        assert experts.shape == (4, 64, args.dim)  # w2 [e, F / 2, D]
        assert isinstance(state[f"layers.{layer}.feed_forward.shared_expert.w1.weight"], torch.Tensor)  # shared: bf16
    assert isinstance(state["layers.4.feed_forward.w1.weight"], torch.Tensor)  # the last layer and the dense ones: bf16
    merged = load_rank_state_dict(spec, 0, 1)
    w2 = merged["layers.1.feed_forward.experts.w2"].expert(0)
    assert w2.shape == (args.dim, 128) and w2.scales.shape == (args.dim, 2)  # one scale per saved shard, exactly
    assert merged["layers.1.feed_forward.experts.w1"].expert(0).scales.shape == (128, 1)


def test_greedy_tokens_and_logits_match_the_reference_quantized_path(releases):
    release, args = releases[1]
    prompts = random_prompts(args.vocab_size, [5, 9, 13], seed=4)
    results, weights = _run(release, prompts)
    assert "fp8" in weights.formats
    assert_matches_quantized_reference(results, lambda tokens, **kw: reference_logits(release, args, tokens, **kw))


def test_mp2_release_at_mp2_and_mp1(releases):
    """As test_meta_fp8's: each rank rounds its own slice of w2's input (the reference at MP=2 does
    too) while MP=1 rounds whole rows; each is much closer to its own split of the reference."""
    release, args = releases[2]
    prompts = random_prompts(args.vocab_size, [5, 11, 8], seed=7)
    at_mp2, _ = _run(release, prompts, mp_size=2)
    at_mp1, _ = _run(release, [tokens for _, tokens in at_mp2.values()])
    agree = total = 0
    errors = {"mp2-split": 0.0, "mp1-whole": 0.0, "split-whole": 0.0}
    for seq_id, (logits, tokens) in at_mp2.items():
        other = at_mp1[seq_id][0][: logits.shape[0]]
        split = reference_logits(release, args, tokens, num_shards=2)[: logits.shape[0]]
        whole = reference_logits(release, args, tokens, num_shards=2, w2_slices=1)[: logits.shape[0]]
        errors["mp2-split"] += mean_error(logits, split)
        errors["mp1-whole"] += mean_error(other, whole)
        errors["split-whole"] += mean_error(split, whole)
        agree += int((logits.argmax(-1) == other.argmax(-1)).sum())
        total += logits.shape[0]
    assert errors["mp2-split"] < 0.3 * errors["split-whole"] and errors["mp1-whole"] < 0.3 * errors["split-whole"]
    assert agree >= 0.85 * total


@pytest.mark.parametrize("damage, message", [
    (lambda shard, scales: scales.pop("layers.3.feed_forward.experts.w2"), r"float8 weight 'layers.3.feed_forward.experts.moe_w_out_eF_D' has no scale"),
    (lambda shard, scales: shard.pop("layers.1.feed_forward.experts.moe_w_in_eD_F"), r"scale 'layers.1.feed_forward.experts.w1' has no weight"),
    (lambda shard, scales: scales.update({"layers.1.feed_forward.experts.w3": scales["layers.1.feed_forward.experts.w3"][:, :8]}),
     r"'layers.1.feed_forward.experts.w3'.*: 32 scales for 4 experts x 128 rows"),
])  # fmt: skip
def test_broken_release_is_refused_naming_the_file_and_key(tmp_path, damage, message):
    release, _ = write_llama4_fp8_release(tmp_path / "r", 1, seed=1)
    shard = torch.load(release / "consolidated.00.pth", weights_only=True)
    scales = torch.load(release / "fp8_scales_0.pt", weights_only=True)
    damage(shard, scales)
    torch.save(shard, release / "consolidated.00.pth")
    torch.save(scales, release / "fp8_scales_0.pt")
    spec = resolve_checkpoint(release, model_id="tiny-llama4", llama_model=TINY_LLAMA4_DESCRIPTOR)
    with pytest.raises(CheckpointError, match=message):
        load_rank_state_dict(spec, 0, 1)


def test_mp2_release_whose_w2_shards_have_no_common_group_is_refused_at_mp1(tmp_path):
    """F = 112: each MP=2 shard's w2 holds 56 columns scaled per row on its own, which no group size
    (a multiple of 32) can hold exactly at MP=1; served at MP=2 it loads."""
    release, _ = write_llama4_fp8_release(tmp_path / "r", 2, seed=1, multiple_of=16)
    spec = resolve_checkpoint(release, model_id="tiny-llama4", llama_model=TINY_LLAMA4_DESCRIPTOR)
    assert load_rank_state_dict(spec, 0, 2)["layers.1.feed_forward.experts.w2"].shape == (4, 56, 64)
    with pytest.raises(CheckpointError, match=r"layers.1.feed_forward.experts.w2 .*cannot reshard these quantized experts"):
        load_rank_state_dict(spec, 0, 1)


def test_expert_weights_cut_and_merge_exactly_like_the_dequantized_tensor():
    """ExpertWeights along the reference's dims: narrow and cat give the dequantized 3-D tensor's
    slices and concatenation, bit for bit (w2's columns from two shards scaled on their own merge
    into one group per shard)."""
    from engine.quant.formats import quantize_fp8

    g = torch.Generator().manual_seed(0)

    def experts(e: int, cols: int, rows: int) -> tuple[ExpertWeights, torch.Tensor]:
        parts = tuple(quantize_fp8(torch.randn(rows, cols, generator=g)) for _ in range(e))
        return ExpertWeights(parts), torch.stack([p.dequantize().t() for p in parts])  # [e, in, out]

    w1, dense = experts(3, 64, 96)
    assert w1.shape == tuple(dense.shape) == (3, 64, 96)
    rows = w1.narrow(2, 32, 32)
    assert torch.equal(torch.stack([p.dequantize().t() for p in rows.parts]), dense[:, :, 32:64])
    a, dense_a = experts(3, 32, 48)
    b, dense_b = experts(3, 32, 48)
    merged = ExpertWeights.cat([a, b], dim=1)
    assert merged.expert(0).scales.shape == (48, 2)
    assert torch.equal(torch.stack([p.dequantize().t() for p in merged.parts]), torch.cat([dense_a, dense_b], dim=1))
    assert torch.equal(torch.stack([p.dequantize().t() for p in merged.narrow(1, 32, 32).parts]), dense_b)
    with pytest.raises(ValueError, match="not dim 0"):
        merged.narrow(0, 0, 1)
