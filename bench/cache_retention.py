"""Does a one-pass weight stream leave a small working set in the caches? (a script, not a test; issue #35)

    python bench/cache_retention.py [--ws-kib 256] [--stream-kib 0,1024,8192,65536,262144] [--rounds 21] [--prefetch 1024]

At one stream a decode step reads every weight once, and the engine thread's Python between two
forwards then finds its own data evicted (bench/step_python.py: ~0.7 ms a step). This measures the
mechanism alone, in C (the kernels' compiler and flags): a working set of --ws-kib is read twice (hot),
then --stream-kib of another buffer is streamed once (eight 64-byte loads a round, the one-row
kernels' pattern), then the working set is read again and timed. Three ways of streaming:
- plain: the loads alone (the hardware prefetchers as they are);
- nta: prefetchnta --prefetch bytes ahead of each line (the non-temporal hint);
- flush: clflushopt on each streamed line one 1 KiB behind the loads (the line leaves every cache).
Prints the re-read's median in us over the rounds in which the thread was not preempted
(getrusage's involuntary switches unchanged: another job on the core evicts everything whatever the
stream does), and how many rounds those were. Compare with the first row (no stream: hot). Needs
AVX-512 and CLFLUSHOPT (the loops are written with their intrinsics).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average  # noqa: E402
from engine.kernels.build import c_compiler, compiler_flags  # noqa: E402

SOURCE = r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static long preemptions(void) { struct rusage u; getrusage(RUSAGE_THREAD, &u); return u.ru_nivcsw; }
static float read_set(const char *p, int64_t bytes) {
    __m512 a = _mm512_setzero_ps(), b = a;
    for (int64_t i = 0; i < bytes; i += 128)
        a = _mm512_add_ps(a, _mm512_loadu_ps((const float *)(p + i))), b = _mm512_add_ps(b, _mm512_loadu_ps((const float *)(p + i + 64)));
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
/* mode 0 plain, 1 prefetchnta `ahead` bytes ahead, 2 clflushopt 1 KiB behind */
static float stream(const char *p, int64_t bytes, int mode, int64_t ahead) {
    __m512 a = _mm512_setzero_ps(), b = a;
    for (int64_t i = 0; i < bytes; i += 128) {
        if (mode == 1) _mm_prefetch(p + i + ahead, _MM_HINT_NTA), _mm_prefetch(p + i + ahead + 64, _MM_HINT_NTA);
        if (mode == 2 && i >= 1024) _mm_clflushopt((void *)(p + i - 1024)), _mm_clflushopt((void *)(p + i - 960));
        a = _mm512_add_ps(a, _mm512_loadu_ps((const float *)(p + i))), b = _mm512_add_ps(b, _mm512_loadu_ps((const float *)(p + i + 64)));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
/* re-read seconds of each unpreempted round into out; returns how many */
int retention(const char *set, int64_t set_bytes, const char *big, int64_t big_bytes, int64_t stream_bytes, int mode,
              int64_t ahead, int rounds, double *out) {
    volatile float sink = 0;
    int kept = 0;
    int64_t offset = 0;
    for (int r = 0; r < rounds; r++) {
        const long before = preemptions();
        sink += read_set(set, set_bytes) + read_set(set, set_bytes);
        sink += stream(big + offset, stream_bytes, mode, ahead);
        offset = (offset + stream_bytes + 4096) % (big_bytes / 2); /* a fresh part each round where it fits */
        const double t = now();
        sink += read_set(set, set_bytes);
        const double seconds = now() - t;
        if (preemptions() == before) out[kept++] = seconds;
    }
    return kept;
}
"""

MODES = ("plain", "nta", "flush")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ws-kib", type=int, default=256, help="the working set (KiB; a multiple of 128 B)")
    parser.add_argument("--stream-kib", default="0,1024,8192,65536,262144", help="bytes streamed between its reads (KiB)")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--prefetch", type=int, default=1024, help="the nta mode's distance ahead (bytes)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, lib = Path(tmp) / "retention.c", Path(tmp) / "retention.so"
        source.write_text(SOURCE)
        subprocess.run([c_compiler(), *compiler_flags(), "-o", str(lib), str(source)], check=True, capture_output=True, text=True)
        fn = ctypes.CDLL(str(lib)).retention
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    sizes = [int(s) << 10 for s in opts.stream_kib.split(",")]
    big_bytes = 2 * max(sizes) + (1 << 20)
    working = ctypes.create_string_buffer(opts.ws_kib << 10)
    big = ctypes.create_string_buffer(b"\1" * big_bytes, big_bytes)  # written: every page backed
    out = (ctypes.c_double * opts.rounds)()
    print(f"working set {opts.ws_kib} KiB, {opts.rounds} rounds, load average {load_average()}")
    for stream_bytes in sizes:
        cells = []
        for mode, name in enumerate(MODES):
            kept = fn(ctypes.addressof(working), opts.ws_kib << 10, ctypes.addressof(big), big_bytes, stream_bytes, mode,
                      opts.prefetch, opts.rounds, out)
            median = sorted(out[:kept])[kept // 2] * 1e6 if kept else float("nan")
            cells.append(f"{name} {median:6.1f} us ({kept:2d} unpreempted)")
        print(f"stream {stream_bytes >> 10:7d} KiB: re-read " + "  ".join(cells), flush=True)
    print(f"load average after {load_average()}")


if __name__ == "__main__":
    main()
