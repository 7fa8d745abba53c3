"""What constrained decoding costs (a script, not a test).

    python bench/structured.py [--batch 32] [--steps 24] [--threads N]

On the demo model (SmolLM2-135M-Instruct, `python -m server --demo`'s weights, tokenizer.json with
49152 tokens), driving EngineCore directly:
1. decode step time at batch 32 with 0%, 50% and 100% of the rows constrained by a JSON schema
   (median over the steps where every row is decoding), and what the grammar adds;
2. the grammar's own share: computing and applying the masks of 32 rows in mid-document states
   (the sampler's hook alone, on random logits), against the unconstrained step;
3. grammar compile time for a typical schema: the first constrained request of a model (builds
   llguidance's view of the vocabulary, then compiles), a new schema after that, a cached one.
The schema asks for a list of at least 20 nested objects, so no constrained row finishes early.
Numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.loading.checkpoint import resolve_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.loading.demo import DEMO_MODEL_ID, ensure_demo_checkpoint  # noqa: E402
from engine.executor.worker_group import WorkerGroup  # noqa: E402
from engine.loader import load_tokenizer_and_chat_format  # noqa: E402
from engine.executor.executor import ModelExecutor  # noqa: E402
from engine.core.sampler import _apply_grammar_masks  # noqa: E402
from engine.core.structured import GrammarCompiler  # noqa: E402
from engine.types import EngineRequest, GrammarSpec, SamplingParams  # noqa: E402

MAX_SEQ_LEN = 1024
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"anyOf": [{"type": "null"}, {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"], "additionalProperties": False}]},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 20}},
          "required": ["people"], "additionalProperties": False}


def make_core(directory: Path, batch: int) -> EngineCore:
    spec = resolve_checkpoint(directory, model_id=DEMO_MODEL_ID)
    tokenizer, _ = load_tokenizer_and_chat_format(spec, None)
    config = EngineConfig(dtype="float32", max_batch_size=batch, max_num_batched_tokens=2048, kv_cache_bytes=512 << 20,
                          max_seq_len=MAX_SEQ_LEN)
    runner = ModelExecutor(WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN))
    return EngineCore(runner, tokenizer, config, MAX_SEQ_LEN)


def decode_step_s(core: EngineCore, batch: int, num_constrained: int, steps: int) -> float:
    """Median wall time of the steps where all `batch` rows decode."""
    prompt = core.tokenizer.encode("List twenty people as JSON, with their name, age, role, tags and address.")
    spec = GrammarSpec("json", json.dumps(PEOPLE))
    for i in range(batch):
        params = SamplingParams(temperature=0.7, seed=i, max_tokens=steps + 4, ignore_eos=True,
                                grammar=spec if i < num_constrained else None)
        core.add_request(EngineRequest(f"r{num_constrained}-{i}", prompt + [i], params))  # distinct last token
    times = []
    while core.has_unfinished:
        all_decoding = core.scheduler.num_running == batch and all(s.num_uncomputed_tokens == 1 for s in core.scheduler.running)
        started = time.perf_counter()
        core.step()
        if all_decoding:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def mask_s(core: EngineCore, batch: int, repeats: int = 20) -> float:
    """Median time of one step's mask work for `batch` rows at staggered points of a valid document."""
    person = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"],
              "address": {"street": "12 St James Square", "city": "London", "zip": "SW1Y 4JH"}}
    document = core.tokenizer.encode(json.dumps({"people": [person] * 3}))
    spec = GrammarSpec("json", json.dumps(PEOPLE))
    compiled = core.grammars.compile(spec)
    states = [core.grammars.new_state(compiled) for _ in range(batch)]
    for k, state in enumerate(states):
        for token in document[: 3 + k * (len(document) - 4) // batch]:
            if not state.accept(token):
                raise RuntimeError(f"the sample document does not tokenize into the grammar: {state.error}")
    logits = torch.randn(batch, core.vocab_size)
    times = []
    for _ in range(repeats):
        x = logits.clone()
        started = time.perf_counter()
        _apply_grammar_masks(x, list(range(batch)), states)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def compile_times(core: EngineCore) -> tuple[float, float, float]:
    compiler = GrammarCompiler(core.tokenizer, core.vocab_size, sorted(core.tokenizer.stop_token_ids))
    started = time.perf_counter()
    compiler.compile(GrammarSpec("json", json.dumps(PERSON)))
    first = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(GrammarSpec("json", json.dumps({**PERSON, "title": "another"})))
    new = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(GrammarSpec("json", json.dumps(PERSON)))
    return first, new, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="sequences decoding together (default 32)")
    parser.add_argument("--steps", type=int, default=24, help="decode steps measured per mix (default 24)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    directory = ensure_demo_checkpoint().checkpoint_dir
    core = make_core(directory, args.batch)
    first, new, cached = compile_times(core)
    print(f"compile, typical schema: first request {first * 1e3:.1f} ms (vocabulary view + compile), "
          f"new schema {new * 1e3:.2f} ms, cached {cached * 1e3:.3f} ms")
    core.grammars.compile(GrammarSpec("json", json.dumps(PEOPLE)))  # warm: the mix runs measure steps, not compiles
    decode_step_s(core, args.batch, 0, 4)  # warm up the kernels and the allocator
    base = None
    for share in (0.0, 0.5, 1.0):
        step_s = decode_step_s(core, args.batch, round(share * args.batch), args.steps)
        base = base or step_s
        print(f"batch {args.batch}, {share:4.0%} rows json_schema-constrained: step {step_s * 1e3:7.2f} ms "
              f"({(step_s / base - 1):+.1%} vs unconstrained)", flush=True)
    masks = mask_s(core, args.batch)
    print(f"masks of {args.batch} constrained rows alone (compute + apply): {masks * 1e3:.2f} ms "
          f"= {masks / base:.1%} of the unconstrained step")
    core.runner.shutdown()


if __name__ == "__main__":
    main()
