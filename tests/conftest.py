"""Shared fixtures. Keep it small: tiny random Meta-format checkpoints, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_PARAMS = dict(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    multiple_of=32,
    ffn_dim_multiplier=1.3,
    norm_eps=1e-5,
    rope_theta=500000.0,
    use_scaled_rope=True,
)
TINY_DESCRIPTOR = "Llama3.2-1B-Instruct"  # supplies the family; params.json supplies the architecture


@pytest.fixture(scope="session")
def tiny_model_args():
    from engine.models.args import ModelArgs

    return ModelArgs(**TINY_PARAMS)


def _write(tmp_path_factory, args, num_shards: int) -> Path:
    import torch

    from engine.loading.checkpoint import write_random_checkpoint

    out = tmp_path_factory.mktemp(f"tiny_ckpt_{num_shards}shard")
    return write_random_checkpoint(out, args, num_shards=num_shards, seed=0, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_model_args) -> Path:
    """params.json + consolidated.00.pth, random weights (seed 0)."""
    return _write(tmp_path_factory, tiny_model_args, 1)


@pytest.fixture(scope="session")
def tiny_checkpoint_2shards(tmp_path_factory, tiny_model_args) -> Path:
    """The same weights as tiny_checkpoint, saved as Meta shards them for model-parallel size 2."""
    return _write(tmp_path_factory, tiny_model_args, 2)


@pytest.fixture(autouse=True)
def _pillow_refuses_truncated_images(monkeypatch):
    """llama-models' Llama 4 preprocess.py (imported by reference tests) sets Pillow's process-wide
    LOAD_TRUNCATED_IMAGES at import; the server never imports it, so every test runs with Pillow's
    default (a truncated image is an error) whatever ran before it."""
    try:
        from PIL import ImageFile
    except ImportError:
        return
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)
