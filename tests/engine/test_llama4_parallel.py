"""Llama 4 across model-parallel sizes: experts split along F on every rank, checkpoints resharded.
(Its own module: test_llama4's llama-models reference holds this process's fairscale group.)"""

from __future__ import annotations

import pytest
import torch

from engine.models.llama import kv_cache_shape
from tests.engine.test_llama4 import executor_of
from tests.engine.test_model import random_prompts, run_random_schedule
from tests.llama4_fixtures import tiny_llama4_args, write_tiny_llama4_checkpoint


@pytest.fixture(scope="module")
def llama4_checkpoint(tmp_path_factory):
    return write_tiny_llama4_checkpoint(tmp_path_factory.mktemp("llama4_1shard"))


@pytest.fixture(scope="module")
def llama4_checkpoint_2shards(tmp_path_factory):
    """The same weights (seed 0) as Meta would ship them for model-parallel size 2."""
    return write_tiny_llama4_checkpoint(tmp_path_factory.mktemp("llama4_2shards"), num_shards=2)


def test_model_parallel_2_equals_1_and_resharded_experts_load(llama4_checkpoint, llama4_checkpoint_2shards):
    prompts = random_prompts(256, [6, 15], seed=9)
    with executor_of(llama4_checkpoint) as one:
        expected = run_random_schedule(one, prompts, seed=9, max_new=3)
    for ckpt, mp_size in ((llama4_checkpoint, 2), (llama4_checkpoint_2shards, 2), (llama4_checkpoint_2shards, 1)):
        with executor_of(ckpt, mp_size=mp_size) as executor:
            got = run_random_schedule(executor, prompts, seed=9, max_new=3)
        for seq_id, (logits, tokens) in got.items():
            assert tokens == expected[seq_id][1]
            torch.testing.assert_close(logits.double(), expected[seq_id][0].double(), atol=1e-9, rtol=1e-9)




def test_expert_shards_split_hidden_size(llama4_checkpoint_2shards):
    shard = torch.load(llama4_checkpoint_2shards / "consolidated.01.pth", weights_only=True)
    args = tiny_llama4_args()
    e, d = args.moe_args.num_experts, args.dim
    assert shard["layers.1.feed_forward.experts.moe_w_in_eD_F"].shape == (e * d, 56)  # F = 112 over 2 ranks
    assert shard["layers.1.feed_forward.experts.moe_w_out_eF_D"].shape == (e * 56, d)
    assert shard["layers.1.feed_forward.router_DE"].shape == (d, e)  # replicated
    assert kv_cache_shape(args, 2, 3, 4) == (3, 4, 1, 16)


def test_vision_weights_load_as_each_rank_slice(tmp_path):
    """A Llama 4 checkpoint as Meta ships it (vision linears split as llama-models' fairscale layers
    hold them): each rank of model-parallel size 2 loads only its slice of the vision weights, the
    same from a 1-shard and a 2-shard release; the slices put back together are the whole weights."""
    from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint
    from engine.loading.layout import llama4_vision_layouts
    from engine.models.llama4.args import VISION_PREFIXES, VisionConfig
    from tests.engine.tokenizer_fixtures import llama_models_file
    from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR, TINY_LLAMA4_PARAMS
    from tests.llama4_vision_fixtures import TINY_VISION_ARGS, write_tiny_llama4_vision_checkpoint

    tokenizer = llama_models_file("llama4/tokenizer.model")
    specs = [resolve_checkpoint(write_tiny_llama4_vision_checkpoint(tmp_path / f"mp{n}", tokenizer_path=tokenizer, num_shards=n),
                                model_id="v", llama_model=TINY_LLAMA4_DESCRIPTOR) for n in (1, 2)]

    def vision(state):
        return {k: v for k, v in state.items() if k.startswith(VISION_PREFIXES)}

    whole = vision(load_rank_state_dict(specs[0], 0, 1))
    layouts = llama4_vision_layouts(VisionConfig.from_params(TINY_VISION_ARGS), TINY_LLAMA4_PARAMS["dim"])
    assert set(whole) == set(layouts) and all(tuple(whole[k].shape) == layouts[k].full_shape for k in whole)
    whole_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    for spec in specs:
        ranks = [vision(load_rank_state_dict(spec, rank, 2)) for rank in range(2)]
        for key, layout in layouts.items():
            if layout.parallel_dim is None:
                assert all(torch.equal(r[key], whole[key]) for r in ranks), key
            else:
                assert all(r[key].shape[layout.parallel_dim] * 2 == whole[key].shape[layout.parallel_dim] for r in ranks), key
                assert torch.equal(torch.cat([r[key] for r in ranks], layout.parallel_dim), whole[key]), key
        for r in ranks:  # about half: only the embeddings, norms and row-parallel biases are whole on both
            assert sum(t.numel() * t.element_size() for t in r.values()) < 0.55 * whole_bytes


def test_vision_args_over_text_only_shards_load_the_text_model(tmp_path):
    """params.json with vision_args over shards without vision weights: the text model loads alone."""
    import json

    from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint
    from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR
    from tests.llama4_vision_fixtures import TINY_VISION_ARGS

    ckpt = write_tiny_llama4_checkpoint(tmp_path, num_shards=2)
    params = json.loads((ckpt / "params.json").read_text())
    params["vision_args"] = TINY_VISION_ARGS
    (ckpt / "params.json").write_text(json.dumps(params))
    spec = resolve_checkpoint(ckpt, model_id="x", llama_model=TINY_LLAMA4_DESCRIPTOR)
    state = load_rank_state_dict(spec, 0, 1)
    assert not any(k.startswith("vision") for k in state) and "tok_embeddings.weight" in state
