"""Issue 30 over HTTP with the real engine: each checkpoint layout registered through POST /v1/models
serves the reference's greedy logprobs; Llama Stack's env spellings (QUANTIZATION_TYPE=bf16,
MODEL_PARALLEL_SIZE=0) start the server and serve; SKUs this engine cannot run are refused at
registration with their reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.types import EngineRequest, SamplingParams
from server.app import STATE_KEY, create_app
from server.config import ServerConfig
from server.model_spec import ModelSpec
from server.registry import ModelRegistry
from tests.engine.test_checkpoint_formats import ARGS, NEW_TOKENS, PROMPT, LAYOUTS, assert_logprobs_close, reference_greedy
from tests.server.test_api_config import config_from
from tests.server.test_model_routes import build_app

pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {name: LAYOUTS[name](root / name) for name in ("meta", "torchtune_epochs", "hf_safetensors", "hf_sharded_index")}


@pytest.fixture(scope="module")
def expected() -> tuple[list[int], list[float]]:
    return reference_greedy(ARGS, PROMPT, NEW_TOKENS)


def completion_body(model: str) -> dict:
    return {"model": model, "prompt": "hello world", "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0}


@pytest.mark.parametrize("layout", ["meta", "torchtune_epochs", "hf_safetensors", "hf_sharded_index"])
async def test_each_layout_registered_over_http_serves_the_reference(aiohttp_client, layouts, expected, layout):
    from engine.loader import LocalEngineFactory

    factory = LocalEngineFactory(EngineConfig(dtype="float64", max_seq_len=64, block_size_tokens=4, max_batch_size=4,
                                              cpu_kv_cache_bytes=4 << 20))
    registry = ModelRegistry(factory, checkpoint_roots=[layouts[layout].parent])
    client = await aiohttp_client(build_app(registry))
    response = await client.post("/v1/models", json={"model_id": layout, "checkpoint_dir": str(layouts[layout])})
    assert response.status == 200, await response.text()
    async with registry.lease(layout) as engine:
        request = EngineRequest("r", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0))
        tokens, logprobs = [], []
        async for out in engine.generate(request):
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
    assert tokens == expected[0]
    assert_logprobs_close(logprobs, expected[1])


async def test_llama_stack_env_spellings_start_the_server_and_serve(aiohttp_client, layouts):
    """INFERENCE_CHECKPOINT_DIR at an HF folder, QUANTIZATION_TYPE=bf16, MODEL_PARALLEL_SIZE=0."""
    from engine.loader import LocalEngineFactory

    env = {"INFERENCE_MODEL": "tiny-hf", "INFERENCE_CHECKPOINT_DIR": str(layouts["hf_safetensors"]),
           "QUANTIZATION_TYPE": "bf16", "MODEL_PARALLEL_SIZE": "0", "MAX_SEQ_LEN": "64",
           "LLAMASERVE_CPU_KV_CACHE_BYTES": "4MiB", "LLAMASERVE_BLOCK_SIZE_TOKENS": "4"}
    config = config_from([], env)
    assert (config.engine.quantization, config.engine.model_parallel_size) == ("bf16", 0)
    app = create_app(config, LocalEngineFactory(config.engine))
    client = await aiohttp_client(app)
    await app[STATE_KEY].startup_task
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny-hf"]
    response = await client.post("/v1/completions", json=completion_body("tiny-hf"))
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["usage"]["completion_tokens"] == NEW_TOKENS
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == NEW_TOKENS
    weights = (await (await client.get("/v1/models/tiny-hf")).json())["weights"]
    assert weights["quantization"] is None and weights["formats"] == ["bfloat16"]  # bf16: unquantized bfloat16


@pytest.mark.parametrize("name, reason", [
    ("Prompt-Guard-86M", "is a classifier"),
    ("Llama-Guard-4-12B", "multimodal"),
])
async def test_unsupported_skus_are_refused_at_registration_with_the_reason(aiohttp_client, layouts, name, reason):
    from tests.server.fake_engine import FakeEngineFactory

    registry = ModelRegistry(FakeEngineFactory(), checkpoint_roots=[layouts["meta"].parent])
    client = await aiohttp_client(build_app(registry))
    for body in ({"model_id": "x", "checkpoint_dir": str(layouts["meta"]), "metadata": {"llama_model": name}},
                 {"model_id": name, "checkpoint_dir": str(layouts["meta"])}):
        response = await client.post("/v1/models", json=body)
        assert response.status == 400
        error = (await response.json())["error"]
        assert reason in error["message"] and error["code"] == "unsupported_model"
        assert error["param"] in ("metadata.llama_model", "model_id") and error["type"] == "invalid_request_error"


async def test_hf_folder_chat_uses_its_tokenizer_json_and_chat_template(aiohttp_client, layouts, tmp_path):
    """tokenizer.json + tokenizer_config.json's chat_template (engine/tokenizers/hf.py, engine/chat/jinja.py)."""
    tokenizers = pytest.importorskip("tokenizers")
    from engine.loader import LocalEngineFactory
    from tests.engine.test_gguf_import import CHATML

    folder = tmp_path / "hf_chat"
    shutil.copytree(layouts["hf_safetensors"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))

    engine_config = EngineConfig(dtype="float32", max_seq_len=64, block_size_tokens=4, max_batch_size=4,
                                 cpu_kv_cache_bytes=4 << 20)
    spec = ModelSpec(model_id="chat", checkpoint_dir=folder, trusted=True)
    app = create_app(ServerConfig(models=[spec], checkpoint_roots=[tmp_path], engine=engine_config),
                     LocalEngineFactory(engine_config))
    client = await aiohttp_client(app)
    await app[STATE_KEY].startup_task
    response = await client.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 3, "temperature": 0,
                                                               "messages": [{"role": "user", "content": "hello"}]})
    assert response.status == 200, await response.text()
    rendered = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    expected = tokenizers.Tokenizer.from_str((folder / "tokenizer.json").read_text()).encode(rendered).ids
    assert expected[0] == 1 and expected.count(2) == 1  # <|im_start|> and <|im_end|> as the special ids
    assert (await response.json())["usage"]["prompt_tokens"] == len(expected)
