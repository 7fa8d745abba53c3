"""torchrun for real (issue 16): `torchrun --nproc-per-node 2 -m server ...` on CPU (gloo) serves a tiny
2-shard Meta checkpoint with the same greedy tokens as one process, refuses to change its model set
with a clear 400, and on SIGTERM drains, stops its follower and exits with every rank; a launcher
killed outright (SIGKILL) leaves no rank behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, E2E_DTYPE, MAX_SEQ_LEN, ready_server, wait_answering, wait_until
from tests.e2e.test_cli_e2e import free_port
from tests.e2e.test_faults_e2e import _alive, children_of

REPO = Path(__file__).resolve().parents[2]
MODEL = BASE_DESCRIPTOR
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
MAX_TOKENS = 16

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # starts a torchrun job of two processes


def greedy_texts(http: httpx.Client) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def torchrun_command(checkpoint_dir: Path, http_port: int, tmp_path: Path) -> list[str]:
    # As README's torchrun section: the launcher's own flags, then `-m server` and the server's flags.
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "server", "--model", MODEL, "--checkpoint-dir", str(checkpoint_dir), "--port", str(http_port),
            "--model-parallel-size", "2", "--dtype", E2E_DTYPE, "--max-seq-len", str(MAX_SEQ_LEN),
            "--cpu-kv-cache-bytes", "8MiB", "--batch-dir", str(tmp_path / "batches"), "--log-format", "console"]


def start_torchrun(checkpoint_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    """The job started as README shows, its output in a log file: (launcher, HTTP port, log path)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMASERVE_")}
    env["PYTHONUNBUFFERED"] = "1"
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(torchrun_command(checkpoint_dir, port, tmp_path), cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
    return launcher, port, log_path


def wait_ready_ranks(http: httpx.Client, launcher: subprocess.Popen, log_path: Path) -> list[int]:
    """Wait for rank 0's /ready; the job's two ranks (rank 0 serves HTTP, rank 1 follows its steps)."""
    wait_answering(http, launcher, log_path, "/ready", timeout_s=240, interval_s=0.2, what="/ready of the torchrun job")
    ranks = children_of(launcher.pid)
    assert len(ranks) == 2, ranks
    return ranks


def stop_everything(launcher: subprocess.Popen, ranks: list[int]) -> None:
    """A failed test leaves no rank behind."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait(30)
    for pid in ranks:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_torchrun_serves_a_two_shard_checkpoint_like_one_process_and_stops_every_rank(checkpoints, tmp_path):
    two_shards = checkpoints.get("Llama3.2-1B-Instruct-2shards", seed=0, num_shards=2)
    with ready_server(MODEL, two_shards, checkpoints.root) as one_process, one_process.http() as http:
        expected = greedy_texts(http)

    launcher, port, log_path = start_torchrun(two_shards, tmp_path)
    ranks: list[int] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            ranks = wait_ready_ranks(http, launcher, log_path)

            assert greedy_texts(http) == expected  # the same greedy tokens as one process

            # The model set is fixed for the job: another model, a hot switch and an unload are a clear 400.
            other = checkpoints.get("Llama3.2-1B-Instruct-other", seed=1)
            for body in ({"model_id": "another", "checkpoint_dir": other.name},
                         {"model_id": MODEL, "checkpoint_dir": other.name}):
                refused = http.post("/v1/models", json=body)
                assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_under_torchrun"
            refused = http.delete(f"/v1/models/{MODEL}")
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_under_torchrun"
            assert [(m["id"], m["status"]) for m in http.get("/v1/models").json()["data"]] == [(MODEL, "ready")]
            assert greedy_texts(http)[:1] == expected[:1]  # and it still serves

            # SIGTERM to the launcher (what a container stop sends): torchrun passes it to every rank; rank 0
            # drains its in-flight stream to the end while the follower keeps computing, then stops it.
            body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = (line for line in response.iter_lines() if line.startswith("data: "))
                next(lines)
                launcher.send_signal(signal.SIGTERM)
                rest = list(lines)
            assert rest[-1] == "data: [DONE]", rest[-3:]
            assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length", rest[-2]
        launcher.wait(timeout=120)
        wait_until(lambda: not any(_alive(pid) for pid in ranks), timeout_s=30, what="every rank to exit")
        log_text = log_path.read_text()
        assert "model-parallel rank 1 stopping" in log_text, log_text[-4000:]  # rank 0's STOP, not a kill
        assert "could not send STOP" not in log_text, log_text[-4000:]
    finally:
        stop_everything(launcher, ranks)


def test_a_sigkilled_torchrun_launcher_leaves_no_rank_behind(checkpoints, tmp_path):
    """SIGKILL reaches only the launcher: its ranks are re-parented and, without a watch, rank 0 would
    keep serving (and holding its port) and rank 1 following, with nothing left to stop them."""
    two_shards = checkpoints.get("Llama3.2-1B-Instruct-2shards", seed=0, num_shards=2)
    launcher, port, log_path = start_torchrun(two_shards, tmp_path)
    ranks: list[int] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            ranks = wait_ready_ranks(http, launcher, log_path)
        launcher.kill()
        launcher.wait(30)
        wait_until(lambda: not any(_alive(pid) for pid in ranks), timeout_s=30, what="every rank to exit")
        assert "the torchrun launcher" in log_path.read_text(), log_path.read_text()[-4000:]
    finally:
        stop_everything(launcher, ranks)
