"""The server's own cost per streamed token and per request, with a fake engine that answers at once.

The server runs in a child process (uvloop, JSON access log to /dev/null, the real app and
middlewares); this process is the client. "Server time" is the child's CPU time (user + system,
from /proc) over the measured requests, so the client's own parsing is not counted and a busy
machine does not inflate it the way wall time would. The fake engine's own cost (building one
RequestOutput per token) is measured alone and shown beside it.

    python bench/server_overhead.py [--tokens 2000] [--streams 20] [--concurrency 4] [--requests 2000]
    python bench/server_overhead.py --engine async --tokens 64 --streams 128 --concurrency 32 --requests 0

Target: under 50 us of server time per streamed token.

--engine async serves the real AsyncEngine (its engine thread, scheduler, output pass, mailboxes and
hand-off) over tests/engine/fakes.FakeRunner (no model: next token = a hash of the context) instead
of the scripted FakeEngine, so `concurrency` streams step together as the served model's do, one
delta each per step; the CPU per token is then also split by thread (main: the event loop; the
engine thread: its bookkeeping, the fake runner included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one_char_per_token(request) -> list[str]:
    return ["x"] * (request.params.max_tokens or 1)


PACED_STEP_S = 0.02  # --engine async: each fake step's time, so that the event loop keeps up and sends every token


class AsyncFakeRunnerFactory:
    """EngineFactory handing out real AsyncEngines over a FakeRunner with tests/server's byte tokenizer."""

    def estimate_memory_bytes(self, spec) -> int:
        return 1 << 20

    async def load(self, spec):
        from engine.config import EngineConfig
        from engine.core.async_engine import AsyncEngine
        from tests.engine.fakes import FakeRunner
        from tests.server.fake_engine import FakeChatFormat, FakeTokenizer

        tokenizer = FakeTokenizer()
        # printable ASCII from a cheap function of the last token: no special token, so no early stop
        runner = FakeRunner(num_blocks=4096, block_size=16, vocab_size=tokenizer.vocab_size,
                            next_token=lambda context, vocab: 97 + (context[-1] + 1) % 26)
        execute = runner.execute

        def paced(batch):  # a model step's time, the GIL released, as a forward does; deltas come one a step
            time.sleep(PACED_STEP_S)
            return execute(batch)

        runner.execute = paced
        return AsyncEngine(spec.model_id, runner, tokenizer, FakeChatFormat(tokenizer), EngineConfig(),
                           max_seq_len=4096)


def serve(port: int, checkpoint_dir: str, engine: str = "fake") -> None:
    from aiohttp import web

    from server.__main__ import new_event_loop
    from server.app import create_app
    from server.config import ServerConfig
    from server.logging import configure_logging
    from tests.server.fake_engine import FakeEngineFactory, fake_spec

    configure_logging("json", "info", stream=open(os.devnull, "w"))
    config = ServerConfig(models=[fake_spec("fake", Path(checkpoint_dir))], checkpoint_roots=[Path(checkpoint_dir)],
                          max_batch_request_items=100_000)
    factory = AsyncFakeRunnerFactory() if engine == "async" else FakeEngineFactory(max_seq_len=1 << 20, script=one_char_per_token)
    web.run_app(create_app(config, factory), host="127.0.0.1", port=port, access_log=None, print=None,
                handler_cancellation=True, loop=new_event_loop())


def thread_cpu_s(pid: int) -> dict[str, float]:
    from bench.served_itl import thread_cpu_s as by_thread  # one reader of /proc's per-thread CPU

    return by_thread(pid)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def wait_ready(session, base: str) -> None:
    for _ in range(600):
        try:
            async with session.get(f"{base}/ready") as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.05)  # a bench polling a starting process; tests never do this
    raise RuntimeError("server did not become ready")


async def stream_once(session, base: str, num_tokens: int) -> int:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": num_tokens, "stream": True}
    chunks = 0
    async with session.post(f"{base}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: "):
                chunks += 1
    return chunks - 2  # the role chunk and [DONE]


async def request_once(session, base: str) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with session.post(f"{base}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        await response.read()


async def measure(pid: int, base: str, args: argparse.Namespace) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:
        await wait_ready(session, base)
        await stream_once(session, base, 10)  # warm up
        for _ in range(50):
            await request_once(session, base)

        semaphore = asyncio.Semaphore(args.concurrency)

        async def bounded(coro):
            async with semaphore:
                return await coro

        wall0, threads0 = time.perf_counter(), thread_cpu_s(pid)
        chunks = sum(await asyncio.gather(*(bounded(stream_once(session, base, args.tokens)) for _ in range(args.streams))))
        tokens = args.streams * args.tokens
        stream_wall = time.perf_counter() - wall0
        # schedstat's nanoseconds, not /proc/PID/stat's 10 ms ticks: a short run is still counted
        threads = {name: cpu_s - threads0.get(name, 0.0) for name, cpu_s in thread_cpu_s(pid).items()}
        stream_cpu = sum(threads.values())

        cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(bounded(request_once(session, base)) for _ in range(args.requests)))
        request_cpu, request_wall = cpu_seconds(pid) - cpu0, time.perf_counter() - wall0

    engine_s = await fake_engine_cost(args.tokens) if args.engine == "fake" else float("nan")
    print(f"streamed: {args.streams} streams x {args.tokens} tokens ({chunks} chunks), concurrency {args.concurrency}, "
          f"{args.engine} engine, load average {os.getloadavg()[0]:.2f}")
    print(f"  server CPU per streamed token: {stream_cpu / tokens * 1e6:7.1f} us  "
          f"(fake engine's own share: {engine_s * 1e6:.1f} us; target < 50 us)")
    for name, cpu_s in sorted(threads.items(), key=lambda item: -item[1])[:3]:
        print(f"    thread {name:24s} {cpu_s / tokens * 1e6:7.1f} us")
    print(f"  wall per streamed token:       {stream_wall / tokens * 1e6:7.1f} us  ({tokens / stream_wall:,.0f} tokens/s, client included)")
    if not args.requests:
        return
    print(f"non-streamed: {args.requests} chat requests of 1 token, concurrency {args.concurrency}")
    print(f"  server CPU per request:        {request_cpu / args.requests * 1e6:7.1f} us")
    print(f"  wall per request:              {request_wall / args.requests * 1e6:7.1f} us  ({args.requests / request_wall:,.0f} requests/s)")


async def fake_engine_cost(num_tokens: int) -> float:
    """Seconds per token the FakeEngine itself spends: subtract it to get the server's share."""
    from engine.types import EngineRequest, SamplingParams
    from tests.server.fake_engine import FakeEngine

    engine = FakeEngine(max_seq_len=1 << 20, script=one_char_per_token)
    request = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=num_tokens))
    start = time.process_time()
    count = 0
    for _ in range(5):
        async for _output in engine.generate(request):
            count += 1
    return (time.process_time() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per streamed request")
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000, help="non-streamed requests")
    parser.add_argument("--engine", choices=("fake", "async"), default="fake",
                        help="fake: scripted outputs; async: the real AsyncEngine over a FakeRunner")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.checkpoint_dir, args.engine)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        child = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--checkpoint-dir", checkpoint_dir,
                                  "--engine", args.engine])
        try:
            asyncio.run(measure(child.pid, f"http://127.0.0.1:{port}", args))
        finally:
            child.terminate()
            child.wait(timeout=30)


if __name__ == "__main__":
    main()
