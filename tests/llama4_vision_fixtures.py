"""Llama 4 vision in tests: tiny vision_args, test images, and llama-models' own Llama 4
preprocessing and ChatFormat made importable without torchvision.

llama-models' llama4/preprocess.py imports torchvision, which cannot be installed beside torch+cpu.
`reference_preprocess_module()` imports it against a stand-in that implements the four torchvision
calls it makes as torchvision documents and implements them for PIL input (Resize / F.resize:
Pillow's `Image.resize(size[::-1], BILINEAR)`; ToTensor: numpy array -> CHW float / 255; Normalize:
sub_(mean).div_(std)): written independently of engine/vision/llama4.py (numpy, not torch.frombuffer),
so the reference's canvas choice, padding, tile split and global view run as shipped.
"""

from __future__ import annotations

import importlib
import io
import sys
import types

import numpy as np
import torch
from PIL import Image

# A tiny Llama 4 vision encoder: 32-pixel tiles of 8-pixel patches, pixel shuffle 0.5 -> 4 tokens a chunk
TINY_VISION_ARGS = dict(image_size=dict(height=32, width=32), patch_size=dict(height=8, width=8), dim=32, n_layers=2,
                        n_heads=4, mlp_ratio=2.0, output_dim=48, pixel_shuffle_ratio=0.5)


def random_image(width: int, height: int, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """Random pixels (so every resize and tile boundary shows), encoded in `fmt`."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format=fmt)
    return buf.getvalue()


def _torchvision_stand_in() -> dict[str, types.ModuleType]:
    class InterpolationMode:
        BILINEAR = "bilinear"

    def resize(img: Image.Image, size, interpolation=InterpolationMode.BILINEAR):
        assert interpolation == InterpolationMode.BILINEAR and isinstance(img, Image.Image)
        height, width = size
        return img.resize((width, height), Image.Resampling.BILINEAR)

    class Resize:
        def __init__(self, size):
            self.size = size

        def __call__(self, img):
            return resize(img, self.size)

    class ToTensor:
        def __call__(self, pic: Image.Image) -> torch.Tensor:
            array = np.array(pic, np.uint8, copy=True)
            img = torch.from_numpy(array).view(pic.size[1], pic.size[0], len(pic.getbands()))
            return img.permute((2, 0, 1)).contiguous().to(dtype=torch.float32).div(255)

    class Normalize:
        def __init__(self, mean, std, inplace=False):
            self.mean, self.std = mean, std

        def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
            mean = torch.as_tensor(self.mean, dtype=tensor.dtype)[:, None, None]
            std = torch.as_tensor(self.std, dtype=tensor.dtype)[:, None, None]
            return tensor.sub_(mean).div_(std)

    class Compose:
        def __init__(self, transforms):
            self.transforms = transforms

        def __call__(self, img):
            for t in self.transforms:
                img = t(img)
            return img

    tv = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.resize = resize
    tv.InterpolationMode, tv.Resize, tv.ToTensor, tv.Normalize, tv.Compose = InterpolationMode, Resize, ToTensor, Normalize, Compose
    tv.functional = functional
    root = types.ModuleType("torchvision")
    root.transforms = tv
    return {"torchvision": root, "torchvision.transforms": tv, "torchvision.transforms.functional": functional}


def reference_preprocess_module() -> types.ModuleType:
    """llama_models.llama4.preprocess, imported against the torchvision stand-in (sys.modules is
    restored afterwards, so nothing else sees it)."""
    stand_in = _torchvision_stand_in()
    saved = {name: sys.modules.get(name) for name in stand_in}
    sys.modules.update(stand_in)
    try:
        sys.modules.pop("llama_models.llama4.preprocess", None)
        sys.modules.pop("llama_models.llama4.chat_format", None)
        preprocess = importlib.import_module("llama_models.llama4.preprocess")
        importlib.import_module("llama_models.llama4.chat_format")
        return preprocess
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def reference_chat_format(tokenizer_path):
    """llama-models' Llama 4 ChatFormat with the tiny vision_args (imported as above)."""
    reference_preprocess_module()
    from llama_models.llama4.args import VisionArgs
    from llama_models.llama4.chat_format import ChatFormat
    from llama_models.llama4.tokenizer import Tokenizer

    return ChatFormat(Tokenizer(tokenizer_path), vision_args=VisionArgs(**TINY_VISION_ARGS))


def write_tiny_llama4_vision_checkpoint(out_dir, *, tokenizer_path, seed: int = 0, num_shards: int = 1):
    """A tiny Llama 4 checkpoint in Meta's release layout with vision: params.json's vision_args and
    the vision encoder, adapter and projection under the names llama-models' model loads, in
    consolidated.00.pth beside the text weights (real vocabulary: image tokens are special tokens)."""
    import json
    from pathlib import Path

    from engine.models.llama4.vision import VisionConfig, random_vision_state
    from tests.llama4_fixtures import LLAMA4_VOCAB_SIZE, TINY_LLAMA4_PARAMS, write_tiny_llama4_checkpoint

    out_dir = write_tiny_llama4_checkpoint(Path(out_dir), seed=seed, tokenizer_path=tokenizer_path,
                                           vocab_size=LLAMA4_VOCAB_SIZE, num_shards=num_shards)
    vision = random_vision_state(VisionConfig.from_params(TINY_VISION_ARGS), output_dim=TINY_VISION_ARGS["output_dim"],
                                 mlp_ratio=TINY_VISION_ARGS["mlp_ratio"], text_dim=TINY_LLAMA4_PARAMS["dim"], seed=seed + 1)
    for rank in range(num_shards):
        shard = out_dir / f"consolidated.{rank:02d}.pth"
        state = torch.load(shard, weights_only=True)
        state.update({key: _vision_shard(key, tensor, rank, num_shards) for key, tensor in vision.items()})
        torch.save(state, shard)
    params = json.loads((out_dir / "params.json").read_text())
    params["vision_args"] = TINY_VISION_ARGS
    (out_dir / "params.json").write_text(json.dumps(params, indent=2))
    return out_dir


def _vision_shard(key: str, tensor: torch.Tensor, rank: int, num_shards: int) -> torch.Tensor:
    """Rank `rank`'s part as llama-models' fairscale layers hold it (engine/loading/layout.py's
    llama4_vision_layouts: column-parallel weights and biases split along dim 0, row-parallel
    weights along dim 1, the rest whole)."""
    from engine.loading.layout import llama4_vision_layouts, rank_range
    from engine.models.llama4.vision import VisionConfig
    from tests.llama4_fixtures import TINY_LLAMA4_PARAMS

    layout = llama4_vision_layouts(VisionConfig.from_params(TINY_VISION_ARGS), TINY_LLAMA4_PARAMS["dim"])[key]
    if layout.parallel_dim is None:
        return tensor
    start, end = rank_range(layout, rank, num_shards)
    return tensor.narrow(layout.parallel_dim, start, end - start).clone()
