"""One stream's time per token in-process, in pieces (a script, not a test; issue #35).

    python bench/one_stream.py [--checkpoint ~/.cache/llamaserve/SmolLM2-135M-Instruct] [--dtype float32]
                               [--rounds 3] [--prompt-tokens 128] [--output-tokens 64] [--streams 1]

Loads the checkpoint as the server does (engine.loader.load_engine: an AsyncEngine whose engine
thread owns the model's OpenMP team), then runs one greedy request (random prompt ids, end of
sequence ignored) two ways per round, interleaved:
- core: EngineCore.step() in a loop on the engine thread itself (no event loop; the same OpenMP team);
- async: AsyncEngine.generate() consumed by a coroutine on a uvloop, as a server handler consumes it.
Every decode step records its wall and engine-thread CPU time and those of the forward with its head
(WorkerGroup.execute) inside it; the rest of the step is its Python (step inputs, sampling,
scheduler, detokenizer, stats). In async mode it also records the engine thread's time between two
steps (its loop: inbox, routing, call_soon_threadsafe) and the hand-off: the engine thread's send to
the coroutine's receipt. Printed per round: medians in ms, and the token-to-token gap the consumer
sees (core: step starts); then the step's parts in engine-thread CPU ms (build_step_inputs, the
sampler, scheduler.schedule and .update, the output pass) and the engine thread's voluntary context
switches per token: each is a wait, in async mode for the GIL while the event loop handles the
token (none in core mode). --streams N runs N requests at once each way (the step parts are then
those of the pure-decode steps of N sequences; hand-off and gaps are the first request's). Wall figures on a shared machine are noisy: the load average is printed
with them; CPU figures are the steadier.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.loader import load_engine  # noqa: E402
from engine.types import EngineRequest, SamplingParams  # noqa: E402
from server.model_spec import ModelSpec  # noqa: E402


def voluntary_switches() -> int:
    """This thread's voluntary context switches so far: each is a wait (for the GIL, a lock, the OpenMP
    team's futex), unlike the involuntary ones a busy machine adds."""
    with open("/proc/thread-self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


class Probe:
    """Per-step stamps, written on the engine thread only."""

    def __init__(self, engine) -> None:
        self.rows: list[dict[str, float]] = []
        self.sends: list[float] = []  # perf_counter right before each call_soon_threadsafe
        self._row: dict[str, float] = {}
        core, executor = engine.core, engine.runner
        # the parts of a step, in engine-thread CPU seconds (the forward's also in wall seconds)
        self._wrap(executor._workers, "execute", "forward")
        self._wrap(executor._sampler, "sample", "sample")
        self._wrap(core.scheduler, "schedule", "schedule", note_batch=True)
        self._wrap(core.scheduler, "update", "update")
        self._wrap(core.output, "process", "output")
        executor_module = sys.modules[type(executor).__module__]
        self._wrap(executor_module, "build_step_inputs", "inputs")
        step, send = core.step, engine._send

        def timed_step():
            switches = voluntary_switches()  # read before the clock starts: /proc costs a few us
            self._row = {"start": time.perf_counter(), "switches": switches}
            cpu = time.thread_time()
            out = step()
            self._row["step_cpu"] = time.thread_time() - cpu
            self._row["end"] = time.perf_counter()
            self._row["step_wall"] = self._row["end"] - self._row["start"]
            if out:
                self.rows.append(self._row)
            return out

        def timed_send(items):
            if items:
                self.sends.append(time.perf_counter())
            return send(items)

        core.step, engine._send = timed_step, timed_send

    def _wrap(self, owner, name: str, label: str, note_batch: bool = False) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            result = None
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                self._row[f"{label}_wall"] = time.perf_counter() - wall
                self._row[f"{label}_cpu"] = time.thread_time() - cpu
                if note_batch and result is not None:  # a step of one new token per sequence: a pure decode
                    self._row["decode"] = float(all(n == 1 for n in result.num_new_tokens))

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.rows, self.sends = [], []


PARTS = ("inputs", "sample", "schedule", "update", "output")


def request(i: int, prompt_tokens: int, output_tokens: int, vocab_size: int) -> EngineRequest:
    rng = random.Random(i)
    ids = [rng.randrange(vocab_size // 8, vocab_size - vocab_size // 8) for _ in range(prompt_tokens)]  # clear of the specials
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    return EngineRequest(request_id=f"bench-{i}", prompt_token_ids=ids, params=params)


def run_core(engine, reqs: list[EngineRequest]) -> None:
    """The synchronous loop, on the engine thread (through the engine's between-steps call)."""
    core = engine.core
    for req in reqs:
        core.add_request(req)
    while core.has_unfinished:
        core.step()


async def run_async(engine, reqs: list[EngineRequest]) -> list[float]:
    """The requests consumed at once, one coroutine each; the first one's arrival times."""
    async def consume(req: EngineRequest) -> list[float]:
        arrivals = []
        async for _ in engine.generate(req):
            arrivals.append(time.perf_counter())
        return arrivals

    return (await asyncio.gather(*(consume(req) for req in reqs)))[0]


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def gap_ms(gaps: list[float]) -> str:
    """Median and mean of the gaps, or why there are none: on a busy machine a consumer can take a short
    request's tokens in one or two wake-ups, leaving no gap between arrivals to measure."""
    if not gaps:
        return "n/a (tokens arrived together)"
    return f"{median_ms(gaps):6.2f} (mean {statistics.mean(gaps) * 1e3:6.2f})"


def report(mode: str, rows: list[dict[str, float]], arrivals: list[float] | None, sends: list[float]) -> None:
    decode = [r for r in rows if r.get("decode")]  # the prompt steps left out
    step_wall = [r["step_wall"] for r in decode]
    fwd_wall = [r["forward_wall"] for r in decode]
    rest_wall = [r["step_wall"] - r["forward_wall"] for r in decode]
    rest_cpu = [r["step_cpu"] - r["forward_cpu"] for r in decode]
    between = [b["start"] - a["end"] for a, b in zip(decode, decode[1:])]
    switches = [b["switches"] - a["switches"] for a, b in zip(decode, decode[1:])]
    gaps = [b["start"] - a["start"] for a, b in zip(decode, decode[1:])]
    line = (f"{mode:5s} forward {median_ms(fwd_wall):6.2f}  step {median_ms(step_wall):6.2f}  step - forward "
            f"{median_ms(rest_wall):5.2f} wall {median_ms(rest_cpu):5.2f} cpu  between steps {median_ms(between):5.2f}")
    if arrivals is not None:
        handoff = [a - s for s, a in zip(sends[1:], arrivals[1:])]
        consumer = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]
        line += f"  hand-off {median_ms(handoff):5.3f}  consumer gap {gap_ms(consumer)}"
    else:
        line += f"  step-start gap {gap_ms(gaps)}"
    print(line, flush=True)
    print("      step parts, cpu ms: " + "  ".join(f"{part} {median_ms([r.get(part + '_cpu', 0.0) for r in decode]):.3f}"
                                             for part in PARTS)
          + f"  engine-thread waits/token {statistics.mean(switches):.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="~/.cache/llamaserve/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=1, help="requests at once")
    args = parser.parse_args()
    import uvloop

    checkpoint = Path(args.checkpoint).expanduser()
    engine = load_engine(ModelSpec(model_id=checkpoint.name, checkpoint_dir=checkpoint, trusted=True),  # a descriptor names the family
                         EngineConfig(dtype=args.dtype, max_seq_len=max(1024, args.prompt_tokens + args.output_tokens)))
    probe = Probe(engine)
    print(f"threads {__import__('torch').get_num_threads()}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", flush=True)

    async def rounds() -> None:
        vocab = engine.core.vocab_size
        await run_async(engine, [request(-1, args.prompt_tokens, 8, vocab)])  # warm-up

        def batch(r: int) -> list[EngineRequest]:  # round r's requests, fresh prompts
            return [request(1000 * r + k, args.prompt_tokens, args.output_tokens, vocab) for k in range(args.streams)]

        for r in range(args.rounds):
            print(f"round {r}: load average {os.getloadavg()[0]:.2f}", flush=True)
            probe.reset()
            await engine._on_engine_thread(lambda: run_core(engine, batch(2 * r)))
            report("core", probe.rows, None, [])
            probe.reset()
            arrivals = await run_async(engine, batch(2 * r + 1))
            report("async", probe.rows, arrivals, probe.sends)
        await engine.shutdown()

    loop = uvloop.new_event_loop()  # what the server runs (server/__main__.py new_event_loop)
    try:
        loop.run_until_complete(rounds())
    finally:
        loop.close()


if __name__ == "__main__":
    main()
