"""The real CLI: `python -m server --config run.yaml` as a subprocess, with models from run.yaml
and from the meta-reference env vars (INFERENCE_MODEL / INFERENCE_CHECKPOINT_DIR), API keys from
run.yaml's auth section; then SIGTERM while a stream is in flight: it drains and exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.e2e.conftest import BASE_DESCRIPTOR, KV_CACHE_BYTES, MAX_SEQ_LEN, wait_answering, wait_until

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-e2e-inference"
ADMIN_KEY = "sk-e2e-admin"
FINETUNE = "my-finetune-v3"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory, checkpoints, base_checkpoint):
    finetune = checkpoints.get(FINETUNE, seed=2)
    lazy = checkpoints.get("second-weights", seed=1)
    work = tmp_path_factory.mktemp("cli")
    port = free_port()
    run_yaml = {
        "version": 2,
        "server": {"host": "127.0.0.1", "port": port, "checkpoint_roots": [str(checkpoints.root)],
                   "drain_timeout_s": 20, "log_format": "json"},
        "engine": {"dtype": "float64", "cpu_kv_cache_bytes": KV_CACHE_BYTES, "max_seq_len": MAX_SEQ_LEN},
        "auth": {"api_key": API_KEY, "admin_api_key": ADMIN_KEY},
        "models": [
            {"model_id": FINETUNE, "checkpoint_dir": str(finetune), "metadata": {"llama_model": BASE_DESCRIPTOR}},
            {"model_id": "lazy-from-yaml", "checkpoint_dir": str(lazy),
             "metadata": {"llama_model": BASE_DESCRIPTOR, "skip_initialize": True}},
        ],
    }
    config_path = work / "run.yaml"
    config_path.write_text(yaml.safe_dump(run_yaml))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMASERVE_")}
    env.update(INFERENCE_MODEL=BASE_DESCRIPTOR, INFERENCE_CHECKPOINT_DIR=str(base_checkpoint), PYTHONUNBUFFERED="1",
               LLAMASERVE_BATCH_DIR=str(work / "batches"))  # not the user's: their batches are not ours to run
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "server", "--config", str(config_path)], cwd=REPO, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=30) as anonymous:
            wait_answering(anonymous, process, log_path, "/health", timeout_s=120, interval_s=0.1, what="the CLI server's /health")
        yield process, url, log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


@pytest.mark.slow  # starts the server process
def test_cli_serves_yaml_and_env_models_with_auth_then_drains_on_sigterm(cli_server):
    process, url, log_path = cli_server
    authed = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
    anonymous = httpx.Client(base_url=url, timeout=60)
    try:
        # /health is open; everything else needs the key.
        assert anonymous.get("/health").json() == {"status": "ok"}
        assert anonymous.get("/ready").status_code == 401
        assert anonymous.get("/v1/models").status_code == 401
        wrong = anonymous.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        wait_until(lambda: authed.get("/ready").status_code == 200, timeout_s=120, interval_s=0.1, what="/ready")

        # run.yaml's models and INFERENCE_MODEL's, registered at start; skip_initialize stays unloaded.
        models = {m["id"]: m for m in authed.get("/v1/models").json()["data"]}
        assert set(models) == {FINETUNE, "lazy-from-yaml", BASE_DESCRIPTOR}
        assert models[FINETUNE]["status"] == "ready" and models[FINETUNE]["llama_model"] == BASE_DESCRIPTOR
        assert models[BASE_DESCRIPTOR]["status"] == "ready"
        assert models["lazy-from-yaml"]["status"] == "registered" and models["lazy-from-yaml"]["memory_bytes"] is None

        with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as sdk:
            texts = {
                model: sdk.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=8)
                .choices[0].message.content
                for model in (FINETUNE, BASE_DESCRIPTOR, "lazy-from-yaml")
            }
            assert len(set(texts.values())) == 3  # three checkpoints, three different weights
        traced = authed.post("/v1/chat/completions", headers={"X-Request-Id": "e2e-trace-1"},
                             json={"model": FINETUNE, "messages": MESSAGES, "temperature": 0, "max_tokens": 5})
        assert traced.status_code == 200 and traced.headers["X-Request-Id"] == "e2e-trace-1"
        with openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(model=FINETUNE, messages=MESSAGES, max_tokens=1)

        # Registering needs the admin key: the inference key gets 403.
        body = {"model_id": "admin-only", "checkpoint_dir": BASE_DESCRIPTOR, "skip_initialize": True}
        assert authed.post("/v1/models", json=body).status_code == 403
        admin = anonymous.post("/v1/models", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert admin.status_code == 200 and admin.json()["status"] == "registered"

        # SIGTERM mid-stream: the stream still runs to its end, then the process exits 0.
        request = {"model": BASE_DESCRIPTOR, "prompt": "Count:", "temperature": 0, "max_tokens": 64, "stream": True}
        with authed.stream("POST", "/v1/completions", json=request) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2].replace(" ", "")
        started = time.monotonic()
        assert process.wait(timeout=60) == 0, log_path.read_text()[-4000:]
        assert time.monotonic() - started < 30
    finally:
        authed.close()
        anonymous.close()
    log_text = log_path.read_text()
    assert "Traceback" not in log_text, log_text[-4000:]
    # One JSON access-log line per request: request id, model, token counts, TTFT, latency.
    records = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
    (access,) = [r for r in records if r.get("request_id") == "e2e-trace-1"]
    assert access["model"] == FINETUNE and access["status"] == 200 and access["path"] == "/v1/chat/completions"
    assert access["completion_tokens"] == 5 and access["prompt_tokens"] > 0
    assert 0 < access["ttft_s"] <= access["latency_s"]
    # Model lifecycle events are logged too.
    assert any(FINETUNE in r.get("event", "") and "ready in" in r.get("event", "") for r in records)


@pytest.mark.slow  # starts the server process
def test_cli_from_env_alone_exits_cleanly_on_sigterm_while_loading(tmp_path, base_checkpoint):
    """Settings from LLAMASERVE_* env vars only (no run.yaml, no flags); SIGTERM before the model is
    loaded (a pod stopped during start-up) still exits 0, without a traceback."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMASERVE_")}
    env.update(INFERENCE_MODEL=BASE_DESCRIPTOR, INFERENCE_CHECKPOINT_DIR=str(base_checkpoint), PYTHONUNBUFFERED="1",
               LLAMASERVE_HOST="127.0.0.1", LLAMASERVE_PORT=str(port), LLAMASERVE_DTYPE="float64",
               LLAMASERVE_CPU_KV_CACHE_BYTES="8MiB", LLAMASERVE_MAX_SEQ_LEN=str(MAX_SEQ_LEN),
               LLAMASERVE_BATCH_DIR=str(tmp_path / "batches"))
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "server"], cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            wait_answering(http, process, log_path, "/health", timeout_s=120, interval_s=0.05, what="/health")
            ready = http.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "loading"  # the port opens before the load ends
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-4000:]
