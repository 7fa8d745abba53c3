"""The C kernel libraries built for one x86-64 level, for tests that run another level's code on this
CPU (the AVX2 intrinsics, x86-64-v3; the portable loops, x86-64-v2) beside the native build, or for
a variant of a level: its build with vec.h's vector width forced (x86-64-v3-16-lanes: the AVX-512
builds' 16-lane generic code, which GCC lowers to pairs of ymm, run where no CPU has AVX-512)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from engine.kernels import build
from engine.kernels import cpu as ck
from engine.kernels import quant as qk


# variant: (the level it builds for, its extra compiler flags)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "x86-64-v3-16-lanes": ("x86-64-v3", ("-DLLAMASERVE_NV_LANES=16",)),
    # the AVX-512 silu_mul's table read by gathers, which AMD CPUs read by loads instead (csrc/elementwise.c)
    "x86-64-v4-silu-gather": ("x86-64-v4", ("-DLLAMASERVE_SILU_GATHER",)),
}


def library_for_level(tmp_path: Path, library: build.Library, level: str) -> Path:
    """`library` compiled for `level`, an x86-64 level or one of VARIANTS (skipped where this CPU
    cannot run it or no compiler builds it)."""
    march, defines = VARIANTS.get(level, (level, ()))
    levels = list(build.X86_LEVELS)
    here = build.cpu_level()
    if here is None or levels.index(here) < levels.index(march):
        pytest.skip(f"this CPU cannot run {march} code")
    target = tmp_path / f"{library.name}_{level}.so"
    try:
        build.compile_library(library, target, [*build.compiler_flags([f"-march={march}", *defines]), *build.PREBUILT_EXTRA_FLAGS])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot build a {level} variant here: {str(exc)[-300:]}")
    return target


def quant_kernels_for_level(tmp_path: Path, level: str) -> qk.QuantKernels:
    """The quant kernels compiled for `level`."""
    return qk.QuantKernels(ctypes.CDLL(str(library_for_level(tmp_path, build.QUANT_KERNELS, level))))


def cpu_kernels_for_level(tmp_path: Path, level: str) -> ck.CpuKernels:
    """The fused CPU kernels (cpu_kernels library) compiled for `level`."""
    return ck.CpuKernels(ctypes.CDLL(str(library_for_level(tmp_path, build.CPU_KERNELS, level))))
