"""The Batch API over a FakeEngine: shapes, validation, per-line errors, priority, the in-flight cap,
cancel and resume from the same storage dir."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import pytest

from server.app import STATE_KEY, create_app
from server.batch_runner import BATCH_PRIORITY
from server.config import ServerConfig
from server.registry import REGISTRY_KEY
from tests.server.fake_engine import FakeEngineFactory, Hold, fake_spec

TERMINAL = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id: str, content: str = "hi", **body: Any) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "fake", "messages": [{"role": "user", "content": content}], **body}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


async def start(aiohttp_client, factory: FakeEngineFactory, tmp_path: Path, **overrides: Any):
    overrides.setdefault("batch_dir", tmp_path / "batches")
    config = ServerConfig(checkpoint_roots=[tmp_path], models=[fake_spec("fake", tmp_path)], **overrides)
    app = create_app(config, factory)
    client = await aiohttp_client(app)
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("fake"):
        pass
    return client


async def upload(client, data: bytes, purpose: str = "batch", filename: str = "in.jsonl"):
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", data, filename=filename, content_type="application/jsonl")
    return await client.post("/v1/files", data=form)


async def create(client, lines: list[Any], endpoint: str = "/v1/chat/completions") -> dict:
    response = await upload(client, jsonl(lines))
    assert response.status == 200, await response.text()
    file = await response.json()
    response = await client.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": endpoint,
                                                      "completion_window": "24h", "metadata": {"job": "t"}})
    assert response.status == 200, await response.text()
    return await response.json()


async def poll(fn: Callable[[], Awaitable[Any]], *, timeout_s: float = 10.0, what: str) -> Any:
    """Call fn until it returns something truthy (a bounded wait, one event-loop turn between calls)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what} (last: {value!r})"
        await asyncio.sleep(0.01)


async def batch_when(client, batch_id: str, statuses: tuple[str, ...] = TERMINAL, **kwargs: Any) -> dict:
    async def check() -> dict | None:
        batch = await (await client.get(f"/v1/batches/{batch_id}")).json()
        return batch if batch["status"] in statuses else None

    return await poll(check, what=f"batch {batch_id} to reach {statuses}", **kwargs)


async def content_lines(client, file_id: str) -> list[dict]:
    response = await client.get(f"/v1/files/{file_id}/content")
    assert response.status == 200
    return [json.loads(line) for line in (await response.read()).splitlines()]


async def error_of(response, status: int) -> dict:
    assert response.status == status, await response.text()
    return (await response.json())["error"]


@pytest.fixture
def factory() -> FakeEngineFactory:
    return FakeEngineFactory()


async def test_round_trip_shapes_order_and_per_line_errors(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path)
    lines = [chat_line("a"), b"{not json", chat_line("b", model="nope"), chat_line("c", temperature=9),
             chat_line("a"), {**chat_line("d"), "url": "/v1/completions"}, chat_line("e", stream=True),
             chat_line("f", max_tokens=10_000), chat_line("g")]
    batch = await create(client, lines)
    assert batch["object"] == "batch" and batch["status"] == "validating" and batch["metadata"] == {"job": "t"}
    assert batch["endpoint"] == "/v1/chat/completions" and batch["completion_window"] == "24h"
    assert batch["expires_at"] == batch["created_at"] + 24 * 3600
    done = await batch_when(client, batch["id"])
    assert done["status"] == "completed" and done["model"] == "fake"
    assert done["request_counts"] == {"total": 9, "completed": 2, "failed": 7}
    assert done["in_progress_at"] and done["finalizing_at"] and done["completed_at"]
    assert done["usage"]["output_tokens"] == 2 * len("Hello world!") and done["usage"]["input_tokens"] > 0

    outputs = await content_lines(client, done["output_file_id"])
    assert [line["custom_id"] for line in outputs] == ["a", "g"]
    for line in outputs:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "Hello world!"

    errors = {i: line for i, line in enumerate(await content_lines(client, done["error_file_id"]))}
    assert [line["custom_id"] for line in errors.values()] == [None, "b", "c", "a", "d", "e", "f"]
    assert errors[0]["response"] is None and errors[0]["error"]["code"] == "invalid_json_line"
    assert "Line 2" in errors[0]["error"]["message"]
    assert errors[1]["response"]["status_code"] == 404
    assert errors[1]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors[2]["response"]["status_code"] == 400
    assert errors[2]["response"]["body"]["error"]["param"] == "temperature"
    assert errors[3]["error"]["code"] == "duplicate_custom_id"
    assert errors[4]["error"]["code"] == "invalid_url"
    assert errors[5]["response"]["body"]["error"]["param"] == "stream"
    assert errors[6]["response"]["body"]["error"]["code"] == "context_length_exceeded"  # found while running

    output_file = await (await client.get(f"/v1/files/{done['output_file_id']}")).json()
    assert output_file["object"] == "file" and output_file["purpose"] == "batch_output"
    # Batch items enter the engine below online requests.
    assert {request.priority for request in factory.engines["fake"].requests} == {BATCH_PRIORITY}


async def test_completions_endpoint(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path)
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": f"prompt {i}", "max_tokens": 5}} for i in range(3)]
    done = await batch_when(client, (await create(client, lines, endpoint="/v1/completions"))["id"])
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0} and done["error_file_id"] is None
    outputs = await content_lines(client, done["output_file_id"])
    assert [line["custom_id"] for line in outputs] == ["p0", "p1", "p2"]
    assert all(line["response"]["body"]["choices"][0]["text"] == "Hello" for line in outputs)


async def test_request_errors(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path, batch_max_file_bytes=1000, batch_max_requests=3)
    assert (await error_of(await upload(client, b"{}\n", purpose="fine-tune"), 400))["param"] == "purpose"
    assert (await error_of(await upload(client, b"x" * 1001), 413))["code"] == "file_too_large"
    assert (await error_of(await upload(client, b"{}\n" * 4), 400))["code"] == "too_many_requests"
    assert (await error_of(await upload(client, b""), 400))["code"] == "empty_file"
    assert (await error_of(await client.post("/v1/files", json={}), 400))["code"] == "invalid_request"
    for content_type, data in (("multipart/form-data", b"x"), ("multipart/form-data; boundary=b", b"garbage"),
                               ("multipart/form-data; boundary=b", b"--b\r\nbroken")):
        malformed = await client.post("/v1/files", data=data, headers={"Content-Type": content_type})
        assert malformed.status == 400, await malformed.text()
    form = aiohttp.FormData()
    form.add_field("purpose", "batch" * 1000)
    form.add_field("file", b"{}\n", filename="in.jsonl")
    assert (await error_of(await client.post("/v1/files", data=form), 400))["param"] == "purpose"
    assert (await error_of(await client.get("/v1/files/file-nope"), 404))["code"] == "file_not_found"
    assert (await error_of(await client.get("/v1/batches/batch_nope"), 404))["code"] == "batch_not_found"
    file = await (await upload(client, jsonl([chat_line("a")]))).json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    assert (await error_of(await client.post("/v1/batches", json={**body, "endpoint": "/v1/embeddings"}), 400))[
        "param"] == "endpoint"
    assert (await error_of(await client.post("/v1/batches", json={**body, "completion_window": "1h"}), 400))[
        "param"] == "completion_window"
    assert (await error_of(await client.post("/v1/batches", json={**body, "extra": 1}), 400))["param"] == "extra"
    assert (await error_of(await client.post("/v1/batches", json={**body, "input_file_id": "file-x"}), 404))[
        "code"] == "file_not_found"
    assert (await error_of(await client.get("/v1/batches?limit=0"), 400))["param"] == "limit"
    assert (await error_of(await client.post("/v1/batches", data=b"{"), 400))["code"] == "invalid_json"


async def test_whole_batch_failure_when_the_input_is_gone(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path)
    file = await (await upload(client, b"\n\n")).json()  # no requests at all
    response = await client.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/completions",
                                                      "completion_window": "24h"})
    failed = await batch_when(client, (await response.json())["id"])
    assert failed["status"] == "failed" and failed["failed_at"]
    assert failed["errors"]["data"][0]["code"] == "empty_file"


async def test_lists_paginate_and_files_delete(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path)
    ids = [(await (await upload(client, jsonl([chat_line(str(i))]))).json())["id"] for i in range(3)]
    page = await (await client.get("/v1/files?limit=2")).json()
    assert page["object"] == "list" and [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = await (await client.get(f"/v1/files?limit=2&after={page['last_id']}")).json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert [f["id"] for f in (await (await client.get("/v1/files?order=asc")).json())["data"]] == ids
    deleted = await (await client.delete(f"/v1/files/{ids[1]}")).json()
    assert deleted == {"id": ids[1], "object": "file", "deleted": True}
    assert (await client.get(f"/v1/files/{ids[1]}/content")).status == 404
    assert (await (await client.get(f"/v1/files/{ids[0]}/content")).read()) == jsonl([chat_line("0")])

    batches = []
    for file_id in (ids[0], ids[2]):
        response = await client.post("/v1/batches", json={"input_file_id": file_id, "completion_window": "24h",
                                                          "endpoint": "/v1/chat/completions"})
        batches.append((await response.json())["id"])
    listed = await (await client.get("/v1/batches?limit=1")).json()
    assert [b["id"] for b in listed["data"]] == [batches[1]] and listed["has_more"]
    older = await (await client.get(f"/v1/batches?after={batches[1]}")).json()
    assert [b["id"] for b in older["data"]] == [batches[0]] and not older["has_more"]


async def test_in_flight_cap_cancel_and_no_engine_request_left(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path, batch_max_in_flight=2)
    engine = factory.engines["fake"]
    engine.hold = Hold(after=1)
    batch = await create(client, [chat_line(f"c{i}") for i in range(6)])
    await poll(lambda: _true(len(engine.requests) >= 2), what="two items in the engine")
    online = asyncio.create_task(client.post("/v1/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "x"}]}))
    await poll(lambda: _true(len(engine.requests) >= 3), what="the online request in the engine")
    # Only max_in_flight batch items at once: the online request is the third; it keeps priority 0.
    assert [request.priority for request in engine.requests] == [BATCH_PRIORITY, BATCH_PRIORITY, 0]
    engine.hold.release.set()
    assert (await online).status == 200
    engine.hold = Hold(after=1)  # the next items stop again mid-way
    in_progress = await poll(lambda: _when(client, batch["id"], lambda b: b["request_counts"]["completed"] >= 2),
                             what="two finished items")
    assert in_progress["status"] == "in_progress"
    cancelling = await (await client.post(f"/v1/batches/{batch['id']}/cancel")).json()
    assert cancelling["status"] in ("cancelling", "cancelled") and cancelling["cancelling_at"]
    done = await batch_when(client, batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"]
    completed = done["request_counts"]["completed"]
    assert 2 <= completed < 6 and done["request_counts"]["failed"] == 0
    outputs = await content_lines(client, done["output_file_id"])
    assert len(outputs) == completed
    assert engine.aborted  # the held items were aborted in the engine, not left running
    again = await (await client.post(f"/v1/batches/{batch['id']}/cancel")).json()
    assert again["status"] == "cancelled"


async def test_resume_after_restart_on_the_same_dir(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path, batch_max_in_flight=1)
    engine = factory.engines["fake"]
    engine.hold = Hold(after=1)
    batch = await create(client, [chat_line(f"r{i}") for i in range(4)])
    await poll(lambda: _true(engine.hold.reached.is_set()), what="the first item in the engine")
    await client.close()  # the app shuts down with the item in flight: it stays pending

    factory2 = FakeEngineFactory()
    client2 = await start(aiohttp_client, factory2, tmp_path, batch_max_in_flight=1)
    done = await batch_when(client2, batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    outputs = await content_lines(client2, done["output_file_id"])
    assert [line["custom_id"] for line in outputs] == ["r0", "r1", "r2", "r3"]


async def _when(client, batch_id: str, predicate: Callable[[dict], bool]) -> dict | None:
    batch = await (await client.get(f"/v1/batches/{batch_id}")).json()
    return batch if predicate(batch) else None


async def _true(value: bool) -> bool:
    return value


async def test_a_batch_past_its_window_expires_with_its_items_in_the_error_file(aiohttp_client, factory, tmp_path,
                                                                                 monkeypatch):
    from compat import batch_protocol

    monkeypatch.setitem(batch_protocol.COMPLETION_WINDOWS_S, "24h", 0)  # expires the moment it is created
    client = await start(aiohttp_client, factory, tmp_path)
    done = await batch_when(client, (await create(client, [chat_line("x"), chat_line("y")]))["id"])
    assert done["status"] == "expired" and done["expired_at"] and done["output_file_id"] is None
    errors = await content_lines(client, done["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("x", "batch_expired"), ("y", "batch_expired")]
    assert factory.engines["fake"].requests == []


async def test_a_store_that_cannot_write_fails_the_batch_instead_of_spinning(aiohttp_client, factory, tmp_path,
                                                                             monkeypatch):
    import sqlite3

    from server.batch_api import BATCH_KEY

    client = await start(aiohttp_client, factory, tmp_path)
    store = await client.app[BATCH_KEY].store()

    def disk_full(*args: Any, **kwargs: Any) -> bool:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "finish_item", disk_full)
    failed = await batch_when(client, (await create(client, [chat_line("x"), chat_line("y")]))["id"])
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "internal_error"
    assert "disk is full" in failed["errors"]["data"][0]["message"]


def test_settings_from_flags_env_and_yaml(tmp_path, monkeypatch):
    from server.__main__ import make_parser, with_batch_dir
    from server.config import ConfigError, build_config

    env = {"LLAMASERVE_BATCH_DIR": str(tmp_path / "env"), "LLAMASERVE_BATCH_MAX_FILE_BYTES": "1MiB"}
    config = build_config(make_parser().parse_args(["--batch-max-in-flight", "3", "--batch-max-requests", "10"]), env)
    assert (config.batch_dir, config.batch_max_file_bytes, config.batch_max_in_flight, config.batch_max_requests) == (
        tmp_path / "env", 1 << 20, 3, 10)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("server: {batch_dir: /data/batches, batch_max_requests: 7}\n")
    from_yaml = build_config(make_parser().parse_args(["--config", str(run_yaml)]), {})
    assert from_yaml.batch_dir == Path("/data/batches") and from_yaml.batch_max_requests == 7
    with pytest.raises(ConfigError):
        build_config(make_parser().parse_args(["--batch-max-in-flight", "-1"]), {})
    # The CLI keeps batches under the cache dir unless told otherwise; a bare ServerConfig keeps none.
    monkeypatch.setenv("LLAMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert with_batch_dir(build_config(make_parser().parse_args([]), {})).batch_dir == tmp_path / "cache" / "batches"
    assert ServerConfig().batch_dir is None


def test_batch_fills_the_engine_by_default_within_its_own_waiting_bound():
    from engine.config import EngineConfig
    from server.batch_api import BatchService

    def in_flight(engine: EngineConfig, configured: int = 0) -> int:
        return BatchService(ServerConfig(engine=engine, batch_max_in_flight=configured), registry=None).max_in_flight

    assert in_flight(EngineConfig(max_batch_size=8)) == 16  # every slot, and the next items queued
    assert in_flight(EngineConfig(max_batch_size=8, max_waiting_batch_sequences=10)) == 10  # the online queue is apart
    assert in_flight(EngineConfig(max_batch_size=8), configured=3) == 3
