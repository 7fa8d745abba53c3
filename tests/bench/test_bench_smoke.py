"""Smoke runs of the bench scripts on the 'tiny' config (a few requests each), so they never rot.

These check that each script runs end to end and writes the results format of bench/common.py;
the figures themselves are not checked (a real run is in bench/README.md, not in the suite).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import read_results

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_script(*argv: str, timeout_s: float = 280) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{argv[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def rows(path: Path, **where) -> list[dict]:
    return [r for r in read_results(path)["rows"] if all(r.get(k) == v for k, v in where.items())]


def test_forward_smoke(tmp_path):
    out = tmp_path / "forward.json"
    run_script("bench/forward.py", "--configs", "tiny", "--dtypes", "float32", "--batches", "1,2", "--smoke", "--json", str(out))
    decode = rows(out, name="decode", config="tiny", dtype="float32")
    assert [r["batch"] for r in decode] == [1, 2]
    assert all(r["value"] > 0 and r["unit"] == "tok/s" and r["bound"] > 0 for r in decode)
    assert len(rows(out, name="prefill", config="tiny")) == 1


def test_throughput_smoke(tmp_path):
    out = tmp_path / "throughput.json"
    run_script("bench/throughput.py", "--config", "tiny", "--concurrency", "1,2", "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--smoke", "--json", str(out))
    tput = rows(out, name="output throughput", config="tiny")
    assert [r["concurrency"] for r in tput] == [1, 2]
    assert all(r["output_tokens"] == r["requests"] * 64 for r in tput)  # ignore_eos: every request ran to max_tokens
    assert len(rows(out, name="prefix cache TTFT cached")) == 1
