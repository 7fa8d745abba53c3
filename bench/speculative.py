"""Speculative decoding at one stream on text the prompt already contains (a script, not a test).

    python bench/speculative.py [--rounds 2] [--max-tokens 160] [--servers llamaserve,llama-server]
    python bench/speculative.py --smoke          # in-process, a tiny random model: checks the script runs
    python bench/speculative.py --in-process     # in-process EngineCore on the demo: step costs by kind

Each request asks the demo model (SmolLM2-135M-Instruct, greedy) to copy a document from its prompt
(prose, code, a quoted paragraph), so prompt lookup finds most of the answer. Per server it measures
output tok/s (completion tokens over the request's wall time, one request at a time) without and with
speculation: ours with `--speculative-config` (ngram, k = --k), llama-server with its own lookup
decoding (`--llama-spec-args`, by default `--spec-type ngram-simple --spec-draft-n-max K` (llama.cpp 0.3.36 removed --draft-max): older llama.cpp builds
spell it differently, e.g. `--lookup-ngram-min` or a draft model `-md FILE --draft-max K`). Servers run one
at a time, configurations alternate per round, and our acceptance rate is read from /metrics. The issue's
target: ours with speculation >= 1.5x ours without, and ahead of llama-server with its lookup decoding.

--in-process runs EngineCore on the demo model in this process (no HTTP; --threads torch threads) over
the same chat prompts, and adds what the gain is made of: the median plain decode step, the median
verify step (a step in which a sequence speculated) and their ratio, in wall and CPU time (on a shared
machine compare the CPU times at --threads 1), and tokens per verify step. With
acceptance a and k drafts a verify step yields about 1 + a*k tokens, so speculation gains while the
verify step costs less than that many plain steps.

--smoke runs EngineCore in-process over a tiny random checkpoint in float64 (so greedy tokens with and
without speculation compare exactly; random weights copy nothing, so
acceptance is low there: it shows the plumbing, not the gain). Figures from a busy machine are noise;
take real ones on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DOCUMENTS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, trimmed the "
    "wick, and polished the great lens until it shone. Ships passing in the night never saw him, but they trusted "
    "the light, and the light was there because he was. When the storms came in November he stayed awake for "
    "three nights in a row, writing the weather in a small leather book.",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n    result.extend(right[j:])\n"
    "    return result\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place mainly in the leaves, inside chloroplasts, which contain the pigment chlorophyll. "
    "The light reactions capture energy, and the Calvin cycle uses that energy to fix carbon into sugar.",
]
INSTRUCTIONS = ["Repeat the following text exactly, word for word:\n\n{doc}",
                "Copy this code exactly as written, with no explanation:\n\n{doc}",
                "Quote the following paragraph verbatim:\n\n{doc}"]


def prompts() -> list[str]:
    return [INSTRUCTIONS[i % len(INSTRUCTIONS)].format(doc=doc) for i, doc in enumerate(DOCUMENTS)]


# --------------------------------------------------------------------------- served
async def chat_once(base: str, model: str, text: str, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of one greedy chat completion on a fresh connection."""
    import aiohttp

    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(base + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{base}: HTTP {response.status}: {(await response.text())[:300]}")
            reply = await response.json()
    return reply["usage"]["completion_tokens"], time.perf_counter() - started


async def acceptance(base: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/metrics") as response:
            text = await response.text()
    drafted = sum(float(v) for v in re.findall(r"^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)", text, re.M))
    accepted = sum(float(v) for v in re.findall(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)", text, re.M))
    return f"acceptance {accepted / drafted:.2f} ({accepted:.0f}/{drafted:.0f})" if drafted else "no drafts"


async def measure(base: str, model: str, max_tokens: int) -> float:
    await chat_once(base, model, "Say hi.", 4)  # warm up
    tokens = seconds = 0.0
    for text in prompts():
        n, s = await chat_once(base, model, text, max_tokens)
        tokens, seconds = tokens + n, seconds + s
    return tokens / seconds


async def served(args: argparse.Namespace) -> None:
    from bench.demo_vs_llamacpp import (
        free_port, llama_server_binary, peer_gguf, start_llama_server, start_ours, stop, wait_ready,
    )
    from engine.loading.demo import default_cache_dir

    cache_dir = Path(args.demo_cache_dir or default_cache_dir())
    ngram = (f'{{"method": "ngram", "num_speculative_tokens": {args.k}, "prompt_lookup_max": 4, '
             f'"prompt_lookup_min": 2}}')
    configs: list[tuple[str, list[str]]] = []
    servers = args.servers.split(",")
    if "llamaserve" in servers:
        configs += [("llamaserve", []), ("llamaserve+ngram", ["--speculative-config", ngram])]
    binary = llama_server_binary(args) if "llama-server" in servers else None
    if binary is not None:
        spec_args = args.llama_spec_args.replace("K", str(args.k)).split()
        configs += [("llama-server", []), ("llama-server+lookup", spec_args)]
    results: dict[str, list[float]] = {name: [] for name, _ in configs}
    for round_index in range(args.rounds):
        for name, extra in configs:
            port = free_port()
            with tempfile.NamedTemporaryFile("w", prefix=f"spec-{name}-", suffix=".log", delete=False) as log:
                if name.startswith("llamaserve"):
                    process = start_ours(port, cache_dir, log, dtype=args.dtype, extra=extra)
                    model, ready = "SmolLM2-135M-Instruct", "/health"
                else:
                    gguf = peer_gguf(cache_dir, {"float32": "F32", "bfloat16": "BF16"}[args.dtype])
                    process = start_llama_server(binary, gguf, port, log, extra=extra, slots=1, context_tokens=4096)
                    model, ready = "demo", "/health"
                base = f"http://127.0.0.1:{port}"
                try:
                    await wait_ready(base, ready, process)
                    rate = await measure(base, model, args.max_tokens)
                    note = await acceptance(base) if name == "llamaserve+ngram" else ""
                finally:
                    stop(process)
            results[name].append(rate)
            print(f"round {round_index + 1} {name:22s} {rate:7.1f} out tok/s {note}  (log {log.name})", flush=True)
    report(results)


def report(results: dict[str, list[float]]) -> None:
    median = {name: statistics.median(rates) for name, rates in results.items() if rates}
    for name, rate in median.items():
        print(f"{name:22s} median {rate:7.1f} out tok/s")
    if "llamaserve" in median and "llamaserve+ngram" in median:
        print(f"speculation speed-up, ours: x{median['llamaserve+ngram'] / median['llamaserve']:.2f} (target x1.5)")
    if "llama-server+lookup" in median and "llamaserve+ngram" in median:
        print(f"ours+ngram / llama-server+lookup: x{median['llamaserve+ngram'] / median['llama-server+lookup']:.2f} (target > 1)")
    if "llama-server" in median and "llama-server+lookup" in median:
        print(f"llama-server's own speed-up: x{median['llama-server+lookup'] / median['llama-server']:.2f}")


# --------------------------------------------------------------------------- smoke (in-process, tiny)
def smoke(args: argparse.Namespace) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.executor.executor import ModelExecutor
    from engine.executor.worker_group import WorkerGroup
    from engine.loading.checkpoint import resolve_checkpoint, write_random_checkpoint
    from engine.models.args import ModelArgs
    from engine.spec.config import SpeculativeConfig
    from engine.types import EngineRequest, SamplingParams
    from bench.throughput import ByteLevelTokenizer

    args_ = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, norm_eps=1e-5)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp), args_, num_shards=1, seed=0, dtype=torch.float32)
        spec = resolve_checkpoint(path, model_id="tiny", llama_model="Llama3.2-1B-Instruct")
        documents = [list(doc.encode())[:96] for doc in DOCUMENTS]
        results: dict[str, list[float]] = {"llamaserve": [], "llamaserve+ngram": []}
        outputs: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for name in results:
                speculative = SpeculativeConfig("ngram", args.k, prompt_lookup_max=4, prompt_lookup_min=2) if "ngram" in name else None
                config = EngineConfig(dtype="float64", max_seq_len=512, kv_cache_bytes=16 << 20, speculative_config=speculative)
                core = EngineCore(ModelExecutor(WorkerGroup(spec, config, max_seq_len=512)), ByteLevelTokenizer(256), config, 512)
                tokens, started = 0, time.perf_counter()
                for i, doc in enumerate(documents):
                    core.add_request(EngineRequest(f"r{i}", doc + doc[:8], SamplingParams(temperature=0.0, max_tokens=args.max_tokens)))
                    while core.has_unfinished:
                        for out in core.step():
                            tokens += len(out.new_token_ids)
                            outputs.setdefault(name, []).extend(out.new_token_ids)
                results[name].append(tokens / (time.perf_counter() - started))
                stats = core.stats()
                core.runner.shutdown()
                note = (f"acceptance {stats.spec_decode_num_accepted_tokens_total}/{stats.spec_decode_num_draft_tokens_total}"
                        if speculative else "")
                print(f"{name:22s} {results[name][-1]:8.1f} out tok/s {note}", flush=True)
        same = outputs["llamaserve"] == outputs["llamaserve+ngram"]
        print(f"greedy tokens identical with and without speculation: {'yes' if same else 'NO'}")
    report(results)


# --------------------------------------------------------------------------- in-process (the demo, no HTTP)
def in_process(args: argparse.Namespace) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.executor.executor import ModelExecutor
    from engine.executor.worker_group import WorkerGroup
    from engine.loader import load_tokenizer_and_chat_format
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.loading.demo import ensure_demo_checkpoint
    from engine.spec.config import SpeculativeConfig
    from engine.types import ChatMessage, EngineRequest, SamplingParams

    torch.set_num_threads(args.threads)
    demo = ensure_demo_checkpoint(Path(args.demo_cache_dir) if args.demo_cache_dir else None)
    checkpoint = resolve_checkpoint(Path(demo.checkpoint_dir), model_id=demo.model_id)
    tokenizer, chat = load_tokenizer_and_chat_format(checkpoint, None)
    prompt_ids = [chat.encode_dialog([ChatMessage("user", text)]) for text in prompts()]
    ngram = SpeculativeConfig("ngram", args.k, prompt_lookup_max=4, prompt_lookup_min=2)
    results: dict[str, list[float]] = {"llamaserve": [], "llamaserve+ngram": []}
    outputs: dict[str, list[int]] = {}
    for round_index in range(args.rounds):
        for name in results:
            speculative = ngram if "ngram" in name else None
            config = EngineConfig(dtype=args.dtype, max_seq_len=2048, kv_cache_bytes=128 << 20, speculative_config=speculative)
            core = EngineCore(ModelExecutor(WorkerGroup(checkpoint, config, max_seq_len=2048)), tokenizer, config, 2048)
            plain_s: list[float] = []
            verify_s: list[float] = []
            # CPU seconds too: on a shared machine a step's wall time includes waiting for a core
            # (at --threads 1 its CPU time is the step's own work)
            plain_cpu: list[float] = []
            verify_cpu: list[float] = []
            verify_tokens = tokens = 0
            seconds = 0.0
            for i, ids in enumerate([prompt_ids[0][:16], *prompt_ids]):  # the first: a warm-up, not counted
                core.add_request(EngineRequest(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)))
                started, prefilled = time.perf_counter(), False
                while core.has_unfinished:
                    drafts = core.stats().spec_decode_num_drafts_total if speculative else 0
                    step_started, step_cpu = time.perf_counter(), time.process_time()
                    step_outputs = core.step()
                    step_s, step_cpu = time.perf_counter() - step_started, time.process_time() - step_cpu
                    new = sum(len(out.new_token_ids) for out in step_outputs)
                    if i and prefilled and core.has_unfinished:  # a decode step (not the prompt's, nor the last)
                        speculated = speculative is not None and core.stats().spec_decode_num_drafts_total > drafts
                        (verify_s if speculated else plain_s).append(step_s)
                        (verify_cpu if speculated else plain_cpu).append(step_cpu)
                        verify_tokens += new if speculated else 0
                    prefilled = True
                    if i:
                        tokens += new
                        outputs[name] = outputs.get(name, []) + [t for out in step_outputs for t in out.new_token_ids]
                if i:
                    seconds += time.perf_counter() - started
            results[name].append(tokens / seconds)
            stats = core.stats()
            core.runner.shutdown()
            plain_ms = statistics.median(plain_s) * 1e3 if plain_s else None
            plain_cpu_ms = statistics.median(plain_cpu) * 1e3 if plain_cpu else None
            note = f"plain step {plain_ms:.1f} ms ({plain_cpu_ms:.1f} ms CPU)" if plain_ms else ""
            if verify_s:
                verify_ms, verify_cpu_ms = statistics.median(verify_s) * 1e3, statistics.median(verify_cpu) * 1e3
                note += f", verify step {verify_ms:.1f} ms ({verify_cpu_ms:.1f} ms CPU)"
                note += f" (x{verify_ms / plain_ms:.2f} a plain one, CPU x{verify_cpu_ms / plain_cpu_ms:.2f})" if plain_ms else ""
                note += (f", {verify_tokens / len(verify_s):.2f} tokens per verify step, acceptance "
                         f"{stats.spec_decode_num_accepted_tokens_total}/{stats.spec_decode_num_draft_tokens_total}")
            print(f"round {round_index + 1} {name:18s} {results[name][-1]:7.1f} out tok/s  {note}", flush=True)
        # float32: the verify rows' sums differ from one decode's in the last bits, which may flip a near tie
        print(f"greedy tokens identical with and without speculation: {'yes' if len(set(map(tuple, outputs.values()))) == 1 else 'no'}")
        outputs.clear()
    report(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (and llama-server's --draft-max)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--servers", default="llamaserve,llama-server")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (default: the cached build)")
    parser.add_argument("--llama-spec-args", default="--spec-type ngram-simple --spec-draft-n-max K",
                        help="llama-server's lookup-decoding flags; K becomes --k")
    parser.add_argument("--demo-cache-dir", default=None)
    parser.add_argument("--smoke", action="store_true", help="in-process, tiny random model, a few tokens")
    parser.add_argument("--in-process", action="store_true", help="in-process EngineCore on the demo model: step costs by kind")
    parser.add_argument("--threads", type=int, default=2, help="--in-process: torch threads")
    args = parser.parse_args()
    if args.smoke:
        args.max_tokens = min(args.max_tokens, 24)
        smoke(args)
    elif args.in_process:
        in_process(args)
    else:
        asyncio.run(served(args))


if __name__ == "__main__":
    main()
