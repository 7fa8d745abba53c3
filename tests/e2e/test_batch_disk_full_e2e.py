"""The Batch API when its disk fills up (issue 29, finding 6 and the issue's fault test): a batch runs
on a small tmpfs, the test fills the tmpfs, the runner cannot record results (nor the failure), the
server is SIGKILLed while it keeps trying, then restarted with room again. Nothing committed is lost,
every batch and file is as it was or finishes exactly once, and online requests are served
throughout. Root mounts the tmpfs; elsewhere the test skips.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sqlite3
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, wait_until
from tests.e2e.test_batch_api_e2e import finished_rows, start_server
from tests.e2e.test_cli_e2e import free_port

pytestmark = pytest.mark.slow  # starts the server process twice
MODEL = BASE_DESCRIPTOR
DISK_SIZE = "16m"  # room for the store of a few small batches; the filler takes the rest
NUM_ITEMS = 8
MAX_TOKENS = 16  # a few tenths of a second an item here: the disk fills while most items still wait
TERMINAL = ("completed", "failed", "cancelled", "expired")


@contextlib.contextmanager
def small_disk(path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(disk: Path) -> Path:
    """Write a file until the file system has no byte left; returns it."""
    filler = disk / "filler"
    chunk_bytes = 1 << 20
    with open(filler, "wb", buffering=0) as out:
        while chunk_bytes:
            try:
                if out.write(b"\0" * chunk_bytes) < chunk_bytes:
                    chunk_bytes //= 2  # a short write: the last pages
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                chunk_bytes //= 2
    return filler


def start(batch_dir: Path, checkpoint: Path, root: Path, log_path: Path, port: int) -> subprocess.Popen:
    return start_server(port, batch_dir, checkpoint, root, log_path, dtype="float32", extra_flags=("--no-cpu-kernels",))


def serves_online(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Still there?", "max_tokens": 3,
                                                  "temperature": 0})
    assert response.status_code == 200, response.text
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text


def submit(http: httpx.Client, prefix: str, num_items: int, max_tokens: int) -> tuple[str, str]:
    """(input file id, batch id) of a /v1/completions batch."""
    lines = [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"Line {i} of {prefix}", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}} for i in range(num_items)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)})
    assert file.status_code == 200, file.text
    batch = http.post("/v1/batches", json={"input_file_id": file.json()["id"], "endpoint": "/v1/completions",
                                           "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    return file.json()["id"], batch.json()["id"]


def batch_of(http: httpx.Client, batch_id: str) -> dict | None:
    response = http.get(f"/v1/batches/{batch_id}")
    return response.json() if response.status_code == 200 else None  # 503 while the batch API is down


def finished(http: httpx.Client, batch_id: str) -> dict:
    return wait_until(lambda: (b := batch_of(http, batch_id)) is not None and b["status"] in TERMINAL and b,
                      timeout_s=120, what=f"batch {batch_id} to finish")


def content(http: httpx.Client, file_id: str) -> bytes:
    response = http.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return response.content


def batch_subsystem(http: httpx.Client) -> dict:
    return http.get("/ready").json()["subsystems"]["batch"]


def test_a_full_disk_under_a_running_batch_then_sigkill_and_restart_loses_nothing(tmp_path, base_checkpoint,
                                                                                  checkpoints):
    with small_disk(tmp_path / "disk") as disk:
        batch_dir, log_path, port = disk / "batches", tmp_path / "server.log", free_port()
        process = start(batch_dir, base_checkpoint, checkpoints.root, log_path, port)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                _, earlier_id = submit(http, "earlier", 1, 2)
                earlier = finished(http, earlier_id)
                assert earlier["status"] == "completed"
                earlier_output = content(http, earlier["output_file_id"])
                input_id, running_id = submit(http, "running", NUM_ITEMS, MAX_TOKENS)
                input_bytes = content(http, input_id)
                wait_until(lambda: (b := batch_of(http, running_id)) and b["request_counts"]["completed"] >= 1,
                           timeout_s=60, interval_s=0.02, what="a finished item")

                filler = fill(disk)
                down = wait_until(lambda: (s := batch_subsystem(http))["status"] == "down" and s, timeout_s=60,
                                  interval_s=0.02, what="the batch subsystem to report the full disk")
                assert "full" in down["reason"], down
                serves_online(http)  # inference does not care
            process.send_signal(signal.SIGKILL)  # while the runner keeps trying to write
            process.wait(timeout=30)

            filler.unlink()  # room again
            before = finished_rows(batch_dir, running_id)
            assert 1 <= len(before) < NUM_ITEMS, "the disk should fill up mid-batch"
            process = start(batch_dir, base_checkpoint, checkpoints.root, log_path, port)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                serves_online(http)
                done = finished(http, running_id)
                assert done["status"] == "completed", done
                assert done["request_counts"] == {"total": NUM_ITEMS, "completed": NUM_ITEMS, "failed": 0}
                raw = content(http, done["output_file_id"]).splitlines()
                assert [json.loads(line)["custom_id"] for line in raw] == [f"running{i}" for i in range(NUM_ITEMS)]
                for line_no, result in before.items():
                    assert raw[line_no - 1] == result  # committed before the disk filled: kept, not redone
                assert content(http, input_id) == input_bytes
                assert batch_of(http, earlier_id) == earlier and content(http, earlier["output_file_id"]) == earlier_output
                assert batch_subsystem(http)["status"] == "up"
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
        with sqlite3.connect(batch_dir / "batches.sqlite3") as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            states = dict(db.execute("SELECT id, status FROM batches"))
        assert states == {earlier_id: "completed", running_id: "completed"}
