"""Where a CUDA decode step's time goes (a script, not a test): torch.profiler over EngineCore steps.

    python bench/cuda_step_profile.py [--config big1b] [--batch 1,32] [--steps 20]

Writes the bench config's random checkpoint once (bench/throughput.py's), fills `batch` sequences
with 128-token prompts, then profiles `steps` pure-decode steps: wall time per step, the GPU's busy
time per step (the sum of its kernels), and the ops with the most host time, so launch and Python
overhead, host syncs and copies show next to the kernels.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import DESCRIPTOR, checkpoint_dir, load_tokenizer, make_core, random_prompt  # noqa: E402
from engine.loading.checkpoint import resolve_checkpoint  # noqa: E402
from engine.types import EngineRequest, SamplingParams  # noqa: E402


def profile(core, batch: int, steps: int, vocab: int, top: int) -> None:
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineRequest(f"b{batch}-{i}", random_prompt(rng, 128, vocab), params))
    for _ in range(batch * 128 // 512 + 4):  # prefill everything (512-token steps), then a few decodes
        core.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    wall_s = (time.perf_counter() - started) / steps
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / steps
    print(f"\n== batch {batch}: {wall_s * 1e3:.2f} ms per step under the profiler, GPU busy {gpu_us / 1e3:.2f} ms per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48))
    while core.has_unfinished:
        core.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="big1b")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    opts = parser.parse_args()
    spec = resolve_checkpoint(checkpoint_dir(opts.config, None), model_id=opts.config, llama_model=DESCRIPTOR)
    tokenizer, _ = load_tokenizer(spec.model_args.vocab_size)
    for batch in (int(b) for b in opts.batch.split(",")):
        core = make_core(spec, tokenizer, max_batch_size=batch, device="cuda", dtype="bfloat16")
        profile(core, batch, opts.steps, spec.model_args.vocab_size, opts.top)
        core.runner.shutdown()


if __name__ == "__main__":
    main()
