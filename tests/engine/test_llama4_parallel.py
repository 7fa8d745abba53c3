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


def test_vision_weights_stay_out_of_the_text_model(tmp_path):
    """A Llama 4 checkpoint as Meta ships it carries vision_args and vision weights: the text model
    loads without them (engine/loading/llama4.load_vision_state reads them for the vision encoder)."""
    import json

    from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint
    from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR

    ckpt = write_tiny_llama4_checkpoint(tmp_path, num_shards=2)
    params = json.loads((ckpt / "params.json").read_text())
    params["vision_args"] = {"image_size": {"height": 336, "width": 336}, "patch_size": {"height": 14, "width": 14}}
    (ckpt / "params.json").write_text(json.dumps(params))
    for rank in range(2):
        path = ckpt / f"consolidated.{rank:02d}.pth"
        shard = torch.load(path, weights_only=True)
        shard["vision_embeddings.patch_embedding.weight"] = torch.zeros(8, 4)
        shard["vision_projection.weight"] = torch.zeros(4, 8)
        torch.save(shard, path)
    spec = resolve_checkpoint(ckpt, model_id="x", llama_model=TINY_LLAMA4_DESCRIPTOR)
    state = load_rank_state_dict(spec, 0, 1)
    assert not any(k.startswith("vision") for k in state)
