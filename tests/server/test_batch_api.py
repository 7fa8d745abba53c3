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


async def upload(client, data: bytes, purpose: str = "batch", filename: str = "in.jsonl", **fields: str):
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    for name, value in fields.items():
        form.add_field(name, value)
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
    bad_json = await client.post("/v1/batches", data=b"{", headers={"Content-Type": "application/json"})
    assert (await error_of(bad_json, 400))["code"] == "invalid_json"


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


# --------------------------------------------------------------------------- a broken store (issue 29, finding 1)
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
BATCH_ROUTES = (("GET", "/v1/files"), ("GET", "/v1/files/file-x"), ("GET", "/v1/files/file-x/content"),
                ("DELETE", "/v1/files/file-x"), ("GET", "/v1/batches"), ("GET", "/v1/batches/batch_x"),
                ("POST", "/v1/batches/batch_x/cancel"))


def broken_batch_dir(tmp_path: Path, breakage: str) -> tuple[Path, str]:
    """A batch dir the store cannot open, and a word its reason names."""
    if breakage == "under_a_file":
        (tmp_path / "a-file").write_bytes(b"not a folder")
        return tmp_path / "a-file" / "batches", "NotADirectoryError"
    batch_dir = tmp_path / "batches"
    batch_dir.mkdir()
    (batch_dir / "batches.sqlite3").write_bytes(b"this is not an SQLite database" * 100)
    return batch_dir, "not a database"


async def text_metric(client, line_start: str) -> str:
    text = await (await client.get("/metrics")).text()
    return next((line for line in text.splitlines() if line.startswith(line_start)), "")


@pytest.mark.parametrize("breakage", ["under_a_file", "corrupt_database"])
async def test_a_batch_store_that_cannot_open_leaves_inference_serving(aiohttp_client, factory, tmp_path, breakage):
    batch_dir, word = broken_batch_dir(tmp_path, breakage)
    client = await start(aiohttp_client, factory, tmp_path, batch_dir=batch_dir)  # starts: no exception escapes
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    for method, path in BATCH_ROUTES:
        error = await error_of(await client.request(method, path), 503)
        assert error["code"] == "batch_unavailable" and error["type"] == "service_unavailable", error
        assert word in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert (await error_of(await upload(client, jsonl([chat_line("a")])), 503))["code"] == "batch_unavailable"
    create = await client.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions",
                                                    "completion_window": "24h"})
    assert (await error_of(create, 503))["code"] == "batch_unavailable"
    # Readiness is about inference: it stays 200 and says what is down, and why.
    ready = await client.get("/ready")
    body = await ready.json()
    assert ready.status == 200 and body["status"] == "ready", body
    assert body["subsystems"]["batch"]["status"] == "down" and word in body["subsystems"]["batch"]["reason"]
    assert await text_metric(client, 'llamaserve:subsystem_up{subsystem="batch"}') == \
        'llamaserve:subsystem_up{subsystem="batch"} 0.0'


async def test_the_batch_store_comes_back_once_it_can_open(aiohttp_client, factory, tmp_path, monkeypatch):
    from server import batch_api
    from server.subsystems import Backoff

    monkeypatch.setattr(batch_api, "RESTART_BACKOFF", Backoff(initial_s=0.01, max_s=0.05))
    batch_dir, _ = broken_batch_dir(tmp_path, "under_a_file")
    client = await start(aiohttp_client, factory, tmp_path, batch_dir=batch_dir)
    assert (await client.get("/v1/files")).status == 503
    (tmp_path / "a-file").unlink()  # the operator fixes the storage; the server retries on its own

    async def up() -> bool:
        return (await client.get("/v1/files")).status == 200

    await poll(up, what="the batch API to come back")
    ready = await (await client.get("/ready")).json()
    assert ready["subsystems"]["batch"]["status"] == "up" and ready["subsystems"]["batch"]["restarts"] >= 1
    assert await text_metric(client, 'llamaserve:subsystem_up{subsystem="batch"}') == \
        'llamaserve:subsystem_up{subsystem="batch"} 1.0'
    done = await batch_when(client, (await create(client, [chat_line("x")]))["id"])
    assert done["status"] == "completed"


async def test_a_folder_inside_the_files_dir_is_left_alone(aiohttp_client, factory, tmp_path):
    (tmp_path / "batches" / "files" / "stray-folder").mkdir(parents=True)
    client = await start(aiohttp_client, factory, tmp_path)
    done = await batch_when(client, (await create(client, [chat_line("x")]))["id"])
    assert done["status"] == "completed" and (tmp_path / "batches" / "files" / "stray-folder").is_dir()


async def test_a_runner_that_cannot_record_a_failure_restarts_and_finishes_the_batch(aiohttp_client, factory, tmp_path,
                                                                                    monkeypatch):
    """Issue 29, finding 6: with the disk full even fail_batch raises; the runner used to end there,
    silently, with the batch in_progress until a restart."""
    from server import batch_api
    from server.batch_api import BATCH_KEY
    from server.subsystems import Backoff
    from tests.server.test_batch_store import CommitFails

    monkeypatch.setattr(batch_api, "RESTART_BACKOFF", Backoff(initial_s=0.01, max_s=0.05))
    client = await start(aiohttp_client, factory, tmp_path, batch_max_in_flight=1)
    store = await client.app[BATCH_KEY].store()
    engine = factory.engines["fake"]
    engine.hold = Hold(after=1)
    batch = await create(client, [chat_line(f"d{i}") for i in range(3)])
    await poll(lambda: _true(engine.hold.reached.is_set()), what="the first item in the engine")
    disk = CommitFails(store._db)
    monkeypatch.setattr(store, "_db", disk)  # the disk fills up under the running batch
    engine.hold.release.set()

    async def batch_down() -> dict | None:
        ready = await (await client.get("/ready")).json()
        return ready if ready["subsystems"]["batch"]["status"] == "down" else None

    ready = await poll(batch_down, what="the batch subsystem to report the failure")
    assert ready["status"] == "ready" and "disk is full" in ready["subsystems"]["batch"]["reason"]
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200  # inference unaffected
    disk.full = False  # space again: the runner restarts on its own and the batch carries on

    async def completed() -> dict | None:
        response = await client.get(f"/v1/batches/{batch['id']}")
        body = await response.json()
        return body if response.status == 200 and body["status"] in TERMINAL else None

    done = await poll(completed, what="the batch to finish once the disk has room")
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert [line["custom_id"] for line in await content_lines(client, done["output_file_id"])] == ["d0", "d1", "d2"]
    batch_state = (await (await client.get("/ready")).json())["subsystems"]["batch"]
    assert batch_state["status"] == "up" and batch_state["restarts"] >= 1


# --------------------------------------------------------------------------- retention (issue 29, finding 3)
DAY_S = 24 * 3600


async def test_files_expire_as_their_client_asks_or_after_the_retention(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path, batch_retention_s=7 * DAY_S)
    default = await (await upload(client, jsonl([chat_line("a")]))).json()
    assert default["expires_at"] == default["created_at"] + 7 * DAY_S
    asked = await (await upload(client, jsonl([chat_line("a")]), **{"expires_after[anchor]": "created_at",
                                                                    "expires_after[seconds]": "3600"})).json()
    assert asked["expires_at"] == asked["created_at"] + 3600
    for fields, param in (({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
                           "expires_after[anchor]"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "59"},
                           "expires_after[seconds]"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "²"},
                           "expires_after[seconds]"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "9" * 5000},
                           "expires_after[seconds]"),
                          ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]")):
        error = await error_of(await upload(client, jsonl([chat_line("a")]), **fields), 400)
        assert error["param"] == param and error["code"] == "invalid_value", error

    body = {"input_file_id": asked["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "output_expires_after": {"anchor": "created_at", "seconds": 7200}}
    too_soon = await client.post("/v1/batches", json={**body, "output_expires_after": {"anchor": "created_at",
                                                                                       "seconds": 5}})
    assert "output_expires_after" in (await error_of(too_soon, 400))["param"]
    done = await batch_when(client, (await (await client.post("/v1/batches", json=body)).json())["id"])
    output = await (await client.get(f"/v1/files/{done['output_file_id']}")).json()
    assert output["expires_at"] == output["created_at"] + 7200


async def test_expired_files_are_purged_when_the_store_opens(aiohttp_client, factory, tmp_path):
    from server.batch_store import BatchStore
    from tests.server.test_batch_store import Clock, add_input

    a_month_ago = Clock(time.time() - 31 * DAY_S)
    earlier = BatchStore(tmp_path / "batches", max_file_bytes=1 << 20, max_requests=10, clock=a_month_ago)
    old = add_input(earlier)  # a previous run's upload, expired since
    earlier.close()
    client = await start(aiohttp_client, factory, tmp_path)
    assert (await client.get(f"/v1/files/{old.id}")).status == 404
    await poll(lambda: _true(not (tmp_path / "batches" / "files" / old.id).exists()), what="the purge")


# --------------------------------------------------------------------------- ownership (issue 29, finding 3)
def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class As:
    """The test client, with one API key on every request."""

    def __init__(self, client, key: str) -> None:
        self.client, self.headers = client, bearer(key)

    def get(self, path: str):
        return self.client.get(path, headers=self.headers)

    def delete(self, path: str):
        return self.client.delete(path, headers=self.headers)

    def post(self, path: str, **kwargs: Any):
        return self.client.post(path, headers=self.headers, **kwargs)

    async def upload(self, data: bytes):
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename="in.jsonl", content_type="application/jsonl")
        return await self.post("/v1/files", data=form)


async def sees_none_of(other: As, file_id: str, batch: dict) -> None:
    """`other` finds nothing of these objects: 404 as if absent, and empty lists."""
    assert (await (await other.get("/v1/files")).json())["data"] == []
    assert (await (await other.get("/v1/batches")).json())["data"] == []
    for file in (file_id, batch["output_file_id"]):
        assert (await error_of(await other.get(f"/v1/files/{file}"), 404))["code"] == "file_not_found"
        assert (await error_of(await other.get(f"/v1/files/{file}/content"), 404))["code"] == "file_not_found"
    assert (await error_of(await other.delete(f"/v1/files/{file_id}"), 404))["code"] == "file_not_found"
    for path in (f"/v1/batches/{batch['id']}", ):
        assert (await error_of(await other.get(path), 404))["code"] == "batch_not_found"
    assert (await error_of(await other.post(f"/v1/batches/{batch['id']}/cancel"), 404))["code"] == "batch_not_found"
    reuse = await other.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"})
    assert (await error_of(reuse, 404))["code"] == "file_not_found"
    for listing in (f"/v1/files?after={file_id}", f"/v1/batches?after={batch['id']}"):
        assert (await error_of(await other.get(listing), 400))["param"] == "after"  # no object with that id


async def test_each_api_key_sees_only_its_own_files_and_batches(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path, api_key="sk-main", admin_api_key="sk-admin",
                         named_api_keys=(("alice", "sk-alice"), ("bob", "sk-bob"), ("alice", "sk-alice-rotated")))
    alice, bob = As(client, "sk-alice"), As(client, "sk-bob")
    file = await (await alice.upload(jsonl([chat_line("a")]))).json()
    created = await (await alice.post("/v1/batches", json={"input_file_id": file["id"], "completion_window": "24h",
                                                           "endpoint": "/v1/chat/completions"})).json()

    async def done() -> dict | None:
        batch = await (await alice.get(f"/v1/batches/{created['id']}")).json()
        return batch if batch["status"] in TERMINAL else None

    batch = await poll(done, what="alice's batch")
    assert batch["status"] == "completed"
    for other in (bob, As(client, "sk-main"), As(client, "sk-admin")):
        await sees_none_of(other, file["id"], batch)
    # A name owns its objects: alice's second (rotated) key sees them; the owner deletes them.
    rotated = As(client, "sk-alice-rotated")
    assert [f["id"] for f in (await (await rotated.get("/v1/files?order=asc")).json())["data"]] == [
        file["id"], batch["output_file_id"]]
    assert (await (await rotated.get(f"/v1/batches/{batch['id']}")).json())["id"] == batch["id"]
    assert (await (await alice.delete(f"/v1/files/{file['id']}")).json())["deleted"]
    assert (await error_of(await client.get("/v1/files"), 401))["code"] == "invalid_api_key"


async def test_the_admin_key_does_not_see_the_inference_keys_objects(aiohttp_client, factory, tmp_path):
    """Before owners, every key holder listed, read and deleted every file and batch."""
    client = await start(aiohttp_client, factory, tmp_path, api_key="sk-main", admin_api_key="sk-admin")
    main = As(client, "sk-main")
    file = await (await main.upload(jsonl([chat_line("a")]))).json()
    admin = As(client, "sk-admin")
    assert (await (await admin.get("/v1/files")).json())["data"] == []
    assert (await admin.get(f"/v1/files/{file['id']}/content")).status == 404
    assert (await admin.delete(f"/v1/files/{file['id']}")).status == 404
    assert (await (await main.get(f"/v1/files/{file['id']}/content")).read()) == jsonl([chat_line("a")])


# --------------------------------------------------------------------------- quotas (issue 29, finding 3)
async def test_a_full_quota_is_a_clear_429_for_that_key_only(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path, batch_quota_files=2, batch_quota_bytes=1000,
                         batch_quota_batches=1, named_api_keys=(("alice", "sk-alice"), ("bob", "sk-bob")))
    alice, bob = As(client, "sk-alice"), As(client, "sk-bob")
    big = await alice.upload(b"x" * 1001)  # more than the quota: refused while it streams
    error = await error_of(big, 429)
    assert (error["code"], error["type"], error["param"]) == ("storage_quota_exceeded", "insufficient_quota", "file")
    assert "--batch-quota-bytes" in error["message"]
    file = await (await alice.upload(jsonl([chat_line("a")]))).json()
    batch = await (await alice.post("/v1/batches", json={"input_file_id": file["id"], "completion_window": "24h",
                                                         "endpoint": "/v1/chat/completions"})).json()
    again = await alice.post("/v1/batches", json={"input_file_id": file["id"], "completion_window": "24h",
                                                  "endpoint": "/v1/chat/completions"})
    assert (await error_of(again, 429))["code"] == "batch_quota_exceeded"

    async def done() -> dict | None:
        found = await (await alice.get(f"/v1/batches/{batch['id']}")).json()
        return found if found["status"] in TERMINAL else None

    assert (await poll(done, what="alice's batch"))["status"] == "completed"  # its output is the second file
    full = await error_of(await alice.upload(jsonl([chat_line("b")])), 429)
    assert full["code"] == "file_quota_exceeded" and "DELETE /v1/files" in full["message"]
    assert (await bob.upload(jsonl([chat_line("b")]))).status == 200  # bob's quota is his own
    assert (await alice.delete(f"/v1/files/{file['id']}")).status == 200
    assert (await alice.upload(jsonl([chat_line("b")]))).status == 200  # room again


def test_quota_and_retention_settings(tmp_path):
    from server.__main__ import make_parser
    from server.config import ConfigError, build_config

    config = build_config(make_parser().parse_args(["--batch-quota-bytes", "5GiB", "--batch-quota-files", "7"]),
                          {"LLAMASERVE_BATCH_QUOTA_BATCHES": "3", "LLAMASERVE_BATCH_RETENTION_S": "0"})
    assert (config.batch_quota_bytes, config.batch_quota_files, config.batch_quota_batches, config.batch_retention_s) \
        == (5 << 30, 7, 3, 0)
    defaults = ServerConfig()
    assert (defaults.batch_quota_files, defaults.batch_quota_bytes, defaults.batch_quota_batches,
            defaults.batch_retention_s) == (10_000, 10 * 10**9, 1_000, 30 * 24 * 3600)
    for flag in ("--batch-quota-files", "--batch-quota-bytes", "--batch-quota-batches", "--batch-retention-s"):
        with pytest.raises(ConfigError):
            build_config(make_parser().parse_args([flag, "-1"]), {})


async def test_an_unexpected_item_error_is_logged_with_its_traceback(aiohttp_client, factory, tmp_path):
    """Issue 29, finding 11: the item got its internal_error line, and the server log had nothing."""
    from structlog.contextvars import merge_contextvars
    from structlog.testing import capture_logs

    client = await start(aiohttp_client, factory, tmp_path)
    factory.engines["fake"].raise_on_generate = RuntimeError("a bug in the engine")
    with capture_logs(processors=[merge_contextvars]) as logs:
        done = await batch_when(client, (await create(client, [chat_line("x")]))["id"])
    assert done["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    (line,) = await content_lines(client, done["error_file_id"])
    assert line["response"]["body"]["error"]["code"] == "internal_error"
    (logged,) = [entry for entry in logs if entry["event"] == "batch item failed"]
    assert logged["batch_id"] == done["id"] and logged["custom_id"] == "x" and logged["log_level"] == "error"
    assert isinstance(logged["exc_info"], RuntimeError) and "a bug in the engine" in str(logged["exc_info"])


async def test_a_closed_batch_service_opens_nothing_again(tmp_path):
    """A request still running at shutdown must not start the store again after the app closed it."""
    from server.batch_api import BatchService
    from server.errors import ApiError

    service = BatchService(ServerConfig(batch_dir=tmp_path / "batches"), registry=None)
    await service.close()
    with pytest.raises(ApiError) as raised:
        await service.store()
    assert raised.value.status == 503 and raised.value.code == "shutting_down"
    assert not (tmp_path / "batches").exists()


async def test_an_upload_that_passes_the_bytes_quota_is_never_stored(aiohttp_client, factory, tmp_path, monkeypatch):
    """Cut off mid-stream, the upload is refused there: even if room frees meanwhile (another upload
    deleted), nothing is stored, least of all the part that was received."""
    from server.batch_api import BATCH_KEY

    client = await start(aiohttp_client, factory, tmp_path, batch_quota_bytes=1000)
    store = await client.app[BATCH_KEY].store()
    monkeypatch.setattr(store, "check_file_quota", lambda owner, num_bytes: None)  # room again, by now
    error = await error_of(await upload(client, b"x" * (1 << 17)), 429)
    assert error["code"] == "storage_quota_exceeded"
    assert (await (await client.get("/v1/files")).json())["data"] == []
    assert [path.name for path in (tmp_path / "batches" / "files").iterdir()] == []
