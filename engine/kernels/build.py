"""Build and cache of the C kernels (engine/kernels/csrc): each library compiled once per machine, or
prebuilt per x86-64 level in the container image. The bindings (engine/kernels/cpu.py, amx.py,
quant.py and the compiled decode step's) load a library with ctypes from library_path().

A library is one shared object compiled from one or more sources over the shared header
(csrc/vec.h): LIBRARIES names them and their sources. Its exported symbols are what the bindings
look up, and the compiled decode step calls them by address.

Built with the system C compiler (`$CC`, else `cc`) at first use into a cache dir keyed by the
sources, the headers, the flags, the compiler and this CPU's feature line (`-march=native`),
atomically, so parallel processes can race. The cache dir is made 0700; a dir or library that
another user owns or that others may write is refused. No compiler, a failed build or a refused
cache: library_path raises (OSError, SubprocessError), the bindings' loaders return None and the
model runs its torch path, which computes the same thing (tests check the two agree). The
libraries link the libgomp torch already loaded, so their parallel loops share the calling
thread's OpenMP team.

Prebuilt (the container image): `python -m engine.kernels.build prebuild DIR [LEVEL ...]` compiles
every library once per x86-64 microarchitecture level (v2: SSE4.2, v3: AVX2+FMA, v4: AVX-512; and
v4-bf16, AVX-512 with AVX512_BF16, for the bfloat16 pairs and int4 x bf16 kernels), and
LLAMASERVE_PREBUILT_KERNELS=DIR makes library_path take the highest level this CPU's flags allow,
so the image needs no compiler. Measured here (Xeon with AVX-512, a decode step of the 'tiny'
config, one thread): the v4 build ran within noise of -march=native.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
CACHE_DIR_ENV = "LLAMASERVE_KERNEL_CACHE_DIR"
PREBUILT_DIR_ENV = "LLAMASERVE_PREBUILT_KERNELS"
# /proc/cpuinfo flags each x86-64 psABI level needs beyond the one before (lzcnt shows as abm)
X86_LEVELS: dict[str, frozenset[str]] = {
    "x86-64-v2": frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
    "x86-64-v3": frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
    "x86-64-v4": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    # not a psABI level: v4 plus AVX512_BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4), whose
    # vdpbf16ps the bfloat16 one-row linears and the int4 x bf16 dots use (bench/NOTES.md)
    "x86-64-v4-bf16": frozenset({"avx512_bf16"}),
}
# what each level compiles with in place of -march=native (default: -march=LEVEL)
LEVEL_MARCH: dict[str, tuple[str, ...]] = {"x86-64-v4-bf16": ("-march=x86-64-v4", "-mavx512bf16")}
# -fassociative-math (with the two flags it needs) lets reductions such as dot products end in a
# vector add tree instead of 16 dependent scalar adds; -fno-math-errno keeps sqrtf inline.
FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC",
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno",
)  # fmt: skip
# prebuilt levels only: v16f arguments and returns change ABI with the level, and only static inline
# functions take them, so GCC's note about it says nothing
PREBUILT_EXTRA_FLAGS = ("-Wno-psabi",)
BUILD_TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class Library:
    """One shared library: `name` (the stem of its file names) compiled from `sources`, files in
    CSRC_DIR, which include its headers."""

    name: str
    sources: tuple[str, ...]

    @property
    def source_paths(self) -> list[Path]:
        return [CSRC_DIR / source for source in self.sources]


# the fused CPU kernels by family (engine/kernels/cpu.py binds them)
CPU_KERNELS = Library("cpu_kernels", ("elementwise.c", "attention.c", "linear.c", "argmax.c", "lora.c", "gemm.c"))
AMX_LINEAR = Library("amx_linear", ("amx_linear.c",))  # engine/kernels/amx.py
QUANT_KERNELS = Library("quant_kernels", ("quant_kernels.c",))  # engine/kernels/quant.py
DECODE_STEP = Library("decode_step", ("decode_step.c",))  # the compiled decode step
LIBRARIES = (AMX_LINEAR, CPU_KERNELS, DECODE_STEP, QUANT_KERNELS)


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or "~/.cache/llamaserve/kernels").expanduser()


def library_path(library: Library, cache_dir: Path | None = None) -> Path:
    """The shared library: prebuilt for this CPU's level when LLAMASERVE_PREBUILT_KERNELS holds it,
    else built on first use (OSError, SubprocessError if it cannot be)."""
    prebuilt_dir = os.environ.get(PREBUILT_DIR_ENV)
    prebuilt = find_prebuilt(Path(prebuilt_dir), library) if prebuilt_dir else None
    return prebuilt or build_library(library, cache_dir or default_cache_dir())


# ----------------------------------------------------------------------------- this CPU
# The line naming the CPU's instruction-set extensions: x86 "flags", Arm "Features", RISC-V "isa".
_FEATURE_KEYS = ("flags", "Features", "isa")
_VOLATILE_KEYS = ("processor", "cpu MHz", "BogoMIPS", "bogomips", "core id", "apicid", "initial apicid")


def cpu_feature_line(cpuinfo: str) -> str:
    """What -march=native code depends on: the feature line, or on an architecture without one, the
    first processor's description without its per-core and clock fields."""
    first_block = cpuinfo.strip().split("\n\n", 1)[0].splitlines()
    for line in first_block:
        if line.split(":", 1)[0].strip() in _FEATURE_KEYS:
            return line
    return "\n".join(line for line in first_block if line.split(":", 1)[0].strip() not in _VOLATILE_KEYS)


def cpu_flags() -> str:
    """This CPU's cpu_feature_line ("" where /proc/cpuinfo cannot be read)."""
    try:
        return cpu_feature_line(Path("/proc/cpuinfo").read_text())
    except OSError:
        return ""


def x86_level(flags: set[str] | frozenset[str]) -> str | None:
    """The highest x86-64 level whose flags (and every lower level's) a CPU with `flags` has; None below v2."""
    level, needed = None, set()
    for name, level_flags in X86_LEVELS.items():
        needed |= level_flags
        if not needed <= flags:
            break
        level = name
    return level


def cpu_level() -> str | None:
    """This CPU's x86_level."""
    return x86_level(set(cpu_flags().split(":", 1)[-1].split()))


# ----------------------------------------------------------------------------- compiling
def c_compiler() -> str:
    return os.environ.get("CC") or "cc"


def compiler_flags(march: Sequence[str] | None = None) -> list[str]:
    """FLAGS, with -march=native replaced by `march` where given (a prebuilt level's, a test's variant)."""
    if march is None:
        return list(FLAGS)
    return [flag for each in FLAGS for flag in (march if each == "-march=native" else (each,))]


def compile_library(library: Library, target: Path, flags: Sequence[str], cc: str | None = None) -> Path:
    """Compile `library`'s sources with `flags` into `target` (OSError with the compiler's complaint
    where it fails)."""
    cc = cc or c_compiler()
    command = [cc, *flags, "-o", str(target), *map(str, library.source_paths)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise OSError(f"{cc} failed on {library.name} ({' '.join(library.sources)}): {result.stderr.strip()[-2000:]}")
    return target


def _key(library: Library, *inputs: str) -> str:
    """16 hex digits digesting the library's sources (names and bytes), every header they may
    #include, and `inputs`."""
    digest = hashlib.sha256()
    for path in [*library.source_paths, *sorted(CSRC_DIR.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for each in inputs:
        digest.update(each.encode())
    return digest.hexdigest()[:16]


def source_key(library: Library) -> str:
    """Prebuilt libraries are named by the sources, headers and flags they came from: a stale one is never loaded."""
    return _key(library, " ".join(FLAGS))


def build_key(library: Library, cc: str) -> str:
    """The cache's key for a -march=native build: source_key's inputs, the compiler and its
    version, the machine and this CPU's feature line (-march=native code only runs on its kind)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    return _key(library, " ".join((cc, *FLAGS)), version, platform.machine(), cpu_flags())


def _check_owned_private(path: Path, what: str) -> None:
    """Refuse a cache dir or library that another user owns or that others may write: loading a
    library runs its code, so whoever can replace it can run code in the server."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(f"kernel cache {what} {path} is a symlink; refusing it")
    if st.st_uid != os.getuid():
        raise OSError(f"kernel cache {what} {path} is owned by uid {st.st_uid}, not this user; refusing it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"kernel cache {what} {path} is group- or world-writable; refusing it")


def build_library(library: Library, cache_dir: Path) -> Path:
    """Compile `library` for this CPU (-march=native) into the cache dir once per build_key; the
    path of the shared library."""
    cc = c_compiler()
    target = cache_dir / f"{library.name}-{build_key(library, cc)}.so"
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_owned_private(cache_dir, "dir")
    if os.path.lexists(target):
        _check_owned_private(target, "library")
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        built = compile_library(library, Path(tmp) / target.name, FLAGS, cc)
        os.replace(built, target)  # atomic: a racing process sees the whole file or none
    log.info("built %s into %s", library.name, target)
    return target


# ----------------------------------------------------------------------------- prebuilt per level
def prebuilt_name(level: str, library: Library) -> str:
    return f"{library.name}-{source_key(library)}-{level}.so"


def find_prebuilt(directory: Path, library: Library) -> Path | None:
    """The library in `directory` for the best level this CPU runs; None (logged) if there is none."""
    level = cpu_level()
    candidates = list(X86_LEVELS)[: list(X86_LEVELS).index(level) + 1] if level else []
    for name in reversed(candidates):
        path = directory / prebuilt_name(name, library)
        if path.is_file():
            log.info("%s: prebuilt %s for this CPU (%s)", library.name, path.name, level)
            return path
    log.warning("no prebuilt %s in %s for this CPU (level %s); building it if a compiler is here", library.name, directory, level)
    return None


def prebuild(out_dir: Path, levels: Sequence[str] | None = None, libraries: Sequence[Library] | None = None) -> list[Path]:
    """Compile each library (default: LIBRARIES) once per x86-64 level (default: all) into
    `out_dir` (the image's builder stage runs this)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for library in libraries or LIBRARIES:
        for level in levels or list(X86_LEVELS):
            flags = [*compiler_flags(LEVEL_MARCH.get(level, (f"-march={level}",))), *PREBUILT_EXTRA_FLAGS]
            built.append(compile_library(library, out_dir / prebuilt_name(level, library), flags))
    return built


def main(argv: list[str]) -> int:
    """python -m engine.kernels.build prebuild DIR [LEVEL ...]"""
    if len(argv) < 2 or argv[0] != "prebuild" or any(level not in X86_LEVELS for level in argv[2:]):
        print(f"usage: python -m engine.kernels.build prebuild DIR [{' '.join(X86_LEVELS)}]", file=sys.stderr)
        return 2
    for path in prebuild(Path(argv[1]), argv[2:] or None):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
