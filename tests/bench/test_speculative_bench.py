"""bench/speculative.py keeps running: its in-process smoke on a tiny random model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_speculative_smoke():
    done = subprocess.run([sys.executable, "bench/speculative.py", "--smoke", "--rounds", "1", "--max-tokens", "12"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("llamaserve+ngram") and "acceptance" in line for line in lines), done.stdout
    assert any("speculation speed-up, ours: x" in line for line in lines), done.stdout
    assert "greedy tokens identical with and without speculation: yes" in done.stdout
