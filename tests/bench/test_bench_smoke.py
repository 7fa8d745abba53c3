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


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """Our server on a tiny real-format Llama 3 checkpoint (the e2e fixtures' model)."""
    from tests.e2e.conftest import BASE_DESCRIPTOR, Checkpoints, ready_server

    base = tmp_path_factory.mktemp("bench-serve")
    checkpoints = Checkpoints(root=base / "checkpoints", outside=base / "elsewhere")
    checkpoints.root.mkdir()
    with ready_server(BASE_DESCRIPTOR, checkpoints.get(BASE_DESCRIPTOR, seed=0), checkpoints.root) as live:
        yield live


def test_serve_smoke_completions_sweep(live_server, tmp_path):
    out = tmp_path / "sweep.json"
    stdout = run_script("bench/serve.py", "--base-url", live_server.url, "--num-prompts", "4", "--random-input-len", "12",
                        "--random-output-len", "5", "--sweep", "1,2", "--result-filename", str(out), "--disable-tqdm")
    assert "Serving Benchmark Result" in stdout
    data = read_results(out)
    assert data["machine"]["ignore_eos"] is True
    for level in (1, 2):
        assert rows(out, name="failed", max_concurrency=level)[0]["value"] == 0
        # token-id prompts of 12 tokens, output held at 5 tokens by ignore_eos: 4 x (12 + 5) tokens
        total = rows(out, name="total_token_throughput", max_concurrency=level)[0]
        output = rows(out, name="output_throughput", max_concurrency=level)[0]
        assert total["value"] == pytest.approx(output["value"] * 17 / 5)
        assert rows(out, name="ttft p99", max_concurrency=level)[0]["value"] > 0
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_serve_smoke_chat_dataset_reports_failures(live_server, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(row) for row in (
        {"prompt": "Say hello."},
        {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3},
        {"prompt": "Too long an answer", "max_tokens": 100000},  # beyond the context: a 400 with its body
    )) + "\n")
    out = tmp_path / "chat.json"
    stdout = run_script("bench/serve.py", "--base-url", live_server.url, "--backend", "openai-chat", "--dataset", str(dataset),
                        "--num-prompts", "3", "--random-output-len", "4", "--max-concurrency", "2", "--result-filename", str(out),
                        "--disable-tqdm")
    failed = rows(out, name="failed")[0]
    assert failed["value"] == 1 and "HTTP 400" in failed["errors"][0]
    assert "1 x HTTP 400" in stdout
    assert rows(out, name="e2e_latency p50")[0]["value"] > 0


def test_serve_help_uses_vllm_flag_names():
    stdout = run_script("bench/serve.py", "--help")
    for flag in ("--base-url", "--model", "--num-prompts", "--random-input-len", "--random-output-len", "--dataset",
                 "--max-concurrency", "--request-rate", "--sweep", "--backend"):
        assert flag in stdout
