"""What sampling one step costs, the host path against the device path (a script, not a test).

    python bench/sampler.py [--device cpu|cuda] [--rows 1,32,128] [--vocab 49152] [--steps 20] [--mixes greedy,top_p,mixed]

Random float32 logits [rows, vocab] (fixed seed; 49152 is the demo model's vocabulary, 128256
Llama 3's), sampled by engine/core/sampler.py's two paths, interleaved, median wall time per step:
- host: what the executor does today, the logits on the CPU (copied there first from a GPU, the
  copy timed) and Sampler.sample (the fused kernels' argmax for plain greedy batches);
- device: Sampler.sample_on_device on the logits where they are (on the CPU too, where sample()
  keeps the host path: this shows what the device path costs there).
Mixes: greedy (temperature 0, nothing else), top_p (temperature 0.7, top_p 0.9, seeded), mixed
(every fourth row greedy, from the fourth; the others top_k 40, top_p 0.9 with min_p, penalties over 256 output
tokens, logprobs 5). The roofline column is the logits' bytes over the step time. Numbers on a
shared machine are noisy: compare the two paths, not runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Results, add_results_arguments, load_average, torch_machine  # noqa: E402
from engine.core.sampler import Sampler  # noqa: E402
from engine.core.sequence import Sequence  # noqa: E402
from engine.kernels.cpu import load_cpu_kernels  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

OUTPUT_TOKENS = 256  # generated so far per row: what the penalties scan


def mix_params(mix: str, row: int) -> SamplingParams:
    if mix == "greedy":
        return SamplingParams(temperature=0)
    if mix == "top_p":
        return SamplingParams(temperature=0.7, top_p=0.9, seed=row)
    if row % 4 == 3:
        return SamplingParams(temperature=0)
    return SamplingParams(temperature=0.8, top_k=40 if row % 4 == 1 else 0, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                          frequency_penalty=0.3, logprobs=5, seed=row)


def sequences(mix: str, rows: int, vocab: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(rows)
    seqs = []
    for row in range(rows):
        output = torch.randint(0, vocab, (OUTPUT_TOKENS,), generator=g).tolist()
        seqs.append(Sequence(row, f"r{row}", [1, 2, 3] + output, 3, mix_params(mix, row)))
    return seqs


def time_step_s(run, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    run()  # both paths end reading their result on the host: the step is over when they return
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", default="1,32,128", help="batch sizes, comma-separated")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per path and configuration (after one warm-up)")
    parser.add_argument("--mixes", default="greedy,top_p,mixed")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_results_arguments(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kernels = load_cpu_kernels()
    results = Results("sampler", context={"vocab": args.vocab, "device": args.device})
    print(f"vocab {args.vocab}, device {args.device}, {torch.get_num_threads()} threads, load average {load_average()}")
    print(f"{'mix':>8} {'rows':>5} {'host ms':>9} {'device ms':>10} {'host GB/s':>10} {'device GB/s':>12}")
    for mix in args.mixes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            seqs = sequences(mix, rows, args.vocab)
            logits = (torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3).to(device)
            host_sampler, device_sampler = Sampler(seed=0, kernels=kernels), Sampler(seed=0, kernels=kernels)
            paths = {
                "host": lambda: host_sampler.sample(logits.cpu(), seqs),
                "device": lambda: device_sampler.sample_on_device(logits, seqs),
            }
            times: dict[str, list[float]] = {name: [] for name in paths}
            for step in range(args.steps + 1):
                for name, run in paths.items():
                    elapsed = time_step_s(run, device)
                    if step:  # the first is a warm-up
                        times[name].append(elapsed)
            median = {name: statistics.median(t) for name, t in times.items()}
            logit_bytes = rows * args.vocab * 4
            print(f"{mix:>8} {rows:>5} {median['host'] * 1e3:9.3f} {median['device'] * 1e3:10.3f} "
                  f"{logit_bytes / median['host'] / 1e9:10.2f} {logit_bytes / median['device'] / 1e9:12.2f}", flush=True)
            for name, value in median.items():
                results.add("sampling step", value * 1e3, "ms", path=name, mix=mix, rows=rows)
    results.write(args.json, **torch_machine())


if __name__ == "__main__":
    main()
