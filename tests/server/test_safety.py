"""Hostile and oversized client input (issue 16): every one is a 4xx in OpenAI's error shape, refused
before the work it would cause (encoding, building engine requests), never a 500."""

from __future__ import annotations

import asyncio

import pytest

from compat import limits
from engine.types import InvalidRequest
from tests.server.fake_engine import FakeEngineFactory
from tests.server.test_api import CHAT, error_of, make_config, start


@pytest.fixture
def factory() -> FakeEngineFactory:
    return FakeEngineFactory()


@pytest.fixture
async def client(aiohttp_client, factory, tmp_path):
    return await start(aiohttp_client, factory, make_config(tmp_path))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def chat_body_with_parameters(parameters_json: str) -> bytes:
    return (
        b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
        b'"function": {"name": "f", "parameters": {"a": ' + parameters_json.encode() + b"}}}]}"
    )


@pytest.mark.parametrize("depth", [limits.MAX_JSON_DEPTH + 1, 1_000, 100_000])
async def test_deeply_nested_json_in_the_body_is_a_400(client, depth):
    response = await client.post("/v1/chat/completions", data=chat_body_with_parameters(nested(depth)),
                                 headers={"Content-Type": "application/json"})
    error = await error_of(response, 400)
    assert error["code"] == "invalid_json" and "nested too deeply" in error["message"]


async def test_nesting_within_the_limit_is_served(client):
    response = await client.post("/v1/chat/completions", data=chat_body_with_parameters(nested(10)),
                                 headers={"Content-Type": "application/json"})
    assert response.status == 200, await response.text()


@pytest.mark.parametrize("depth", [limits.MAX_JSON_DEPTH + 1, 5_000])
async def test_deeply_nested_tool_call_arguments_are_a_400(client, depth):
    arguments = '{"a": ' + nested(depth) + "}"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                               "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    response = await client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    error = await error_of(response, 400)
    assert error["param"] == "messages[1].tool_calls[0].function.arguments"


async def test_deeply_nested_register_metadata_is_a_400(client):
    body = b'{"model_id": "x", "metadata": {"a": ' + nested(2_000).encode() + b"}}"
    error = await error_of(await client.post("/v1/models", data=body, headers={"Content-Type": "application/json"}), 400)
    assert error["code"] == "invalid_json"


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "9" * 5_000, "-1", "1e3", ""])
async def test_logit_bias_keys_must_be_short_ascii_digits(client, key):
    response = await client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {key: 1.0}})
    error = await error_of(response, 400)
    assert error["param"] == "logit_bias"


async def test_non_utf8_authorization_header_is_a_401(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, make_config(tmp_path, api_key="secret"))
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80\r\n"
                 b"Connection: close\r\n\r\n")
    await writer.drain()
    response = await reader.read()
    writer.close()
    assert response.startswith(b"HTTP/1.1 401"), response[:200]
    assert b'"invalid_api_key"' in response


async def test_stop_string_length_is_bounded(client):
    too_long = "x" * (limits.MAX_STOP_CHARS + 1)
    for stop in (too_long, [too_long]):
        error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, "stop": stop}), 400)
        assert error["param"].startswith("stop")


async def test_stop_token_ids_are_bounded_and_kept_as_a_set(client, factory):
    body = {**CHAT, "stop_token_ids": [1] * (limits.MAX_STOP_TOKEN_IDS + 1)}
    error = await error_of(await client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "stop_token_ids"
    response = await client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": [5, 5, 7]})
    assert response.status == 200
    assert factory.engines["fake"].requests[-1].params.stop_token_ids == frozenset({5, 7})


async def test_prompts_times_n_is_bounded_before_requests_are_built(client, factory):
    prompts = [[1]] * (factory.engines["fake"].max_sequences_per_request // 2 + 1)
    response = await client.post("/v1/completions", json={"model": "fake", "prompt": prompts, "n": 2})
    error = await error_of(response, 400)
    assert error["code"] == "too_many_sequences" and error["param"] == "prompt"
    assert factory.engines["fake"].requests == []


async def test_text_far_past_the_context_is_refused_before_encoding(client, factory, monkeypatch):
    engine = factory.engines["fake"]
    encoded: list[int] = []
    original = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or original(text, **kw))
    huge = "a" * (limits.CHARS_PER_TOKEN_LIMIT * engine.max_seq_len + 1)
    for path, body in [
        ("/v1/completions", {"model": "fake", "prompt": huge}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": huge}]}),
        ("/tokenize", {"model": "fake", "prompt": huge}),
    ]:
        error = await error_of(await client.post(path, json=body), 400)
        assert error["code"] == "context_length_exceeded", path
    assert encoded == []


async def test_a_huge_token_id_prompt_is_a_context_error(client):
    response = await client.post("/v1/completions", json={"model": "fake", "prompt": [1] * 100_000})
    error = await error_of(response, 400)
    assert error["code"] == "context_length_exceeded"


# --------------------------------------------------------------------------- exposure
def test_default_host_is_loopback_and_other_hosts_warn_without_a_key():
    from server.config import ServerConfig
    from server.safety import exposure_warning, is_loopback

    assert ServerConfig().host == "127.0.0.1" and exposure_warning(ServerConfig()) is None
    assert [is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "0.0.0.0", "10.0.0.1", "::", "")] \
        == [True, True, True, True, False, False, False, False]
    warning = exposure_warning(ServerConfig(host="0.0.0.0"))
    assert warning is not None and "without an API key" in warning
    assert exposure_warning(ServerConfig(host="0.0.0.0", api_key="k")) is None


def admin_request(method: str, path: str, remote: str):
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (remote, 5555) if name == "peername" else default
    return make_mocked_request(method, path, transport=transport)


@pytest.mark.parametrize("method,path", [("POST", "/v1/models"), ("DELETE", "/v1/models/m")])
def test_registry_routes_refuse_remote_clients_without_an_admin_key(method, path):
    from server import auth
    from server.errors import ApiError

    with pytest.raises(ApiError) as raised:
        auth.check(admin_request(method, path, "10.1.2.3"), None, None)
    assert raised.value.status == 403 and raised.value.code == "admin_requires_loopback"
    auth.check(admin_request(method, path, "127.0.0.1"), None, None)  # the operator's own machine
    auth.check(admin_request(method, path, "10.1.2.3"), None, None, allow_remote_admin=True)
    auth.check(admin_request("GET", "/v1/models", "10.1.2.3"), None, None)  # listing stays open
    with pytest.raises(ApiError) as raised:  # with a key, the key decides, wherever the client is
        auth.check(admin_request(method, path, "127.0.0.1"), "k", None)
    assert raised.value.status == 401


async def test_registration_bounds_model_parallel_size_and_max_seq_len_by_the_machine(client, tmp_path):
    import os

    (tmp_path / "fake").mkdir()
    from server.safety import MAX_REGISTERED_SEQ_LEN

    too_many = (os.cpu_count() or 1) + 1
    response = await client.post("/v1/models", json={"model_id": "fake", "model_parallel_size": too_many})
    error = await error_of(response, 400)
    assert error["param"] == "model_parallel_size" and "CPU cores" in error["message"]
    response = await client.post("/v1/models", json={"model_id": "fake", "max_seq_len": MAX_REGISTERED_SEQ_LEN + 1})
    assert (await error_of(response, 400))["param"] == "max_seq_len"


# --------------------------------------------------------------------------- slow readers
async def test_a_reader_that_stops_taking_data_is_dropped_and_releases_its_lease(aiohttp_client, factory, tmp_path,
                                                                                monkeypatch):
    from aiohttp import web

    client = await start(aiohttp_client, factory, make_config(tmp_path, stream_write_timeout_s=0.2))
    engine = factory.engines["fake"]
    original_write = web.StreamResponse.write
    stalled = asyncio.Event()

    async def write_then_stall(self, data):  # the socket's buffers are full: the second write never drains
        if not stalled.is_set():
            stalled.set()
            return await original_write(self, data)
        await asyncio.Event().wait()

    def buffered_bytes(transport):  # what a full socket leaves in the transport once the stall began
        return 1 << 20 if stalled.is_set() else original_buffered(transport)

    monkeypatch.setattr(web.StreamResponse, "write", write_then_stall)
    # the test loop's socket transport (aiohttp_client runs on asyncio's default loop)
    transport_class = asyncio.selector_events._SelectorSocketTransport
    original_buffered = transport_class.get_write_buffer_size
    monkeypatch.setattr(transport_class, "get_write_buffer_size", buffered_bytes)
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200
    await asyncio.wait_for(engine.abort_seen.wait(), 10)  # dropped: the engine request is aborted
    assert engine.aborted == [engine.requests[0].request_id]
    monkeypatch.setattr(web.StreamResponse, "write", original_write)
    monkeypatch.setattr(transport_class, "get_write_buffer_size", original_buffered)
    delete = await asyncio.wait_for(client.delete("/v1/models/fake"), 10)  # the lease is free
    assert delete.status == 200


class _Transport:
    """A write transport as sse.may_wait reads it."""

    def __init__(self, buffered: int, high_water: int = 65536) -> None:
        self.buffered, self.high_water = buffered, high_water

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.high_water // 4, self.high_water


def test_only_a_write_that_may_wait_for_the_reader_is_timed():
    from server.sse import may_wait

    assert not may_wait(_Transport(0), 300)  # the socket took everything: a token's frame cannot wait
    assert not may_wait(_Transport(0), 65536)  # up to the high-water mark the protocol is not paused
    assert may_wait(_Transport(0), 65537)  # past it the write may pause the protocol
    assert may_wait(_Transport(1), 300)  # bytes the reader has not taken yet: timed
    assert may_wait(None, 300)  # no transport (closed): timed, as before
    assert may_wait(object(), 300)  # a transport that cannot tell: timed


async def test_a_stream_ends_at_its_maximum_duration(aiohttp_client, factory, tmp_path):
    from tests.server.fake_engine import Hold
    from tests.server.test_api import sse_events

    client = await start(aiohttp_client, factory, make_config(tmp_path, max_stream_duration_s=0.3))
    engine = factory.engines["fake"]
    engine.hold = Hold(after=1)  # the engine produces one delta, then nothing
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = sse_events(await asyncio.wait_for(response.text(), 10))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "stream_timeout"
    assert engine.aborted == [engine.requests[0].request_id]


def test_a_lagging_slot_keeps_deltas_as_a_list_and_joins_them_once():
    from engine.core.async_engine import _Mailbox
    from engine.types import RequestOutput

    async def scenario():
        slot = _Mailbox(asyncio.get_running_loop())
        for i in range(3):
            slot.put(RequestOutput("r", [i], f"<{i}>", num_output_tokens=i + 1))
        assert [out.text_delta for out in slot.pending] == ["<0>", "<1>", "<2>"]
        merged = await slot.get()
        assert (merged.new_token_ids, merged.text_delta, merged.num_output_tokens) == ([0, 1, 2], "<0><1><2>", 3)
        assert slot.pending == []

    asyncio.run(scenario())


# --------------------------------------------------------------------------- the event loop
@pytest.mark.parametrize("path,body", [
    ("/v1/batch/completions", {"model": "fake", "prompts": ["x" * 40_000, "y" * 40_000], "max_tokens": 1}),
    ("/v1/batch/chat/completions", {"model": "fake", "messages_batch": [[{"role": "user", "content": "x" * 70_000}]],
                                    "max_tokens": 1}),
    ("/tokenize", {"model": "fake", "prompt": "x" * 70_000, "return_token_strs": True}),
    ("/detokenize", {"model": "fake", "tokens": [120] * 30_000}),
    ("/v1/inference/batch-completion", {"model_id": "fake", "content_batch": ["x" * 40_000, "y" * 40_000]}),
    ("/v1/inference/batch-chat-completion", {"model_id": "fake", "messages_batch": [
        [{"role": "user", "content": "x" * 70_000}]]}),
])
async def test_large_bodies_are_tokenized_off_the_event_loop(aiohttp_client, tmp_path, monkeypatch, path, body):
    import threading

    factory = FakeEngineFactory(max_seq_len=1 << 17)
    client = await start(aiohttp_client, factory, make_config(tmp_path))
    factory.engines["fake"].chat_format.family = "llama3_2"  # Llama Stack's chat reads its tool format by family
    tokenizer = factory.engines["fake"].tokenizer
    threads: set[str] = set()
    for name in ("encode", "decode", *(("token_bytes",) if path == "/tokenize" else ())):  # return_token_strs
        original = getattr(tokenizer, name)

        def recording(arg, *args, _original=original, **kwargs):
            if not isinstance(arg, (str, list)) or len(arg) > 1_000:  # the request's text, not the fake's replies
                threads.add(threading.current_thread().name)
            return _original(arg, *args, **kwargs)

        monkeypatch.setattr(tokenizer, name, recording)
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    loop_thread = threading.current_thread().name  # the test's event loop runs the server too
    assert threads and loop_thread not in threads


# --------------------------------------------------------------------------- inputs that reached 500s (issue 29)
@pytest.mark.parametrize("depth", [limits.MAX_JSON_DEPTH + 1, 5_000])
@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
async def test_a_deeply_nested_json_schema_string_is_a_400(client, field, depth):
    schema = nested(depth)
    fields = {"guided_json": schema} if field == "guided_json" else {"structured_outputs": {"json": schema}}
    error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, **fields}), 400)
    assert error["param"] == ("guided_json" if field == "guided_json" else "structured_outputs.json")
    assert "nested too deeply" in error["message"]


@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches"])
@pytest.mark.parametrize("limit", ["\u00b2", "\u0661", "9" * 5_000, "1" + "0" * 20],
                         ids=["superscript", "arabic", "5000-digits", "1e20"])
async def test_list_limits_that_are_not_short_ascii_numbers_are_a_400(client, path, limit):
    error = await error_of(await client.get(path, params={"limit": limit}), 400)
    assert error["param"] == "limit"


def test_nesting_behind_a_leading_scalar_is_checked():
    for hidden in ([0, nested_list(limits.MAX_JSON_DEPTH)], ["s", {"a": nested_list(limits.MAX_JSON_DEPTH)}],
                   {"a": 1, "b": nested_list(limits.MAX_JSON_DEPTH)}):
        with pytest.raises(InvalidRequest, match="nested too deeply"):
            limits.check_nesting(hidden)
    limits.check_nesting([0, nested_list(limits.MAX_JSON_DEPTH - 2)])  # within the limit
    limits.check_nesting(list(range(100_000)))  # token ids: scalars all the way


async def test_nesting_behind_a_leading_scalar_in_a_body_is_a_400(client):
    response = await client.post("/v1/chat/completions", data=chat_body_with_parameters("[0, " + nested(200) + "]"),
                                 headers={"Content-Type": "application/json"})
    error = await error_of(response, 400)
    assert error["code"] == "invalid_json"


def nested_list(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


async def test_a_deeply_nested_batch_line_is_one_error_line(aiohttp_client, factory, tmp_path):
    from tests.server.test_batch_api import batch_when, chat_line, content_lines, create, start as start_batch

    client = await start_batch(aiohttp_client, factory, tmp_path)
    deep = b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"x": ' + \
        nested(5_000).encode() + b"}}"
    done = await batch_when(client, (await create(client, [chat_line("a"), deep, chat_line("b")]))["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    [error] = await content_lines(client, done["error_file_id"])
    assert error["error"]["code"] == "invalid_json_line" and "nested too deeply" in error["error"]["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", lambda text: {**CHAT, "messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ("/v1/completions", lambda text: {"model": "fake", "prompt": text, "max_tokens": 1}),
    ("/v1/inference/completion", lambda text: {"model_id": "fake", "content": text}),
    ("/tokenize", lambda text: {"model": "fake", "prompt": text}),
])
async def test_large_bodies_are_decoded_and_checked_off_the_event_loop(aiohttp_client, tmp_path, monkeypatch, path,
                                                                        body):
    """msgspec's decode and the nesting check of a 30 MB body take seconds; in a thread, every other
    stream and /health keep their turns. Small bodies stay inline (a thread hop costs more)."""
    import threading

    from compat import protocol as p

    client = await start(aiohttp_client, FakeEngineFactory(max_seq_len=1 << 17), make_config(tmp_path))
    threads: dict[int, str] = {}
    original = p.decode

    def recording(decoder, data):
        threads[len(data)] = threading.current_thread().name
        return original(decoder, data)

    monkeypatch.setattr(p, "decode", recording)
    for sent in (body("x" * 70_000), body("x")):
        response = await client.post(path, json=sent)
        assert response.status == 200, await response.text()
    loop_thread = threading.current_thread().name  # the test's event loop runs the server too
    large_size, small_size = sorted(threads, reverse=True)
    assert threads[large_size] != loop_thread and threads[small_size] == loop_thread


async def test_uploaded_files_are_written_off_the_event_loop(aiohttp_client, factory, tmp_path, monkeypatch):
    import threading

    from server import batch_api
    from tests.server.test_batch_api import start as start_batch
    from tests.server.test_batch_api import upload

    client = await start_batch(aiohttp_client, factory, tmp_path)
    writers: set[str] = set()

    class RecordingFile:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            writers.add(threading.current_thread().name)
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

    # the function _receive_file opens its temporary file with (open_private once the store makes files 0600)
    opener = "open_private" if hasattr(batch_api, "open_private") else "open"
    original = getattr(batch_api, opener, open)
    monkeypatch.setattr(batch_api, opener, lambda *args, **kwargs: RecordingFile(original(*args, **kwargs)),
                        raising=False)
    response = await upload(client, b'{"custom_id": "a"}\n' * 10_000)
    assert response.status == 200, await response.text()
    assert writers and threading.current_thread().name not in writers
