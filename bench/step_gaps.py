"""Where the compiled one-stream decode step's time goes between its weight reads (a script, not a test).

    python bench/step_gaps.py [--checkpoint DIR | --config NAME] [--dtype bfloat16] [--threads 1,2] [--rounds 20] [--steps 16]

Runs a checkpoint's (default: the demo's; --config: random weights of a bench config instead) compiled decode step (engine/kernels/csrc/decode_step.c) as
bench/step_gaps.c rebuilds it, with a wall clock around every kernel call, one sequence decoding
after 128 tokens of context (bench/decode_profile.py's steps). Each call's figure is its best over
rounds x steps steps, summed over the layers: the step the kernels allow when nothing else runs,
steady on a shared machine (two runs at load 4-5 agree within 1-2%) where means are not. Prints per
kind of call its sum, the linears' weight bytes over it (GB/s), and each linear's time past the
largest linear's rate (what a short call pays once: fork and join, the first lines cold, the tail);
the head's best call beside them; then the cost of an empty OpenMP region of the step's threads, of
one whose if() is false and of a barrier (best batch of 50, 3000 batches).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average  # noqa: E402
from bench.decode_profile import decode_steps, load  # noqa: E402
from engine.kernels.build import c_compiler, compiler_flags  # noqa: E402

PHASES = ("norm1", "wqkv", "rope", "attention", "wo", "norm2", "w13", "silu", "w2")  # step_gaps.c's PHASE_*
LINEARS = ("wqkv", "wo", "w13", "w2")  # cpu_step.block_linears' order
HARNESS = Path(__file__).with_name("step_gaps.c")
UNSET_NS = 1e18


def build(out_dir: Path) -> ctypes.CDLL:
    target = out_dir / "step_gaps.so"
    subprocess.run([c_compiler(), *compiler_flags(), "-o", str(target), str(HARNESS)], check=True)
    lib = ctypes.CDLL(str(target))  # after torch: its libgomp serves these regions, as it does the kernels'
    for name in ("region_ns", "barrier_ns"):
        getattr(lib, name).restype = ctypes.c_double
    return lib


def timed_step(step, lib: ctypes.CDLL, min_ns) -> None:
    """Point the bound DecodeStep at decode_step_gaps, which folds each call's time into min_ns."""
    lib.decode_step_gaps.argtypes = (*step._fn.argtypes, ctypes.c_void_p)
    lib.decode_step_gaps.restype = ctypes.c_int
    gaps, buffer = lib.decode_step_gaps, ctypes.addressof(min_ns)
    step._fn = lambda program, h, out, tokens, threads: gaps(program, h, out, tokens, threads, buffer)


def report(model, min_ns, head_s: float, dtype: str, threads: int, samples: int) -> None:
    from engine.backends import cpu_step

    layers = len(model.layers)
    weight_bytes = {name: linear.interleaved.numel() * linear.interleaved.element_size() * layers for name, linear in zip(LINEARS, cpu_step.block_linears(model.layers[0]))}
    sums_us = {name: sum(min_ns[i][p] for i in range(layers)) / 1e3 for p, name in enumerate(PHASES)}
    sums_us["final norm"] = min_ns[layers][0] / 1e3
    best_rate = max(weight_bytes[name] / sums_us[name] for name in LINEARS)  # bytes per us
    blocks = sum(sums_us.values())
    print(f"{dtype}, {threads} thread{'s' if threads > 1 else ''}: each call's best of {samples} steps, summed over {layers} layers (us per step); load average {load_average()}")
    for name, us in sums_us.items():
        line = f"  {name:10s} {us:8.1f}  {us / blocks:6.1%}"
        if name in LINEARS:
            past = us - weight_bytes[name] / best_rate
            line += f"  {weight_bytes[name] / us / 1e3:5.1f} GB/s, {us / layers:6.1f} us a call, {past / layers:4.1f} us a call past the best rate"
        print(line)
    linears = sum(sums_us[name] for name in LINEARS)
    between = blocks - linears
    past = linears - sum(weight_bytes.values()) / best_rate
    head_bytes = model.output.interleaved.numel() * model.output.interleaved.element_size() if getattr(model.output, "interleaved", None) is not None else 0
    print(f"  blocks {blocks:.0f} us: linears {linears:.0f} ({sum(weight_bytes.values()) / linears / 1e3:.1f} GB/s, {past:.0f} of it past the best rate), "
          f"between them {between:.0f} (attention {sums_us['attention']:.0f}, norms/RoPE/SiLU {between - sums_us['attention']:.0f})")
    print(f"  head best call {head_s * 1e6:.0f} us" + (f" ({head_bytes / head_s / 1e9:.1f} GB/s)" if head_bytes else ""))


def region_costs(lib: ctypes.CDLL, threads: int) -> None:
    best = {"region": UNSET_NS, "if(0) region": UNSET_NS, "barrier": UNSET_NS}
    for _ in range(3000):
        best["region"] = min(best["region"], lib.region_ns(threads, 1, 50))
        best["if(0) region"] = min(best["if(0) region"], lib.region_ns(threads, 0, 50))
        best["barrier"] = min(best["barrier"], lib.barrier_ns(threads, 50))
    print(f"  OpenMP at {threads} threads, best batch of 50 (ns each): " + ", ".join(f"{k} {v:.0f}" for k, v in best.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="~/.cache/llamaserve/SmolLM2-135M-Instruct")
    parser.add_argument("--config", help="random weights of this bench config (bench/common.py) instead of the checkpoint")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=16)
    opts = parser.parse_args()
    forward, model = load(argparse.Namespace(checkpoint=None if opts.config else opts.checkpoint, config=opts.config, dtype=opts.dtype, steps=opts.steps, decodes="1"))
    step = model.decode_step
    if step is None:
        sys.exit("no compiled decode step here (its library did not build)")
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        min_ns = ((ctypes.c_double * len(PHASES)) * (len(model.layers) + 1))()
        timed_step(step, lib, min_ns)
        head, head_best = model.output.forward, [float("inf")]

        def timed_head(*args):
            started = time.perf_counter()
            try:
                return head(*args)
            finally:
                head_best[0] = min(head_best[0], time.perf_counter() - started)

        model.output.forward = timed_head
        steps = decode_steps(forward, 1, opts.steps)
        for threads in (int(n) for n in opts.threads.split(",")):
            torch.set_num_threads(threads)
            steps()  # warm: the steps' blocks, the team
            for row in min_ns:
                row[:] = [UNSET_NS] * len(PHASES)
            head_best[0] = float("inf")
            for _ in range(opts.rounds):
                steps()
            report(model, min_ns, head_best[0], opts.dtype, threads, opts.rounds * opts.steps)
            region_costs(lib, threads)


if __name__ == "__main__":
    main()
