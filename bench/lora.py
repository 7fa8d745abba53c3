"""LoRA serving cost (a script, not a test): output tok/s of the base alone, one adapter, and 8
different adapters across the streams, at 1, 8 and 32 streams.

    python bench/lora.py [--model demo | --config tiny|small] [--streams 1,8,32] [--rank 16]
                         [--output-tokens 64] [--repeats 3] [--device cuda] [--dtype bfloat16] [--json PATH] [--smoke]

The model is the demo (SmolLM2-135M-Instruct, converted once into the cache by
engine.loading.demo) or a random checkpoint of bench/common.py's configs. Random rank-`--rank`
adapters on every projection (q, k, v, o, gate, up, down of every layer) are written once in
torchtune's Meta-named format. The engine runs without HTTP (EngineCore driven directly, as
bench/throughput.py does): for each stream count s, s requests of 64 prompt tokens and
--output-tokens output tokens (greedy, ignore_eos) all admitted at once; output tokens/s over the
whole run and the mean step time. The issue's target: 8 adapters in one batch cost at most 1.3x
the base's step time at 32 streams (printed as "8 adapters / base step time").
Numbers on a shared machine are noisy; say so with them. --repeats N runs the modes N times,
interleaved (base, one, 8, base, ...), and keeps each mode's fastest run: load that comes and goes
then falls on every mode alike, instead of on whichever ran while it lasted.

    python bench/lora.py --delta [--model demo | --config tiny|small] [--streams 32] [--rank 16] [--rounds 5]

--delta measures one adapted linear's LoRA delta alone (no engine, less sensitive to load): the
torch path (two matmuls per run of rows, engine/lora/layers.py) against the segmented C kernel
(one call, engine/kernels/csrc/lora.c), microseconds per call for each of a block's four adapted
linears with 8 rank-`--rank` adapters over the top `--streams` rows (one run of rows per adapter,
as the executor orders a step), alternating the two paths `--rounds` times and keeping each one's
best; then the step's total (x layers) and the adapters' weight bytes read per second against this
machine's read bandwidth.
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


def delta_benchmark(args, rows: int, rank: int, dtype: torch.dtype, rounds: int) -> None:
    """--delta: each adapted linear's delta per call, the torch path vs the segmented kernel, over
    every layer's own adapter weights (a step reads each once, from memory, not from cache)."""
    from bench.common import load_average
    from bench.forward import memory_bytes_per_s
    from engine.backends.base import DenseLinear
    from engine.kernels.cpu import load_cpu_kernels
    from engine.lora.layers import LORA_LINEARS, LoraLinear, LoraSlots

    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels cannot be built here: nothing to compare")
    q, kv, dim, hidden = args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.dim, args.ffn_hidden_dim
    linears = {"attention.wqkv": (dim, [q, kv, kv]), "attention.wo": (q, [dim]),
               "feed_forward.w13": (dim, [hidden, hidden]), "feed_forward.w2": (hidden, [dim])}
    per_adapter = [rows // NUM_ADAPTERS + (i < rows % NUM_ADAPTERS) for i in range(NUM_ADAPTERS)]
    starts = [sum(per_adapter[:i]) for i in range(NUM_ADAPTERS + 1)]
    layers, load_before = args.n_layers, load_average()
    print(f"one linear's LoRA delta: {NUM_ADAPTERS} rank-{rank} adapters over {rows} rows, {dtype}, "
          f"{torch.get_num_threads()} threads, {layers} layers' weights per sweep, best of {rounds} alternating sweeps")
    print(f"{'linear':<18} {'torch us':>9} {'kernel us':>10} {'speedup':>8} {'kernel GB/s':>12}")
    totals, step_bytes = {"torch": 0.0, "kernel": 0.0}, 0
    for linear, (in_features, sizes) in linears.items():
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        base = DenseLinear(torch.zeros(sum(sizes), in_features, dtype=dtype))
        y = base(x)
        adapters = [{f"layers.{layer}.{part}": (torch.randn(rank, in_features, generator=gen) / in_features**0.5,
                                                 torch.randn(out, rank, generator=gen) * 0.01)
                     for layer in range(layers) for part, out in zip(LORA_LINEARS[linear], sizes)}
                    for _ in range(NUM_ADAPTERS)]  # fmt: skip
        sweeps, kernel_bytes = {}, 0
        for path, path_kernels in (("torch", None), ("kernel", kernels)):
            slots = LoraSlots(kernels=path_kernels)
            wrapped = [LoraLinear(base, f"layers.{layer}.{linear}", slots, sizes) for layer in range(layers)]
            held = sum(slots.install(i + 1, local, 2.0, {linear: sizes}, dtype=dtype, device=torch.device("cpu"))
                       for i, local in enumerate(adapters))  # fmt: skip
            slots.runs = [(starts[i], starts[i + 1], i + 1) for i in range(NUM_ADAPTERS) if starts[i + 1] > starts[i]]
            if path_kernels is not None:  # what begin_step builds from a step's inputs
                slots.run_rows = torch.tensor([(a, b, slots.slot_of[i]) for a, b, i in slots.runs], dtype=torch.int64)
                slots.run_rows_address = slots.run_rows.data_ptr()
                kernel_bytes = held // layers
            sweeps[path] = [layer._add_delta for layer in wrapped]
        best = {path: float("inf") for path in sweeps}
        for sweep in range(rounds + 1):  # each path's first sweep (page faults) is not counted
            for path, calls in sweeps.items():
                started = time.perf_counter()
                for call in calls:
                    call(x, y)
                if sweep:
                    best[path] = min(best[path], (time.perf_counter() - started) / layers)
        for path in totals:
            totals[path] += best[path]
        step_bytes += kernel_bytes * layers
        print(f"{linear:<18} {best['torch'] * 1e6:>9.1f} {best['kernel'] * 1e6:>10.1f} {best['torch'] / best['kernel']:>7.2f}x "
              f"{kernel_bytes / best['kernel'] / 1e9:>12.1f}")
        del sweeps, adapters
    bandwidth = memory_bytes_per_s(64)
    print(f"a step's deltas ({layers} layers): torch {totals['torch'] * layers * 1e3:.2f} ms, kernel "
          f"{totals['kernel'] * layers * 1e3:.2f} ms; the adapters' {step_bytes / 1e6:.1f} MB at {bandwidth / 1e9:.1f} GB/s "
          f"(this machine's read bandwidth now) take {step_bytes / bandwidth * 1e3:.2f} ms: the kernel at "
          f"{step_bytes / bandwidth / (totals['kernel'] * layers):.0%} of that bound")
    print(f"load average before {load_before}, after {load_average()}")


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
    parser.add_argument("--delta", action="store_true", help="one linear's LoRA delta alone: torch path vs C kernel, us per call")
    parser.add_argument("--rounds", type=int, default=5, help="--delta: alternating sweeps of each path")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each mode, interleaved; each mode's least disturbed (fastest) one is kept")
    add_results_arguments(parser)
    opts = parser.parse_args(argv)
    streams = [int(s) for s in opts.streams.split(",")]
    output_tokens = 4 if opts.smoke else opts.output_tokens
    if opts.delta:
        from bench.common import model_args

        dtype = getattr(torch, opts.dtype or "float32")
        delta_benchmark(model_args(opts.model or opts.config), max(streams), opts.rank, dtype, 1 if opts.smoke else opts.rounds)
        return 0

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
        best: dict[str, tuple[float, float]] = {}  # mode -> (step seconds, output tok/s) of its least disturbed run
        for repeat in range(opts.repeats):  # the modes interleaved: load that drifts hits each alike
            for mode, adapters in modes.items():
                # fresh prompts each repeat: a repeated prompt would hit the prefix cache
                seconds, produced, steps = run(core, count, adapters, output_tokens, seed=count + 1000 * repeat)
                step, rate = seconds / max(steps, 1), produced / seconds
                if mode not in best or step < best[mode][0]:
                    best[mode] = (step, rate)
                print(f"{mode:<14} {count:>7} {rate:>13.1f} {1000 * step:>9.2f}")
        if opts.repeats > 1:
            print(f"best of {opts.repeats}:")
        for mode, (step, rate) in best.items():
            step_s[(mode, count)] = step
            results.add("output throughput", rate, "tok/s", mode=mode, streams=count, model=name, rank=opts.rank,
                        dtype=dtype, device=opts.device)
            results.add("mean step time", 1000 * step, "ms", mode=mode, streams=count, model=name)
            if opts.repeats > 1:
                print(f"{mode:<14} {count:>7} {rate:>13.1f} {1000 * step:>9.2f}")
    top = max(streams)
    ratio = step_s[(f"{NUM_ADAPTERS} adapters", top)] / step_s[("base", top)]
    results.add("8 adapters / base step time", ratio, "x", streams=top, model=name)
    print(f"{NUM_ADAPTERS} adapters / base step time at {top} streams: {ratio:.2f}x (target <= 1.3x)")
    results.write(opts.json, **torch_machine())
    runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
