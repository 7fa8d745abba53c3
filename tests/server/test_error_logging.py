"""Every unexpected failure (a 5xx that no ApiError announced) is logged with its traceback, wherever
it happens: before a response, in the middle of a stream, in one item of a /v1/batch/* call
(issue 29, finding 11). Errors the server meant (ApiError, 4xx) are not logged as failures."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from structlog.testing import LogCapture

from engine.types import EngineError, RequestOutput
from tests.server.test_api import CHAT, client, error_of, factory, sse_events  # noqa: F401 - fixtures


@pytest.fixture
def logs():
    """The log entries as the CLI's renderer gets them: exc_info already rendered as `exception`."""
    capture = LogCapture()
    config = structlog.get_config()
    structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.format_exc_info,
                                    capture])
    yield capture.entries
    structlog.configure(**config)


def failures(logs: list[dict]) -> list[dict]:
    return [entry for entry in logs if entry["level"] == "error"]


def assert_traceback_of(entry: dict, exc_type: type, message: str) -> None:
    traceback = entry.get("exception", "")
    assert traceback.startswith("Traceback (most recent call last):"), entry
    assert traceback.rstrip().endswith(f"{exc_type.__module__}.{exc_type.__qualname__}: {message}".removeprefix(
        "builtins.")), traceback


@pytest.mark.parametrize("exc", [EngineError("the step failed"), RuntimeError("a bug")])
async def test_an_unexpected_error_before_the_response_is_logged_with_its_traceback(client, factory, logs, exc):
    factory.engines["fake"].raise_on_generate = exc
    await error_of(await client.post("/v1/chat/completions", json=CHAT), 500)
    [entry] = failures(logs)
    assert entry["request_id"] and entry["path"] == "/v1/chat/completions"
    assert_traceback_of(entry, type(exc), str(exc))


async def test_an_unexpected_error_mid_stream_is_logged_with_its_traceback(client, factory, logs):
    engine = factory.engines["fake"]

    async def one_delta_then_a_bug(request):
        yield RequestOutput(request_id=request.request_id, new_token_ids=[72], text_delta="H",
                            num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=1)
        raise RuntimeError("a bug mid-stream")

    engine.generate = one_delta_then_a_bug
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = sse_events(await asyncio.wait_for(response.text(), 10))
    assert events[-2]["error"]["code"] == "internal_error"
    [entry] = failures(logs)
    assert entry["event"] == "stream failed" and entry["request_id"] == response.headers["X-Request-Id"]
    assert_traceback_of(entry, RuntimeError, "a bug mid-stream")


async def test_an_unexpected_error_in_one_batch_item_is_logged_with_its_traceback(client, factory, logs):
    factory.engines["fake"].raise_on_generate = RuntimeError("a bug in one item")
    response = await client.post("/v1/batch/completions", json={"model": "fake", "prompts": ["a"]})
    assert response.status == 200 and (await response.json())["data"][0]["error"]["code"] == "internal_error"
    [entry] = failures(logs)
    assert_traceback_of(entry, RuntimeError, "a bug in one item")


async def test_errors_the_server_meant_are_not_logged_as_failures(client, factory, logs):
    await error_of(await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404)
    await error_of(await client.post("/v1/chat/completions", json={**CHAT, "n": 0}), 400)
    assert failures(logs) == []
