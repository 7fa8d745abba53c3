"""Resident memory over many distinct step sizes, per memory policy (a script, not a test).

    python bench/step_memory.py [--what model|linear] [--steps 240] [--dtype float32]
                                [--candidates none,buckets,...] [--speed]

Each candidate runs in a fresh process (allocator and oneDNN settings must precede torch's first
use) that drives `--steps` steps, each of a token count not seen before as long as there are any
(1..--max-rows, shuffled): the worst case of mixed prompt lengths under chunked prefill, which the
soak meets slowly. `--what model`: the real demo-shaped Transformer (random weights, oneDNN packed
linears and the C kernels, as served), each step a prefill chunk plus up to 64 decodes;
`--what linear`: only its packed linears (wqkv, wo, w13, w2, and the head on up to 64 rows), faster.
Prints resident memory (RSS, MiB) at the start (after a malloc_trim(0): building the model frees
memory that later allocations would reuse unseen), after the first --warmup-steps, at the end and
the change, then after malloc_trim(0) (what glibc held on to).

Candidates (combine with '+', e.g. buckets+trim):
- none: main before the fix: every row count runs as it is;
- buckets: engine.kernels.memory.onednn_rows pads packed linears' rows to a few buckets;
- mmap: mallopt(M_MMAP_THRESHOLD, 1 MiB) (a fixed threshold: big buffers mmapped, returned on free);
- arena2: mallopt(M_ARENA_MAX, 2);
- trim: malloc_trim(0) every --trim-every steps (what an idle hook does when the engine idles);
- cap32: ONEDNN_PRIMITIVE_CACHE_CAPACITY=32 (a smaller primitive cache);
- lru32: LRU_CACHE_CAPACITY=32 (ideep's cache of primitives, torch's oneDNN glue; 1024 by default).

`--speed` instead times padded against exact row counts at decode and prefill sizes, interleaved,
in CPU time (the machine's load moves wall times), and what a malloc_trim(0) costs: itself, and
the step after it (the pages it gave back fault in again).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import rss_mib  # noqa: E402

M_MMAP_THRESHOLD = -3  # glibc malloc.h
M_ARENA_MAX = -8
DEMO_LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # wqkv, wo, w13, w2: (out, in)
DEMO_HEAD = (49152, 576)
MAX_DECODES = 64


def libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")


# --------------------------------------------------------------------------- one candidate (child)
def apply_before_torch(knobs: set[str]) -> None:
    if "cap32" in knobs:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "32"
    if "lru32" in knobs:
        os.environ["LRU_CACHE_CAPACITY"] = "32"  # ideep's own cache of primitives (torch's oneDNN glue)
    if "mmap" in knobs:
        libc().mallopt(M_MMAP_THRESHOLD, 1 << 20)
    if "arena2" in knobs:
        libc().mallopt(M_ARENA_MAX, 2)


def apply_after_torch(knobs: set[str]) -> None:
    if "buckets" not in knobs:
        import engine.backends.cpu as cpu

        cpu.onednn_rows = lambda rows: rows  # main before the fix


class LinearDriver:
    def __init__(self, dtype) -> None:
        import torch

        from engine.backends.cpu import PackedCpuLinear, pack_weight

        torch.manual_seed(0)
        self.torch, self.dtype = torch, dtype
        self.layers = [PackedCpuLinear(pack_weight(torch.randn(o, i, dtype=dtype) * 0.02)) for o, i in DEMO_LINEARS]
        self.head = PackedCpuLinear(pack_weight(torch.randn(*DEMO_HEAD, dtype=dtype) * 0.02))

    def step(self, rows: int, rng: random.Random) -> None:
        for layer in self.layers:
            layer(self.torch.randn(rows, layer.in_features, dtype=self.dtype))
        self.head(self.torch.randn(min(rows, MAX_DECODES), DEMO_HEAD[1], dtype=self.dtype))


class ModelDriver:
    """The demo-shaped model as served: a step is one prefill chunk plus up to 64 decodes."""

    def __init__(self, dtype, max_rows: int, layers: int) -> None:
        from bench.common import CONFIGS
        from bench.forward import BLOCK_SIZE, Bench
        from engine.models.args import ModelArgs

        self.block_size = BLOCK_SIZE
        self.blocks_per_seq = math.ceil((max_rows + 256) / BLOCK_SIZE)
        args = ModelArgs(**{**CONFIGS["demo"], "n_layers": layers})
        self.bench = Bench.build(args, dtype, (MAX_DECODES + 1) * self.blocks_per_seq, pack=True)

    def step(self, rows: int, rng: random.Random) -> None:
        from engine.core.sequence import Sequence
        from engine.types import SamplingParams

        decodes = rng.randint(0, min(MAX_DECODES, rows))
        seqs, counts = [], []
        for i in range(decodes + (rows > decodes)):
            prefill = i == decodes
            computed = 0 if prefill else rng.randint(8, 255)
            count = rows - decodes if prefill else 1
            seq = Sequence(i, str(i), [7] * (computed + count), computed + count, SamplingParams(temperature=0.0))
            seq.num_computed_tokens = computed
            seq.block_table = list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq))
            seqs.append(seq)
            counts.append(count)
        self.bench.step(seqs, counts)


def child(opts: argparse.Namespace) -> None:
    knobs = set(opts.child.split("+"))
    apply_before_torch(knobs)
    import torch

    apply_after_torch(knobs)
    dtype = getattr(torch, opts.dtype)
    driver = ModelDriver(dtype, opts.max_rows, opts.layers) if opts.what == "model" else LinearDriver(dtype)
    rng = random.Random(opts.seed)
    sizes = list(range(2, opts.max_rows + 1))
    rng.shuffle(sizes)
    libc().malloc_trim(0)  # start from what the process holds, not what building it freed
    trace = {"start": rss_mib()}
    started_s = time.perf_counter()
    with torch.inference_mode():
        for i in range(opts.steps):
            driver.step(sizes[i % len(sizes)], rng)
            if "trim" in knobs and (i + 1) % opts.trim_every == 0:
                libc().malloc_trim(0)
            if i + 1 == opts.warmup_steps:
                trace["warmup"] = rss_mib()
    trace["end"] = rss_mib()
    libc().malloc_trim(0)
    trace["trimmed"] = rss_mib()
    print(json.dumps({"candidate": opts.child, "seconds": round(time.perf_counter() - started_s, 1),
                      **{k: round(v, 1) for k, v in trace.items()}}), flush=True)


# --------------------------------------------------------------------------- speed
def best_s(fn, min_sample_s: float = 0.01) -> float:
    """CPU seconds per call of fn (process time: on a shared machine the time this process waits
    for a core does not count), from one sample of enough calls to last min_sample_s."""
    calls, started_s = 0, time.process_time()
    while (elapsed_s := time.process_time() - started_s) < min_sample_s or calls == 0:
        fn()
        calls += 1
    return elapsed_s / calls


def speed(opts: argparse.Namespace) -> None:
    """Padded over exact row counts, per size, interleaved; then what a malloc_trim(0) costs."""
    import torch

    import engine.backends.cpu as cpu
    from engine.kernels.memory import onednn_rows

    torch.set_num_threads(opts.threads or torch.get_num_threads())
    dtype = getattr(torch, opts.dtype)
    driver = LinearDriver(dtype)
    exact, padded = (lambda rows: rows), onednn_rows
    print(f"{opts.dtype}, {torch.get_num_threads()} threads; padded / exact time of the four demo linears (CPU time, best "
          f"of {opts.repeats} samples each, interleaved)")
    with torch.inference_mode():
        for rows in [int(s) for s in opts.speed_rows.split(",")]:
            xs = [torch.randn(rows, layer.in_features, dtype=dtype) for layer in driver.layers]
            best = {"exact": math.inf, "padded": math.inf}
            for _ in range(opts.repeats):
                for name, rule in (("exact", exact), ("padded", padded)):
                    cpu.onednn_rows = rule
                    best[name] = min(best[name], best_s(lambda: [layer(x) for layer, x in zip(driver.layers, xs)]))
            print(f"  rows {rows:4d} -> {onednn_rows(rows):4d}: x{best['padded'] / best['exact']:.3f}", flush=True)
        cpu.onednn_rows = padded
        model = ModelDriver(dtype, opts.max_rows, opts.layers)
        step_cost(opts, model, cpu)
        trim_cost(opts, model)


def step_cost(opts: argparse.Namespace, model: ModelDriver, cpu) -> None:
    """A whole model step (a prefill chunk and decodes, attention and norms included) with its
    linears padded over exact, interleaved, in CPU time."""
    from engine.kernels.memory import onednn_rows

    for rows in (20, 72, 129, 300):
        best = {"exact": math.inf, "padded": math.inf}
        for _ in range(opts.repeats):
            for name, rule in (("exact", lambda rows: rows), ("padded", onednn_rows)):
                cpu.onednn_rows = rule
                best[name] = min(best[name], best_s(lambda: model.step(rows, random.Random(rows)), 0.0))
        cpu.onednn_rows = onednn_rows
        print(f"{opts.layers}-layer model, {rows}-row step -> {onednn_rows(rows)}: padded x{best['padded'] / best['exact']:.3f} "
              f"of exact", flush=True)


def trim_cost(opts: argparse.Namespace, model: ModelDriver) -> None:
    """malloc_trim(0) alone, and a model step right after one over a step without (pages come back
    as the step touches them again), interleaved."""
    for rows in (opts.max_rows, 64):
        best = {"step": math.inf, "trim": math.inf, "step after trim": math.inf}
        for _ in range(opts.repeats):
            model.step(rows, random.Random(rows))
            started_s = time.process_time()
            model.step(rows, random.Random(rows))
            best["step"] = min(best["step"], time.process_time() - started_s)
            started_s = time.process_time()
            libc().malloc_trim(0)
            best["trim"] = min(best["trim"], time.process_time() - started_s)
            started_s = time.process_time()
            model.step(rows, random.Random(rows))
            best["step after trim"] = min(best["step after trim"], time.process_time() - started_s)
        print(f"{opts.layers}-layer model, {rows}-row step: malloc_trim(0) {1e3 * best['trim']:.2f} ms; the step after "
              f"it x{best['step after trim'] / best['step']:.3f} of a step without", flush=True)


# --------------------------------------------------------------------------- parent
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", choices=("model", "linear"), default="model")
    parser.add_argument("--candidates", default="none,buckets,buckets+trim,buckets+mmap,mmap,cap32")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--warmup-steps", type=int, default=24)
    parser.add_argument("--max-rows", type=int, default=512, help="the step token budget (max-num-batched-tokens)")
    parser.add_argument("--layers", type=int, default=4, help="model layers (the demo has 30; oneDNN keys primitives by weight shape, so depth costs time, not primitives)")
    parser.add_argument("--trim-every", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--speed-rows", default="2,8,16,17,24,33,48,65,100,129,200,257,300,400,500")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="--speed's torch threads (1: a descheduled partner thread does not stall the barrier)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        return child(opts)
    if opts.speed:
        return speed(opts)
    print(f"{opts.what}, {opts.dtype}, {opts.steps} steps of distinct sizes 2..{opts.max_rows}; RSS MiB "
          f"(start, after {opts.warmup_steps} steps, end, end - warm-up, after malloc_trim(0))", flush=True)
    for name in opts.candidates.split(","):
        argv = [sys.executable, __file__, "--child", name, "--what", opts.what, "--steps", str(opts.steps),
                "--warmup-steps", str(opts.warmup_steps), "--max-rows", str(opts.max_rows), "--layers", str(opts.layers),
                "--trim-every", str(opts.trim_every), "--dtype", opts.dtype, "--seed", str(opts.seed)]
        line = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        r = json.loads(line)
        growth = r["end"] / r["warmup"] - 1
        print(f"  {name:16s} {r['start']:8.1f} {r['warmup']:8.1f} {r['end']:8.1f}  {100 * growth:+6.1f}%  "
              f"{r['trimmed']:8.1f}   ({r['seconds']} s)", flush=True)


if __name__ == "__main__":
    main()
