"""Offline throughput of the Batch API against the other ways to send an eval, and what a running
batch does to online latency (a script, not a test).

    python bench/batch.py                       # starts `python -m server --demo` on a free port
    python bench/batch.py --url http://localhost:8000 --model SmolLM2-135M-Instruct
    python bench/batch.py --tiny                # a tiny random checkpoint and a few prompts (smoke test)

Workload: --prompts eval-style completion prompts (arithmetic and multiple-choice questions, each
different), greedy, --max-tokens tokens out each (end of sequence ignored, so every mode generates
the same number of tokens). Each is sent four ways and timed end to end:
1. the Batch API: upload a JSONL file, create a batch, poll until completed, download the output;
2. `/v1/batch/completions`: one request carrying every prompt;
3. one request at a time (the first --sequential-limit prompts; its tokens/s is what counts);
4. concurrent requests, at most --concurrency in flight.
Reported: wall time, output tokens/s, and each mode's speedup over one at a time. Then online time
to first token (streamed completions, one at a time, up to --ttft-probes of them; under a load only
those sent while it still runs, so the table gives their count) on the idle server, while
a Batch API batch runs (items run below online priority and are preempted for online requests; at
most --batch-max-in-flight of them in the engine, by default enough to fill it), and while a
`/v1/batch/completions` request of the same prompts runs (same priority as online). Numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = "SmolLM2-135M-Instruct"
TINY_MODEL = "tiny-batch-bench"
TINY_DESCRIPTOR = "Llama3.2-1B-Instruct"  # the tiny checkpoint's family (tokenizer, chat format)
READY_TIMEOUT_S = 600.0
BATCH_TIMEOUT_S = 3600.0
POLL_S = 0.1
Load = tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[bool]]]  # a background load: (stop it, is it over)


# --------------------------------------------------------------------------- workload
def eval_prompts(count: int) -> list[str]:
    """Eval-harness-style prompts, all different (no shared prefix beyond a few tokens)."""
    subjects = ["chemistry", "history", "geometry", "biology", "economics", "law", "astronomy", "music"]
    prompts = []
    for i in range(count):
        a, b = 17 + 7 * i, 3 + (i * 13) % 89
        if i % 2 == 0:
            prompts.append(f"{i}. Question: What is {a} plus {b}?\nAnswer:")
        else:
            subject = subjects[i % len(subjects)]
            prompts.append(f"{i}. The following is a multiple choice question about {subject}.\n"
                           f"Which number is the largest?\nA. {a}\nB. {b}\nC. {a + b}\nD. {abs(a - b)}\nAnswer:")
    return prompts


@dataclass
class Result:
    name: str
    num_prompts: int
    wall_s: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


class Bench:
    def __init__(self, base: str, model: str, args: argparse.Namespace) -> None:
        self.base = base
        self.model = model
        self.args = args

    def body(self, prompt: str, **extra: Any) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
                "ignore_eos": True, **extra}

    async def _post(self, session: aiohttp.ClientSession, path: str, **kwargs: Any) -> Any:
        async with session.post(self.base + path, **kwargs) as response:
            data = await response.json()
            if response.status != 200:
                raise RuntimeError(f"POST {path}: HTTP {response.status}: {data}")
            return data

    async def _get(self, session: aiohttp.ClientSession, path: str) -> Any:
        async with session.get(self.base + path) as response:
            if response.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {response.status}: {await response.text()}")
            return await response.json() if response.content_type == "application/json" else await response.read()

    # ------------------------------------------------------------------ the four modes
    async def one_by_one(self, session: aiohttp.ClientSession, prompts: list[str]) -> Result:
        tokens = 0
        started = time.perf_counter()
        for prompt in tqdm(prompts, desc="one at a time", leave=False):
            tokens += (await self._post(session, "/v1/completions", json=self.body(prompt)))["usage"]["completion_tokens"]
        return Result("one request at a time", len(prompts), time.perf_counter() - started, tokens)

    async def concurrent(self, session: aiohttp.ClientSession, prompts: list[str]) -> Result:
        gate = asyncio.Semaphore(self.args.concurrency)
        progress = tqdm(total=len(prompts), desc=f"concurrent ({self.args.concurrency})", leave=False)

        async def one(prompt: str) -> int:
            async with gate:
                data = await self._post(session, "/v1/completions", json=self.body(prompt))
            progress.update()
            return data["usage"]["completion_tokens"]

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        progress.close()
        return Result(f"concurrent requests ({self.args.concurrency} in flight)", len(prompts),
                      time.perf_counter() - started, tokens)

    async def batch_endpoint(self, session: aiohttp.ClientSession, prompts: list[str]) -> Result:
        body = {"model": self.model, "prompts": prompts, "max_tokens": self.args.max_tokens, "temperature": 0,
                "ignore_eos": True}
        started = time.perf_counter()
        data = await self._post(session, "/v1/batch/completions", json=body)
        wall_s = time.perf_counter() - started
        errors = [item["error"] for item in data["data"] if item.get("error")]
        if errors:
            raise RuntimeError(f"/v1/batch/completions: {len(errors)} items failed, e.g. {errors[0]}")
        return Result("/v1/batch/completions", len(prompts), wall_s, data["usage"]["completion_tokens"])

    async def submit_batch(self, session: aiohttp.ClientSession, prompts: list[str]) -> str:
        lines = [json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                             "body": self.body(prompt)}) for i, prompt in enumerate(prompts)]
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", ("\n".join(lines) + "\n").encode(), filename="eval.jsonl")
        file = await self._post(session, "/v1/files", data=form)
        batch = await self._post(session, "/v1/batches", json={"input_file_id": file["id"], "completion_window": "24h",
                                                               "endpoint": "/v1/completions"})
        return batch["id"]

    async def batch_api(self, session: aiohttp.ClientSession, prompts: list[str]) -> Result:
        started = time.perf_counter()
        batch_id = await self.submit_batch(session, prompts)
        progress = tqdm(total=len(prompts), desc="Batch API", leave=False)
        deadline = time.monotonic() + BATCH_TIMEOUT_S
        while True:
            batch = await self._get(session, f"/v1/batches/{batch_id}")
            counts = batch["request_counts"]
            progress.update(counts["completed"] + counts["failed"] - progress.n)
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} did not finish in {BATCH_TIMEOUT_S} s")
            await asyncio.sleep(POLL_S)
        progress.close()
        if batch["status"] != "completed" or counts["failed"]:
            raise RuntimeError(f"batch {batch_id}: {batch['status']}, {counts}, errors {batch.get('errors')}")
        output = await self._get(session, f"/v1/files/{batch['output_file_id']}/content")
        wall_s = time.perf_counter() - started
        tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in output.splitlines())
        return Result("Batch API (upload, run, download)", len(prompts), wall_s, tokens)

    # ------------------------------------------------------------------ online TTFT
    async def ttft_s(self, session: aiohttp.ClientSession, prompt: str) -> float:
        """Time to the first streamed token of one online completion."""
        started = time.perf_counter()
        body = self.body(prompt, stream=True, max_tokens=2)
        async with session.post(self.base + "/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"TTFT probe: HTTP {response.status}: {await response.text()}")
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    first_s = time.perf_counter() - started
                    break
            else:
                raise RuntimeError("TTFT probe: no token streamed")
        return first_s

    async def probes(self, session: aiohttp.ClientSession, label: str, offset: int,
                     finished: Callable[[], Awaitable[bool]] | None = None) -> list[float]:
        """TTFT samples, one at a time; with `finished`, only while the load still runs (later
        probes would measure an idle server)."""
        samples = []
        for prompt in tqdm(eval_prompts(offset + self.args.ttft_probes)[offset:], desc=f"TTFT {label}", leave=False):
            if finished is not None and await finished():
                break
            samples.append(await self.ttft_s(session, prompt))
        return samples

    async def probes_under(self, session: aiohttp.ClientSession, label: str, offset: int,
                           start_load: Callable[[], Awaitable[Load]]) -> list[float]:
        stop, finished = await start_load()
        try:
            return await self.probes(session, label, offset, finished)
        finally:
            await stop()

    async def running_batch(self, session: aiohttp.ClientSession, prompts: list[str]) -> Load:
        batch_id = await self.submit_batch(session, prompts)
        while (await self._get(session, f"/v1/batches/{batch_id}"))["status"] == "validating":
            await asyncio.sleep(POLL_S)
        async def finished() -> bool:
            status = (await self._get(session, f"/v1/batches/{batch_id}"))["status"]
            return status in ("completed", "failed", "cancelled", "expired")

        await self.wait_running(finished)

        async def stop() -> None:
            # The batch can reach finalizing between the last poll and this cancel; the server
            # then refuses the cancel, and there is nothing left to stop.
            async with session.post(f"{self.base}/v1/batches/{batch_id}/cancel") as response:
                data = await response.json()
            if response.status != 200 and data.get("error", {}).get("code") != "batch_not_cancellable":
                raise RuntimeError(f"POST /v1/batches/{batch_id}/cancel: HTTP {response.status}: {data}")
        return stop, finished

    async def running_batch_endpoint(self, session: aiohttp.ClientSession, prompts: list[str]) -> Load:
        body = {"model": self.model, "prompts": prompts, "max_tokens": self.args.max_tokens, "temperature": 0,
                "ignore_eos": True}
        task = asyncio.create_task(self._post(session, "/v1/batch/completions", json=body))

        async def finished() -> bool:
            return task.done()

        await self.wait_running(finished)

        async def stop() -> None:
            task.cancel()  # the client leaves: the server aborts the rest
            await asyncio.gather(task, return_exceptions=True)
        return stop, finished

    async def wait_running(self, finished: Callable[[], Awaitable[bool]]) -> None:
        """Until the engine has requests running (read from /metrics), or the load is already over."""
        async with aiohttp.ClientSession() as session:
            while not await finished():
                async with session.get(self.base + "/metrics") as response:
                    text = await response.text()
                running = [line for line in text.splitlines() if line.startswith("llamaserve:num_requests_running{")]
                if any(float(line.rsplit(" ", 1)[1]) > 0 for line in running):
                    return
                await asyncio.sleep(POLL_S)


# --------------------------------------------------------------------------- report
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(results: list[Result], ttfts: dict[str, list[float]]) -> None:
    baseline = next(r for r in results if r.name.startswith("one request"))
    print(f"\n{'mode':44} {'prompts':>7} {'wall s':>8} {'out tok/s':>10} {'speedup':>8}")
    for r in results:
        print(f"{r.name:44} {r.num_prompts:7d} {r.wall_s:8.2f} {r.tokens_per_s:10.1f} "
              f"{r.tokens_per_s / baseline.tokens_per_s:7.2f}x")
    idle = percentile(ttfts["idle server"], 50)
    print(f"\n{'online TTFT':44} {'probes':>7} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs idle':>12}")
    for label, values in ttfts.items():
        if not values:  # the load was over before the first probe: a larger --prompts keeps it running
            print(f"{label:44} {0:7d} {'-':>8} {'-':>8} {'-':>12}")
            continue
        print(f"{label:44} {len(values):7d} {1000 * percentile(values, 50):8.1f} {1000 * percentile(values, 99):8.1f} "
              f"{percentile(values, 50) / idle:11.2f}x")


async def run(base: str, model: str, args: argparse.Namespace) -> None:
    bench = Bench(base, model, args)
    prompts = eval_prompts(args.prompts)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await bench.one_by_one(session, prompts[:2])  # warm up (kernels, allocator)
        results = [
            await bench.batch_api(session, prompts),
            await bench.batch_endpoint(session, prompts),
            await bench.one_by_one(session, prompts[: args.sequential_limit]),
            await bench.concurrent(session, prompts),
        ]
        offset = args.prompts
        ttfts = {"idle server": await bench.probes(session, "idle", offset)}
        offset += args.ttft_probes
        ttfts["while a Batch API batch runs"] = await bench.probes_under(
            session, "under Batch API", offset, lambda: bench.running_batch(session, prompts))
        offset += args.ttft_probes
        ttfts["while /v1/batch/completions runs"] = await bench.probes_under(
            session, "under /v1/batch/completions", offset, lambda: bench.running_batch_endpoint(session, prompts))
    report(results, ttfts)


# --------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_checkpoint(out: Path) -> Path:
    """A random 2-layer Llama 3 checkpoint with the real tokenizer (llama-models, a dev dependency)."""
    import importlib.util

    import torch

    sys.path.insert(0, str(ROOT))
    from engine.loading.checkpoint import write_random_checkpoint
    from engine.models.args import ModelArgs

    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--tiny needs llama-models (pip install -e '.[dev]') or --checkpoint-dir")
    tokenizer = Path(list(spec.submodule_search_locations)[0]) / "llama3" / "tokenizer.model"
    params = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128256, multiple_of=32,
                       ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True)
    return write_random_checkpoint(out / TINY_MODEL, params, seed=0, tokenizer_path=tokenizer, dtype=torch.float32)


def server_command(args: argparse.Namespace, port: int, work: Path) -> tuple[list[str], str]:
    command = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
               "--batch-dir", str(work / "batches"), "--max-batch-request-items", str(max(256, args.prompts))]
    if args.batch_max_in_flight is not None:
        command += ["--batch-max-in-flight", str(args.batch_max_in_flight)]
    if args.checkpoint_dir is None and not args.tiny:
        return command + ["--demo"], DEMO_MODEL
    checkpoint = args.checkpoint_dir or tiny_checkpoint(work)
    model = args.model or TINY_MODEL
    return command + ["--model", model, "--checkpoint-dir", str(checkpoint), "--llama-model", TINY_DESCRIPTOR,
                      "--cpu-kv-cache-bytes", "64MiB", "--max-seq-len", "1024"], model


async def wait_ready(base: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"the server exited with status {process.returncode}")
            try:
                async with session.get(base + "/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(POLL_S)
    raise SystemExit(f"{base} not ready after {READY_TIMEOUT_S} s")


async def with_server(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        work = Path(tmp)
        port = free_port()
        command, model = server_command(args, port, work)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMASERVE_")}
        if args.threads is not None:
            env["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in the server
        with open(work / "server.log", "wb") as log:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_ready(base, process)
            await run(base, model, args)
        finally:
            process.terminate()
            process.wait(timeout=60)
            if process.returncode not in (0, -15):
                print((work / "server.log").read_text()[-4000:], file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", help="model id (default: the demo model, or the tiny one)")
    parser.add_argument("--checkpoint-dir", type=Path, help="serve this Meta checkpoint instead of the demo model")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random checkpoint and a small workload: a smoke test in seconds")
    parser.add_argument("--prompts", type=int, help="prompts per mode (default 256; --tiny 6)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per prompt (default 32; --tiny 4)")
    parser.add_argument("--sequential-limit", type=int, help="prompts sent one at a time (default 64; --tiny 3)")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent requests in flight")
    parser.add_argument("--ttft-probes", type=int, help="online TTFT samples per condition (default 40; --tiny 3)")
    parser.add_argument("--batch-max-in-flight", type=int, help="the started server's --batch-max-in-flight")
    parser.add_argument("--threads", type=int, help="the started server's torch threads (default: torch's choice); "
                        "1 keeps numbers sane on a machine other processes load")
    args = parser.parse_args(argv)
    small = args.tiny
    for name, full, tiny in (("prompts", 256, 6), ("max_tokens", 32, 4), ("sequential_limit", 64, 3),
                             ("ttft_probes", 40, 3)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if small else full)
    args.sequential_limit = min(args.sequential_limit, args.prompts)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup: stop the server we started
    if args.url:
        asyncio.run(run(args.url.rstrip("/"), args.model or DEMO_MODEL, args))
    else:
        asyncio.run(with_server(args))


if __name__ == "__main__":
    main()
