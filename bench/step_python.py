"""The engine thread's CPU per decode step outside the C kernels, cold and warm (a script, not a test; issue #35).

    python bench/step_python.py [--checkpoint ~/.cache/llamaserve/SmolLM2-135M-Instruct] [--dtype bfloat16]
                                [--streams 1] [--output-tokens 64] [--rounds 3] [--threads 1]

Loads the checkpoint as the server does, then runs rounds of --streams greedy requests (random
prompts, end of sequence ignored) through EngineCore.step() on the engine thread, alternating two
modes per round:
- cold: the real step. Per pure-decode step it records the engine thread's CPU time (thread_time) less
  that spent in the compiled decode step's C call, the output head and the sampler's argmax: what is
  left is the step's Python (scheduler, step inputs, attention metadata, module calls, sampler,
  detokenizer, stats), run right after the forward streamed the weights through every cache;
- warm: the same Python with the decode step's C call a no-op and the head returning fixed logits (one
  token per row): no weights stream between two steps, so what it costs with warm caches.
Prints the medians in us. The difference is what the forward's pass over the weights costs the Python
after it (bench/NOTES.md 'The engine thread's Python per decode step'). To compare two trees, run
this script from each (copy it there) in alternation; CPU time is steadier than wall on a shared machine.
Models without a compiled decode step (quantized, op by op) are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.loader import load_engine  # noqa: E402
from one_stream import request  # noqa: E402
from server.model_spec import ModelSpec  # noqa: E402


class KernelClock:
    """Engine-thread CPU inside the step's C calls, summed per step; the warm mode's stand-ins."""

    def __init__(self, engine) -> None:
        model = engine.runner._workers._shard.model
        self.step = model.decode_step
        if self.step is None:
            raise SystemExit("this model has no compiled decode step: nothing to tell the Python from")
        self.seconds = 0.0
        self.warm = False
        self._vocab = engine.core.vocab_size
        self._fixed: dict[int, torch.Tensor] = {}
        step_fn, head_forward = self.step._fn, model.output.forward
        kernels = engine.runner._sampler._kernels
        self.step._fn = lambda *args: 0 if self.warm else self._timed(step_fn, *args)
        model.output.forward = lambda x: self._fixed_logits(x.shape[0]) if self.warm else self._timed(head_forward, x)
        if kernels is not None:
            argmax = kernels._lib.argmax_rows
            kernels._lib.argmax_rows = lambda *args: self._timed(argmax, *args)

    def _timed(self, fn, *args):
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.seconds += time.thread_time() - started

    def _fixed_logits(self, rows: int) -> torch.Tensor:
        """Logits whose every row picks its own token from the vocabulary's middle (plain text for the
        detokenizer, clear of the special tokens at either end)."""
        if rows not in self._fixed:
            logits = torch.zeros(rows, self._vocab)
            logits[torch.arange(rows), (self._vocab // 2 + torch.arange(rows)) % self._vocab] = 1.0
            self._fixed[rows] = logits
        return self._fixed[rows]


def run_round(engine, clock: KernelClock, reqs, out: list[float]) -> None:
    """Every pure-decode step of all --streams sequences at once: its CPU less its kernels'."""
    core = engine.core
    for req in reqs:
        core.add_request(req)
    while core.has_unfinished:
        running = core.scheduler.running
        decode = len(running) == len(reqs) and all(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in running)
        clock.seconds = 0.0
        started = time.thread_time()
        core.step()
        if decode:
            out.append(time.thread_time() - started - clock.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="~/.cache/llamaserve/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    checkpoint = Path(args.checkpoint).expanduser()
    engine = load_engine(ModelSpec(model_id=checkpoint.name, checkpoint_dir=checkpoint, trusted=True),
                         EngineConfig(dtype=args.dtype, max_seq_len=max(1024, args.prompt_tokens + args.output_tokens)))
    clock = KernelClock(engine)
    results: dict[str, list[float]] = {"cold": [], "warm": []}
    vocab = engine.core.vocab_size

    def rounds() -> None:
        torch.set_num_threads(args.threads)  # the engine thread's own team
        run_round(engine, clock, [request(-1, args.prompt_tokens, 8, vocab)], [])  # warm-up
        for r in range(2 * args.rounds):
            mode = ("cold", "warm")[r % 2]
            clock.warm = mode == "warm"
            reqs = [request(1000 * r + k, args.prompt_tokens, args.output_tokens, vocab) for k in range(args.streams)]
            run_round(engine, clock, reqs, results[mode])

    async def session() -> None:
        await engine._on_engine_thread(rounds)
        await engine.shutdown()

    asyncio.run(session())
    cold, warm = (statistics.median(results[m]) * 1e6 for m in ("cold", "warm"))
    print(f"{args.streams} streams {args.dtype}, {args.threads} thread(s), {len(results['cold'])} decode steps a mode: "
          f"engine-thread CPU per decode step outside the kernels, median: cold {cold:.0f} us, warm {warm:.0f} us")


if __name__ == "__main__":
    main()
