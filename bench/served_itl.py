"""Where one stream's time per token goes between the engine and the client, from one run: the
engine's own step time against the inter-token time the server records and the one a client sees
(a script, not a test; issue #35's lead: a 12.0 ms in-process step served at 16.7-17.1 ms a token).

    python -m server --demo &
    python bench/served_itl.py [--base-url http://127.0.0.1:8000] [--model SmolLM2-135M-Instruct] [--requests 4]
    python bench/served_itl.py --concurrency 32 --requests 64 --server-pid PID   # 2 rounds of 32 streams at once

Streams --requests completions one after another (batch 1: one step per token; 128 prompt-ish
characters, 64 tokens, greedy, end of sequence ignored) after one warm-up, and reads the server's
own counters from /metrics before and after: llamaserve:engine_step_seconds (the step, inside the
engine thread) and llamaserve:time_per_output_token_seconds (the gaps between a request's outputs,
as the server's event loop receives them). Printed: the mean decode step (a prefill step measured alone first is taken out once per request), the server's inter-token mean
(its excess over the step: the engine-thread -> event-loop hand-off and anything else the engine
thread does between steps) and the client's inter-token median and mean (its excess over the
server's: detokenized chunk -> JSON -> SSE -> socket -> client parse). All three come from the
same run, so a busy machine inflates them alike and the differences stay comparable.

--concurrency N streams N requests at once (threads, one urllib stream each; --requests of them in all,
in rounds of N that start together): the engine then steps the N together, and the figures that
matter are the CPU per token below (the step mean then includes the rounds' prefill steps).

--server-pid PID adds where the CPU went, which a busy machine does not inflate the way it does wall
time: each of the served process's threads' CPU time per streamed token over the measured requests
(from /proc: the engine thread, its OpenMP workers, the event loop, ...), and this client's own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time
import urllib.request

COUNTERS = ("llamaserve:engine_step_seconds", "llamaserve:time_per_output_token_seconds")


def counters(base_url: str) -> dict[str, float]:
    """Each counter's _sum and _count over every model (one model served: that model's)."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=30).read().decode()
    out = {}
    for name in COUNTERS:
        for kind in ("sum", "count"):
            out[f"{name}_{kind}"] = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name}_{kind}"))
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each of a process's threads (/proc schedstat: nanoseconds on a CPU), by "name tid";
    the main thread, which runs the server's event loop, is "main" (Python's thread names do not reach
    the OS before 3.14: the engine thread is the busiest "python", its OpenMP workers the next)."""
    out: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                on_cpu_ns = int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name = "main" if int(task) == pid else f"{stat[stat.index('(') + 1 : stat.rindex(')')]} {task}"
        out[name] = on_cpu_ns / 1e9
    return out


def stream_gaps_s(base_url: str, model: str, i: int, max_tokens: int) -> list[float]:
    """The client's gaps between consecutive text chunks of one streamed completion."""
    body = {"model": model, "prompt": f"Request {i}: once upon a time, in a land far away, there lived", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    arrivals = []
    with urllib.request.urlopen(request, timeout=3600) as response:
        for line in response:
            if line.startswith(b"data: ") and b'"text"' in line:
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--server-pid", type=int, default=None, help="the served process: CPU per token by thread")
    parser.add_argument("--concurrency", type=int, default=1, help="streams at once (rounds of this many)")
    args = parser.parse_args()
    pool = concurrent.futures.ThreadPoolExecutor(max(1, args.concurrency))
    stream_gaps_s(args.base_url, args.model, -1, 8)  # warm-up
    # a prefill step alone (one token out: one step), to take each request's prefill out of the step mean
    start = counters(args.base_url)
    stream_gaps_s(args.base_url, args.model, -2, 1)
    before, gaps = counters(args.base_url), []
    threads_before = thread_cpu_s(args.server_pid) if args.server_pid else {}
    client_cpu_s, wall_s = time.process_time(), time.perf_counter()
    prefill_s = before["llamaserve:engine_step_seconds_sum"] - start["llamaserve:engine_step_seconds_sum"]
    for first in range(0, args.requests, args.concurrency):
        ids = range(first, min(args.requests, first + args.concurrency))
        for request_gaps in pool.map(lambda i: stream_gaps_s(args.base_url, args.model, i, args.max_tokens), ids):
            gaps += request_gaps
    client_cpu_s, wall_s = time.process_time() - client_cpu_s, time.perf_counter() - wall_s
    threads_after = thread_cpu_s(args.server_pid) if args.server_pid else {}
    after = counters(args.base_url)
    delta = {key: after[key] - before[key] for key in after}
    if args.concurrency == 1:
        decode_steps = delta["llamaserve:engine_step_seconds_count"] - args.requests
        step_s = (delta["llamaserve:engine_step_seconds_sum"] - args.requests * prefill_s) / max(1.0, decode_steps)
    else:  # rounds' prefills overlap other requests' decodes: every step counts
        step_s = delta["llamaserve:engine_step_seconds_sum"] / max(1.0, delta["llamaserve:engine_step_seconds_count"])
    server_itl_s = delta["llamaserve:time_per_output_token_seconds_sum"] / max(1.0, delta["llamaserve:time_per_output_token_seconds_count"])
    client_mean_s = statistics.mean(gaps)
    print(f"{delta['llamaserve:engine_step_seconds_count']:.0f} steps, {len(gaps)} client gaps, "
          f"{args.requests * args.max_tokens / wall_s:.1f} out tok/s over {wall_s:.2f} s (wall: load inflates it)")
    if args.concurrency == 1:
        print(f"engine step           {step_s * 1e3:8.2f} ms  (decode steps: each request's prefill step, {prefill_s * 1e3:.2f} ms "
              "measured alone, taken out)")
    else:
        print(f"engine step           {step_s * 1e3:8.2f} ms  (every step: the rounds' prefills included)")
    print(f"server inter-token    {server_itl_s * 1e3:8.2f} ms  (+{(server_itl_s - step_s) * 1e3:.2f} over the step)")
    print(f"client inter-token    {client_mean_s * 1e3:8.2f} ms mean, {statistics.median(gaps) * 1e3:.2f} median  "
          f"(+{(client_mean_s - server_itl_s) * 1e3:.2f} over the server's)")
    if args.server_pid:
        tokens = args.requests * args.max_tokens
        spent = {name: threads_after[name] - threads_before.get(name, 0.0) for name in threads_after}
        print(f"CPU per token ({tokens} tokens; the server's threads' include each request's own work):")
        for name, seconds in sorted(spent.items(), key=lambda item: -item[1]):
            if seconds * 1e3 / tokens >= 0.001:
                print(f"  server thread {name:22s} {seconds / tokens * 1e3:8.3f} ms")
        print(f"  this client                  {client_cpu_s / tokens * 1e3:12.3f} ms")


if __name__ == "__main__":
    main()

