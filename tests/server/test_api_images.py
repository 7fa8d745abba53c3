"""Images in requests, through every route, over the real Llama 4 tokenizer and chat format with
the tiny Llama 4 image preprocessor (no weights: a scripted engine records the requests): prompt
tokens equal llama-models' own Llama 4 ChatFormat, each image's placement is recorded, and every
bad input is a 400 naming its field while the server keeps serving."""

from __future__ import annotations

import base64

import openai
import pytest
from aiohttp.test_utils import TestServer

from engine.vision.llama4 import Llama4ImagePreprocessor
from server.app import STATE_KEY, create_app
from server.config import ServerConfig
from server.registry import REGISTRY_KEY
from tests.engine.tokenizer_fixtures import llama_models_file, real_llama4
from tests.llama4_vision_fixtures import random_image, reference_chat_format
from tests.server.fake_engine import fake_spec
from tests.server.test_api_real_formats import Factory, ScriptedTokenEngine

pytest.importorskip("llama_models")

WIDE = random_image(100, 30, seed=1)  # 4 tiles in a row + the global view
SMALL = random_image(20, 12, seed=2, fmt="JPEG")  # one tile



def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def vision_engine(*, takes_images: bool = True) -> ScriptedTokenEngine:
    from engine.chat.llama4 import Llama4ChatFormat

    tokenizer = real_llama4()
    words = [tokenizer.encode(w) for w in ("A", " picture", ".")]
    engine = ScriptedTokenEngine(tokenizer, lambda: (words, tokenizer.special_token_id("<|eot|>")))
    engine.chat_format = Llama4ChatFormat(tokenizer)
    engine.image_preprocessor = Llama4ImagePreprocessor(tile_size=32, patch_size=8, pixel_shuffle_ratio=0.5) \
        if takes_images else None
    return engine


async def start(aiohttp_client, tmp_path, engine, **config):
    app = create_app(ServerConfig(models=[fake_spec("llama", tmp_path)], checkpoint_roots=[tmp_path], **config),
                     Factory(engine))
    client = await aiohttp_client(app)
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("llama"):
        pass
    return client


def reference_tokens(content: list) -> list[int]:
    """llama-models' Llama 4 ChatFormat.encode_dialog_prompt for one user message."""
    from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem

    chat = reference_chat_format(llama_models_file("llama4/tokenizer.model"))
    raw = [RawMediaItem(data=item) if isinstance(item, bytes) else RawTextItem(text=item) for item in content]
    return chat.encode_dialog_prompt([RawMessage(role="user", content=raw)]).tokens


CONTENT = [WIDE, "What is in these pictures?", SMALL, " And this one?"]


def openai_content(content: list) -> list[dict]:
    return [image_part(c) if isinstance(c, bytes) else {"type": "text", "text": c} for c in content]


async def test_chat_prompt_equals_llama_models_and_records_placements(aiohttp_client, tmp_path):
    engine = vision_engine()
    client = await start(aiohttp_client, tmp_path, engine)
    response = await client.post("/v1/chat/completions", json={
        "model": "llama", "temperature": 0, "messages": [{"role": "user", "content": openai_content(CONTENT)}]})
    assert response.status == 200, await response.text()
    assert (await response.json())["choices"][0]["message"]["content"] == "A picture."
    request = engine.requests[-1]
    expected = reference_tokens(CONTENT)
    assert request.prompt_token_ids == expected
    tok = engine.tokenizer
    start_id, end_id, patch = (tok.special_token_id(n) for n in ("<|image_start|>", "<|image_end|>", "<|patch|>"))
    assert [p.offset for p in request.images] == [i for i, t in enumerate(expected) if t == start_id]
    for placement, (chunks, ratio) in zip(request.images, [(5, (1, 4)), (1, (1, 1))]):
        span = expected[placement.offset: placement.offset + placement.length]
        assert span[0] == start_id and span[-1] == end_id
        assert span.count(patch) == chunks * 4 == placement.image.num_chunks * placement.image.tokens_per_chunk
        assert placement.image.aspect_ratio == ratio
        assert placement.image.param.startswith("messages[0].content[")
    assert request.images[0].image.content_hash != request.images[1].image.content_hash


async def test_stream_tokenize_and_batch_routes_take_images(aiohttp_client, tmp_path):
    engine = vision_engine()
    client = await start(aiohttp_client, tmp_path, engine)
    messages = [{"role": "user", "content": openai_content(CONTENT)}]
    expected = reference_tokens(CONTENT)
    response = await client.post("/tokenize", json={"model": "llama", "messages": messages})
    assert response.status == 200, await response.text()
    assert (await response.json())["tokens"] == expected
    response = await client.post("/v1/chat/completions", json={"model": "llama", "messages": messages, "stream": True})
    assert response.status == 200 and '"content":" picture"' in await response.text()
    assert engine.requests[-1].prompt_token_ids == expected and len(engine.requests[-1].images) == 2
    response = await client.post("/v1/batch/chat/completions", json={
        "model": "llama", "messages_batch": [messages, [{"role": "user", "content": "no image"}]]})
    body = await response.json()
    assert response.status == 200 and all(item.get("error") is None for item in body["data"]), body
    assert sorted(len(r.images) for r in engine.requests[-2:]) == [0, 2]  # items run concurrently


async def test_llama_stack_native_route_takes_image_items(aiohttp_client, tmp_path):
    engine = vision_engine()
    client = await start(aiohttp_client, tmp_path, engine)
    content = [{"type": "image", "image": {"data": base64.b64encode(WIDE).decode()}},
               {"type": "text", "text": "What is in these pictures?"},
               {"type": "image", "image": {"data": base64.b64encode(SMALL).decode()}},
               {"type": "text", "text": " And this one?"}]
    response = await client.post("/v1/inference/chat-completion", json={
        "model_id": "llama", "messages": [{"role": "user", "content": content}],
        "sampling_params": {"strategy": {"type": "greedy"}, "max_tokens": 8}})
    assert response.status == 200, await response.text()
    assert engine.requests[-1].prompt_token_ids == reference_tokens(CONTENT)


def _too_big_pixels() -> bytes:
    return random_image(70, 70, seed=4)  # 4900 pixels, over the 4096 configured below


BAD_CASES = [
    ("corrupt", [{"type": "image_url", "image_url": {"url": data_url(b"\x89PNG\r\n\x1a\n broken")}}],
     "messages[0].content[0]", 400),
    ("not base64", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "messages[0].content[0]", 400),
    ("too many pixels", [{"type": "text", "text": "x"}, image_part(_too_big_pixels())], "messages[0].content[1]", 400),
    ("too many images", [image_part(SMALL)] * 3, "messages[0].content[2]", 400),
    ("http not allowed", [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}],
     "messages[0].content[0]", 400),
]


@pytest.mark.parametrize("case,content,param,status", BAD_CASES, ids=[c[0] for c in BAD_CASES])
async def test_bad_images_are_400_naming_the_field_and_the_server_keeps_serving(
        aiohttp_client, tmp_path, case, content, param, status):
    engine = vision_engine()
    client = await start(aiohttp_client, tmp_path, engine, max_image_pixels=4096, max_images_per_request=2)
    response = await client.post("/v1/chat/completions", json={
        "model": "llama", "messages": [{"role": "user", "content": content}]})
    body = await response.json()
    assert response.status == status, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body
    ok = await client.post("/v1/chat/completions", json={
        "model": "llama", "messages": [{"role": "user", "content": [image_part(SMALL), {"type": "text", "text": "hi"}]}]})
    assert ok.status == 200, await ok.text()


async def test_images_on_a_text_only_model_or_outside_user_messages_are_400(aiohttp_client, tmp_path):
    client = await start(aiohttp_client, tmp_path, vision_engine(takes_images=False))
    response = await client.post("/v1/chat/completions", json={
        "model": "llama", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, image_part(SMALL)]}]})
    body = await response.json()
    assert response.status == 400 and body["error"]["param"] == "messages[0].content[1]", body
    assert body["error"]["code"] == "images_not_supported"
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["input_modalities"] == ["text"]

    client = await start(aiohttp_client, tmp_path, vision_engine())
    response = await client.post("/v1/chat/completions", json={"model": "llama", "messages": [
        {"role": "system", "content": [image_part(SMALL)]}, {"role": "user", "content": "hi"}]})
    body = await response.json()
    assert response.status == 400 and body["error"]["param"] == "messages[0].content[0]", body
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["input_modalities"] == ["text", "image"]


async def test_openai_sdk_sends_a_data_url_image(tmp_path):
    engine = vision_engine()
    app = create_app(ServerConfig(models=[fake_spec("llama", tmp_path)], checkpoint_roots=[tmp_path]), Factory(engine))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    await app[STATE_KEY].startup_task
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        completion = await client.chat.completions.create(model="llama", temperature=0, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": data_url(SMALL, "jpeg")}}]}])
        assert completion.choices[0].message.content == "A picture."
        assert len(engine.requests[-1].images) == 1
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="llama", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(b"nope")}}]}])
        assert info.value.body["param"] == "messages[0].content[0]"
    finally:
        await client.close()
        await server.close()


@pytest.fixture
async def image_host(aiohttp_server):
    """An image server on loopback: /small.png, /big.png (over 10 kB), /hop (redirects to
    /small.png), /away (redirects to a host that is not allowed)."""
    from aiohttp import web

    async def small(request):
        return web.Response(body=SMALL, content_type="image/jpeg")

    async def big(request):
        return web.Response(body=random_image(200, 200, seed=5), content_type="image/png")

    async def hop(request):
        raise web.HTTPFound("/small.png")

    async def away(request):
        raise web.HTTPFound("http://elsewhere.invalid/x.png")

    app = web.Application()
    app.router.add_get("/small.png", small)
    app.router.add_get("/big.png", big)
    app.router.add_get("/hop", hop)
    app.router.add_get("/away", away)
    return await aiohttp_server(app, host="127.0.0.1")


@pytest.mark.parametrize("path,private_ok,status,code", [
    ("/small.png", True, 200, None),
    ("/hop", True, 200, None),
    ("/small.png", False, 400, "image_url_not_allowed"),  # loopback is refused unless configured
    ("/big.png", True, 400, "image_too_large"),
    ("/away", True, 400, "image_url_not_allowed"),
])
async def test_allowed_image_urls_are_fetched_within_bounds(aiohttp_client, tmp_path, image_host, path, private_ok,
                                                            status, code):
    engine = vision_engine()
    client = await start(aiohttp_client, tmp_path, engine, allowed_media_domains=("127.0.0.1",),
                         allow_private_media_addresses=private_ok, max_image_bytes=10_000)
    url = str(image_host.make_url(path))
    response = await client.post("/v1/chat/completions", json={"model": "llama", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
    body = await response.json()
    assert response.status == status, body
    if code is not None:
        assert body["error"]["code"] == code and body["error"]["param"] == "messages[0].content[0]", body
    else:
        assert len(engine.requests[-1].images) == 1


async def test_names_resolving_to_private_addresses_are_refused_at_connect():
    from server.media import GlobalOnlyResolver

    with pytest.raises(OSError, match="non-global"):
        await GlobalOnlyResolver(allow_private=False).resolve("localhost", 80)
    assert await GlobalOnlyResolver(allow_private=True).resolve("localhost", 80)


async def test_batch_api_lines_take_images(aiohttp_client, tmp_path):
    from tests.server.test_batch_api import batch_when, content_lines, create

    engine = vision_engine()
    client = await start(aiohttp_client, tmp_path, engine, batch_dir=tmp_path / "batches")

    def line(custom_id: str, content: list) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "llama", "temperature": 0, "messages": [{"role": "user", "content": content}]}}

    lines = [line("ok", openai_content(CONTENT)), line("bad", [image_part(b"not an image")])]
    done = await batch_when(client, (await create(client, lines))["id"])
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}, done
    [output] = await content_lines(client, done["output_file_id"])
    assert output["custom_id"] == "ok" and output["response"]["body"]["choices"][0]["message"]["content"] == "A picture."
    assert any(r.prompt_token_ids == reference_tokens(CONTENT) and len(r.images) == 2 for r in engine.requests)
    [error] = await content_lines(client, done["error_file_id"])
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400, error
    assert error["response"]["body"]["error"]["param"] == "messages[0].content[0]", error
