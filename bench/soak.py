"""Soak: many requests at fixed concurrency on the demo model, with clients that cancel and read slowly.

Starts `python -m server --demo` on a free port and sends `--requests` (2,000) requests with
`--streams` (64) in flight: mixed prompt and output lengths, streaming and not, `--cancel-fraction`
(10%) cancelled at a random point, `--slow-readers` (2) streams that read one event per
`--slow-read-s`. Prints, as one JSON object at the end:
- lost: requests that got neither a complete answer nor a clear error (an OpenAI error body or an
  in-band error event); must be 0;
- leaked_kv_blocks: KV blocks still in use once the server is idle (/metrics); must be 0;
- rss_drift: the server's resident memory at the end (idle, every stream closed) over after the
  first `--warmup-requests` (200) requests completed (within 5%), and rss_trace_mib, RSS every
  `--progress-every` (200) requests, to see whether it plateaus; rss_idle_mib: RSS once the server
  has been idle `--idle-settle-s` more (a CPU engine trims its heap when idle: engine/kernels/memory.py);
- p99 latency (s) of complete requests per quarter of the run, and outcome counts.

Numbers, not a test: the machine's load changes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.demo_vs_llamacpp import ROOT, free_port, stop, wait_ready  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial sphinx".split()


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=dict)
    latencies_s: list[tuple[int, float]] = field(default_factory=list)  # (request index, seconds), complete only

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice([4, 16, 64, 256])))


async def one(session, base: str, index: int, rng: random.Random, tally: Tally, *, cancel: bool, slow_read_s: float) -> None:
    import aiohttp

    stream = rng.random() < 0.5 or slow_read_s > 0 or cancel  # a cancelled request leaves mid-stream
    cancel_after_events = rng.randint(1, 6)
    body = {"model": MODEL, "prompt": prompt(rng), "max_tokens": rng.choice([1, 8, 32, 128]), "temperature": 0,
            "stream": stream}
    started_s = time.perf_counter()
    try:
        async with session.post(base + "/v1/completions", json=body) as response:
            if response.status != 200:
                error = (await response.json()).get("error", {})
                tally.add("error" if {"message", "type", "code"} <= set(error) else "lost")
                return
            if not stream:
                data = await response.json()
                tally.add("complete" if data["choices"][0]["finish_reason"] else "lost")
            else:
                events = 0
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    events += 1
                    if line.startswith(b"data: [DONE]"):
                        tally.add("complete")
                        break
                    if b'"error"' in line[:20]:
                        tally.add("error")
                        return
                    if cancel and events >= cancel_after_events:
                        tally.add("cancelled")
                        return
                    if slow_read_s:
                        await asyncio.sleep(slow_read_s)
                else:
                    tally.add("lost")  # the stream ended without [DONE] or an error event
                    return
    except aiohttp.ClientError:
        tally.add("lost")
        return
    tally.latencies_s.append((index, time.perf_counter() - started_s))


async def run(base: str, args: argparse.Namespace, server_pid: int) -> dict:
    import aiohttp

    rng = random.Random(args.seed)
    tally = Tally()
    semaphore = asyncio.Semaphore(args.streams)
    rss_after_warmup: list[int] = []
    rss_trace_mib: list[tuple[int, float]] = []  # (requests done, server RSS MiB)
    slow = set(rng.sample(range(args.requests), args.slow_readers))
    started_s = time.perf_counter()

    async def gated(session, index: int) -> None:
        async with semaphore:
            request_rng = random.Random(rng.random())
            await one(session, base, index, request_rng, tally, cancel=request_rng.random() < args.cancel_fraction,
                      slow_read_s=args.slow_read_s if index in slow else 0.0)
        done = sum(tally.outcomes.values())
        if done == args.warmup_requests:
            rss_after_warmup.append(rss_bytes(server_pid))
        if done % args.progress_every == 0:  # progress on stderr: a long soak shows it is moving
            rss_trace_mib.append((done, round(rss_bytes(server_pid) / 2**20, 1)))
            print(f"soak: {done}/{args.requests} done in {time.perf_counter() - started_s:.0f} s, server RSS "
                  f"{rss_trace_mib[-1][1]:.1f} MiB, {tally.outcomes}", file=sys.stderr, flush=True)

    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=args.streams + 8)) as session:
        await asyncio.gather(*(gated(session, i) for i in range(args.requests)))
        leaked = await idle_kv_blocks(session, base)
        rss_end = rss_bytes(server_pid)
        await asyncio.sleep(args.idle_settle_s)
    rss_idle = rss_bytes(server_pid)
    quarter = args.requests // 4
    p99 = {f"q{q + 1}": p99_of([s for i, s in tally.latencies_s if q * quarter <= i < (q + 1) * quarter])
           for q in range(4)}
    baseline = rss_after_warmup[0] if rss_after_warmup else rss_end
    return {"requests": args.requests, "streams": args.streams, "outcomes": tally.outcomes,
            "lost": tally.outcomes.get("lost", 0), "leaked_kv_blocks": leaked,
            "rss_after_warmup_mib": round(baseline / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_drift": round(rss_end / baseline - 1, 4), "rss_trace_mib": rss_trace_mib,
            "rss_idle_mib": round(rss_idle / 2**20, 1),
            "p99_latency_s_per_quarter": p99}


def p99_of(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    return round(statistics.quantiles(values, n=100)[98], 3)


async def idle_kv_blocks(session, base: str, timeout_s: float = 30.0) -> int:
    """KV blocks in use once running = waiting = 0 (0 when nothing leaked)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        async with session.get(base + "/metrics") as response:
            text = await response.text()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("llamaserve:") and f'model_name="{MODEL}"' in line}
        used = round(values.get("llamaserve:kv_cache_usage_perc", 0.0) * values.get("llamaserve:kv_cache_blocks_total", 0))
        idle = values.get("llamaserve:num_requests_running") == 0 and values.get("llamaserve:num_requests_waiting") == 0
        if (idle and used == 0) or time.monotonic() > deadline_s:
            return used
        await asyncio.sleep(0.2)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--cancel-fraction", type=float, default=0.10)
    parser.add_argument("--slow-readers", type=int, default=2)
    parser.add_argument("--slow-read-s", type=float, default=1.0)
    parser.add_argument("--warmup-requests", type=int, default=200, help="the RSS baseline: after this many requests")
    parser.add_argument("--progress-every", type=int, default=200, help="print progress and sample RSS every this many requests")
    parser.add_argument("--idle-settle-s", type=float, default=5.0, help="idle this long before rss_idle_mib")
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/llamaserve").expanduser())
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        command = [sys.executable, "-m", "server", "--demo", "--demo-cache-dir", str(args.cache_dir), "--port", str(port),
                   "--dtype", "float32", "--max-batch-size", "64", "--log-level", "warning"]
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log)
        try:
            asyncio.run(wait_ready(base, "/ready", process))
            result = asyncio.run(run(base, args, process.pid))
        finally:
            stop(process)
    print(json.dumps(result, indent=2))
    print(f"RSS after the first {args.warmup_requests} requests {result['rss_after_warmup_mib']:.1f} MiB, at the end "
          f"{result['rss_end_mib']:.1f} MiB ({100 * result['rss_drift']:+.1f}%; the goal is within 5%), idle "
          f"{args.idle_settle_s:g} s later {result['rss_idle_mib']:.1f} MiB")


if __name__ == "__main__":
    main()
