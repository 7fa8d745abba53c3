"""LoRA adapters over a live server: registered as models (POST /v1/models with
metadata.base_model) and through vLLM's /v1/load_lora_adapter, served to the openai SDK as their
own model ids, hot-swapped under load, unloaded while the base keeps serving. Greedy outputs are
checked against an engine loaded from a checkpoint with the adapter merged into its weights."""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, E2E_PARAMS, LiveServer, engine_config, expected_greedy_texts, metric, scrape

PROMPT_IDS = [128000, 9906, 1070, 11, 1268]  # <|begin_of_text|>Hello there, how
MAX_TOKENS = 8
BASE = "base"


@pytest.fixture(scope="module")
def adapters(checkpoints, base_checkpoint):
    """Two adapters (torchtune's and PEFT's files) under the checkpoint root, and for each a
    checkpoint with the adapter merged in (the expectation)."""
    import torch

    from engine.models.args import ModelArgs
    from tests.engine.lora_fixtures import write_peft, write_torchtune

    args = ModelArgs(**E2E_PARAMS)
    written = {"tt": write_torchtune(checkpoints.root / "ada-tt", args, seed=5),
               "peft": write_peft(checkpoints.root / "ada-peft", args, seed=6)}
    state = torch.load(base_checkpoint / "consolidated.00.pth", weights_only=True)
    merged = {}
    for name, adapter in written.items():
        out = checkpoints.root / f"merged-{name}"
        out.mkdir(exist_ok=True)
        for file in ("params.json", "tokenizer.model"):
            shutil.copy(base_checkpoint / file, out / file)
        torch.save(adapter.merged(state), out / "consolidated.00.pth")
        merged[name] = out
    return {name: (adapter.folder, merged[name]) for name, adapter in written.items()}


@pytest.fixture(scope="module")
def wide_adapter(checkpoints) -> Path:
    """An adapter for a base of dim 128: it does not fit the e2e base (dim 64)."""
    import dataclasses

    from engine.models.args import ModelArgs
    from tests.engine.lora_fixtures import write_torchtune

    return write_torchtune(checkpoints.root / "ada-wide", dataclasses.replace(ModelArgs(**E2E_PARAMS), dim=128)).folder


@pytest.fixture(scope="module")
def expected(adapters, base_checkpoint):
    texts = {name: expected_greedy_texts(merged, [PROMPT_IDS], MAX_TOKENS)[0] for name, (_, merged) in adapters.items()}
    texts[BASE] = expected_greedy_texts(base_checkpoint, [PROMPT_IDS], MAX_TOKENS)[0]
    assert len(set(texts.values())) == 3  # each adapter changes what the base says
    return texts


@pytest.fixture(scope="module")
def server(checkpoints, base_checkpoint):
    from server.config import ServerConfig
    from server.model_spec import ModelSpec

    config = ServerConfig(models=[], checkpoint_roots=[checkpoints.root], engine=engine_config(max_loras=2),
                          load_wait_timeout_s=60)
    live = LiveServer(config).start()
    spec = ModelSpec(model_id=BASE, checkpoint_dir=base_checkpoint, llama_model=BASE_DESCRIPTOR)
    live.call(live.registry.register(spec, load=True))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as session:
        yield session


def complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT_IDS, "temperature": 0,
                                              "max_tokens": MAX_TOKENS})


def text_of(http: httpx.Client, model: str) -> str:
    response = complete(http, model)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_adapter_registered_as_a_model_serves_the_openai_sdk(server, http, adapters, expected):
    folder, _ = adapters["tt"]
    response = http.post("/v1/models", json={"model_id": "ada", "checkpoint_dir": folder.name,
                                             "metadata": {"base_model": BASE, "skip_initialize": True}})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "registered" and response.json()["parent"] == BASE
    client = server.openai()
    reply = client.completions.create(model="ada", prompt=PROMPT_IDS, temperature=0, max_tokens=MAX_TOKENS)
    assert reply.model == "ada" and reply.choices[0].text == expected["tt"]  # the first request loaded it
    chat = client.chat.completions.create(model="ada", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=4)
    assert chat.model == "ada"
    listed = {m.id: m for m in client.models.list().data}
    assert listed["ada"].model_extra["parent"] == BASE and listed["ada"].model_extra["root"] == folder.name
    assert listed["ada"].model_extra["status"] == "ready"
    assert text_of(http, BASE) == expected[BASE]  # the base is untouched


def test_vllm_load_and_unload_routes(http, adapters, expected):
    folder, _ = adapters["peft"]
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(folder)})  # absolute
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": folder.name})  # relative
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert text_of(http, "sql") == expected["peft"]
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert gone.status_code == 200 and "removed successfully" in gone.text
    assert complete(http, "sql").status_code == 404
    assert text_of(http, BASE) == expected[BASE]  # the base keeps serving
    missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_are_400_with_the_reason(http, wide_adapter, tmp_path):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": wide_adapter.name})
    body = response.json()["error"]
    assert response.status_code == 400 and "this base needs" in body["message"] and "[4, 64]" in body["message"]
    outside = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "lora_path"
    assert "outside the checkpoint roots" in outside.json()["error"]["message"]
    unknown_base = http.post("/v1/models", json={"model_id": "y", "checkpoint_dir": "ada-tt",
                                                 "metadata": {"base_model": "nope"}})
    assert unknown_base.status_code == 404 and unknown_base.json()["error"]["param"] == "metadata.base_model"
    assert http.get("/v1/models/wide").status_code == 404  # vLLM's route keeps no adapter it could not load
    registered = http.post("/v1/models", json={"model_id": "wide", "checkpoint_dir": wide_adapter.name,
                                               "metadata": {"base_model": BASE}})
    assert registered.status_code == 400 and "this base needs" in registered.json()["error"]["message"]
    assert http.get("/v1/models/wide").json()["status"] == "failed"  # a model registration keeps it, with why
    assert "this base needs" in http.get("/v1/models/wide").json()["error"]
    assert http.delete("/v1/models/wide").status_code == 200


def test_hot_swap_under_load_drops_nothing_and_unload_404s(http, adapters, expected, wide_adapter):
    tt_folder, peft_folder = adapters["tt"][0], adapters["peft"][0]
    response = http.post("/v1/models", json={"model_id": "swap", "checkpoint_dir": tt_folder.name,
                                             "metadata": {"base_model": BASE}})
    assert response.status_code == 200 and response.json()["status"] == "ready"
    started = threading.Barrier(9)

    def one(i: int) -> tuple[int, str]:
        started.wait()
        response = complete(http, "swap" if i % 2 else BASE)
        return response.status_code, response.json()["choices"][0]["text"] if response.status_code == 200 else response.text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        started.wait()
        swapped = http.post("/v1/models", json={"model_id": "swap", "checkpoint_dir": peft_folder.name,
                                                "metadata": {"base_model": BASE}})
        results = [f.result() for f in futures]
    assert swapped.status_code == 200, swapped.text
    for i, (status, text) in enumerate(results):
        assert status == 200, text  # nothing dropped: each ran on the old weights or the new
        assert text in ((expected["tt"], expected["peft"]) if i % 2 else (expected[BASE],))
    assert text_of(http, "swap") == expected["peft"]
    bad = http.post("/v1/models", json={"model_id": "swap", "checkpoint_dir": wide_adapter.name, "metadata": {"base_model": BASE}})
    assert bad.status_code == 400  # a swap to an adapter that does not fit: the loaded version keeps serving
    assert text_of(http, "swap") == expected["peft"] and http.get("/v1/models/swap").json()["root"] == peft_folder.name
    assert http.delete("/v1/models/swap").status_code == 200
    assert complete(http, "swap").status_code == 404
    assert text_of(http, BASE) == expected[BASE]


def test_lora_metrics(http, adapters):
    folder, _ = adapters["tt"]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "counted", "lora_path": folder.name}).status_code == 200
    text_of(http, "counted")
    text_of(http, "counted")
    samples = scrape(http)
    assert metric(samples, "llamaserve:lora_requests_total", model_name=BASE, lora_name="counted") == 2
    info = [labels for (name, labels), _ in samples.items() if name == "vllm:lora_requests_info"]
    assert info and dict(info[0])["max_lora"] == "2"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "counted"}).status_code == 200


def test_adapters_named_at_start_and_evicted_lru_under_the_memory_budget(checkpoints, base_checkpoint, adapters, expected):
    """--lora-modules / run.yaml adapters are registered at start and loaded by their first request;
    with a memory budget that holds the base and one adapter, loading the other evicts the idle one."""
    from engine.loader import LocalEngineFactory
    from server.config import LoraModule, ServerConfig
    from server.model_spec import ModelSpec

    cfg = engine_config(max_loras=2)
    base_spec = ModelSpec(model_id=BASE, checkpoint_dir=base_checkpoint, llama_model=BASE_DESCRIPTOR, trusted=True)
    base_bytes = LocalEngineFactory(cfg).estimate_memory_bytes(base_spec)
    adapter_bytes = max((folder / name).stat().st_size for folder, _ in adapters.values()
                        for name in ("adapter_model.pt", "adapter_model.safetensors") if (folder / name).is_file())
    config = ServerConfig(models=[base_spec], checkpoint_roots=[checkpoints.root], engine=cfg, load_wait_timeout_s=60,
                          memory_budget_bytes=base_bytes + adapter_bytes + adapter_bytes // 2,
                          lora_modules=(LoraModule("tt", adapters["tt"][0]), LoraModule("peft", adapters["peft"][0], BASE)))
    live = LiveServer(config).start()
    try:
        with live.http() as http:
            listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
            assert listed["tt"]["status"] == "registered" and listed["peft"]["parent"] == BASE
            assert text_of(http, "tt") == expected["tt"]
            assert text_of(http, "peft") == expected["peft"]  # evicts tt (idle), which no longer fits beside it
            statuses = {m["id"]: m["status"] for m in http.get("/v1/models").json()["data"]}
            assert statuses["peft"] == "ready" and statuses["tt"] == "registered"
            assert text_of(http, "tt") == expected["tt"]  # loaded again on its next request
            assert http.delete(f"/v1/models/{BASE}").status_code == 200  # the adapters stay, holding nothing
            statuses = {m["id"]: (m["status"], m["memory_bytes"]) for m in http.get("/v1/models").json()["data"]}
            assert statuses == {"tt": ("registered", None), "peft": ("registered", None)}
            assert live.call(_reserved(live)) == 0
            assert complete(http, "tt").status_code == 404  # its base is gone
    finally:
        live.stop()


async def _reserved(live) -> int:
    return live.registry.lifecycle_stats().memory_reserved_bytes
