"""LoRA serving cost (a script, not a test): output tok/s of the base alone, one adapter, and 8
different adapters across the streams, at 1, 8 and 32 streams.

    python bench/lora.py [--model demo | --config tiny|small] [--streams 1,8,32] [--rank 16]
                         [--output-tokens 64] [--device cuda] [--dtype bfloat16] [--json PATH] [--smoke]

The model is the demo (SmolLM2-135M-Instruct, converted once into the cache by
engine.loading.demo) or a random checkpoint of bench/common.py's configs. Random rank-`--rank`
adapters on every projection (q, k, v, o, gate, up, down of every layer) are written once in
torchtune's Meta-named format. The engine runs without HTTP (EngineCore driven directly, as
bench/throughput.py does): for each stream count s, s requests of 64 prompt tokens and
--output-tokens output tokens (greedy, ignore_eos) all admitted at once; output tokens/s over the
whole run and the mean step time. The issue's target: 8 adapters in one batch cost at most 1.3x
the base's step time at 32 streams (printed as "8 adapters / base step time").
Numbers on a shared machine are noisy; say so with them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Results, add_results_arguments, torch_machine  # noqa: E402
from bench.throughput import checkpoint_dir, load_tokenizer  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.executor.executor import ModelExecutor  # noqa: E402
from engine.executor.worker_group import WorkerGroup  # noqa: E402
from engine.loading.checkpoint import resolve_checkpoint  # noqa: E402
from engine.loading.layout import param_layouts  # noqa: E402
from engine.types import EngineRequest, SamplingParams  # noqa: E402

DESCRIPTOR = "Llama3.2-1B-Instruct"  # the family for random checkpoints; params.json gives the architecture
PROMPT_TOKENS = 64
MAX_SEQ_LEN = 1024
NUM_ADAPTERS = 8
PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def write_adapters(args, out_dir: Path, *, rank: int, count: int) -> list[Path]:
    """`count` random adapters on every projection of every layer (torchtune, Meta names), written once."""
    layouts = param_layouts(args)
    folders = []
    for i in range(count):
        folder = out_dir / f"adapter-{i}-r{rank}"
        folders.append(folder)
        if (folder / "adapter_model.pt").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(100 + i)
        state = {}
        for layer in range(args.n_layers):
            for part in PROJECTIONS:
                rows, cols = layouts[f"layers.{layer}.{part}.weight"].full_shape
                state[f"layers.{layer}.{part}.lora_a.weight"] = torch.randn(rank, cols, generator=gen) / cols**0.5
                state[f"layers.{layer}.{part}.lora_b.weight"] = torch.randn(rows, rank, generator=gen) * 0.01
        torch.save(state, folder / "adapter_model.pt")
        (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "peft_type": "LORA"}))
    return folders


def run(core: EngineCore, streams: int, adapters: list[str | None], output_tokens: int, seed: int) -> tuple[float, int, int]:
    """(seconds, output tokens, steps) for `streams` requests, request i on adapters[i % len]."""
    rng = random.Random(seed)
    vocab = core.vocab_size
    for i in range(streams):
        prompt = [rng.randrange(256, min(vocab, 100_000)) for _ in range(PROMPT_TOKENS)]
        params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
        core.add_request(EngineRequest(f"s{seed}-{i}", prompt, params, lora_name=adapters[i % len(adapters)]))
    steps_before = core.timing.num_steps
    started = time.perf_counter()
    produced = 0
    while core.has_unfinished:
        produced += sum(len(out.new_token_ids) for out in core.step())
    return time.perf_counter() - started, produced, core.timing.num_steps - steps_before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["demo"], default=None, help="the demo model (default: --config)")
    parser.add_argument("--config", default="tiny", help="a bench/common.py config, when not --model demo")
    parser.add_argument("--checkpoint-dir", default=None, help="where the random checkpoint is written once")
    parser.add_argument("--adapter-dir", default=None, help="where the adapters are written once")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs, measures nothing")
    add_results_arguments(parser)
    opts = parser.parse_args(argv)
    streams = [int(s) for s in opts.streams.split(",")]
    output_tokens = 4 if opts.smoke else opts.output_tokens

    if opts.model == "demo":
        from engine.loading.demo import ensure_demo_checkpoint

        demo = ensure_demo_checkpoint()
        spec = resolve_checkpoint(Path(demo.checkpoint_dir), model_id=demo.model_id)
        name = demo.model_id
    else:
        spec = resolve_checkpoint(checkpoint_dir(opts.config, opts.checkpoint_dir), model_id="bench",
                                  llama_model=DESCRIPTOR)
        name = opts.config
    adapter_dir = Path(opts.adapter_dir or Path(tempfile.gettempdir()) / f"llamaserve-bench-lora-{name}")
    folders = write_adapters(spec.model_args, adapter_dir, rank=opts.rank, count=NUM_ADAPTERS)

    dtype = opts.dtype or ("bfloat16" if opts.device == "cuda" else "float32")
    config = EngineConfig(device=opts.device, dtype=dtype, max_batch_size=max(streams), max_num_batched_tokens=2048,
                          kv_cache_bytes=256 << 20, max_loras=NUM_ADAPTERS, max_lora_rank=opts.rank)
    runner = ModelExecutor(WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN))
    tokenizer, _ = load_tokenizer(spec.model_args.vocab_size)
    core = EngineCore(runner, tokenizer, config, MAX_SEQ_LEN)
    for i, folder in enumerate(folders):
        adapter = runner.read_adapter(folder)
        core.load_adapter(f"a{i}", adapter, str(folder))

    modes = {"base": [None], "one adapter": ["a0"], f"{NUM_ADAPTERS} adapters": [f"a{i}" for i in range(NUM_ADAPTERS)]}
    results = Results("lora")
    step_s: dict[tuple[str, int], float] = {}
    run(core, 2, [None, "a0"], 2, seed=0)  # warm-up: kernels, allocator, the LoRA wrappers
    print(f"{name}, rank {opts.rank} adapters on every projection, {dtype} on {opts.device}, "
          f"{PROMPT_TOKENS} prompt + {output_tokens} output tokens per stream")
    print(f"{'mode':<14} {'streams':>7} {'output tok/s':>13} {'step ms':>9}")
    for count in streams:
        for mode, adapters in modes.items():
            seconds, produced, steps = run(core, count, adapters, output_tokens, seed=count)
            step_s[(mode, count)] = seconds / max(steps, 1)
            results.add("output throughput", produced / seconds, "tok/s", mode=mode, streams=count, model=name,
                        rank=opts.rank, dtype=dtype, device=opts.device)
            results.add("mean step time", 1000 * seconds / max(steps, 1), "ms", mode=mode, streams=count, model=name)
            print(f"{mode:<14} {count:>7} {produced / seconds:>13.1f} {1000 * seconds / max(steps, 1):>9.2f}")
    top = max(streams)
    ratio = step_s[(f"{NUM_ADAPTERS} adapters", top)] / step_s[("base", top)]
    results.add("8 adapters / base step time", ratio, "x", streams=top, model=name)
    print(f"{NUM_ADAPTERS} adapters / base step time at {top} streams: {ratio:.2f}x (target <= 1.3x)")
    results.write(opts.json, **torch_machine())
    runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
