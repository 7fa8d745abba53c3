"""/v1/models routes over a real ModelRegistry and a fake EngineFactory, in a small aiohttp app."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from engine.types import CheckpointError
from server.errors import ApiError
from server.model_routes import add_model_routes
from server.model_spec import ModelSpec
from server.registry import REGISTRY_KEY, ModelRegistry
from tests.server.test_registry import FakeFactory, checkpoint, make_registry

OPENAI_MODEL_KEYS = {"id", "object", "created", "owned_by"}
OUR_KEYS = {"status", "llama_model", "max_seq_len", "checkpoint_dir", "metadata", "load_time_s", "memory_bytes"}


@web.middleware
async def api_errors(request: web.Request, handler):
    """What H5's app middleware does, reduced to what these routes need."""
    try:
        return await handler(request)
    except ApiError as error:
        return web.Response(
            status=error.status, body=error.to_json(), content_type="application/json", headers=error.headers
        )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    for name in ("m", "v2", "Llama3.2-3B-Instruct", "meta-llama/Llama-3.2-3B-Instruct", "bad"):
        checkpoint(path, name)
    return path


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory(sizes={"v2": 120})


def build_app(registry: ModelRegistry) -> web.Application:
    app = web.Application(middlewares=[api_errors])
    app[REGISTRY_KEY] = registry
    add_model_routes(app)

    async def close_registry(app: web.Application):
        yield
        await asyncio.wait_for(registry.close(), 5)

    app.cleanup_ctx.append(close_registry)
    return app


@pytest.fixture
async def registry(root: Path, factory: FakeFactory) -> ModelRegistry:
    return make_registry([root], factory, memory_budget_bytes=300)


@pytest.fixture
async def client(aiohttp_client, registry: ModelRegistry):
    return await aiohttp_client(build_app(registry))


async def expect_error(response, status: int, *, code: str | None = None, param: str | None = None) -> dict:
    assert response.status == status, await response.text()
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


async def test_list_starts_empty(client) -> None:
    response = await client.get("/v1/models")
    assert response.status == 200
    assert await response.json() == {"object": "list", "data": []}


async def test_register_skip_initialize_then_get_and_list(client, factory, root) -> None:
    body = {"model_id": "m", "metadata": {"llama_model": "Llama3.2-3B-Instruct", "skip_initialize": True}}
    response = await client.post("/v1/models", json=body)
    assert response.status == 200, await response.text()
    model = await response.json()
    assert OPENAI_MODEL_KEYS | OUR_KEYS <= set(model) and "error" not in model
    assert model["object"] == "model" and model["owned_by"] == "llamaserve"
    assert model["status"] == "registered" and model["llama_model"] == "Llama3.2-3B-Instruct"
    assert model["checkpoint_dir"] == "m"  # found in the root by model id (shown relative to it)
    assert model["metadata"] == body["metadata"]
    assert model["identifier"] == "m" and model["provider_resource_id"] == "Llama3.2-3B-Instruct"
    assert factory.loads() == []
    got = await (await client.get("/v1/models/m")).json()
    assert got == model
    listed = await (await client.get("/v1/models")).json()
    assert listed == {"object": "list", "data": [model]}


async def test_register_loads_in_the_call(client, factory) -> None:
    response = await client.post("/v1/models", json={"model": "m", "max_seq_len": 64})
    model = await response.json()
    assert response.status == 200 and model["status"] == "ready"
    assert model["max_seq_len"] == 64 and model["memory_bytes"] == 100 and model["load_time_s"] >= 0
    assert factory.loads() == ["m"]
    # vLLM's names, which its clients and routers read: the context length, what was loaded, no parent
    assert (model["max_model_len"], model["root"], model["parent"]) == (64, "m", None)


async def test_llama_stack_client_register_body(client, registry, root) -> None:
    body = {
        "model_id": "my-finetune",
        "provider_model_id": "meta-llama/Llama-3.2-3B-Instruct",
        "provider_id": "meta-reference",
        "model_type": "llm",
        "metadata": {"skip_load": True, "quantization": {"type": "fp8_mixed"}, "model_parallel_size": 1},
    }
    response = await client.post("/v1/models", json=body)
    model = await response.json()
    assert response.status == 200, model
    assert model["status"] == "registered" and model["llama_model"] == "meta-llama/Llama-3.2-3B-Instruct"
    # No folder named my-finetune: found by llama_model, here an HF-style folder in the root.
    assert model["checkpoint_dir"] == "meta-llama/Llama-3.2-3B-Instruct"
    spec = registry._entries["my-finetune"].spec
    assert (spec.quantization, spec.model_parallel_size) == ("fp8_mixed", 1)


async def test_metadata_as_the_cli_sends_it(client, registry) -> None:
    # `llama-stack-client models register X --metadata JSON` sends the JSON as a string, and null without it.
    body = {"model_id": "my-finetune", "provider_model_id": None, "provider_id": None,
            "metadata": '{"llama_model": "meta-llama/Llama-3.2-3B-Instruct", "skip_initialize": true}'}
    response = await client.post("/v1/models", json=body)
    model = await response.json()
    assert response.status == 200, model
    assert model["status"] == "registered" and model["llama_model"] == "meta-llama/Llama-3.2-3B-Instruct"
    assert model["metadata"] == {"llama_model": "meta-llama/Llama-3.2-3B-Instruct", "skip_initialize": True}
    plain = await client.post("/v1/models", json={"model_id": "meta-llama/Llama-3.2-3B-Instruct", "metadata": None})
    assert plain.status == 200, await plain.text()
    for bad in ("{not json", "[1, 2]"):
        await expect_error(await client.post("/v1/models", json={"model_id": "x", "metadata": bad}), 400,
                           code="invalid_value", param="metadata")


async def test_ids_with_a_slash(client, factory, root) -> None:
    model_id = "meta-llama/Llama-3.2-3B-Instruct"
    response = await client.post("/v1/models", json={"model_id": model_id})
    model = await response.json()
    assert response.status == 200 and model["id"] == model_id
    assert model["checkpoint_dir"] == model_id
    assert (await (await client.get(f"/v1/models/{model_id}")).json())["status"] == "ready"
    deleted = await client.delete(f"/v1/models/{model_id}")
    assert await deleted.json() == {"id": model_id, "object": "model", "deleted": True}
    assert factory.events == [f"load {Path(model_id).name}", f"shutdown {Path(model_id).name}"]
    await expect_error(await client.get(f"/v1/models/{model_id}"), 404, code="model_not_found", param="model")


async def test_hot_switch_through_the_api(client, registry) -> None:
    await client.post("/v1/models", json={"model_id": "m"})
    response = await client.post("/v1/models", json={"model_id": "m", "checkpoint_dir": "v2"})
    model = await response.json()
    assert model["status"] == "ready" and model["checkpoint_dir"].endswith("v2") and model["memory_bytes"] == 120
    async with registry.lease("m") as engine:
        assert engine.checkpoint == "v2"


async def test_delete_unloads_and_unregisters(client, registry, factory) -> None:
    await client.post("/v1/models", json={"model_id": "m"})
    response = await client.delete("/v1/models/m")
    assert response.status == 200 and (await response.json())["deleted"] is True
    assert factory.events == ["load m", "shutdown m"]
    assert registry.lifecycle_stats().memory_reserved_bytes == 0
    await expect_error(await client.delete("/v1/models/m"), 404, code="model_not_found")
    assert (await (await client.get("/v1/models")).json())["data"] == []


async def test_failed_load_answers_and_shows_failed(client, factory) -> None:
    factory.failures["bad"] = CheckpointError("bad/consolidated.00.pth: missing key tok_embeddings.weight")
    response = await client.post("/v1/models", json={"model_id": "bad"})
    error = await expect_error(response, 400, code="invalid_checkpoint")
    assert "tok_embeddings.weight" in error["message"]
    model = await (await client.get("/v1/models/bad")).json()
    assert model["status"] == "failed" and "tok_embeddings.weight" in model["error"]
    ok = await client.post("/v1/models", json={"model_id": "m"})
    assert (await ok.json())["status"] == "ready"  # the server goes on serving others


async def test_memory_budget_exceeded_is_507(client) -> None:
    for name in ("m", "v2"):
        assert (await client.post("/v1/models", json={"model_id": name})).status == 200
    error = await expect_error(
        await client.post("/v1/models", json={"model_id": "Llama3.2-3B-Instruct"}), 507, code="memory_budget_exceeded"
    )
    assert "memory budget" in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model_id": "m", "max_seq_len": "long"}, "max_seq_len", "invalid_value"),
        ({"model_id": "m", "metadata": {"max_seq_len": -1}}, "metadata.max_seq_len", "invalid_value"),
        ({"model_id": "m", "metadata": {"skip_initialize": "yes"}}, "metadata.skip_initialize", "invalid_value"),
        ({"model_id": "m", "metadata": []}, "metadata", "invalid_value"),
        ({"model_id": ""}, "model_id", "invalid_value"),
        ({"model_id": "m", "colour": "blue"}, "colour", "invalid_value"),
        ({"model_id": "m", "metadata": {"max_seq_len": 8, "quantization": {"kind": "x"}}}, "metadata.quantization.type", None),
        ({"metadata": {}}, "model_id", None),
        ({"model_id": "m", "model": "other"}, "model", None),
        ({"model_id": "m", "checkpoint_dir": "m", "metadata": {"checkpoint_dir": "v2"}}, 
         "metadata.checkpoint_dir", None),
        ({"model_id": "m", "model_type": "embedding"}, "model_type", None),
        ({"model_id": "m", "llama_model": "Llama3.2-3B-Instrct"}, "metadata.llama_model", "unknown_llama_model"),
    ],
)
async def test_bad_bodies_are_precise_400s(client, factory, body, param, code) -> None:
    error = await expect_error(await client.post("/v1/models", json=body), 400, code=code, param=param)
    assert error["type"] == "invalid_request_error"
    assert factory.loads() == []


async def test_unknown_llama_model_lists_close_matches(client) -> None:
    body = {"model_id": "m", "metadata": {"llama_model": "Llama3.2-3B-Instrct"}}
    error = await expect_error(await client.post("/v1/models", json=body), 400, code="unknown_llama_model")
    assert "Llama3.2-3B-Instruct" in error["message"]


async def test_invalid_json_is_a_400(client) -> None:
    response = await client.post("/v1/models", data=b"{not json", headers={"Content-Type": "application/json"})
    await expect_error(response, 400, code="invalid_json")


async def test_checkpoint_dir_safety_through_the_api(client, root, tmp_path) -> None:
    outside = checkpoint(tmp_path, "outside")
    (root / "escape").symlink_to(outside)
    cases = [
        (str(outside), "checkpoint_dir_outside_roots"),
        ("../outside", "checkpoint_dir_outside_roots"),
        ("escape", "checkpoint_dir_outside_roots"),
        ("absent", "checkpoint_not_found"),
    ]
    for checkpoint_dir, code in cases:
        body = {"model_id": "x", "checkpoint_dir": checkpoint_dir}
        await expect_error(await client.post("/v1/models", json=body), 400, code=code, param="checkpoint_dir")
    body = {"model_id": "x", "metadata": {"checkpoint_dir": str(outside), "skip_initialize": True}}
    await expect_error(await client.post("/v1/models", json=body), 400, code="checkpoint_dir_outside_roots")
    await expect_error(await client.post("/v1/models", json={"model_id": "nowhere"}), 400, code="checkpoint_not_found")


async def test_lease_of_a_loading_model_is_503_with_retry_after(aiohttp_client, root, factory) -> None:
    registry = make_registry([root], factory, load_wait_timeout_s=0.01)
    client = await aiohttp_client(build_app(registry))
    gate = factory.gate("m")
    registering = asyncio.create_task(client.post("/v1/models", json={"model_id": "m"}))
    await asyncio.wait_for(factory.load_started("m").wait(), 5)
    assert (await (await client.get("/v1/models/m")).json())["status"] == "loading"
    with pytest.raises(ApiError) as caught:
        async with registry.lease("m"):
            pass
    assert caught.value.status == 503 and "Retry-After" in caught.value.headers
    gate.set()
    assert (await (await asyncio.wait_for(registering, 5)).json())["status"] == "ready"



async def test_openai_sdk_reads_the_model_objects(client) -> None:
    import openai

    model_id = "meta-llama/Llama-3.2-3B-Instruct"
    await client.post("/v1/models", json={"model_id": model_id, "metadata": {"skip_initialize": True}})
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    async with sdk:
        listed = await sdk.models.list()
        assert [m.id for m in listed.data] == [model_id] and listed.data[0].owned_by == "llamaserve"
        retrieved = await sdk.models.retrieve(model_id)
        assert retrieved.id == model_id and retrieved.object == "model"
        deleted = await sdk.models.delete(model_id)
        assert deleted.deleted and deleted.id == model_id
        with pytest.raises(openai.NotFoundError):
            await sdk.models.retrieve(model_id)


async def test_in_the_real_app_a_registered_model_loads_on_its_first_chat(aiohttp_client, tmp_path) -> None:
    """create_app with no models: register with skip_initialize, chat, see it load and answer."""
    from server.app import create_app
    from server.config import ServerConfig
    from tests.server.fake_engine import FakeEngineFactory

    checkpoint(tmp_path, "ft")
    checkpoint(tmp_path, "ft2")
    fake_factory = FakeEngineFactory()
    client = await aiohttp_client(create_app(ServerConfig(checkpoint_roots=[tmp_path], models=[]), fake_factory))
    assert (await (await client.get("/v1/models")).json())["data"] == []
    body = {"model_id": "my-ft", "checkpoint_dir": "ft", "metadata": {"skip_initialize": True}}
    assert (await (await client.post("/v1/models", json=body)).json())["status"] == "registered"
    assert fake_factory.engines == {}
    chat = {"model": "my-ft", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = await client.post("/v1/chat/completions", json=chat)
    assert response.status == 200, await response.text()
    assert (await response.json())["model"] == "my-ft" and "my-ft" in fake_factory.engines
    assert (await (await client.get("/v1/models/my-ft")).json())["status"] == "ready"
    loaded = await (await client.post("/v1/models", json={"model_id": "other", "checkpoint_dir": "ft2"})).json()
    assert loaded["status"] == "ready" and loaded["memory_bytes"] == 1 << 20
    assert (await client.get("/ready")).status == 200


async def test_under_torchrun_register_hot_switch_and_unload_are_a_clear_400(client, registry, root, monkeypatch):
    await registry.register(ModelSpec(model_id="m", checkpoint_dir=root / "m"), load=True)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")  # what torchrun sets in every rank
    for body in ({"model_id": "other", "checkpoint_dir": "v2"}, {"model_id": "m", "checkpoint_dir": "v2"}):
        error = await expect_error(await client.post("/v1/models", json=body), 400, code="unsupported_under_torchrun")
        assert "torchrun" in error["message"]
    await expect_error(await client.delete("/v1/models/m"), 400, code="unsupported_under_torchrun")
    listed = await (await client.get("/v1/models")).json()
    assert [(m["id"], m["status"]) for m in listed["data"]] == [("m", "ready")]  # nothing changed


async def test_keep_alive_at_registration(client, registry) -> None:
    body = {"model_id": "m", "metadata": {"keep_alive": "5m", "skip_initialize": True}}
    model = await (await client.post("/v1/models", json=body)).json()
    assert model["keep_alive_s"] == 300.0 and registry._entries["m"].spec.keep_alive_s == 300.0
    never = await (await client.post("/v1/models", json={"model_id": "m", "keep_alive": -1, "skip_initialize": True})).json()
    assert never["keep_alive_s"] is None  # kept loaded while idle: the server's default, "never"
    bad = await client.post("/v1/models", json={"model_id": "m", "metadata": {"keep_alive": "5 minutes"}})
    await expect_error(bad, 400, code="invalid_value", param="metadata.keep_alive")
