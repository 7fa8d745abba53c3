"""What --batch-invariant costs: the time of one decode step with and without the mode, at 1 and at
32 decoding sequences (a script, not a test).

    python bench/batch_invariant.py [--config demo] [--dtype bfloat16] [--rows 1,32] [--steps 20]

Each configuration builds the model once (random weights, the CPU backend WorkerGroup picks), starts
`rows` sequences of 64 prompt tokens, then times `steps` pure-decode steps through EngineCore
(wall time per step, median). The modes run interleaved; on a shared machine compare ratios, not
absolute figures. What changes in the mode (docs/backends.md): every linear on one kernel for all
rows (AMX tiles where the CPU has them, else the one-row kernel; no oneDNN), decode attention split
per sequence, no compiled step above one row but on the tiles.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average  # noqa: E402
from bench.throughput import ByteLevelTokenizer, checkpoint_dir, random_prompt  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.executor.executor import ModelExecutor  # noqa: E402
from engine.executor.worker_group import WorkerGroup  # noqa: E402
from engine.loading.checkpoint import resolve_checkpoint  # noqa: E402
from engine.types import EngineRequest, SamplingParams  # noqa: E402

PROMPT_TOKENS = 64
MAX_SEQ_LEN = 512


def step_time_s(spec, dtype: str, rows: int, steps: int, batch_invariant: bool) -> float:
    """Median wall time of one pure-decode step of `rows` sequences."""
    config = EngineConfig(dtype=dtype, max_batch_size=max(rows, 1), max_num_batched_tokens=rows * PROMPT_TOKENS,
                          kv_cache_bytes=256 << 20, batch_invariant=batch_invariant)  # fmt: skip
    core = EngineCore(ModelExecutor(WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN)), ByteLevelTokenizer(spec.model_args.vocab_size), config, MAX_SEQ_LEN)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True)
    for i in range(rows):
        core.add_request(EngineRequest(f"r{i}", random_prompt(rng, PROMPT_TOKENS, spec.model_args.vocab_size), params))
    core.step()  # every prefill in one step (the budget fits them), then decodes only
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    spec = resolve_checkpoint(checkpoint_dir(args.config, args.checkpoint_dir), model_id=args.config, llama_model="Llama3.2-1B-Instruct")
    print(f"{args.config} {args.dtype}, load average {load_average()} (a shared machine: compare ratios)")
    for rows in (int(r) for r in args.rows.split(",")):
        off = step_time_s(spec, args.dtype, rows, args.steps, False)
        on = step_time_s(spec, args.dtype, rows, args.steps, True)
        print(f"rows {rows:3d}: step {off * 1e3:8.2f} ms without, {on * 1e3:8.2f} ms with --batch-invariant (x{on / off:.2f})")


if __name__ == "__main__":
    main()
