"""Offline engine throughput (a script, not a test).

    python bench/throughput.py [--config small] [--concurrency 1,8,32] [--checkpoint-dir DIR] [--threads N] [--json PATH]
                               [--device cuda] [--dtype bfloat16] [--no-cuda-graphs]

Writes a random Meta checkpoint of the chosen config once (reused when --checkpoint-dir already
holds one), then drives EngineCore directly (no HTTP, no event loop):
1. for each concurrency c: 2c requests (c at least 4) of 128 prompt tokens and 64 output tokens
   (greedy, ignore_eos), at most c in a batch; output tokens/s, the ratio to concurrency 1, and the
   weight bytes streamed per second against this machine's read bandwidth (decode is memory bound);
2. at the highest concurrency: the share of step time spent outside runner.execute (scheduling,
   scheduler.update, detokenization, stop checks, stats);
3. prefix caching: TTFT of a request with a 1000-token system prompt, cold vs. with the prompt's
   blocks already cached.
Numbers on a shared machine are noisy. The configs and the --json format are bench/common.py's.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS, Results, add_results_arguments, model_args, torch_machine  # noqa: E402
from bench.forward import matmul_flops_per_s, memory_bytes_per_s, weight_counts  # noqa: E402  (the same roofline)
from engine.loading.checkpoint import estimate_weight_bytes, resolve_checkpoint, write_random_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.executor.worker_group import WorkerGroup  # noqa: E402
from engine.executor.executor import ModelExecutor  # noqa: E402
from engine.types import EngineRequest, SamplingParams  # noqa: E402

DESCRIPTOR = "Llama3.2-1B-Instruct"  # supplies the family (llama3); params.json supplies the architecture
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
SYSTEM_PROMPT_TOKENS = 1000
MAX_SEQ_LEN = 2048


class ByteLevelTokenizer:
    """Stands in when llama-models' Llama 3 tokenizer.model is not installed (ids >= 256 print nothing)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids: frozenset[int] = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    first_token_bytes = token_bytes

    def is_special(self, token_id: int) -> bool:
        return False

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


def load_tokenizer(vocab_size: int):
    """The real Llama 3 tokenizer when available, so detokenization costs what it costs in serving."""
    try:
        import importlib.util

        from engine.tokenizers.tokenizer import llama3_tokenizer

        origin = importlib.util.find_spec("llama_models").origin  # type: ignore[union-attr]
        tokenizer = llama3_tokenizer(Path(origin).parent / "llama3" / "tokenizer.model")
        if tokenizer.vocab_size == vocab_size:
            return tokenizer, "llama3 tiktoken"
    except Exception:  # a bench aid only
        pass
    return ByteLevelTokenizer(vocab_size), "byte-level stand-in"


def checkpoint_dir(config_name: str, given: str | None) -> Path:
    directory = Path(given) if given else Path(tempfile.gettempdir()) / f"llamaserve-bench-{config_name}"
    if not (directory / "consolidated.00.pth").exists():
        print(f"writing a random '{config_name}' checkpoint to {directory} ...", flush=True)
        write_random_checkpoint(directory, model_args(config_name), seed=0, dtype=torch.bfloat16)
    return directory


def make_core(spec, tokenizer, *, max_batch_size: int, device: str, dtype: str, cuda_graphs: bool = True) -> EngineCore:
    # a GPU's KV cache holds 128 streams of the 1.1B model's 192 tokens (~0.8 GB); the CPU's stays small
    kv_cache_bytes = (4 << 30) if device == "cuda" else 768 << 20
    config = EngineConfig(
        device=device, dtype=dtype, max_batch_size=max_batch_size, max_num_batched_tokens=512, kv_cache_bytes=kv_cache_bytes,
        cuda_graphs=cuda_graphs,
    )
    runner = ModelExecutor(WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN))
    return EngineCore(runner, tokenizer, config, MAX_SEQ_LEN)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(256, min(vocab, 100_000)) for _ in range(n)]


def run_offline(core: EngineCore, requests: list[EngineRequest]) -> tuple[float, int]:
    started = time.perf_counter()
    for request in requests:
        core.add_request(request)
    num_output = 0
    while core.has_unfinished:
        for out in core.step():
            num_output += len(out.new_token_ids)
    return time.perf_counter() - started, num_output


def workload_flops(args, num_prompt_tokens: int, num_output_tokens: int) -> float:
    """Matmul FLOPs of the work: every prompt token goes through the body, the head runs once per
    output token (the first one from the prefill's last row)."""
    body, head = weight_counts(args)
    return 2.0 * (body * (num_prompt_tokens + num_output_tokens) + head * num_output_tokens)


def cuda_roofline(dtype: torch.dtype, *, smoke: bool) -> tuple[float, float]:
    """The GPU's copy bandwidth (bytes read + written) and matmul rate in `dtype`, synchronized."""
    def timed(fn, repeats: int = 5) -> float:
        fn()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / repeats

    x = torch.empty((64 if smoke else 1024) << 20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() / timed(lambda: y.copy_(x))
    n = 1024 if smoke else 8192
    a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    return bandwidth, 2 * n**3 / timed(lambda: a @ b)


def throughput(spec, tokenizer, concurrencies: list[int], weight_bytes: int, bandwidth: float, flops: float, out: Results,
               *, device: str, dtype: str, cuda_graphs: bool = True) -> None:  # fmt: skip
    vocab = spec.model_args.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    base_rate = None
    for c in concurrencies:
        core = make_core(spec, tokenizer, max_batch_size=c, device=device, dtype=dtype, cuda_graphs=cuda_graphs)
        rng = random.Random(c)
        warm = [EngineRequest(f"warm{i}", random_prompt(rng, 16, vocab), SamplingParams(max_tokens=2)) for i in range(2)]
        run_offline(core, warm)
        core.timing.__init__()  # type: ignore[misc]
        requests = [EngineRequest(f"c{c}-{i}", random_prompt(rng, PROMPT_TOKENS, vocab), params) for i in range(max(4, 2 * c))]
        elapsed_s, num_output = run_offline(core, requests)
        rate = num_output / elapsed_s
        base_rate = base_rate or rate
        timing = core.timing
        streamed = timing.num_steps * weight_bytes / elapsed_s
        achieved = workload_flops(spec.model_args, len(requests) * PROMPT_TOKENS, num_output) / elapsed_s
        # the decode floor: each step reads the weights once (KV reads and prefill steps left out)
        floor_rate = c * bandwidth / weight_bytes
        print(
            f"concurrency {c:3d}: {elapsed_s / num_output * 1e3:7.3f} ms per output token (a stream: "
            f"{elapsed_s / num_output * c * 1e3:7.3f} ms); floor {floor_rate:9.1f} tok/s "
            f"({weight_bytes / bandwidth * 1e3:6.3f} ms a step) -> {rate / floor_rate:6.1%} of it",
            flush=True,
        )
        print(
            f"concurrency {c:3d}: {len(requests):3d} requests, {num_output:5d} output tokens in {elapsed_s:7.2f} s = "
            f"{rate:8.1f} tok/s ({rate / base_rate:5.2f}x of concurrency 1); {timing.num_steps} steps, "
            f"weights streamed {streamed / 1e9:5.2f} GB/s ({streamed / bandwidth:5.1%} of read bandwidth), "
            f"matmuls {achieved / 1e9:5.1f} GFLOP/s ({achieved / flops:5.1%} of peak)",
            flush=True,
        )
        out.add("output throughput", rate, "tok/s", concurrency=c, requests=len(requests), output_tokens=num_output,
                elapsed_s=elapsed_s, steps=timing.num_steps, weights_streamed_of_bandwidth=streamed / bandwidth,
                matmul_of_peak=achieved / flops, floor_tok_s=floor_rate, cuda_graphs=cuda_graphs)
        if c == max(concurrencies):
            total = timing.schedule_s + timing.execute_s + timing.update_s
            print(
                f"  step time at batch {c}: schedule {timing.schedule_s / total:6.2%}, runner.execute "
                f"{timing.execute_s / total:6.2%}, update+output+stats {timing.update_s / total:6.2%} -> "
                f"scheduler and bookkeeping {timing.bookkeeping_fraction:6.2%} (target < 5%)",
                flush=True,
            )
            out.add("bookkeeping share of step time", timing.bookkeeping_fraction, "fraction", concurrency=c)
        core.runner.shutdown()


def time_to_first_token(core: EngineCore, request: EngineRequest) -> float:
    started = time.perf_counter()
    core.add_request(request)
    first = None
    while core.has_unfinished:
        outputs = core.step()
        if first is None and any(o.new_token_ids for o in outputs):
            first = time.perf_counter() - started
    assert first is not None
    return first


def prefix_ttft(spec, tokenizer, out: Results, *, device: str, dtype: str, repeats: int = 5) -> None:
    vocab = spec.model_args.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    core = make_core(spec, tokenizer, max_batch_size=8, device=device, dtype=dtype)
    time_to_first_token(core, EngineRequest("warm", random_prompt(rng, 16, vocab), params))
    cold, cached, alone = [], [], []
    for i in range(repeats):
        system = random_prompt(rng, SYSTEM_PROMPT_TOKENS, vocab)  # a new system prompt: nothing cached
        cold.append(time_to_first_token(core, EngineRequest(f"cold{i}", system + random_prompt(rng, 24, vocab), params)))
        cached.append(time_to_first_token(core, EngineRequest(f"hit{i}", system + random_prompt(rng, 24, vocab), params)))
        alone.append(time_to_first_token(core, EngineRequest(f"alone{i}", random_prompt(rng, 32, vocab), params)))
    cold_s, cached_s, alone_s = (statistics.median(x) for x in (cold, cached, alone))
    stats = core.stats()
    print(
        f"prefix cache, {SYSTEM_PROMPT_TOKENS}-token system prompt + 24 tokens (median of {repeats}): TTFT cold "
        f"{cold_s * 1e3:7.1f} ms, cached {cached_s * 1e3:7.1f} ms -> {cold_s / cached_s:5.1f}x faster (target >= 5x); "
        f"floor: a 32-token prompt alone {alone_s * 1e3:7.1f} ms; "
        f"hits {stats.prefix_cache_hits_total}/{stats.prefix_cache_queries_total} prompt tokens",
        flush=True,
    )
    out.add("prefix cache TTFT cold", cold_s, "s", system_prompt_tokens=SYSTEM_PROMPT_TOKENS, repeats=repeats)
    out.add("prefix cache TTFT cached", cached_s, "s", system_prompt_tokens=SYSTEM_PROMPT_TOKENS, repeats=repeats)
    core.runner.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument("--concurrency", default="1,8,32", help='"" skips the throughput part')
    parser.add_argument("--checkpoint-dir", default=None, help="where the random checkpoint is written or found")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="the model dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="cuda: every step eager (graphs off, to compare)")
    parser.add_argument("--smoke", action="store_true", help="a tiny roofline sample and one prefix repeat: checks the script runs (tests)")
    add_results_arguments(parser)
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    spec = resolve_checkpoint(checkpoint_dir(opts.config, opts.checkpoint_dir), model_id=opts.config, llama_model=DESCRIPTOR)
    tokenizer, tokenizer_name = load_tokenizer(spec.model_args.vocab_size)
    dtype = opts.dtype or ("bfloat16" if opts.device == "cuda" else "float32")
    if opts.device == "cuda":
        bandwidth, flops = cuda_roofline(getattr(torch, dtype), smoke=opts.smoke)
        where = f"{torch.cuda.get_device_name()}, copy"
    else:
        bandwidth = memory_bytes_per_s(mib=8) if opts.smoke else memory_bytes_per_s()
        flops = matmul_flops_per_s(getattr(torch, dtype), n=128) if opts.smoke else matmul_flops_per_s(getattr(torch, dtype))
        where = f"{torch.get_num_threads()} threads, read"
    args = spec.model_args
    weight_bytes = estimate_weight_bytes(args, dtype)  # read once per step
    print(
        f"torch {torch.__version__}, {opts.device}, {dtype}, tokenizer: {tokenizer_name}; "
        f"config '{opts.config}' (dim {args.dim}, {args.n_layers} layers, vocab {args.vocab_size}), "
        f"{weight_bytes / 2**20:.0f} MiB of weights; {where} bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"matmul {flops / 1e9:.1f} GFLOP/s. "
        "Shared machine: numbers are noisy.",
        flush=True,
    )
    out = Results("throughput", context={"config": opts.config, "device": opts.device, "dtype": dtype})
    out.add("read bandwidth", bandwidth, "B/s")
    out.add("matmul", flops, "FLOP/s", dtype=dtype)
    if opts.concurrency:
        throughput(spec, tokenizer, [int(c) for c in opts.concurrency.split(",")], weight_bytes, bandwidth, flops, out,
                   device=opts.device, dtype=dtype, cuda_graphs=not opts.no_cuda_graphs)  # fmt: skip
    if not opts.skip_prefix:
        prefix_ttft(spec, tokenizer, out, device=opts.device, dtype=dtype, repeats=1 if opts.smoke else 5)
    out.write(opts.json, **torch_machine(), tokenizer=tokenizer_name)


if __name__ == "__main__":
    main()
