"""The machine's read-bandwidth bound for a batch-1 decode step, and how close the one-row linears
come to it (a script, not a test).

    PYTHONPATH=. python bench/read_bandwidth.py [--threads 1,2] [--mib 512] [--rounds 5] [--streams 1,2,4] [--prefetch 0,1024]
        [--dtypes float32,bfloat16] [--baseline OLD.so]

A batch-1 step reads every weight once (plus the KV cache): its floor is weight bytes over the
rate the cores can stream memory. Three figures, each on 1 and 2 threads:
- read: a pure streaming read of --mib MiB (one buffer on huge pages, split in contiguous parts
  between the threads, eight 32-byte vector accumulators per thread: the loads and nothing else),
  compiled here with the kernels' compiler and flags; each thread's part read as --streams
  sequential streams side by side (the hardware prefetchers track each: more streams, more lines in
  flight), with a software prefetch ahead of each stream at the distances of --prefetch (bytes; 0:
  the hardware prefetchers alone). The bound quoted is the best of these;
- copy: bench/demo_vs_llamacpp.py's roofline "copy GB/s" (torch's copy of 256 MiB, read + write
  bytes over the time: what the issue's 90% target divides by);
- step linears: the demo model's block linears (30 x wqkv, wo, w13, w2) and its output head as one
  batch-1 step streams them, one-row interleaved copies in one WeightArena in step order, one call
  each through the cpu_kernels library (and --baseline, another build of it, alternating): GB/s of
  weight read, and its fraction of the read figure of the same round. The Python around each call
  (~1 us, 121 calls) is counted in.
Best of --rounds per figure (a stream's best is its rate; the rest is the other jobs), wall and
CPU time, load average before and after. On a shared machine quote the 1-thread figures and the
ratios of one run; 2-thread figures only from a quiet one.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import kernel_builds, load_average  # noqa: E402
from engine.kernels.build import c_compiler, compiler_flags  # noqa: E402
from engine.kernels.memory import WeightArena  # noqa: E402

# 8 independent 32-byte accumulators (no FMA latency in the way: one add per load), each thread
# a contiguous part of the buffer, prefetch_bytes ahead of its loads when nonzero
READ_SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
typedef float v8f __attribute__((vector_size(32)));
float read_stream(const float *p, int64_t n, int threads, int64_t prefetch_bytes, int64_t streams) {
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        t = omp_get_thread_num(), nt = omp_get_num_threads();
#endif
        /* this thread's part, cut into `streams` equal pieces read side by side (64 floats of each in turn) */
        const int64_t per = (n / nt / streams) & ~(int64_t)63;
        const float *base = p + per * streams * t;
        v8f a0 = {0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t i = 0; i < per; i += 64) {
            for (int64_t s = 0; s < streams; s++) {
                const float *q = base + s * per + i;
                if (prefetch_bytes) {
                    const char *ahead = (const char *)q + prefetch_bytes;
                    __builtin_prefetch(ahead, 0, 0);
                    __builtin_prefetch(ahead + 64, 0, 0);
                    __builtin_prefetch(ahead + 128, 0, 0);
                    __builtin_prefetch(ahead + 192, 0, 0);
                }
                const v8f *v = (const v8f *)q;
                a0 += v[0], a1 += v[1], a2 += v[2], a3 += v[3], a4 += v[4], a5 += v[5], a6 += v[6], a7 += v[7];
            }
        }
        const v8f s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
        for (int j = 0; j < 8; j++) total += s[j];
    }
    return total;
}
"""

# the demo model's block linears in step order (n, k) and its tied output head
DEMO_LAYERS, DEMO_BLOCK = 30, ((960, 576), (576, 576), (3072, 576), (576, 1536))
DEMO_HEAD = (49152, 576)


def build_read_stream(workdir: Path):
    source, lib = workdir / "read_stream.c", workdir / "read_stream.so"
    source.write_text(READ_SOURCE)
    subprocess.run([c_compiler(), *compiler_flags(), "-o", str(lib), str(source)], check=True, capture_output=True, text=True)
    fn = ctypes.CDLL(str(lib)).read_stream
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_float
    return fn


def best(fn, rounds: int) -> tuple[float, float]:
    """(best wall, best CPU) seconds of fn() over rounds."""
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def step_linears(libs: dict, dtype: torch.dtype, layers: int = DEMO_LAYERS, vocab: int = DEMO_HEAD[0]) -> dict:
    """{lib name: (calls, weight bytes, arena)}: every linear of a demo step (`layers` blocks, a head
    of `vocab` rows; 0: none) as one-row interleaved copies in one WeightArena (per library: a
    library may lay its copies out differently)."""
    torch.manual_seed(0)
    shapes = [shape for _ in range(layers) for shape in DEMO_BLOCK] + ([(vocab, DEMO_HEAD[1])] if vocab else [])
    out = {}
    for name, lib in libs.items():
        copies = [lib.interleave(torch.randn(n, k).to(dtype)) for n, k in shapes]
        arena = WeightArena([(c.shape, c.dtype) for c in copies])
        placed = [arena.place(i, c) for i, c in enumerate(copies)]
        del copies
        inputs = {k: torch.randn(1, k).to(dtype) for _, k in shapes}
        bound = [(lib.bind_interleaved(w), inputs[k]) for w, (_, k) in zip(placed, shapes)]
        out[name] = (bound, sum(w.numel() * w.element_size() for w in placed), arena)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--mib", type=int, default=512, help="MiB streamed by the read figure")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefetch", default="0,1024,4096", help="software prefetch distances of the read figure, bytes")
    parser.add_argument("--streams", default="1,2,4", help="sequential streams each thread reads side by side (the read figure)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="of the step linears")
    parser.add_argument("--layers", type=int, default=DEMO_LAYERS, help="blocks of the step linears (the demo's 30)")
    parser.add_argument("--vocab", type=int, default=DEMO_HEAD[0], help="rows of the step linears' head (0: none)")
    parser.add_argument("--baseline", type=Path, help="another build of the cpu_kernels library (.so) for the step linears")
    opts = parser.parse_args()
    before = load_average()
    print(f"torch {torch.__version__}; {opts.mib} MiB read, best of {opts.rounds}; load average {before}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        read_stream = build_read_stream(Path(tmp))
        nbytes = opts.mib << 20
        arena = WeightArena([(torch.Size((nbytes // 4,)), torch.float32)])
        buffer = arena.place(0, torch.ones(nbytes // 4))
        print(f"read buffer on huge pages: {arena.huge_pages}")
        src = torch.ones(256 * 2**20 // 4)
        dst = torch.empty_like(src)
        libs = kernel_builds(opts.baseline)
        linears = {dtype: step_linears(libs, getattr(torch, dtype), opts.layers, opts.vocab) for dtype in opts.dtypes.split(",")}
        for threads in (int(t) for t in opts.threads.split(",")):
            torch.set_num_threads(threads)
            read_best = 0.0
            for streams in (int(s) for s in opts.streams.split(",")):
                for distance in (int(d) for d in opts.prefetch.split(",")):
                    wall, cpu = best(lambda: read_stream(buffer.data_ptr(), buffer.numel(), threads, distance, streams), opts.rounds)
                    read_best = max(read_best, nbytes / wall)
                    print(f"{threads} thread(s) read, {streams} stream(s) a thread, prefetch {distance:5d} B: {nbytes / wall / 1e9:6.1f} GB/s wall "
                          f"({nbytes / cpu / 1e9 * threads:6.1f} GB/s of CPU x threads)", flush=True)
            wall, _ = best(lambda: dst.copy_(src), opts.rounds)
            print(f"{threads} thread(s) copy (read + write bytes, the roofline's 'copy GB/s'): {2 * src.numel() * 4 / wall / 1e9:6.1f} GB/s", flush=True)
            for dtype, per_lib in linears.items():
                calls = {name: bound for name, (bound, _, _) in per_lib.items()}
                times = {name: [] for name in calls}
                for r in range(opts.rounds):  # alternate the libraries within each round
                    for name in list(calls)[r % len(calls) :] + list(calls)[: r % len(calls)]:
                        times[name].append(best(lambda: [f(x, threads) for f, x in calls[name]], 1))
                cells = []
                for name, samples in times.items():
                    wall, cpu = min(s[0] for s in samples), min(s[1] for s in samples)
                    weight_bytes = per_lib[name][1]
                    cells.append(f"{name} {wall * 1e3:6.2f} ms (CPU {cpu * 1e3:6.2f}) {weight_bytes / wall / 1e9:5.1f} GB/s = {weight_bytes / wall / read_best:5.1%} of read")
                print(f"{threads} thread(s) {dtype} step linears ({per_lib['ours'][1] / 1e6:.0f} MB): " + "  ".join(cells), flush=True)
    print(f"load average before {before}, after {load_average()}")


if __name__ == "__main__":
    main()
