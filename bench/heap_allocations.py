"""What a serving process's large allocations cost inside its steps, under glibc (a script, not a test).

    python bench/heap_allocations.py [--dtype bfloat16] [--streams 32] [--rounds 2] [--heap default]
    gcc -O2 -shared -fPIC -o /tmp/alloc_shim.so bench/alloc_shim.c -ldl
    LD_PRELOAD=/tmp/alloc_shim.so python bench/heap_allocations.py ...   # also count and time them

Loads the demo checkpoint as the server does (engine.loader.load_engine), then runs `streams`
requests of 128 random prompt tokens and 64 greedy output tokens (--prompt-tokens, --output-tokens)
at once on the engine thread (512-token prefill chunks, then decodes), `rounds` times. Per round: the
steps' engine-thread CPU time (1 thread by default, so other jobs on the machine count far less) and
minor page faults, glibc's free chunks and bytes (mallinfo2: a large request walks the chunks) and,
after the round, the median time of a torch.empty the size of a 512-row w13 output and of a norm's. With the LD_PRELOAD shim (bench/alloc_shim.c: wraps
malloc/posix_memalign/aligned_alloc for requests >= 256 KiB, timing them in thread CPU time) it also
prints how many large allocations a step made and the CPU time spent in them (each includes the
shim's two clock reads, ~1 us).

--heap picks what is done to the heap before loading: `default` (nothing, as the server does), or
mallopt settings such as `mmap=33554432`, `trim=...`, `top_pad=...`, `arena_max=...`, comma-separated;
`load_trim` adds a malloc_trim(0) after loading. Compare processes of alternating configurations.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import resource
import statistics
import sys
import time
from pathlib import Path

if "OMP_WAIT_POLICY" not in os.environ:  # as the server sets it (server/__main__.py)
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.config import EngineConfig  # noqa: E402
from engine.loader import load_engine  # noqa: E402
from one_stream import request  # noqa: E402
from server.model_spec import ModelSpec  # noqa: E402

MALLOPT_PARAMS = {"trim": -1, "top_pad": -2, "mmap": -3, "arena_max": -8}  # <malloc.h> M_*
PROBE_SHAPES = ((512, 3072), (512, 576))  # a 512-token step's w13 output, a norm's output


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def libc():
    return ctypes.CDLL("libc.so.6")


def free_chunks() -> tuple[int, int]:
    """(free chunks in the main arena's bins, their MiB)."""
    fn = libc().mallinfo2
    fn.restype = MallInfo2
    info = fn()
    return info.ordblks, info.fordblks >> 20


def shim_counters():
    """(count, ns) readers of the LD_PRELOAD shim's counters, or None without it."""
    try:
        process = ctypes.CDLL(None)
        count = ctypes.c_uint64.in_dll(process, "shim_large_count")
        ns = ctypes.c_uint64.in_dll(process, "shim_large_ns")
    except ValueError:
        return None
    return lambda: (count.value, ns.value)


def apply_heap(setting: str) -> bool:
    """Apply --heap before loading; True when a malloc_trim(0) should follow the load."""
    load_trim = False
    for item in filter(None, setting.split(",")):
        if item == "default":
            continue
        if item == "load_trim":
            load_trim = True
        else:
            name, value = item.split("=")
            assert libc().mallopt(MALLOPT_PARAMS[name], int(value)) == 1, item
    return load_trim


def empty_us(shape, rounds: int = 9) -> float:
    """Median us of a torch.empty of `shape` bf16."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = torch.empty(shape, dtype=torch.bfloat16)
        times.append(time.perf_counter() - start)
        del out
    return statistics.median(times) * 1e6


def probes_us() -> str:
    return " / ".join(f"{empty_us(shape):.1f}" for shape in PROBE_SHAPES)


def one_round(core, reqs, shim) -> dict[str, float]:
    for req in reqs:
        core.add_request(req)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    cpu_s, allocs, alloc_ns, steps, big = 0.0, 0, 0, 0, []
    while core.has_unfinished:
        before = shim() if shim else (0, 0)
        start = time.thread_time()
        core.step()
        cpu_s += time.thread_time() - start
        after = shim() if shim else (0, 0)
        allocs, alloc_ns, steps = allocs + after[0] - before[0], alloc_ns + after[1] - before[1], steps + 1
        if after[0] - before[0] >= 64:  # a prefill or mixed step
            big.append((after[0] - before[0], (after[1] - before[1]) / 1e3))
    many = (f", steps of >= 64: {len(big)}, {statistics.mean(n for n, _ in big):.0f} allocations "
            f"{statistics.mean(us for _, us in big) / 1e3:.2f} ms a step") if big else ""
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
    return {"steps": steps, "cpu_s": cpu_s, "faults": faults, "allocs": allocs, "alloc_ms": alloc_ns / 1e6, "many": many}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="~/.cache/llamaserve/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--heap", default="default")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_trim = apply_heap(args.heap)
    checkpoint = Path(args.checkpoint).expanduser()
    engine = load_engine(ModelSpec(model_id=checkpoint.name, checkpoint_dir=checkpoint, trusted=True),
                         EngineConfig(dtype=args.dtype, max_seq_len=max(1024, args.prompt_tokens + args.output_tokens), max_batch_size=args.streams))
    if load_trim:
        libc().malloc_trim(0)
    shim = shim_counters()
    print(f"heap {args.heap}, {args.dtype}, {args.threads} threads, after load: free chunks {free_chunks()}, "
          f"torch.empty {PROBE_SHAPES} bf16 {probes_us()} us, load average {os.getloadavg()[0]:.1f}", flush=True)

    def rounds() -> None:
        vocab = engine.core.vocab_size
        one_round(engine.core, [request(-1, args.prompt_tokens, args.output_tokens, vocab)], shim)  # warm-up
        for r in range(args.rounds):
            reqs = [request(1000 * r + k, args.prompt_tokens, args.output_tokens, vocab) for k in range(args.streams)]
            row = one_round(engine.core, reqs, shim)
            allocs = (f"large allocations {row['allocs'] / row['steps']:.1f}/step {row['alloc_ms']:.1f} ms total"
                      f"{row['many']}" if shim else "large allocations not counted (no LD_PRELOAD shim)")
            print(f"round {r}: {row['steps']} steps, step CPU {row['cpu_s'] * 1e3 / row['steps']:.2f} ms "
                  f"(total {row['cpu_s']:.3f} s), page faults {row['faults'] / row['steps']:.0f}/step, {allocs}, torch.empty {probes_us()} us, "
                  f"free chunks {free_chunks()}", flush=True)

    async def drive() -> None:
        await engine._on_engine_thread(rounds)
        await engine.shutdown()

    asyncio.run(drive())


if __name__ == "__main__":
    main()
