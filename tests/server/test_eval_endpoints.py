"""What eval harnesses and OpenAI clients ask beside completions, over a FakeEngine: /tokenizer_info,
/tokenize and /detokenize without `model`, the parameter classes over HTTP, sampling defaults."""

from __future__ import annotations

import pytest

from engine.types import SamplingDefaults
from tests.server.fake_engine import BOS, EOS, EOT, fake_spec
from tests.server.test_api import CHAT, client, error_of, factory, make_config, start  # noqa: F401 - fixtures


@pytest.fixture
async def two_models(aiohttp_client, factory, tmp_path):
    config = make_config(tmp_path, models=[fake_spec("fake", tmp_path), fake_spec("other", tmp_path)])
    return await start(aiohttp_client, factory, config)


async def test_tokenizer_info_in_vllms_shape(client):
    response = await client.get("/tokenizer_info")
    assert response.status == 200
    info = await response.json()
    assert info["tokenizer_class"] == "FakeTokenizer"
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<|begin_of_text|>", "<|end_of_text|>", None)
    assert (info["bos_token_id"], info["eos_token_id"], info["pad_token_id"]) == (BOS, EOS, None)
    assert info["model_max_length"] == 256 and "chat_template" not in info  # the fake's format is code, not Jinja


async def test_tokenize_and_detokenize_without_model_use_the_only_one(client):
    # lm-eval's remote tokenizer finds the eos id by tokenizing its spelling: it must parse as the token
    tokens = (await (await client.post("/tokenize", json={"prompt": "a<|eot_id|>", "add_special_tokens": False})).json())
    assert tokens["tokens"] == [ord("a"), EOT]
    detok = await (await client.post("/detokenize", json={"tokens": [ord("h"), ord("i")]})).json()
    assert detok == {"prompt": "hi"}


@pytest.mark.parametrize("method,path,body", [
    ("post", "/tokenize", {"prompt": "a"}), ("post", "/detokenize", {"tokens": [1]}), ("get", "/tokenizer_info", None),
])
async def test_without_model_and_several_registered_is_a_400_naming_model(two_models, method, path, body):
    response = await getattr(two_models, method)(path, **({"json": body} if body else {}))
    error = await error_of(response, 400)
    assert error["param"] == "model" and "fake" in error["message"] and "other" in error["message"]
    named = await getattr(two_models, method)(path + ("?model=other" if body is None else ""),
                                              **({"json": {**body, "model": "other"}} if body else {}))
    assert named.status == 200


async def test_models_show_the_sampling_defaults_in_force(client, factory):
    body = await (await client.get("/v1/models/fake")).json()
    assert body["sampling_defaults"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                         "repetition_penalty": 1.0}
    factory.engines["fake"].sampling_defaults = SamplingDefaults(temperature=0.2, top_p=0.9)
    body = await (await client.get("/v1/models")).json()
    assert body["data"][0]["sampling_defaults"]["temperature"] == 0.2
    await client.post("/v1/chat/completions", json=CHAT)
    params = factory.engines["fake"].requests[-1].params
    assert (params.temperature, params.top_p) == (0.2, 0.9)


async def test_each_parameter_class_over_http(client, factory):
    accepted = {**CHAT, "store": True, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u",
                "safety_identifier": "s", "prompt_cache_key": "p", "stream_options": None, "n": None}
    assert (await client.post("/v1/chat/completions", json=accepted)).status == 200
    error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "high"}), 400)
    assert error["param"] == "reasoning_effort" and error["code"] == "unsupported_parameter"
    error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, "frobnicate": 1}), 400)
    assert error["param"] == "frobnicate"
