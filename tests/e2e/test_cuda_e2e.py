"""A live server whose engine runs on a CUDA device, over real sockets: greedy completions equal the
CPU engine's (float64), chat streams, concurrent requests, a bad request answered 400 while the
others run, and a bfloat16 model loaded at run time. Skipped without a GPU (.ci/cuda runs them
where one is lent)."""

from __future__ import annotations

import concurrent.futures
import gc
import json

import pytest
import torch

from tests.e2e.conftest import BASE_DESCRIPTOR, expected_greedy_texts, ready_server

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")]

PROMPTS = [[128000, 9906, 1070, 11, 1268], [128000, 791, 6864, 315, 9822, 374], [128000, 40, 1093]]
MAX_TOKENS = 8
KV_CACHE_BYTES = 64 << 20


@pytest.fixture(scope="module")
def server(checkpoints, base_checkpoint):
    with ready_server(BASE_DESCRIPTOR, base_checkpoint, checkpoints.root, device="cuda",
                      kv_cache_bytes=KV_CACHE_BYTES) as live:
        yield live


def complete(http, prompt, **body):
    return http.post("/v1/completions", json={"model": BASE_DESCRIPTOR, "prompt": prompt, "temperature": 0,
                                              "max_tokens": MAX_TOKENS, **body})


def test_concurrent_greedy_completions_equal_the_cpu_engine(server, base_checkpoint):
    expected = expected_greedy_texts(base_checkpoint, PROMPTS, MAX_TOKENS)  # float64 on the CPU, one at a time
    with server.http() as http, concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        futures = [pool.submit(complete, http, prompt) for prompt in PROMPTS * 2]
        bad = http.post("/v1/completions", json={"model": BASE_DESCRIPTOR, "prompt": PROMPTS[0], "max_tokens": -3})
        responses = [f.result() for f in futures]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert [r.status_code for r in responses] == [200] * len(responses)
    assert [r.json()["choices"][0]["text"] for r in responses] == expected * 2
    models = {m["id"]: m for m in server.http().get("/v1/models").json()["data"]}
    assert BASE_DESCRIPTOR in models


def test_chat_streams_on_cuda(server):
    body = {"model": BASE_DESCRIPTOR, "messages": [{"role": "user", "content": "Say hi"}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    with server.http() as http:
        plain = http.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None})
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert plain.status_code == 200, plain.text
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == plain.json()["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"]


def test_a_bfloat16_model_loaded_and_unloaded_at_run_time(checkpoints):
    """The default dtype on CUDA (bfloat16), a model loaded through POST /v1/models on a server that
    started with none, answering, then unloaded; three times over: the card's allocated memory comes
    back to the same level each time. (The first round may keep per-thread CUDA state, such as a
    cuBLAS workspace for the engine thread: the level is taken after it.)"""
    from server.config import ServerConfig
    from tests.e2e.conftest import LiveServer, engine_config

    checkpoint = checkpoints.get("cuda-finetune", seed=2)
    config = ServerConfig(models=[], checkpoint_roots=[checkpoints.root],
                          engine=engine_config(device="cuda", dtype=None, kv_cache_bytes=KV_CACHE_BYTES))
    live = LiveServer(config).start()
    try:
        with live.http() as http:
            levels = []
            for _ in range(3):
                registered = http.post("/v1/models", json={"model_id": "ft", "checkpoint_dir": str(checkpoint),
                                                           "llama_model": BASE_DESCRIPTOR})
                assert registered.status_code == 200, registered.text
                response = complete(http, PROMPTS[1], model="ft")
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
                loaded_bytes = torch.cuda.memory_allocated()
                assert http.delete("/v1/models/ft").status_code == 200
                gc.collect()
                torch.cuda.synchronize()
                levels.append((loaded_bytes, torch.cuda.memory_allocated()))
        print(f"\nallocated bytes (loaded, after unload) per round: {levels}")
        assert all(loaded > unloaded + KV_CACHE_BYTES // 2 for loaded, unloaded in levels)
        assert levels[2][1] == levels[1][1]
    finally:
        live.stop()
