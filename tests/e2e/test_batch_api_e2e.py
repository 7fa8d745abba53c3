"""The Batch API on a live server with tiny real checkpoints, through the unmodified openai SDK:
upload, create, poll, download; results equal the same requests sent online at temperature 0; a
lazily loaded model; per-line errors in custom_id order; an online request preempts a batch that
fills the engine; cancel mid-batch frees every KV block; and
a server SIGKILLed mid-batch resumes on restart with every item exactly once."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import (
    BASE_DESCRIPTOR,
    KV_CACHE_BYTES,
    MAX_SEQ_LEN,
    metric,
    ready_server,
    scrape,
    wait_answering,
    wait_until,
)
from tests.e2e.test_cli_e2e import REPO, free_port

MODEL = BASE_DESCRIPTOR
LAZY = "batch-lazy-model"
TERMINAL = ("completed", "failed", "cancelled", "expired")
POLL_S = 0.05


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in lines)


def submit(sdk: openai.OpenAI, lines: list[Any], endpoint: str):
    file = sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    assert file.object == "file" and file.purpose == "batch" and file.bytes == len(jsonl(lines))
    return sdk.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h",
                              metadata={"suite": "e2e"})


def finished(sdk: openai.OpenAI, batch_id: str, timeout_s: float = 120):
    def done():
        batch = sdk.batches.retrieve(batch_id)
        return batch if batch.status in TERMINAL else None

    return wait_until(done, timeout_s=timeout_s, interval_s=POLL_S, what=f"batch {batch_id} to finish")


def file_lines(sdk: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(text) for text in sdk.files.content(file_id).text.splitlines()]


def kv_idle(http: httpx.Client, model: str) -> bool:
    samples = scrape(http)
    return (metric(samples, "llamaserve:num_requests_running", model_name=model) == 0
            and metric(samples, "llamaserve:num_requests_waiting", model_name=model) == 0
            and metric(samples, "llamaserve:kv_cache_usage_perc", model_name=model) == 0)


@pytest.fixture(scope="module")
def server(base_checkpoint, checkpoints):
    checkpoints.get(LAZY, seed=1)
    with ready_server(MODEL, base_checkpoint, checkpoints.root, server_settings={"batch_max_in_flight": 3}) as live:
        yield live


def test_sdk_chat_batch_equals_online_with_lazy_model_and_line_errors(server):
    with server.http() as http:
        registered = http.post("/v1/models", json={"model_id": LAZY, "skip_initialize": True,
                                                   "llama_model": BASE_DESCRIPTOR})
        assert registered.status_code == 200 and registered.json()["status"] == "registered"
    bodies = {
        f"chat-{i}": {"model": MODEL if i % 2 == 0 else LAZY, "temperature": 0, "max_tokens": 6 + 3 * i,
                      "messages": [{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}]}
        for i in range(5)
    }
    good = [line(custom_id, "/v1/chat/completions", body) for custom_id, body in bodies.items()]
    bad_params = line("bad-params", "/v1/chat/completions", {**bodies["chat-0"], "temperature": 3})
    unknown = line("unknown-model", "/v1/chat/completions", {**bodies["chat-0"], "model": "no-such-model"})
    lines = [good[0], b'{"custom_id": "cut', good[1], bad_params, good[2], unknown, *good[3:]]
    with server.openai() as sdk:
        batch = submit(sdk, lines, "/v1/chat/completions")
        assert batch.status == "validating" and batch.metadata == {"suite": "e2e"}
        done = finished(sdk, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 5, 3)
        assert sdk.models.retrieve(LAZY).model_extra["status"] == "ready"  # loaded by the batch, lazily

        outputs = file_lines(sdk, done.output_file_id)
        assert [item["custom_id"] for item in outputs] == list(bodies)  # input order
        for item in outputs:
            online = sdk.chat.completions.create(**bodies[item["custom_id"]])
            body = item["response"]["body"]
            assert item["response"]["status_code"] == 200 and item["error"] is None
            assert body["choices"][0]["message"]["content"] == online.choices[0].message.content
            assert body["choices"][0]["finish_reason"] == online.choices[0].finish_reason
            assert body["usage"]["completion_tokens"] == online.usage.completion_tokens
            assert body["usage"]["prompt_tokens"] == online.usage.prompt_tokens
        assert done.usage.output_tokens == sum(item["response"]["body"]["usage"]["completion_tokens"]
                                               for item in outputs)

        errors = file_lines(sdk, done.error_file_id)
        assert [item["custom_id"] for item in errors] == [None, "bad-params", "unknown-model"]
        assert errors[0]["response"] is None and errors[0]["error"]["code"] == "invalid_json_line"
        assert errors[1]["response"]["status_code"] == 400
        assert errors[1]["response"]["body"]["error"]["param"] == "temperature"
        assert errors[2]["response"]["status_code"] == 404
        assert errors[2]["response"]["body"]["error"]["code"] == "model_not_found"

        assert done.id in [b.id for b in sdk.batches.list(limit=5)]
        assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"
        assert sdk.files.delete(batch.input_file_id).deleted
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(batch.input_file_id)


def test_sdk_completions_batch_equals_online(server):
    bodies = {f"cmpl-{i}": {"model": MODEL, "prompt": f"Once upon a time {i}", "temperature": 0, "max_tokens": 12}
              for i in range(6)}
    with server.openai() as sdk:
        done = finished(sdk, submit(sdk, [line(k, "/v1/completions", b) for k, b in bodies.items()],
                                    "/v1/completions").id)
        assert done.status == "completed" and done.error_file_id is None
        outputs = file_lines(sdk, done.output_file_id)
        assert [item["custom_id"] for item in outputs] == list(bodies)
        for item in outputs:
            online = sdk.completions.create(**bodies[item["custom_id"]])
            assert item["response"]["body"]["choices"][0]["text"] == online.choices[0].text


def test_cancel_mid_batch_keeps_finished_items_and_frees_kv_blocks(base_checkpoint, checkpoints):
    num_items = 8
    body = {"model": MODEL, "temperature": 0, "max_tokens": 200, "ignore_eos": True}
    lines = [line(f"long-{i}", "/v1/completions", {**body, "prompt": f"Item {i}:"}) for i in range(num_items)]
    with ready_server(MODEL, base_checkpoint, checkpoints.root, server_settings={"batch_max_in_flight": 2}) as live:
        with live.openai() as sdk, live.http() as http:
            batch = submit(sdk, lines, "/v1/completions")
            wait_until(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 1, timeout_s=120,
                       interval_s=POLL_S, what="a finished item")
            cancelling = sdk.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled")
            done = finished(sdk, batch.id)
            assert done.status == "cancelled" and done.cancelled_at is not None
            completed = done.request_counts.completed
            assert 1 <= completed < num_items and done.request_counts.failed == 0
            outputs = file_lines(sdk, done.output_file_id)
            assert len(outputs) == completed
            assert all(item["response"]["body"]["usage"]["completion_tokens"] == 200 for item in outputs)
            wait_until(lambda: kv_idle(http, MODEL), timeout_s=10, interval_s=POLL_S,
                       what="no running request and no KV block in use")


def test_online_request_preempts_a_batch_that_fills_the_engine(base_checkpoint, checkpoints):
    """By default a batch fills every sequence slot; an online request sent then preempts batch items
    and finishes while the first items are still running (before any could have finished); the
    preempted items resume, and every result equals the same request sent online."""
    num_items, max_batch_size = 8, 4
    body = {"model": MODEL, "temperature": 0, "max_tokens": 96, "ignore_eos": True}
    bodies = {f"fill-{i}": {**body, "prompt": f"Entry {i} reads"} for i in range(num_items)}
    with ready_server(MODEL, base_checkpoint, checkpoints.root, max_batch_size=max_batch_size) as live:
        with live.openai() as sdk, live.http() as http:
            batch = submit(sdk, [line(k, "/v1/completions", b) for k, b in bodies.items()], "/v1/completions")
            wait_until(lambda: metric(scrape(http), "llamaserve:num_requests_running", model_name=MODEL)
                       == max_batch_size, timeout_s=120, interval_s=POLL_S, what="the batch to fill the engine")
            online = sdk.completions.create(model=MODEL, prompt="Online question:", temperature=0, max_tokens=8)
            assert online.usage.completion_tokens == 8
            during = sdk.batches.retrieve(batch.id)
            assert during.status == "in_progress" and during.request_counts.completed == 0
            samples = scrape(http)
            assert metric(samples, "llamaserve:num_preemptions_total", model_name=MODEL, priority="1") >= 1
            assert metric(samples, "llamaserve:num_preemptions_total", model_name=MODEL, priority="0") == 0

            done = finished(sdk, batch.id, timeout_s=300)
            assert done.status == "completed" and done.request_counts.completed == num_items
            outputs = file_lines(sdk, done.output_file_id)
            assert [item["custom_id"] for item in outputs] == list(bodies)
            for item in outputs:  # ignore_eos is a vLLM extension: the SDK takes it in extra_body
                request = dict(bodies[item["custom_id"]])
                ignore_eos = request.pop("ignore_eos")
                alone = sdk.completions.create(**request, extra_body={"ignore_eos": ignore_eos})
                assert item["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
            wait_until(lambda: kv_idle(http, MODEL), timeout_s=10, interval_s=POLL_S,
                       what="no running request and no KV block in use")


# --------------------------------------------------------------------------- SIGKILL and restart
def start_server(port: int, batch_dir: Path, checkpoint: Path, root: Path, log_path: Path, *,
                 dtype: str = "float64", extra_flags: tuple[str, ...] = ()) -> subprocess.Popen:
    command = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
               "--checkpoint-dir", str(checkpoint), "--checkpoint-root", str(root), "--dtype", dtype,
               "--cpu-kv-cache-bytes", str(KV_CACHE_BYTES), "--max-seq-len", str(MAX_SEQ_LEN),
               "--batch-dir", str(batch_dir), "--batch-max-in-flight", "2", "--log-level", "warning", *extra_flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMASERVE_") and k != "INFERENCE_MODEL"}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        wait_answering(http, process, log_path, "/ready", timeout_s=120, interval_s=0.1, what="the server's /ready")
    return process


def finished_rows(batch_dir: Path, batch_id: str) -> dict[int, bytes]:
    """line -> result of the items the store had committed (read straight from its database)."""
    with sqlite3.connect(batch_dir / "batches.sqlite3") as db:
        rows = db.execute("SELECT line, result FROM items WHERE batch_id = ? AND state = 'done'", (batch_id,))
        return {line_no: bytes(result) for line_no, result in rows}


@pytest.mark.slow  # starts the server process twice
def test_sigkill_mid_batch_then_restart_completes_every_item_exactly_once(tmp_path, base_checkpoint, checkpoints):
    num_items = 8
    body = {"model": MODEL, "temperature": 0, "max_tokens": 64, "ignore_eos": True}
    bodies = {f"k{i}": {**body, "prompt": f"Record {i} says"} for i in range(num_items)}
    batch_dir, log_path = tmp_path / "batches", tmp_path / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    process = start_server(port, batch_dir, base_checkpoint, checkpoints.root, log_path)
    try:
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as sdk:
            batch = submit(sdk, [line(k, "/v1/completions", b) for k, b in bodies.items()], "/v1/completions")
            wait_until(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 2, timeout_s=120,
                       interval_s=POLL_S, what="two finished items")
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        before = finished_rows(batch_dir, batch.id)
        assert 2 <= len(before) < num_items, "the kill should land mid-batch"

        process = start_server(port, batch_dir, base_checkpoint, checkpoints.root, log_path)
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as sdk:
            done = finished(sdk, batch.id)
            assert done.status == "completed" and done.request_counts.completed == num_items
            assert done.request_counts.failed == 0 and done.error_file_id is None
            raw = sdk.files.content(done.output_file_id).content.splitlines()
            outputs = [json.loads(text) for text in raw]
            assert [item["custom_id"] for item in outputs] == list(bodies)  # each exactly once, in order
            for line_no, result in before.items():
                assert raw[line_no - 1] == result  # finished before the kill: kept, not redone
            for item in outputs:  # ignore_eos is a vLLM extension: the SDK takes it in extra_body
                request = dict(bodies[item["custom_id"]])
                ignore_eos = request.pop("ignore_eos")
                online = sdk.completions.create(**request, extra_body={"ignore_eos": ignore_eos})
                assert item["response"]["body"]["choices"][0]["text"] == online.choices[0].text
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-4000:]
