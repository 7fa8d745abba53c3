"""Resolving and loading Meta-format checkpoints: resharding, and one clear error per bad case."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.loading.checkpoint import (
    ModelArgs,
    check_tokenizer_vocab,
    estimate_weight_bytes,
    load_rank_state_dict,
    random_state_dict,
    resolve_checkpoint,
    shard_state_dict,
    write_random_checkpoint,
)
from engine.types import CheckpointError
from tests.conftest import TINY_DESCRIPTOR


def resolve(path, **kw):
    return resolve_checkpoint(path, model_id=kw.pop("model_id", "tiny"), llama_model=kw.pop("llama_model", TINY_DESCRIPTOR),
                              **kw)


def load(path, rank=0, size=1, **kw):
    return load_rank_state_dict(resolve(path, **kw), rank, size)


@pytest.fixture
def ckpt(tmp_path, tiny_checkpoint) -> Path:
    """A private, editable copy of the 1-shard tiny checkpoint."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


def edit_shard(path: Path, fn) -> None:
    state = {k: v.clone() for k, v in torch.load(path, weights_only=True).items()}
    fn(state)
    torch.save(state, path)


# --------------------------------------------------------------------------- resolving
def test_resolve_reads_params_and_descriptor(tiny_checkpoint, tiny_model_args):
    spec = resolve(tiny_checkpoint)
    assert spec.model_args == dataclasses.replace(tiny_model_args, rope_scaling_factor=32.0)  # from Llama3.2's descriptor
    assert spec.family == "llama3_2" and spec.descriptor.name == TINY_DESCRIPTOR
    assert spec.max_seq_len == 131072 and spec.tokenizer_path is None
    assert [p.name for p in spec.shard_paths] == ["consolidated.00.pth"]
    # the model id alone names the descriptor when no llama_model is given
    assert resolve_checkpoint(tiny_checkpoint, model_id="meta-llama/Llama-3.1-8B-Instruct").family == "llama3_1"


def test_rope_scaling_factor_comes_from_the_descriptor_unless_params_state_it(ckpt):
    # Meta's params.json never states it: Llama 3.2 1B/3B need 32, Llama 3.1 / 3.3 use 8.
    assert resolve(ckpt).model_args.rope_scaling_factor == 32.0
    assert resolve(ckpt, llama_model="Llama3.1-8B-Instruct").model_args.rope_scaling_factor == 8.0
    params = json.loads((ckpt / "params.json").read_text())
    (ckpt / "params.json").write_text(json.dumps({**params, "rope_scaling_factor": 16.0}))
    assert resolve(ckpt).model_args.rope_scaling_factor == 16.0


def test_architecture_mismatch_is_logged_not_refused(tiny_checkpoint, caplog):
    with caplog.at_level(logging.WARNING):
        resolve(tiny_checkpoint)
    assert "params.json differs from Llama3.2-1B-Instruct: dim=64 (published 2048)" in caplog.text


def test_params_json_missing_uses_descriptor_architecture(ckpt):
    (ckpt / "params.json").unlink()
    spec = resolve(ckpt)
    assert spec.model_args.dim == 2048 and spec.model_args.n_layers == 16
    with pytest.raises(
        CheckpointError,
        match=r"consolidated.00.pth: missing key 'layers.2.attention.wq.weight' \(and 125 more\), "
        r"expected by Llama3.2-1B-Instruct's published architecture \(no params.json\)",
    ):
        load_rank_state_dict(spec, 0, 1)


def test_llama2_params_get_family_defaults(ckpt):
    params = json.loads((ckpt / "params.json").read_text())
    for key in ("rope_theta", "use_scaled_rope", "n_kv_heads", "ffn_dim_multiplier"):
        params.pop(key)
    params["vocab_size"] = -1
    (ckpt / "params.json").write_text(json.dumps(params))
    args = resolve(ckpt, llama_model="meta-llama/Llama-2-7b-chat").model_args
    assert (args.vocab_size, args.rope_theta, args.kv_heads) == (32000, 10000.0, 4)


def test_unknown_params_keys_are_kept_and_logged(ckpt, caplog):
    params = json.loads((ckpt / "params.json").read_text())
    (ckpt / "params.json").write_text(json.dumps({**params, "max_batch_size": 4, "flux_capacitor": True}))
    with caplog.at_level(logging.INFO):
        args = resolve(ckpt).model_args
    assert dict(args.extra) == {"max_batch_size": 4, "flux_capacitor": True}
    assert "ignoring params.json keys flux_capacitor, max_batch_size" in caplog.text


def test_hf_family_without_descriptor(ckpt):
    (ckpt / "tokenizer.json").write_text("{}")
    spec = resolve_checkpoint(ckpt, model_id="my-finetune")
    assert spec.family == "hf" and spec.descriptor is None and spec.tokenizer_path == ckpt / "tokenizer.json"


def test_hf_repo_layout_with_original_dir(tmp_path, tiny_checkpoint):
    shutil.copytree(tiny_checkpoint, tmp_path / "repo" / "original")
    (tmp_path / "repo" / "original" / "tokenizer.model").write_bytes(b"stub")
    spec = resolve(tmp_path / "repo")
    assert spec.checkpoint_dir == tmp_path / "repo" / "original"
    assert spec.tokenizer_path == tmp_path / "repo" / "original" / "tokenizer.model"


def test_torchtune_meta_format_file_names(ckpt, tiny_checkpoint):
    (ckpt / "consolidated.00.pth").rename(ckpt / "meta_model_0.pt")
    shutil.copy(ckpt / "meta_model_0.pt", ckpt / "meta_model_1.pt")
    spec = resolve(ckpt)
    assert [p.name for p in spec.shard_paths] == ["meta_model_1.pt"]  # the latest epoch
    expected = load(tiny_checkpoint)
    for key, value in load_rank_state_dict(spec, 0, 1).items():
        assert torch.equal(value, expected[key])


# --------------------------------------------------------------------------- resharding
@pytest.mark.parametrize("saved, run", [(1, 2), (2, 1), (2, 2), (1, 4), (2, 4), (4, 1), (4, 2)])  # 4 > n_kv_heads
def test_reshard_gives_each_rank_its_slice(tmp_path, tiny_model_args, saved, run):
    write_random_checkpoint(tmp_path, tiny_model_args, num_shards=saved, seed=5)
    full = random_state_dict(tiny_model_args, seed=5)
    spec = resolve(tmp_path)
    for rank in range(run):
        got = load_rank_state_dict(spec, rank, run)
        want = shard_state_dict(full, tiny_model_args, rank, run)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_mp_past_kv_heads_repeats_kv_heads(tiny_checkpoint, tiny_model_args):
    """Meta's rule for MP > n_kv_heads: each rank holds one KV head, shared by neighbouring ranks."""
    full = random_state_dict(tiny_model_args, seed=0)
    hd = tiny_model_args.head_dim
    for rank in range(4):
        wk = load(tiny_checkpoint, rank, 4)["layers.0.attention.wk.weight"]
        head = rank // 2
        assert torch.equal(wk, full["layers.0.attention.wk.weight"][head * hd : (head + 1) * hd])


def test_llama2_dim_split_embedding_is_merged(tmp_path, tiny_model_args):
    """Llama 2 shards split tok_embeddings along dim (fairscale ParallelEmbedding)."""
    write_random_checkpoint(tmp_path, tiny_model_args, num_shards=2, seed=6)
    full = random_state_dict(tiny_model_args, seed=6)
    for rank in range(2):
        edit_shard(
            tmp_path / f"consolidated.0{rank}.pth",
            lambda s: s.__setitem__("tok_embeddings.weight", full["tok_embeddings.weight"][:, rank * 32 : (rank + 1) * 32].clone()),
        )
    assert torch.equal(load(tmp_path)["tok_embeddings.weight"], full["tok_embeddings.weight"])
    assert torch.equal(load(tmp_path, 1, 2)["tok_embeddings.weight"], full["tok_embeddings.weight"][128:])


def test_loading_logs_bytes_and_seconds(tiny_checkpoint, caplog):
    with caplog.at_level(logging.INFO):
        load(tiny_checkpoint)
    assert any("MiB of weights from 1 shard(s)" in r.message and " s" in r.message for r in caplog.records)


def test_estimate_weight_bytes_matches_loaded(tiny_checkpoint, tiny_model_args):
    loaded = sum(t.numel() * t.element_size() for t in load(tiny_checkpoint).values())
    assert estimate_weight_bytes(tiny_model_args, torch.float32) == loaded
    assert estimate_weight_bytes(tiny_model_args, "bfloat16") == loaded // 2


# --------------------------------------------------------------------------- bad checkpoints
def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere: checkpoint directory does not exist"):
        resolve(tmp_path / "nowhere")


def test_no_shards(ckpt):
    (ckpt / "consolidated.00.pth").unlink()
    with pytest.raises(CheckpointError, match=r"no model weights found \(found params.json\); expected Meta.s consolidated.NN.pth"):
        resolve(ckpt)


def test_shard_numbering_gap(tmp_path, tiny_model_args):
    write_random_checkpoint(tmp_path, tiny_model_args, num_shards=2)
    (tmp_path / "consolidated.01.pth").rename(tmp_path / "consolidated.02.pth")
    with pytest.raises(CheckpointError, match=r"not numbered 00..01: \[0, 2\]"):
        resolve(tmp_path)


def test_shard_deleted_after_resolve(tmp_path, tiny_model_args):
    write_random_checkpoint(tmp_path, tiny_model_args, num_shards=2)
    spec = resolve(tmp_path)
    (tmp_path / "consolidated.01.pth").unlink()
    with pytest.raises(CheckpointError, match="consolidated.01.pth: weight shard is missing"):
        load_rank_state_dict(spec, 0, 1)


def test_missing_key(ckpt):
    edit_shard(ckpt / "consolidated.00.pth", lambda s: s.pop("layers.1.feed_forward.w2.weight"))
    with pytest.raises(CheckpointError, match=r"consolidated.00.pth: missing key 'layers.1.feed_forward.w2.weight'"):
        load(ckpt)


def test_unexpected_key(ckpt):
    edit_shard(ckpt / "consolidated.00.pth", lambda s: s.__setitem__("layers.2.attention.wq.weight", torch.zeros(1)))
    with pytest.raises(CheckpointError, match=r"consolidated.00.pth: unexpected key 'layers.2.attention.wq.weight'"):
        load(ckpt)


def test_rope_freqs_key_of_llama2_is_ignored(ckpt):
    edit_shard(ckpt / "consolidated.00.pth", lambda s: s.__setitem__("rope.freqs", torch.zeros(8)))
    assert "rope.freqs" not in load(ckpt)


def test_wrong_shape(ckpt):
    edit_shard(ckpt / "consolidated.00.pth", lambda s: s.__setitem__("layers.0.attention.wk.weight", torch.zeros(64, 64)))
    with pytest.raises(
        CheckpointError,
        match=r"consolidated.00.pth: key 'layers.0.attention.wk.weight' has shape \[64, 64\], expected \[32, 64\] "
        r"\(shard 0 of 1, params.json dim=64, n_heads=4, n_kv_heads=2",
    ):
        load(ckpt)


def test_vocab_mismatch_between_params_and_weights(ckpt):
    params = json.loads((ckpt / "params.json").read_text())
    (ckpt / "params.json").write_text(json.dumps({**params, "vocab_size": 300}))
    with pytest.raises(CheckpointError, match=r"'tok_embeddings.weight' has shape \[256, 64\], expected \[300, 64\].*vocab_size=300"):
        load(ckpt)


def test_vocab_mismatch_with_tokenizer(tiny_checkpoint):
    spec = resolve(tiny_checkpoint)
    check_tokenizer_vocab(spec, 256)
    with pytest.raises(CheckpointError, match="tokenizer has 128256 tokens but .*params.json vocab_size is 256"):
        check_tokenizer_vocab(spec, 128256)


def test_not_a_dict_of_tensors(ckpt):
    torch.save({"tok_embeddings.weight": 3}, ckpt / "consolidated.00.pth")
    with pytest.raises(CheckpointError, match="consolidated.00.pth: missing key"):
        load(ckpt)
    torch.save([torch.zeros(1)], ckpt / "consolidated.00.pth")
    with pytest.raises(CheckpointError, match="consolidated.00.pth: expected a dict of tensors, found list"):
        load(ckpt)


def test_truncated_file(ckpt):
    path = ckpt / "consolidated.00.pth"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="consolidated.00.pth: not a readable torch checkpoint"):
        load(ckpt)


@pytest.mark.parametrize(
    "params, message",
    [
        ("{not json", "cannot read params.json"),
        ('{"dim": 64, "n_layers": 2}', "missing required field"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 5}', "dim 64 must split into 5 heads"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 3}', "n_heads 4 must be a multiple of n_kv_heads 3"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "vision_args": {"image_size": 448}}', "vision checkpoints are not supported"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "moe_args": {"num_experts": 16}}', "mixture-of-experts params.json needs ffn_exp"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_exp": 4, "ffn_dim_multiplier": 1, "moe_args": {"num_experts": 2, "top_k": 3}}', "top_k must be in"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "head_dim": 32, "use_qk_norm": true}', "head_dim 32 differs from dim // n_heads = 16"),
        ('{"dim": 64, "n_layers": 2, "n_heads": 4, "attention_chunk_size": 0}', "attention_chunk_size must be a positive integer"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_params_json(ckpt, params, message):
    (ckpt / "params.json").write_text(params)
    with pytest.raises(CheckpointError, match=message) as info:
        resolve(ckpt)
    assert "params.json" in str(info.value)


def test_meta_fp8_scales_file_that_cannot_be_read_fails_the_load_naming_it(ckpt):
    """Meta's FP8 releases load (tests/engine/test_meta_fp8.py); a broken scales file is named."""
    (ckpt / "fp8_scales_0.pt").write_bytes(b"")
    spec = resolve(ckpt)
    with pytest.raises(CheckpointError, match=r"fp8_scales_0.pt: not a readable fp8 scales file"):
        load_rank_state_dict(spec, 0, 1)


def test_unknown_llama_model_lists_close_matches(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="unknown Llama model descriptor 'Llama3.2-1B-Instrukt'.*Llama3.2-1B-Instruct"):
        resolve(tiny_checkpoint, llama_model="Llama3.2-1B-Instrukt")


def test_no_descriptor_and_no_tokenizer_json(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="'my-model' names no known Llama model; set llama_model"):
        resolve_checkpoint(tiny_checkpoint, model_id="my-model")


def test_llama4_descriptor_resolves_to_its_family(tiny_checkpoint):
    spec = resolve(tiny_checkpoint, llama_model="meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert spec.family == "llama4" and spec.descriptor.name == "Llama-4-Scout-17B-16E-Instruct"


def test_model_parallel_size_that_does_not_divide(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="model-parallel size 3 does not divide n_heads 4"):
        load(tiny_checkpoint, 0, 3)


class _Payload:
    """Unpickling this runs a shell command: the classic malicious checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_code_payload_is_refused(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    state = torch.load(ckpt / "consolidated.00.pth", weights_only=True)
    torch.save({**state, "evil": _Payload(marker)}, ckpt / "consolidated.00.pth")
    with pytest.raises(CheckpointError, match="consolidated.00.pth: refused to load: the file holds objects other than tensors"):
        load(ckpt)
    assert not marker.exists()


def test_model_args_round_trip(tiny_model_args):
    params = tiny_model_args.to_params()
    assert "rope_scaling_factor" not in params  # unset fields are not written
    assert ModelArgs.from_params(params, source="x") == tiny_model_args
    tied = dataclasses.replace(tiny_model_args, tie_word_embeddings=True, n_kv_heads=None)
    assert ModelArgs.from_params(tied.to_params(), source="x") == tied


# --------------------------------------------------------------------------- hostile checkpoints (issue 16)
@pytest.mark.parametrize("value", [10**12, 0, -5, "4096", True])
def test_params_max_seq_len_is_bounded(ckpt, value):
    (ckpt / "tokenizer.json").write_text("{}")  # an "hf" checkpoint: its max_seq_len comes from params.json
    params = json.loads((ckpt / "params.json").read_text())
    (ckpt / "params.json").write_text(json.dumps({**params, "max_seq_len": value}))
    with pytest.raises(CheckpointError, match="max_seq_len must be an integer"):
        resolve_checkpoint(ckpt, model_id="my-finetune")


def test_files_are_rechecked_at_open_time_inside_symlinked_dirs(tmp_path, tiny_checkpoint):
    """Resolving scans the dir, symlinked dirs entered: every file's real path must be inside the
    roots; and a shard swapped for a link out after resolving is refused when it is opened."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    model = Path(shutil.copytree(tiny_checkpoint, root / "m"))
    (root / "shared").mkdir()
    (root / "shared" / "secret").symlink_to(outside / "secret.txt")
    (outside / "secret.txt").write_text("x")
    (model / "extras").symlink_to(root / "shared", target_is_directory=True)  # a link that stays in the root
    with pytest.raises(CheckpointError, match="secret: resolves outside the checkpoint roots"):
        resolve(model, allowed_roots=(root,))
    (model / "extras").unlink()
    spec = resolve(model, allowed_roots=(root,))
    shard = spec.shard_paths[0]
    moved = outside / shard.name
    shutil.move(shard, moved)
    shard.symlink_to(moved)  # swapped after the checks that ran at resolve time
    with pytest.raises(CheckpointError, match="resolves outside the checkpoint roots"):
        load_rank_state_dict(spec, 0, 1)
    assert resolve(model).shard_paths == spec.shard_paths  # trusted (no roots): not checked


def test_tokenizer_json_with_hostile_token_ids_is_refused(tmp_path):
    from engine.tokenizers.hf import MAX_VOCAB_SIZE, load_hf_tokenizer
    from tests.engine.test_hf_tokenizer import CHATML_CONFIG, byte_level_tokenizer_json, write_checkpoint_tokenizer

    spec = json.loads(byte_level_tokenizer_json())
    spec["added_tokens"].append({"id": MAX_VOCAB_SIZE + 10, "content": "<evil>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    directory = write_checkpoint_tokenizer(tmp_path / "t", json.dumps(spec), CHATML_CONFIG)
    with pytest.raises(CheckpointError, match="token ids must lie in"):
        load_hf_tokenizer(directory)
