"""The official openai SDK against a live app on a free port, over the FakeEngine."""

from __future__ import annotations

import openai
import pytest
from aiohttp.test_utils import TestServer

from server.app import STATE_KEY, create_app
from server.config import ServerConfig
from server.registry import REGISTRY_KEY
from tests.server.fake_engine import FakeEngineFactory, fake_spec

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def sdk(tmp_path):
    factory = FakeEngineFactory()
    app = create_app(ServerConfig(models=[fake_spec("fake", tmp_path)], checkpoint_roots=[tmp_path], api_key="sk-test"),
                     factory)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("fake"):
        pass
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="sk-test", max_retries=0)
    yield client
    await client.close()
    await server.close()


async def test_sdk_chat(sdk):
    completion = await sdk.chat.completions.create(model="fake", messages=MESSAGES, temperature=0, seed=1, n=2,
                                                   logprobs=True, top_logprobs=1)
    assert [c.message.content for c in completion.choices] == ["Hello world!", "Hello world!"]
    assert completion.choices[0].finish_reason == "stop" and completion.usage.completion_tokens == 24
    assert completion.choices[0].logprobs.content[0].token == "H"
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


async def test_sdk_chat_stream(sdk):
    stream = await sdk.chat.completions.create(model="fake", messages=MESSAGES, stream=True,
                                               stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert (text, finish, usage.completion_tokens) == ("Hello world!", "stop", 12)


async def test_sdk_completions(sdk):
    completion = await sdk.completions.create(model="fake", prompt=["a", "b"], max_tokens=5, logprobs=1)
    assert [c.text for c in completion.choices] == ["Hello", "Hello"]
    assert completion.choices[1].logprobs.text_offset == [0, 1, 2, 3, 4]
    stream = await sdk.completions.create(model="fake", prompt=[1, 2, 3], stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == "Hello world!"


async def test_sdk_errors(sdk):
    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(model="fake", messages=MESSAGES, temperature=3)
    assert info.value.body["param"] == "temperature"
    bad_key = openai.AsyncOpenAI(base_url=str(sdk.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad_key.chat.completions.create(model="fake", messages=MESSAGES)
    await bad_key.close()


async def test_sdk_models(sdk):
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["fake"]
