"""Llama 4 images through the engine (no HTTP): TTFT and output tok/s with 0, 1 and 4 images per
request at 1 and 8 concurrent requests, image preprocessing time per image, and memory per image in
flight, on a random Llama 4 vision checkpoint in Meta's layout (written once to a temporary folder).

    python bench/vision.py                       # 'small': text dim 512, 336-pixel tiles of 14 (Scout's), vision dim 512
    python bench/vision.py --size tiny --images 0,1 --concurrency 1,2 --max-tokens 4   # a smoke run

Memory per image in flight: its pixels (float32 tiles) plus its encoded rows (kept until its last
token is computed) plus the KV cache its tokens fill; printed per image size. Needs llama-models'
Llama 4 tokenizer.model (the dev extra) for the image special tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench.common import Results, add_results_arguments, torch_machine  # noqa: E402

SIZES = {
    "tiny": dict(text=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2),
                 vision=dict(image_size=dict(height=32, width=32), patch_size=dict(height=8, width=8), dim=32, n_layers=1,
                             n_heads=4, mlp_ratio=2.0, output_dim=48, pixel_shuffle_ratio=0.5), image=(100, 30)),
    "small": dict(text=dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=2),
                  vision=dict(image_size=dict(height=336, width=336), patch_size=dict(height=14, width=14), dim=512,
                              n_layers=4, n_heads=8, mlp_ratio=4.0, output_dim=512, pixel_shuffle_ratio=0.5),
                  image=(640, 480)),
}
LLAMA4_VOCAB_SIZE = 202048


def write_checkpoint(out_dir: Path, size: str) -> Path:
    from engine.loading.checkpoint import PARAMS_FILE, random_state_dict
    from engine.loading.llama4 import to_meta_layout
    from engine.models.args import ModelArgs
    from engine.models.llama4.vision import VisionConfig, random_vision_state

    cfg = SIZES[size]
    params = dict(vocab_size=LLAMA4_VOCAB_SIZE, multiple_of=16, ffn_dim_multiplier=1.3, ffn_exp=4.0, norm_eps=1e-5,
                  rope_theta=500000.0, use_scaled_rope=True, rope_scaling_factor=8.0, rope_high_freq_factor=4.0,
                  nope_layer_interval=4, attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True,
                  floor_scale=8192.0, attn_scale=0.1,
                  moe_args=dict(num_experts=4, top_k=1, capacity_factor=1.0, auto_scale_F=True, interleave_moe_layer_step=2),
                  **cfg["text"])
    args = ModelArgs.from_params(params, source="bench")
    state = to_meta_layout(random_state_dict(args, seed=0, dtype=torch.float32), args)
    state.update(random_vision_state(VisionConfig.from_params(cfg["vision"]), output_dim=cfg["vision"]["output_dim"],
                                     mlp_ratio=cfg["vision"]["mlp_ratio"], text_dim=args.dim, seed=1))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(state, out_dir / "consolidated.00.pth")
    (out_dir / PARAMS_FILE).write_text(json.dumps({**args.to_params(), "vision_args": cfg["vision"]}, indent=2))
    tokenizer = Path(importlib.util.find_spec("llama_models").origin).parent / "llama4" / "tokenizer.model"
    (out_dir / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    return out_dir


def image_bytes(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG")
    return buf.getvalue()


def request(engine, images: list, text: str, request_id: str, max_tokens: int):
    from engine.types import ChatMessage, EngineRequest, SamplingParams

    built = engine.chat_format.encode_prompt([ChatMessage("user", text, parts=(*images, text))])
    return EngineRequest(request_id, built.ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         images=tuple(built.images))


async def run_level(engine, prepared, num_images: int, concurrency: int, max_tokens: int, tag: str) -> tuple[float, float]:
    """(median TTFT in seconds, output tok/s over the wave) of `concurrency` requests sent at once."""
    async def one(i: int) -> tuple[float, int]:
        started = time.perf_counter()
        ttft, produced = None, 0
        async for out in engine.generate(request(engine, prepared[:num_images], f"Picture {i}, describe it.",
                                                 f"{tag}-{i}", max_tokens)):
            ttft = ttft if ttft is not None or not out.new_token_ids else time.perf_counter() - started
            produced = out.num_output_tokens
        return ttft or 0.0, produced

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall_s = time.perf_counter() - started
    return statistics.median(t for t, _ in results), sum(n for _, n in results) / wall_s


async def main_async(opts) -> None:
    from engine.config import EngineConfig
    from engine.loader import load_engine
    from engine.types import ImageLimits
    from engine.vision.decode import prepare_image

    results = Results("vision", context={"size": opts.size})
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(Path(tmp) / "llama4-vision", opts.size)
        spec = SimpleNamespace(model_id="vision", checkpoint_dir=checkpoint, llama_model="Llama-4-Scout-17B-16E-Instruct")
        engine = load_engine(spec, EngineConfig(dtype=opts.dtype, max_batch_size=max(opts.concurrency), max_seq_len=4096,
                                                cpu_kv_cache_bytes=opts.kv_cache_mib << 20))
        try:
            width, height = SIZES[opts.size]["image"]
            raw = [image_bytes(width, height, seed) for seed in range(max(opts.images))]
            prepared, times_s = [], []
            for k, data in enumerate(raw):
                started = time.perf_counter()
                prepared.append(prepare_image(data, engine.image_preprocessor, ImageLimits(), param=f"image {k}"))
                times_s.append(time.perf_counter() - started)
            if prepared:
                img = prepared[0]
                tokens = len(request(engine, prepared[:1], "x", "count", 1).prompt_token_ids) - \
                    len(request(engine, [], "x", "count", 1).prompt_token_ids)
                rows = img.num_chunks * img.tokens_per_chunk
                dim = engine.core.runner._workers.model_args.dim  # the projected rows' width
                elem = torch.empty((), dtype=getattr(torch, opts.dtype)).element_size()
                kv_per_token = engine.core.runner._workers._shard.bytes_per_block / engine.core.runner.block_size
                memory = img.pixels.numel() * 4 + rows * dim * elem + tokens * kv_per_token
                results.add("preprocess_ms_per_image", round(1000 * statistics.median(times_s), 2), "ms",
                            image=f"{width}x{height}")
                results.add("memory_per_image_in_flight", round(memory / 2**20, 3), "MiB", image=f"{width}x{height}",
                            chunks=img.num_chunks, image_tokens=tokens)
                print(f"image {width}x{height}: {img.num_chunks} chunks, {tokens} prompt tokens, preprocessing "
                      f"{1000 * statistics.median(times_s):.1f} ms, {memory / 2**20:.2f} MiB in flight "
                      f"(pixels {img.pixels.numel() * 4 / 2**20:.2f}, rows {rows * dim * elem / 2**20:.2f}, "
                      f"KV {tokens * kv_per_token / 2**20:.2f})", flush=True)
            await run_level(engine, prepared, min(1, len(prepared)), 1, 2, "warm")
            for num_images in opts.images:
                for concurrency in opts.concurrency:
                    ttft_s, tok_s = await run_level(engine, prepared, num_images, concurrency, opts.max_tokens,
                                                    f"{num_images}-{concurrency}")
                    results.add("ttft_median", round(1000 * ttft_s, 2), "ms", images=num_images, concurrency=concurrency)
                    results.add("output_tok_s", round(tok_s, 1), "tok/s", images=num_images, concurrency=concurrency)
                    print(f"{num_images} image(s), {concurrency} concurrent: TTFT {1000 * ttft_s:.1f} ms, "
                          f"{tok_s:.1f} output tok/s", flush=True)
        finally:
            await engine.shutdown()
    results.write(opts.json, **torch_machine())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--images", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 4])
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    add_results_arguments(parser)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
