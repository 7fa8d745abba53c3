"""The quant kernels built for one x86-64 level, for tests that run another level's code on this CPU
(the AVX2 intrinsics, x86-64-v3; the portable loops, x86-64-v2) beside the native build."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from engine.kernels import build
from engine.kernels import quant as qk


def quant_kernels_for_level(tmp_path: Path, level: str) -> qk.QuantKernels:
    """The quant kernels compiled for `level` (skipped where this CPU cannot run it or no compiler builds it)."""
    levels = list(build.X86_LEVELS)
    here = build.cpu_level()
    if here is None or levels.index(here) < levels.index(level):
        pytest.skip(f"this CPU cannot run {level} code")
    target = tmp_path / f"quant_kernels_{level}.so"
    try:
        build.compile_library(build.QUANT_KERNELS, target, [*build.compiler_flags([f"-march={level}"]), *build.PREBUILT_EXTRA_FLAGS])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot build a {level} variant here: {str(exc)[-300:]}")
    return qk.QuantKernels(ctypes.CDLL(str(target)))
