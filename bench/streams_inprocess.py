"""Many streams through EngineCore in-process: output tok/s and TTFT p50 for step budgets and batch
sizes (a script, not a test).

    python bench/streams_inprocess.py [--streams 32,64] [--budgets 512,2048] [--max-batch-size 32] [--threads 1]

The served bench's workload without HTTP: the demo-shaped model (random weights, bfloat16, the CPU
backend WorkerGroup picks), `streams` clients each sending requests of 128 random prompt tokens
and 64 output tokens (greedy, end of sequence ignored) one after another, 2 requests per client.
With --threads 1 every op runs on the engine thread and the clock is that thread's CPU time, which
a machine busy with other jobs disturbs far less than wall time; the configurations run
interleaved, --rounds times, and each line is one run (compare ratios, not absolute figures).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

if "OMP_WAIT_POLICY" not in os.environ:  # as the server sets it (server/__main__.py)
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import ByteLevelTokenizer, checkpoint_dir, random_prompt  # noqa: E402
from engine.loading.checkpoint import resolve_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.executor.worker_group import WorkerGroup  # noqa: E402
from engine.executor.executor import ModelExecutor  # noqa: E402
from engine.types import EngineRequest, SamplingParams  # noqa: E402

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
REQUESTS_PER_STREAM = 2
MAX_SEQ_LEN = 1024


def run(spec, streams: int, budget: int, max_batch_size: int, clock, seed: int) -> tuple[float, float, float]:
    """(output tok/s, TTFT p50 s, TTFT p90 s) of one closed-loop run."""
    config = EngineConfig(dtype="bfloat16", max_batch_size=max_batch_size, max_num_batched_tokens=budget, kv_cache_bytes=512 << 20)
    core = EngineCore(ModelExecutor(WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN)), ByteLevelTokenizer(spec.model_args.vocab_size), config, MAX_SEQ_LEN)
    rng = random.Random(seed)
    vocab = spec.model_args.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    warm = EngineRequest("warm", random_prompt(rng, 16, vocab), SamplingParams(max_tokens=2))
    core.add_request(warm)
    while core.has_unfinished:
        core.step()
    sent_at: dict[str, float] = {}
    ttfts: list[float] = []
    left = {s: REQUESTS_PER_STREAM for s in range(streams)}

    def send(stream: int) -> None:
        left[stream] -= 1
        request_id = f"s{stream}-{left[stream]}"
        sent_at[request_id] = clock()
        core.add_request(EngineRequest(request_id, random_prompt(rng, PROMPT_TOKENS, vocab), params))

    started = clock()
    for stream in range(streams):
        send(stream)
    num_output = 0
    while core.has_unfinished:
        for out in core.step():
            if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
                ttfts.append(clock() - sent_at[out.request_id])
            num_output += len(out.new_token_ids)
            if out.finish_reason is not None:
                stream = int(out.request_id[1:].split("-")[0])
                if left[stream]:
                    send(stream)
    elapsed = clock() - started
    core.runner.shutdown()
    ttfts.sort()
    return num_output / elapsed, statistics.median(ttfts), ttfts[int(0.9 * (len(ttfts) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="32,64")
    parser.add_argument("--budgets", default="512,2048", help="max_num_batched_tokens values")
    parser.add_argument("--max-batch-size", default="32", help="comma-separated values; 'streams' = as many as streams")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    clock = time.thread_time if opts.threads == 1 else time.perf_counter
    spec = resolve_checkpoint(checkpoint_dir("demo", None), model_id="demo", llama_model="Llama3.2-1B-Instruct")
    print(f"{opts.threads} threads, clock {'thread CPU' if opts.threads == 1 else 'wall'}, load average {os.getloadavg()}", flush=True)
    for round_index in range(opts.rounds):
        for streams in (int(s) for s in opts.streams.split(",")):
            for batch in opts.max_batch_size.split(","):
                max_batch = streams if batch == "streams" else int(batch)
                for budget in (int(b) for b in opts.budgets.split(",")):
                    rate, p50, p90 = run(spec, streams, budget, max_batch, clock, seed=round_index)
                    print(
                        f"round {round_index}: {streams:3d} streams, max batch {max_batch:3d}, budget {budget:5d}: "
                        f"{rate:7.1f} out tok/s, TTFT p50 {p50:6.2f} s, p90 {p90:6.2f} s",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
