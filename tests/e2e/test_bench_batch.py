"""Smoke test of bench/batch.py: the whole script (server start, four modes, TTFT probes, report)
on a tiny checkpoint with a few prompts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.test_cli_e2e import REPO


@pytest.mark.slow  # starts a server process
def test_bench_batch_runs_on_a_tiny_checkpoint(base_checkpoint):
    command = [sys.executable, "bench/batch.py", "--tiny", "--checkpoint-dir", str(base_checkpoint),
               "--prompts", "4", "--max-tokens", "3", "--ttft-probes", "2", "--concurrency", "4"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for mode in ("Batch API (upload, run, download)", "/v1/batch/completions", "one request at a time",
                 "concurrent requests (4 in flight)", "idle server", "while a Batch API batch runs",
                 "while /v1/batch/completions runs"):
        row = next((line for line in lines if line.startswith(mode)), None)
        assert row is not None, f"no {mode!r} row in:\n{done.stdout}"
    batch_row = next(line for line in lines if line.startswith("Batch API"))
    assert batch_row.split()[-4] == "4"  # every prompt went through the Batch API
