"""The server as the container image runs it, without a Docker daemon (issue 29, finding 1): the
Dockerfile's non-root USER, its ENV lines, and its file system's ownership rebuilt under a temporary
"image root" (everything root's, but the dirs the Dockerfile's `install -d -o ... -m ...` lines make).

- With the Dockerfile's dirs, the image's defaults serve a completion and run a batch as its user.
- With a batch dir its user cannot write (the image before the fix), the server still serves
  completions; the Batch API routes answer 503 with the reason; /ready stays 200 and, with
  /metrics, says the batch subsystem is down.

Root runs the server as the image's uid with `setpriv`; elsewhere these tests skip. Where the
interpreter lives somewhere that user cannot read (root's home, as with pyenv), the server process
gets CAP_DAC_READ_SEARCH: it may read any file, but writing still needs the permissions the image
would have, which is what these tests are about.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, MAX_SEQ_LEN, metric, scrape, wait_answering, wait_until
from tests.e2e.test_cli_e2e import REPO, free_port
from tests.test_dockerfile import instructions

pytestmark = pytest.mark.slow  # starts server processes
MODEL = BASE_DESCRIPTOR
# The engine settings of this test (not the image's): a small KV cache, no kernel compile at start.
TEST_ENV = {"LLAMASERVE_DTYPE": "float32", "LLAMASERVE_CPU_KV_CACHE_BYTES": "8MiB",
            "LLAMASERVE_MAX_SEQ_LEN": str(MAX_SEQ_LEN), "LLAMASERVE_CPU_KERNELS": "false",
            "LLAMASERVE_LOG_LEVEL": "warning"}


# --------------------------------------------------------------------------- the Dockerfile, read
def runtime_stage() -> list[tuple[str, str]]:
    found = instructions()
    last_from = max(i for i, (name, _) in enumerate(found) if name == "FROM")
    return found[last_from + 1:]


def image_user() -> tuple[int, int]:
    (user,) = [args for name, args in runtime_stage() if name == "USER"][-1:]
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def image_env() -> dict[str, str]:
    """The runtime stage's ENV lines as a mapping (PATH left out: the test's interpreter is not /opt/venv)."""
    env = {}
    for name, args in runtime_stage():
        if name == "ENV":
            env.update(pair.split("=", 1) for pair in args.split())
    env.pop("PATH", None)
    return env


def image_owned_dirs() -> list[tuple[Path, int, int, int]]:
    """(path, uid, gid, mode) of every `install -d -o UID -g GID -m MODE PATH...` of the runtime stage."""
    dirs = []
    for name, args in runtime_stage():
        if name != "RUN":
            continue
        for command in args.split("&&"):
            match = re.match(r"\s*install -d -o (\d+) -g (\d+) -m ([0-7]+) (.+)$", command.strip())
            if match:
                for path in match.group(4).split():
                    dirs.append((Path(path), int(match.group(1)), int(match.group(2)), int(match.group(3), 8)))
    return dirs


def test_the_image_gives_its_user_every_dir_the_server_writes_by_default():
    """The static half, which runs anywhere: the batch dir the image names is made for its user."""
    uid, gid = image_user()
    owned = {path: (owner, group, mode) for path, owner, group, mode in image_owned_dirs()}
    batch_dir = Path(image_env()["LLAMASERVE_BATCH_DIR"])
    assert owned.get(batch_dir) == (uid, gid, 0o700), owned


# --------------------------------------------------------------------------- the image's file system, rebuilt
def _link_tree(source: Path, target: Path) -> None:
    """Hard links (a copy across file systems) of a checkpoint, readable by anyone as in a volume."""
    target.mkdir(parents=True)
    os.chmod(target, 0o755)
    for path in source.iterdir():
        try:
            os.link(path, target / path.name)
        except OSError:
            shutil.copy2(path, target / path.name)


@contextlib.contextmanager
def image_root(checkpoint: Path, *, with_owned_dirs: bool) -> Iterator[tuple[Path, dict[str, str]]]:
    """A temporary root laid out as the image: /opt/llamaserve root's, /checkpoints holding the
    checkpoint, the user's home; the Dockerfile's own dirs only `with_owned_dirs`. Yields the root
    and the image's environment with its paths moved under it."""
    uid, gid = image_user()
    root = Path(tempfile.mkdtemp(prefix="llamaserve-image-"))  # not under pytest's 0700 tmp: the user must reach it
    try:
        os.chmod(root, 0o755)
        env = {k: str(root / v.lstrip("/")) if v.startswith("/") else v for k, v in image_env().items()}
        for key in ("LLAMASERVE_CACHE_DIR", "LLAMASERVE_PREBUILT_KERNELS"):
            Path(env[key]).mkdir(parents=True, exist_ok=True)  # the builder's COPY: root's, 0755
        _link_tree(checkpoint, Path(env["LLAMASERVE_CHECKPOINT_ROOTS"]) / MODEL)
        home = root / "home" / "llamaserve"
        home.mkdir(parents=True)
        os.chown(home, uid, gid)
        if with_owned_dirs:
            for path, owner, group, mode in image_owned_dirs():
                moved = root / str(path).lstrip("/")
                moved.mkdir(parents=True)
                os.chown(moved, owner, group)
                os.chmod(moved, mode)
        yield root, {**env, "HOME": str(home)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- the server, as the image's user
def as_image_user() -> list[str]:
    """The setpriv prefix that runs a command as the image's uid:gid, with no supplementary groups."""
    if os.geteuid() != 0:
        pytest.skip("running the server as the image's user needs root (setpriv)")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    uid, gid = image_user()
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import server.subsystems"], cwd=REPO,
                           capture_output=True, timeout=120)
    if probe.returncode == 0:
        return prefix
    # The interpreter or its packages are not readable by that user here: read access only.
    return [*prefix, "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


@contextlib.contextmanager
def image_server(env: dict[str, str], log_path: Path) -> Iterator[httpx.Client]:
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMASERVE_", "INFERENCE_"))}
    full_env = {**clean, **env, **TEST_ENV, "INFERENCE_MODEL": MODEL, "LLAMASERVE_PORT": str(port),
                "LLAMASERVE_HOST": "127.0.0.1"}  # the image binds 0.0.0.0; a test keeps to loopback
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*as_image_user(), sys.executable, "-m", "server"], cwd=REPO, env=full_env,
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            wait_answering(http, process, log_path, "/ready", timeout_s=120, interval_s=0.1, what="/ready")
            yield http
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


def completes(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                                  "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def finished(http: httpx.Client, batch_id: str) -> dict | None:
    batch = http.get(f"/v1/batches/{batch_id}").json()
    return batch if batch["status"] in ("completed", "failed", "cancelled", "expired") else None


def test_the_image_defaults_serve_completions_and_batches_as_its_user(base_checkpoint, tmp_path):
    with image_root(base_checkpoint, with_owned_dirs=True) as (root, env):
        with image_server(env, tmp_path / "server.log") as http:
            completes(http)
            line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                    "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}}
            upload = http.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")})
            assert upload.status_code == 200, upload.text
            created = http.post("/v1/batches", json={"input_file_id": upload.json()["id"], "completion_window": "24h",
                                                     "endpoint": "/v1/completions"})
            assert created.status_code == 200, created.text
            done = wait_until(lambda: finished(http, created.json()["id"]), timeout_s=60, what="the batch to finish")
            assert done["status"] == "completed" and done["request_counts"]["completed"] == 1, done
            assert http.get("/ready").json()["subsystems"]["batch"]["status"] == "up"
        batch_dir = Path(env["LLAMASERVE_BATCH_DIR"])
        assert batch_dir.stat().st_uid == image_user()[0] and (batch_dir / "batches.sqlite3").is_file()
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_a_batch_dir_the_user_cannot_write_leaves_inference_serving(base_checkpoint, tmp_path):
    with image_root(base_checkpoint, with_owned_dirs=False) as (root, env):
        with image_server(env, tmp_path / "server.log") as http:
            completes(http)
            for method, path in (("GET", "/v1/files"), ("GET", "/v1/batches"), ("POST", "/v1/files")):
                response = http.request(method, path)
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["code"] == "batch_unavailable" and "PermissionError" in error["message"], error
                assert str(root) not in error["message"]  # no server paths to clients
            ready = http.get("/ready")
            assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
            assert ready.json()["subsystems"]["batch"]["status"] == "down"
            assert metric(scrape(http), "llamaserve:subsystem_up", subsystem="batch") == 0.0
            completes(http)  # and it keeps serving
