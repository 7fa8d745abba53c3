"""Llama 4 early fusion served end to end: a tiny random Llama 4 vision checkpoint in Meta's
release layout, loaded by the real loader, served by the server at temperature 0 in float32;
greedy tokens equal llama-models' own generation (its ChatFormat, its multimodal Transformer with
its VisionEmbeddings, full recompute each token) for the same image and text, logprobs within
2e-3; a text-only prompt on the same checkpoint equals its text reference; /v1/models says images."""

from __future__ import annotations

import base64

import pytest
import torch

from engine.config import EngineConfig
from server.app import STATE_KEY, create_app
from server.config import ServerConfig
from server.registry import REGISTRY_KEY
from tests.engine.tokenizer_fixtures import llama_models_file
from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR
from tests.llama4_vision_fixtures import random_image, reference_chat_format, write_tiny_llama4_vision_checkpoint
from tests.server.fake_engine import fake_spec
from tests.server.test_api_real_formats import Factory

pytest.importorskip("llama_models.llama4.model")

MAX_NEW = 6
IMAGES = [random_image(100, 30, seed=11), random_image(20, 12, seed=12, fmt="JPEG")]  # 4 tiles + global; 1 tile


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama4_vision_checkpoint(tmp_path_factory.mktemp("llama4_vision"),
                                               tokenizer_path=llama_models_file("llama4/tokenizer.model"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    from types import SimpleNamespace

    from engine.loader import load_engine

    spec = SimpleNamespace(model_id="llama", checkpoint_dir=checkpoint, llama_model=TINY_LLAMA4_DESCRIPTOR)
    engine = load_engine(spec, EngineConfig(dtype="float32", block_size_tokens=8, max_batch_size=4,
                                            cpu_kv_cache_bytes=8 << 20, max_num_batched_tokens=16, max_prefill_chunk_tokens=0))
    yield engine
    engine.core.runner.shutdown()


CASES = {
    "one image": [IMAGES[0], "Describe the picture."],
    "two images between text": ["Compare", IMAGES[1], "with", IMAGES[0], "please."],
    "text only": ["Just text, no image."],
}
OTHER = [random_image(100, 30, seed=99), "Describe the picture."]  # another image, the same tokens as "one image"


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(content items) -> (greedy tokens, their logprobs) from llama-models' Llama 4, float32."""
    from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem
    from llama_models.llama4.args import ModelArgs as MetaArgs
    from llama_models.llama4.datatypes import MaskedEmbedding, TransformerInput
    from llama_models.llama4.model import Transformer

    from engine.executor.parallel import destroy_group, init_group
    import json

    chat = reference_chat_format(llama_models_file("llama4/tokenizer.model"))
    params = json.loads((checkpoint / "params.json").read_text())
    state = torch.load(checkpoint / "consolidated.00.pth", weights_only=True)
    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # the reference's KV caches call .cuda()
    try:
        model = Transformer(MetaArgs(**params, max_batch_size=1, max_seq_len=256)).float()
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("cache" in k for k in missing), (missing, unexpected)
        patch = chat.tokenizer.special_tokens["<|patch|>"]
        eot = chat.tokenizer.special_tokens["<|eot|>"]

        def generate(content: list) -> tuple[list[int], list[int], list[float]]:
            raw = [RawMediaItem(data=c) if isinstance(c, bytes) else RawTextItem(text=c) for c in content]
            llm_input = chat.encode_dialog_prompt([RawMessage(role="user", content=raw)])
            tokens, out, logprobs = list(llm_input.tokens), [], []
            for _ in range(MAX_NEW):
                t = torch.tensor([tokens])
                embedding = None
                if llm_input.images:
                    mask = (t == patch).unsqueeze(-1)
                    h = model.tok_embeddings(t)
                    embedding = MaskedEmbedding(model.vision_embeddings([llm_input.images], mask, h), mask)
                with torch.inference_mode():
                    logits = model(TransformerInput(tokens=t, tokens_position=0, image_embedding=embedding)).logits[0, -1]
                token = int(torch.argmax(logits))
                out.append(token)
                logprobs.append(float(torch.log_softmax(logits.double(), dim=-1)[token]))
                if token == eot:
                    break
                tokens.append(token)
            return list(llm_input.tokens), out, logprobs

        # every answer up front, then the group of one is freed (a model-parallel engine needs its own)
        answers = {repr(content): generate(content) for content in [*CASES.values(), OTHER]}
    finally:
        torch.Tensor.cuda = cuda
        destroy_group()
    return lambda content: answers[repr(content)]


async def start(aiohttp_client, tmp_path, engine):
    app = create_app(ServerConfig(models=[fake_spec("llama", tmp_path)], checkpoint_roots=[tmp_path]), Factory(engine))
    client = await aiohttp_client(app)
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("llama"):
        pass
    return client


def openai_content(content: list) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(c).decode()}}
            if isinstance(c, bytes) else {"type": "text", "text": c} for c in content]


async def served(client, content: list) -> tuple[list[int], list[float], list[int]]:
    response = await client.post("/v1/chat/completions", json={
        "model": "llama", "temperature": 0, "max_tokens": MAX_NEW, "logprobs": True, "top_logprobs": 1,
        "skip_special_tokens": False, "messages": [{"role": "user", "content": openai_content(content)}]})
    body = await response.json()
    assert response.status == 200, body
    entries = body["choices"][0]["logprobs"]["content"]
    return [e["token"] for e in entries], [e["logprob"] for e in entries], body


async def test_served_greedy_tokens_equal_llama_models(aiohttp_client, tmp_path, engine, reference):
    # one app for every case: the app's cleanup shuts the (module-wide) engine down
    client = await start(aiohttp_client, tmp_path, engine)
    for name, content in CASES.items():
        prompt, expected, expected_logprobs = reference(content)
        tokens = await client.post("/tokenize", json={"model": "llama", "messages": [
            {"role": "user", "content": openai_content(content)}]})
        assert (await tokens.json())["tokens"] == prompt, name  # the prompt, token for token, as llama-models encodes it
        texts, logprobs, _ = await served(client, content)
        assert texts == [engine.tokenizer.decode([t]) for t in expected], (name, texts, expected)
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 2e-3, name
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["input_modalities"] == ["text", "image"]


@pytest.fixture(scope="module")
def small_engine(checkpoint):
    """The same checkpoint on a KV pool of 8 blocks of 8 tokens (one image prompt and its answer fit,
    two do not): concurrent image prompts preempt."""
    from types import SimpleNamespace

    from engine.loader import load_engine

    spec = SimpleNamespace(model_id="llama", checkpoint_dir=checkpoint, llama_model=TINY_LLAMA4_DESCRIPTOR)
    engine = load_engine(spec, EngineConfig(dtype="float32", block_size_tokens=8, max_batch_size=4,
                                            cpu_kv_cache_bytes=8 * 8192, max_num_batched_tokens=16, max_prefill_chunk_tokens=0))  # 8 blocks of 8192 bytes
    yield engine
    engine.core.runner.shutdown()


async def test_batched_preempted_and_prefix_cached_requests_keep_their_tokens(aiohttp_client, tmp_path, small_engine,
                                                                              reference):
    """Image and text-only requests at once (chunked prefills split the images, the small pool
    preempts), then an image prompt again (a prefix-cache hit through its image) and the same text
    with another image in its place (no hit past the image's first block): every answer is its
    reference's."""
    import asyncio

    engine = small_engine
    client = await start(aiohttp_client, tmp_path, engine)
    expected = {name: reference(content) for name, content in CASES.items()}
    names = list(CASES) * 2 + ["text only"] * 3  # three short ones admitted together outgrow the pool
    results = await asyncio.gather(*(served(client, CASES[name]) for name in names))
    for name, (texts, logprobs, _) in zip(names, results):
        assert texts == [engine.tokenizer.decode([t]) for t in expected[name][1]], name
        assert max(abs(a - b) for a, b in zip(logprobs, expected[name][2])) < 2e-3, name
    assert engine.stats().num_preempted_total > 0  # the pool was too small for all at once

    content = CASES["one image"]
    first = (await served(client, content))[2]
    again_texts, again_logprobs, again = await served(client, content)
    prompt = expected["one image"][0]
    image_start = prompt.index(engine.tokenizer.special_token_id("<|image_start|>"))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > image_start + 8  # blocks holding the image hit
    assert again_texts == [engine.tokenizer.decode([t]) for t in expected["one image"][1]]
    other = OTHER
    other_prompt, other_tokens, _ = reference(other)
    assert other_prompt == prompt
    texts, _, body = await served(client, other)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] <= image_start  # nothing past the image's first block
    assert texts == [engine.tokenizer.decode([t]) for t in other_tokens]
    assert first["usage"]["prompt_tokens"] == len(prompt)


async def serve_cases(aiohttp_client, tmp_path, checkpoint, mp_size: int, names) -> tuple[dict, int, object]:
    """({case: (tokens, logprobs)} served at temperature 0 by a fresh engine at mp_size, rank 0's
    vision weight bytes, the tokenizer); the client is closed at the end, which shuts the engine (its group) down."""
    from types import SimpleNamespace

    from engine.loader import load_engine

    spec = SimpleNamespace(model_id="llama", checkpoint_dir=checkpoint, llama_model=TINY_LLAMA4_DESCRIPTOR)
    engine = load_engine(spec, EngineConfig(dtype="float32", block_size_tokens=8, max_batch_size=4, model_parallel_size=mp_size,
                                            cpu_kv_cache_bytes=8 << 20, max_num_batched_tokens=16, max_prefill_chunk_tokens=0))
    vision_bytes = engine.core.runner._workers._shard.image_encoder.nbytes
    client = await start(aiohttp_client, tmp_path, engine)
    try:
        answers = {}
        for name in names:
            texts, logprobs, _ = await served(client, CASES[name])
            answers[name] = texts, logprobs
        return answers, vision_bytes, engine.tokenizer
    finally:
        await client.close()


async def test_model_parallel_2_serves_the_same_tokens(aiohttp_client, tmp_path, tmp_path_factory, checkpoint, reference):
    """The vision encoder sharded as llama-models' fairscale layers shard it: at model_parallel_size 2
    each rank holds about half the vision weights and encodes its part of each image, and image and
    text requests get model_parallel_size 1's tokens (logprobs within 2e-3) and the reference's;
    from weights shipped for model-parallel size 2 (vision linears split as the reference holds
    them) and from a 1-shard release resharded at load."""
    names = ("two images between text", "one image", "text only")
    at_mp1, mp1_bytes, tokenizer = await serve_cases(aiohttp_client, tmp_path, checkpoint, 1, names)
    checkpoint_2shards = write_tiny_llama4_vision_checkpoint(tmp_path_factory.mktemp("llama4_vision_mp2"), num_shards=2,
                                                             tokenizer_path=llama_models_file("llama4/tokenizer.model"))
    for ckpt in (checkpoint_2shards, checkpoint):
        at_mp2, mp2_bytes, _ = await serve_cases(aiohttp_client, tmp_path, ckpt, 2, names)
        assert mp2_bytes < 0.55 * mp1_bytes  # rank 0's slice (the norms, embeddings, row biases whole)
        for name in names:
            (texts, logprobs), (texts1, logprobs1) = at_mp2[name], at_mp1[name]
            _, expected, expected_logprobs = reference(CASES[name])
            assert texts == texts1 == [tokenizer.decode([t]) for t in expected], name
            assert max(abs(a - b) for a, b in zip(logprobs, logprobs1)) < 2e-3, name
            assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 2e-3, name
