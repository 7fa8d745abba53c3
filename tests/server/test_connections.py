"""What one client may hold (issue 29, finding 11): a body that stalls is dropped with 408 (its
upload's temporary file removed), a connection that never sends a request is closed, and
connections past --max-connections get 503 and are closed, while the ones admitted are served."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import AsyncIterator

import pytest
from aiohttp import web

from server import drain
from server.app import create_app
from server.connections import CappedSite, watch_body
from tests.server.fake_engine import FakeEngineFactory
from tests.server.test_api import make_config, start

WAIT_S = 30  # bounds a wait on the server's own timers; a pass takes a fraction of it


async def send_head(port: int, head: str, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
    await writer.drain()
    return reader, writer


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict]:
    """One HTTP/1.1 response with a Content-Length: its status and JSON body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    length = int(headers["Content-Length"])
    return int(lines[0].split()[1]), json.loads(await asyncio.wait_for(reader.readexactly(length), WAIT_S))


# --------------------------------------------------------------------------- stalled bodies
async def test_a_body_that_stalls_is_dropped_with_408(aiohttp_client, tmp_path):
    factory = FakeEngineFactory()
    client = await start(aiohttp_client, factory, make_config(tmp_path, body_read_timeout_s=0.2))
    head = ("POST /v1/chat/completions HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n"
            "Content-Length: 1000\n")
    reader, writer = await send_head(client.port, head, b'{"model": "fake", "messages": [')  # then nothing
    status, body = await read_response(reader)
    writer.close()
    assert status == 408 and body["error"]["code"] == "body_timeout" and body["error"]["type"] == "timeout_error"
    assert factory.engines["fake"].requests == []
    assert (await client.get("/health")).status == 200  # everyone else is served meanwhile


async def test_an_upload_that_stalls_is_dropped_and_its_temporary_file_removed(aiohttp_client, tmp_path):
    from tests.server.test_batch_api import start as start_batch

    client = await start_batch(aiohttp_client, FakeEngineFactory(), tmp_path, body_read_timeout_s=0.2)
    part = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n' + b'{"a": 1}\n' * 1000)
    head = ("POST /v1/files HTTP/1.1\nHost: 127.0.0.1\nContent-Type: multipart/form-data; boundary=b\n"
            f"Content-Length: {len(part) + 100_000}\n")
    reader, writer = await send_head(client.port, head, part)  # most of the file never comes
    status, body = await read_response(reader)
    writer.close()
    assert status == 408 and body["error"]["code"] == "body_timeout"
    assert list((tmp_path / "batches").rglob(".upload-*")) == []
    assert (await (await client.get("/v1/files")).json())["data"] == []


class FakePayload:
    def __init__(self) -> None:
        self.total_bytes = 0
        self.eof = False

    def is_eof(self) -> bool:
        return self.eof


class FakeDeadline:
    def __init__(self) -> None:
        self.expired_at: float | None = None

    def reschedule(self, when: float | None) -> None:
        self.expired_at = when


async def test_a_slow_body_that_keeps_sending_is_never_dropped():
    """The bound is on silence, not on the whole upload: a 200 MB file over a slow link is fine."""
    payload, deadline = FakePayload(), FakeDeadline()

    async def a_chunk_per_period(_s: float) -> None:
        payload.total_bytes += 1
        payload.eof = payload.total_bytes == 1_000

    await watch_body(payload, deadline, 60.0, sleep=a_chunk_per_period)
    assert deadline.expired_at is None


async def test_a_body_silent_for_a_whole_period_expires_its_deadline():
    payload, deadline = FakePayload(), FakeDeadline()
    periods: list[float] = []

    async def silence(stall_s: float) -> None:
        periods.append(stall_s)
        payload.total_bytes = 10 if len(periods) == 1 else payload.total_bytes  # some bytes, then none

    await watch_body(payload, deadline, 60.0, sleep=silence)
    assert deadline.expired_at is not None and periods == [60.0, 60.0]


# --------------------------------------------------------------------------- connections
@contextlib.asynccontextmanager
async def serving(tmp_path: Path, **overrides) -> AsyncIterator[tuple[web.AppRunner, CappedSite]]:
    """The app behind the runner and site `llamaserve` listens with (server/drain.py)."""
    config = make_config(tmp_path, **overrides)
    runner = drain.make_runner(create_app(config, FakeEngineFactory()))
    await runner.setup()
    try:
        site = CappedSite(runner, "127.0.0.1", 0, max_connections=config.max_connections)
        await site.start()
        yield runner, site
    finally:
        await runner.cleanup()


async def get_health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    return (await read_response(reader))[0]


async def connections_past_the_cap(tmp_path: Path) -> None:
    async with serving(tmp_path, max_connections=2) as (runner, site):
        held = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(2)]
        assert [await get_health(*connection) for connection in held] == [200, 200]
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
        status, body = await read_response(reader)
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # closed by the server
        writer.close()
        held.pop()[1].close()  # one leaves: the next is admitted
        for _ in range(10_000):
            if len(runner.server.connections) < 2:
                break
            await asyncio.sleep(0)  # one event-loop turn: the server notices the close
        connection = await asyncio.open_connection("127.0.0.1", site.port)
        assert await get_health(*connection) == 200
        assert await get_health(*held[0]) == 200  # the admitted ones were served throughout
        for _, held_writer in (connection, *held):
            held_writer.close()


async def test_connections_past_the_cap_get_503_and_are_closed(tmp_path):
    await connections_past_the_cap(tmp_path)


def test_the_cap_holds_on_uvloop_too(tmp_path):
    """The CLI serves on uvloop when it is installed, whose transports are no asyncio.Transport."""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(connections_past_the_cap(tmp_path))


async def test_a_connection_that_never_sends_a_request_is_closed(tmp_path):
    async with serving(tmp_path, keepalive_timeout_s=0.2) as (_, site):
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
        writer.close()


def test_connection_settings_from_flags():
    from server.__main__ import make_parser
    from server.config import ConfigError, build_config

    args = ["--body-read-timeout-s", "5", "--keepalive-timeout-s", "9", "--max-connections", "64"]
    config = build_config(make_parser().parse_args(args), env={})
    assert (config.body_read_timeout_s, config.keepalive_timeout_s, config.max_connections) == (5.0, 9.0, 64)
    with pytest.raises(ConfigError, match="max_connections"):
        build_config(make_parser().parse_args(["--max-connections", "0"]), env={})
