// LD_PRELOAD shim for bench/heap_allocations.py: counts the process's large allocations (>= 256 KiB,
// where glibc's heap walks its large bins or mmaps) and their CPU time, for the script to read.
//   gcc -O2 -shared -fPIC -o /tmp/alloc_shim.so bench/alloc_shim.c -ldl
// Thread CPU time, not wall: on a machine shared with other jobs a preemption inside one call
// would otherwise count as milliseconds of allocator. Each timed call adds two clock reads (~1 us).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define LARGE_BYTES (256u << 10)

uint64_t shim_large_count, shim_large_ns;

static uint64_t thread_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void count(uint64_t started_ns) {
  __atomic_fetch_add(&shim_large_ns, thread_ns() - started_ns, __ATOMIC_RELAXED);
  __atomic_fetch_add(&shim_large_count, 1, __ATOMIC_RELAXED);
}

void *malloc(size_t n) {
  static void *(*real)(size_t);
  if (!real) real = (void *(*)(size_t))dlsym(RTLD_NEXT, "malloc");
  if (n < LARGE_BYTES) return real(n);
  uint64_t started_ns = thread_ns();
  void *p = real(n);
  count(started_ns);
  return p;
}

int posix_memalign(void **p, size_t align, size_t n) {
  static int (*real)(void **, size_t, size_t);
  if (!real) real = (int (*)(void **, size_t, size_t))dlsym(RTLD_NEXT, "posix_memalign");
  if (n < LARGE_BYTES) return real(p, align, n);
  uint64_t started_ns = thread_ns();
  int rc = real(p, align, n);
  count(started_ns);
  return rc;
}

void *aligned_alloc(size_t align, size_t n) {
  static void *(*real)(size_t, size_t);
  if (!real) real = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "aligned_alloc");
  if (n < LARGE_BYTES) return real(align, n);
  uint64_t started_ns = thread_ns();
  void *p = real(align, n);
  count(started_ns);
  return p;
}
