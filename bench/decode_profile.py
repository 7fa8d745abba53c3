"""Where a batch-1 decode step's time goes (a script, not a test).

    python bench/decode_profile.py [--checkpoint DIR] [--config demo] [--dtype bfloat16] [--threads N] [--ab ROUNDS] [--decodes 1,2,4,8]

Loads a Meta-format checkpoint (e.g. ~/.cache/llamaserve/SmolLM2-135M-Instruct, or its
`-native` Q4_1 copy: `--demo-weights native`) through WorkerGroup with the server's defaults, or
random weights of a bench config, then times one-token decode steps with 128 tokens of context
(head included: each step's token is its sequence's last), first plainly, then with every backend
operation and linear wrapped in a timer: ms per step, calls and us per call for each. The wrapped
run costs a little more (the timers); 'untimed' is what the timers do not see (module calls, the
block's own code). CPU time per step is printed next to wall time: on a shared machine it is the
steadier of the two. Figures are noisy there; say so when quoting them.

The compiled batch-1 step (engine/backends/cpu_step.py: all blocks and the final norm in one C
call) runs where the backend built one; the per-op profile turns it off (its timers wrap the
per-op calls). --ab ROUNDS: that many interleaved rounds of the per-op path ('old') and the
compiled step ('step'), each the best of two runs of --steps steps, and their ratio per round.
--decodes N,...: steps of N sequences each decoding one token (same context each; speculative
verification and small batches run such steps), timed plainly and with --ab for each N; the
per-op profile below stays the first N's.
--split ROUNDS: the compiled step's own parts, median per step over ROUNDS runs of --steps steps:
the blocks (the one C call), the output head, the embedding and the step plan (attention
metadata), wall and thread CPU ms, and the blocks' and head's weight bytes over their wall time.
--baseline OLD.so (with --split): another build of the cpu_kernels library serves a second
compiled step and head over the same weights, alternating with this tree's by round (the
kernels A/B of one process; the weights' layout is this tree's).
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average, model_args  # noqa: E402
from engine.executor.executor import build_step_inputs  # noqa: E402
from engine.core.sequence import ScheduledBatch, Sequence  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

CONTEXT_TOKENS = 128
BLOCK_SIZE = 16
BACKEND_OPS = ("attention_metadata", "add_rms_norm", "rope_and_cache_write", "attention", "silu_mul")


def load(opts: argparse.Namespace):
    """(forward(StepInputs), model) for the checkpoint or the random config."""
    if opts.checkpoint:
        from engine.loading.checkpoint import resolve_checkpoint
        from engine.config import EngineConfig
        from engine.executor.worker_group import WorkerGroup

        spec = resolve_checkpoint(Path(opts.checkpoint).expanduser(), model_id="bench")
        executor = WorkerGroup(spec, EngineConfig(dtype=opts.dtype, kv_cache_bytes=256 << 20), max_seq_len=1024)
        return executor.execute, executor._shard.model
    from bench.forward import Bench

    blocks = max(64, max(int(n) for n in opts.decodes.split(",")) * -(-(CONTEXT_TOKENS + opts.steps) // BLOCK_SIZE))
    bench = Bench.build(model_args(opts.config), getattr(torch, opts.dtype), blocks, pack=True)
    return (lambda inputs: bench.model(inputs, bench.caches)), bench.model


def timed(times: dict, counts: collections.Counter, label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label] += time.perf_counter() - started
            counts[label] += 1

    return wrapper


def instrument(model) -> tuple[dict, collections.Counter]:
    times, counts = collections.defaultdict(float), collections.Counter()
    for name in BACKEND_OPS:
        setattr(model.backend, name, timed(times, counts, name, getattr(model.backend, name)))
    for layer in model.layers:
        linears = {"wqkv": layer.attention.wqkv, "wo": layer.attention.wo, "w13": getattr(layer.feed_forward, "w13", None), "w2": getattr(layer.feed_forward, "w2", None)}
        for name, linear in linears.items():
            if linear is not None:
                linear.forward = timed(times, counts, name, linear.forward)
    model.output.forward = timed(times, counts, "output head", model.output.forward)
    model.tok_embeddings.forward = timed(times, counts, "embedding", model.tok_embeddings.forward)
    return times, counts


def decode_steps(forward, decodes: int, num_steps: int):
    """A function timing num_steps steps of `decodes` sequences each decoding one token after
    CONTEXT_TOKENS of prompt (prefilled here): (wall, CPU) ms per step."""
    per_seq_blocks = -(-(CONTEXT_TOKENS + num_steps) // BLOCK_SIZE)
    seqs = [Sequence(i, str(i), [7] * CONTEXT_TOKENS, CONTEXT_TOKENS, SamplingParams(temperature=0.0)) for i in range(decodes)]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * per_seq_blocks, (i + 1) * per_seq_blocks))
    forward(build_step_inputs(ScheduledBatch(seqs, [CONTEXT_TOKENS] * decodes), BLOCK_SIZE)[0])

    def steps() -> tuple[float, float]:
        for seq in seqs:
            del seq.token_ids[CONTEXT_TOKENS:]
            seq.num_computed_tokens = CONTEXT_TOKENS
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(num_steps):
            for seq in seqs:
                seq.token_ids.append(7)
            forward(build_step_inputs(ScheduledBatch(seqs, [1] * decodes), BLOCK_SIZE)[0])
            for seq in seqs:
                seq.num_computed_tokens += 1
        return (time.perf_counter() - wall) / num_steps * 1e3, (time.process_time() - cpu) / num_steps * 1e3

    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a Meta-format checkpoint dir (default: random weights of --config)")
    parser.add_argument("--config", default="demo", help="bench config without --checkpoint (bench/common.py)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--ab", type=int, default=0, metavar="ROUNDS", help="A/B rounds: per-op path vs the compiled step")
    parser.add_argument("--decodes", default="1", help="sequences per step, each decoding one token (comma-separated)")
    parser.add_argument("--split", type=int, default=0, metavar="ROUNDS", help="the compiled step's parts: blocks, head, embedding, plan")
    parser.add_argument("--baseline", type=Path, help="with --split: another cpu_kernels build (.so) for a second compiled step and head")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    forward, model = load(opts)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    compiled = model.decode_step
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {opts.dtype}, {opts.checkpoint or opts.config}; "
          f"load average {load_average()}; shared machine: noisy")
    first_steps = None
    for decodes in (int(n) for n in opts.decodes.split(",")):
        steps = decode_steps(forward, decodes, opts.steps)
        steps()
        plain = min(steps() for _ in range(3))
        served = compiled is not None and decodes <= compiled.max_rows
        print(f"decode step ({decodes} decode{'s' if decodes > 1 else ''}, {CONTEXT_TOKENS} tokens of context, "
              f"{'compiled step' if served else 'per-op'}): {plain[0]:.2f} ms wall, {plain[1]:.2f} ms CPU")
        if opts.ab and served:
            ab_rounds(model, compiled, steps, opts.ab)
        first_steps = first_steps or steps
    steps = first_steps
    if opts.split and compiled is not None:
        split_rounds(model, steps, opts.split, opts.baseline)
    model.decode_step = None  # the profile below times the per-op calls
    times, counts = instrument(model)
    steps()
    times.clear(), counts.clear()
    total = steps()[0]
    print(f"with timers: {total:.2f} ms wall per step")
    for label, seconds in sorted(times.items(), key=lambda kv: -kv[1]):
        per_step = seconds / opts.steps * 1e3
        print(f"  {label:22s} {per_step:7.3f} ms/step {per_step / total:6.1%}  {counts[label] // opts.steps:3d} calls  {seconds / counts[label] * 1e6:8.1f} us/call")
    untimed = total - sum(times.values()) / opts.steps * 1e3
    print(f"  {'untimed':22s} {untimed:7.3f} ms/step {untimed / total:6.1%}")


def split_rounds(model, steps, rounds: int, baseline: Path | None) -> None:
    """The compiled step's parts per step (median over rounds of the per-step medians), for this
    tree's kernels and, with a baseline library, that one's, alternating by round."""
    import ctypes
    import statistics

    from engine.backends import cpu_step
    from engine.kernels.cpu import CpuKernels

    head = model.output
    variants = {"ours": (model.decode_step, getattr(head, "_rows", None))}
    if baseline is not None:
        if not hasattr(head, "_rows"):
            sys.exit("--baseline: the head is not an InterleavedHeadLinear (a bfloat16 model on the C kernels)")
        kernels = CpuKernels(ctypes.CDLL(str(baseline)), partial=True)
        gather, cpu_step.gather_one_row_copies = cpu_step.gather_one_row_copies, lambda linears: None  # keep our arena: the first program points into it
        try:
            variants["baseline"] = (cpu_step.build_decode_step(model, kernels), kernels.bind_interleaved(head.interleaved, f32_out=True))
        finally:
            cpu_step.gather_one_row_copies = gather
    parts: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)

    def timer(label: str, fn):
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[label].append((time.perf_counter() - wall, time.thread_time() - cpu))

        return timed

    originals = {"output": head.forward, "embedding": model.tok_embeddings.forward, "plan": model.backend.plan_step}
    head.forward = timer("head", head.forward)
    model.tok_embeddings.forward = timer("embedding", model.tok_embeddings.forward)
    model.backend.plan_step = timer("plan", model.backend.plan_step)
    block_bytes = sum(linear.interleaved.numel() * linear.interleaved.element_size() for block in model.layers for linear in cpu_step.block_linears(block))
    head_bytes = head.interleaved.numel() * head.interleaved.element_size() if getattr(head, "interleaved", None) is not None else 0
    results = {name: collections.defaultdict(list) for name in variants}
    names = list(variants)
    try:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                step, rows = variants[name]
                model.decode_step = timer("blocks", step)
                model.decode_step.max_rows = step.max_rows  # what the step's plan reads
                if rows is not None:
                    head._rows = rows
                parts.clear()
                wall, cpu = steps()
                results[name]["step"].append((wall / 1e3, cpu / 1e3))
                for label, samples in parts.items():
                    results[name][label].append((statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples)))
    finally:
        head.forward, model.tok_embeddings.forward, model.backend.plan_step = originals["output"], originals["embedding"], originals["plan"]
        model.decode_step, rows = variants["ours"]
        if rows is not None:
            head._rows = rows
    print(f"compiled step's parts, median of {rounds} rounds (ms wall / thread CPU; step: process CPU); load average {load_average()}")
    for name in names:
        cells = []
        for label in ("step", "blocks", "head", "embedding", "plan"):
            samples = results[name][label]
            wall, cpu = statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples)
            rate = {"blocks": block_bytes, "head": head_bytes}.get(label)
            cells.append(f"{label} {wall * 1e3:.3f} / {cpu * 1e3:.3f}" + (f" ({rate / wall / 1e9:.1f} GB/s)" if rate else ""))
        print(f"  {name}: " + "  ".join(cells))


def ab_rounds(model, compiled, steps, rounds: int) -> None:
    """Interleaved rounds of the per-op path and the compiled step: (wall, CPU) ms per step, best of two runs each."""
    ratios_cpu, ratios_wall = [], []
    for i in range(rounds):
        timings = {}
        for label, step in (("old", None), ("step", compiled)) if i % 2 == 0 else (("step", compiled), ("old", None)):
            model.decode_step = step
            timings[label] = min(steps() for _ in range(2))
        ratios_wall.append(timings["step"][0] / timings["old"][0])
        ratios_cpu.append(timings["step"][1] / timings["old"][1])
        print(f"  A/B round {i}: old {timings['old'][0]:.2f} ms wall {timings['old'][1]:.2f} ms CPU; "
              f"step {timings['step'][0]:.2f} ms wall {timings['step'][1]:.2f} ms CPU; step/old wall x{ratios_wall[-1]:.3f} CPU x{ratios_cpu[-1]:.3f}")
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"A/B median step/old: wall x{median(ratios_wall):.3f}, CPU x{median(ratios_cpu):.3f} over {rounds} rounds")
    model.decode_step = compiled


if __name__ == "__main__":
    main()
