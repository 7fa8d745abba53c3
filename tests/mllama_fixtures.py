"""Tiny random Llama 3.2 Vision checkpoints in Meta's release layout (params.json with its vision_*
fields, CrossAttentionTransformer's key names, one unnumbered consolidated.pth), and llama-models'
own multimodal model built at the same tiny sizes as the oracle."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import torch

TINY_VISION_PARAMS: dict[str, Any] = dict(
    dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16, ffn_dim_multiplier=1.3,
    norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True,
    vision_chunk_size=28, vision_max_num_chunks=4, vision_num_cross_attention_layers=2,
)  # fmt: skip
TINY_VISION_WIDTH = 32  # encoder width (1280 released); 16 heads of 2
TINY_VISION_PATCH = 14  # patch side as released: a 28-pixel tile is a 2 x 2 grid
TINY_VISION_DESCRIPTOR = "Llama3.2-11B-Vision-Instruct"


def tiny_vision_args(**overrides: Any):
    from engine.models.args import ModelArgs

    return ModelArgs.from_params({**TINY_VISION_PARAMS, **overrides}, source="tiny Llama 3.2 Vision params")


def tiny_vision_dims(chunk_size: int = 28):
    from engine.models.mllama.args import INTERMEDIATE_LAYERS, VisionDims

    # 32 local layers as released, so every intermediate layer (3, 7, 15, 23, 30) exists; 8 global layers
    return VisionDims(TINY_VISION_WIDTH, TINY_VISION_PATCH, chunk_size // TINY_VISION_PATCH, 4, 32, 8, INTERMEDIATE_LAYERS)


def write_tiny_vision_checkpoint(out_dir: Path, *, num_shards: int = 1, seed: int = 0, tokenizer_path: Path | None = None,
                                 **overrides: Any) -> Path:  # fmt: skip
    from engine.loading.checkpoint import write_random_checkpoint

    return write_random_checkpoint(
        Path(out_dir), tiny_vision_args(**overrides), num_shards=num_shards, seed=seed, tokenizer_path=tokenizer_path,
        vision=tiny_vision_dims(), unnumbered=num_shards == 1,
    )  # fmt: skip


def install_torchvision_shim() -> None:
    """llama-models' image_transform.py imports torchvision, whose PyPI wheel cannot load beside
    torch+cpu. Its four uses, as torchvision defines them for PIL images: ToTensor (uint8 HWC ->
    float CHW / 255), Normalize(inplace) (sub_ mean, div_ std per channel), InterpolationMode and
    functional.resize (PIL's Image.resize at (w, h) with the mode's PIL filter). A no-op when the
    real torchvision imports."""
    import sys
    import types

    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    import enum

    import numpy as np
    from PIL import Image

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    pil_modes = {InterpolationMode.NEAREST: Image.NEAREST, InterpolationMode.BILINEAR: Image.BILINEAR,
                 InterpolationMode.BICUBIC: Image.BICUBIC}  # fmt: skip

    class ToTensor:
        def __call__(self, pic):
            array = torch.from_numpy(np.array(pic, np.uint8, copy=True))
            return array.view(pic.size[1], pic.size[0], len(pic.getbands())).permute(2, 0, 1).contiguous().to(torch.get_default_dtype()).div(255)

    class Normalize:
        def __init__(self, mean, std, inplace=False):
            self.mean, self.std, self.inplace = mean, std, inplace

        def __call__(self, tensor):
            tensor = tensor if self.inplace else tensor.clone()
            mean = torch.as_tensor(self.mean, dtype=tensor.dtype)[:, None, None]
            std = torch.as_tensor(self.std, dtype=tensor.dtype)[:, None, None]
            return tensor.sub_(mean).div_(std)

    def resize(img, size, interpolation=InterpolationMode.BILINEAR, **_):
        return img.resize(tuple(size[::-1]), pil_modes[interpolation])

    root = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    transforms.ToTensor, transforms.Normalize, transforms.InterpolationMode = ToTensor, Normalize, InterpolationMode
    functional.resize = resize
    transforms.functional = functional
    root.transforms = transforms
    sys.modules.update({"torchvision": root, "torchvision.transforms": transforms, "torchvision.transforms.functional": functional})


def _reference_module():
    """llama-models' llama3/multimodal/model.py with its two hard-coded encoder widths (1280) set to
    the tiny one: the only edit (its encoder width is not in params.json)."""
    import importlib.util

    install_torchvision_shim()
    import llama_models.llama3.multimodal.model as original

    source = Path(original.__file__).read_text()
    source, n = re.subn(r"\b1280\b", str(TINY_VISION_WIDTH), source)
    assert n == 2, n
    spec = importlib.util.spec_from_loader("llama_models.llama3.multimodal._tiny_model", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "llama_models.llama3.multimodal"
    exec(compile(source, original.__file__, "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def reference_model(checkpoint: Path, *, max_seq_len: int = 64):
    """llama-models' CrossAttentionTransformer in float32 with the checkpoint's weights (fairscale
    group of one; its caches' .cuda() as identity)."""
    from llama_models.llama3.args import ModelArgs as MetaArgs

    from engine.executor.parallel import destroy_group, init_group

    params = json.loads((checkpoint / "params.json").read_text())
    state = torch.load(checkpoint / "consolidated.pth", weights_only=True)
    module = _reference_module()
    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        model = module.CrossAttentionTransformer(MetaArgs(**params, max_batch_size=1, max_seq_len=max_seq_len))
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("cache" in k for k in missing), (missing, unexpected)
        model.setup_cache(1, torch.device("cpu"), torch.float32)
        yield model.eval()
    finally:
        torch.Tensor.cuda = cuda
        destroy_group()
