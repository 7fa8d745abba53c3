"""Issue 8 end to end: a live server that starts with no model; models registered, loaded, hot
switched and unloaded over HTTP, on tiny real Llama 3 checkpoints (random weights, the real
tokenizer), with greedy outputs checked against engines loaded straight from the checkpoints.

(run.yaml and INFERENCE_MODEL / INFERENCE_CHECKPOINT_DIR registration at start: test_cli_e2e.py.)
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (
    BASE_DESCRIPTOR,
    LiveServer,
    empty_server,
    engine_config,
    expected_greedy_texts,
    metric,
    release_freed_memory,
    resident_bytes,
    scrape,
    wait_until,
)

FINETUNE = "my-finetune-v3"
PROMPT_IDS = [128000, 9906, 1070, 11, 1268]  # <|begin_of_text|>Hello there, how
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(checkpoints):
    with empty_server(checkpoints.root) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with server.http() as session:
        yield session


@pytest.fixture(scope="module")
def expected(checkpoints):
    """Greedy completion of PROMPT_IDS per checkpoint, from an engine loaded without the server."""
    cache: dict[Path, str] = {}

    def get(checkpoint_dir: Path) -> str:
        if checkpoint_dir not in cache:
            cache[checkpoint_dir] = expected_greedy_texts(checkpoint_dir, [PROMPT_IDS], MAX_TOKENS)[0]
        return cache[checkpoint_dir]

    return get


def register(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/models", json=body)


def complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions",
                     json={"model": model, "prompt": PROMPT_IDS, "temperature": 0, "max_tokens": MAX_TOKENS})


def completion_text(http: httpx.Client, model: str) -> str:
    response = complete(http, model)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def chat(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                   "temperature": 0, "max_tokens": 4})


def model_ids(http: httpx.Client) -> set[str]:
    return {m["id"] for m in http.get("/v1/models").json()["data"]}


def gauge(http: httpx.Client, name: str) -> float:
    return metric(scrape(http), f"llamaserve:{name}")


def unregister_all(http: httpx.Client, *ids: str) -> None:
    for model_id in ids:
        http.delete(f"/v1/models/{model_id}")
    assert not model_ids(http) & set(ids)


def shown(path: Path) -> str:
    """A checkpoint dir as listings show it: relative to its root (these all sit directly in it)."""
    return Path(os.path.realpath(path)).name


# --------------------------------------------------------------------------- lazy loading
def test_starts_empty_then_skip_initialize_registers_without_loading(server, http, base_checkpoint):
    assert http.get("/ready").status_code == 200 and model_ids(http) == set()
    try:
        # The descriptor alone: the checkpoint is found at <root>/<model_id>, as meta-reference did.
        response = register(http, model_id=BASE_DESCRIPTOR, skip_initialize=True)
        assert response.status_code == 200, response.text
        info = response.json()
        assert info["status"] == "registered" and info["checkpoint_dir"] == shown(base_checkpoint)
        assert info["load_time_s"] is None and info["memory_bytes"] is None
        assert gauge(http, "models_loaded") == 0 and gauge(http, "model_memory_reserved_bytes") == 0
        assert server.registry.engines() == []  # no weights in memory
        loads_before = gauge(http, "model_loads_total")

        # Three first requests at once: one load, three answers.
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            responses = list(pool.map(lambda _: chat(http, BASE_DESCRIPTOR), range(3)))
        assert [r.status_code for r in responses] == [200] * 3, [r.text for r in responses]
        assert len({r.json()["choices"][0]["message"]["content"] for r in responses}) == 1
        assert gauge(http, "model_loads_total") == loads_before + 1
        info = http.get(f"/v1/models/{BASE_DESCRIPTOR}").json()
        assert info["status"] == "ready" and info["load_time_s"] > 0 and info["memory_bytes"] > 0

        # Llama Stack's later spelling, inside metadata, with an HF-style base id.
        other = register(http, model_id="lazy-skip-load", checkpoint_dir=BASE_DESCRIPTOR,
                         metadata={"llama_model": "meta-llama/Llama-3.2-1B-Instruct", "skip_load": True})
        assert other.status_code == 200 and other.json()["status"] == "registered", other.text
    finally:
        unregister_all(http, BASE_DESCRIPTOR, "lazy-skip-load")


# --------------------------------------------------------------------------- load in the call, unload frees memory
def test_register_loads_in_the_call_and_delete_frees_memory(server, http, base_checkpoint):
    from engine.loading.checkpoint import estimate_weight_bytes
    from engine.models.args import ModelArgs
    from tests.e2e.conftest import E2E_DTYPE, E2E_PARAMS

    weight_bytes = estimate_weight_bytes(ModelArgs(**E2E_PARAMS), E2E_DTYPE)  # ~132 MB in float64
    # The first load in a process keeps ~90 MB for good (torch runtime and allocator arenas; later
    # load/unload cycles return to within ~1 MB, measured): pay it before measuring.
    warm = register(http, model_id="warmup", checkpoint_dir=str(base_checkpoint), llama_model=BASE_DESCRIPTOR)
    assert warm.status_code == 200 and http.delete("/v1/models/warmup").status_code == 200
    release_freed_memory()
    before = resident_bytes()
    try:
        started = time.monotonic()
        response = register(http, model="eager", checkpoint_dir=str(base_checkpoint), llama_model=BASE_DESCRIPTOR)
        assert response.status_code == 200, response.text
        info = response.json()
        assert info["status"] == "ready"  # loaded before the call returned
        assert 0 < info["load_time_s"] <= time.monotonic() - started
        assert info["memory_bytes"] >= weight_bytes
        assert completion_text(http, "eager")
        loaded = resident_bytes()
        assert loaded - before > 0.75 * weight_bytes, (before, loaded)
    finally:
        deleted = http.delete("/v1/models/eager")
    assert deleted.status_code == 200 and deleted.json() == {"id": "eager", "object": "model", "deleted": True}
    assert http.get("/v1/models/eager").status_code == 404 and complete(http, "eager").status_code == 404
    assert gauge(http, "models_loaded") == 0 and gauge(http, "model_memory_reserved_bytes") == 0

    def memory_returned() -> bool:
        release_freed_memory()  # gc + malloc_trim: see conftest
        return resident_bytes() - before < 0.25 * weight_bytes

    wait_until(memory_returned, timeout_s=10, interval_s=0.2, what="resident memory to drop after DELETE")


# --------------------------------------------------------------------------- llama_model with a custom id
def test_custom_id_serves_a_finetune_of_the_base(server, http, checkpoints, base_checkpoint, expected):
    finetune = checkpoints.get(FINETUNE, seed=2)  # same params.json as the base, other weights
    try:
        # my-finetune-v3 names no Llama model: the load says to set llama_model.
        response = register(http, model_id=FINETUNE)
        assert response.status_code == 400 and "llama_model" in response.json()["error"]["message"], response.text
        assert http.get(f"/v1/models/{FINETUNE}").json()["status"] == "failed"

        response = register(http, model_id=FINETUNE, metadata={"llama_model": BASE_DESCRIPTOR})  # found in the root
        assert response.status_code == 200, response.text
        info = response.json()
        assert info["status"] == "ready" and info["llama_model"] == BASE_DESCRIPTOR
        assert info["checkpoint_dir"] == shown(finetune) and info["metadata"] == {"llama_model": BASE_DESCRIPTOR}
        text = completion_text(http, FINETUNE)
        assert text == expected(finetune)
        assert text != expected(base_checkpoint)  # the finetune's weights, not the base's
    finally:
        unregister_all(http, FINETUNE)


# --------------------------------------------------------------------------- hot switch under load
def test_hot_switch_under_load_drops_nothing(server, http, checkpoints, base_checkpoint, expected):
    first, second = base_checkpoint, checkpoints.get("second-weights", seed=1)
    expected_first, expected_second = expected(first), expected(second)
    assert expected_first != expected_second
    response = register(http, model_id="switch", checkpoint_dir=str(first), llama_model=BASE_DESCRIPTOR)
    assert response.status_code == 200, response.text
    unloads_before = gauge(http, "model_unloads_total")
    # A stream opened before the switch and read after it: it must finish on the weights it started with.
    long_body = {"model": "switch", "prompt": PROMPT_IDS, "temperature": 0, "max_tokens": 120}
    long_expected = http.post("/v1/completions", json=long_body).json()["choices"][0]["text"]

    results: list[tuple[float, float, int, str]] = []  # (sent at, done at, status, text or error)
    lock = threading.Lock()
    stop = threading.Event()

    def client_loop() -> None:
        with server.http() as own:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    r = complete(own, "switch")
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                    outcome = (sent, time.monotonic(), r.status_code, text)
                except httpx.HTTPError as exc:
                    outcome = (sent, time.monotonic(), -1, repr(exc))
                with lock:
                    results.append(outcome)

    def count_after(t: float) -> int:
        with lock:
            return sum(1 for sent, _, _, _ in results if sent > t)

    threads = [threading.Thread(target=client_loop, name=f"client-{i}") for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: count_after(0) >= 6, timeout_s=60, what="traffic before the switch")
        with http.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as long_response:
            events = (line[len("data: "):] for line in long_response.iter_lines() if line.startswith("data: "))
            long_text = json.loads(next(events))["choices"][0]["text"]  # running on the first weights now
            switch_sent = time.monotonic()
            response = register(http, model_id="switch", checkpoint_dir=str(second), llama_model=BASE_DESCRIPTOR)
            switch_done = time.monotonic()
            long_text += "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "ready" and response.json()["checkpoint_dir"] == shown(second)
        wait_until(lambda: count_after(switch_done) >= 6, timeout_s=60, what="traffic after the switch")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    try:
        failures = [r for r in results if r[2] != 200]
        assert failures == []
        # Done before the switch was asked for: the first weights. Sent after it returned: the second.
        before = [text for _, done, _, text in results if done < switch_sent]
        after = [text for sent, _, _, text in results if sent > switch_done]
        overlapping = [text for sent, done, _, text in results if done >= switch_sent and sent <= switch_done]
        assert before and set(before) == {expected_first}
        assert after and set(after) == {expected_second}
        assert set(overlapping) <= {expected_first, expected_second}  # either, never a mix or an error
        assert long_text == long_expected  # opened on the first weights, read to its end after the switch
        # The old engine is shut down once its last request ended.
        wait_until(lambda: gauge(http, "model_unloads_total") == unloads_before + 1, timeout_s=10,
                   what="the old engine to unload")
        assert gauge(http, "models_loaded") == 1 and completion_text(http, "switch") == expected_second
    finally:
        unregister_all(http, "switch")


# --------------------------------------------------------------------------- refusals
def test_paths_outside_the_roots_symlink_escapes_and_missing_dirs_are_400(server, http, checkpoints):
    outside = checkpoints.outside_copy("outside-model")
    escape_link = checkpoints.root / "escape-link"
    if not escape_link.is_symlink():
        escape_link.symlink_to(outside, target_is_directory=True)
    sneaky = checkpoints.root / "sneaky-shard-link"
    if not sneaky.exists():
        sneaky.mkdir()
        shutil.copy(outside / "params.json", sneaky / "params.json")
        shutil.copy(outside / "tokenizer.model", sneaky / "tokenizer.model")
        (sneaky / "consolidated.00.pth").symlink_to(outside / "consolidated.00.pth")

    cases = {
        "outside": (str(outside), "checkpoint_dir_outside_roots", "outside the checkpoint roots"),
        "dotdot": (f"{checkpoints.root}/../{outside.parent.name}/{outside.name}", "checkpoint_dir_outside_roots", ".."),
        "dir-link": ("escape-link", "checkpoint_dir_outside_roots", "symlink"),
        "file-link": (str(sneaky), "checkpoint_dir_outside_roots", "symlink"),
        "missing": (str(checkpoints.root / "no-such-checkpoint"), "checkpoint_not_found", "does not exist"),
    }
    for model_id, (checkpoint_dir, code, words) in cases.items():
        response = register(http, model_id=model_id, checkpoint_dir=checkpoint_dir, llama_model=BASE_DESCRIPTOR)
        assert response.status_code == 400, (model_id, response.text)
        error = response.json()["error"]
        assert error["code"] == code and error["param"] == "checkpoint_dir" and words in error["message"], (model_id, error)
        assert str(checkpoints.outside) not in error["message"] or model_id in ("outside", "dotdot")

    response = register(http, model_id="nowhere-to-be-found", skip_initialize=True)
    assert response.status_code == 400 and response.json()["error"]["code"] == "checkpoint_not_found"
    response = register(http, model_id="typo", checkpoint_dir=BASE_DESCRIPTOR, llama_model="Llama3.2-1B-Instruc",
                        skip_initialize=True)
    assert response.status_code == 400 and response.json()["error"]["code"] == "unknown_llama_model"
    assert BASE_DESCRIPTOR in response.json()["error"]["message"]  # close matches are listed
    assert model_ids(http) & {*cases, "nowhere-to-be-found", "typo"} == set()


def test_corrupt_shard_fails_with_reason_and_the_server_keeps_serving(server, http, checkpoints, base_checkpoint):
    broken = checkpoints.corrupt("corrupt-shard")
    try:
        assert register(http, model_id="good", checkpoint_dir=BASE_DESCRIPTOR, llama_model=BASE_DESCRIPTOR).status_code == 200
        failures_before = gauge(http, "model_load_failures_total")
        response = register(http, model_id="broken", checkpoint_dir=str(broken), llama_model=BASE_DESCRIPTOR)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_checkpoint"
        assert "consolidated.00.pth" in response.json()["error"]["message"]
        info = http.get("/v1/models/broken").json()
        assert info["status"] == "failed" and "consolidated.00.pth" in info["error"]
        assert gauge(http, "model_load_failures_total") == failures_before + 1
        refused = chat(http, "broken")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_load_failed"
        assert chat(http, "good").status_code == 200  # the others keep serving
        assert http.get("/v1/models/good").json()["status"] == "ready"

        # A hot switch to the corrupt shard fails; the old weights keep serving under the old spec.
        response = register(http, model_id="good", checkpoint_dir=str(broken), llama_model=BASE_DESCRIPTOR)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_checkpoint"
        info = http.get("/v1/models/good").json()
        assert info["status"] == "ready" and info["checkpoint_dir"] == shown(base_checkpoint)
        assert chat(http, "good").status_code == 200
    finally:
        unregister_all(http, "good", "broken")


def test_skip_initialize_reregistration_retires_the_old_weights(server, http, checkpoints, base_checkpoint, expected):
    second = checkpoints.get("second-weights", seed=1)
    try:
        assert register(http, model_id="relazy", checkpoint_dir=str(base_checkpoint),
                        llama_model=BASE_DESCRIPTOR).status_code == 200
        assert completion_text(http, "relazy") == expected(base_checkpoint)
        response = register(http, model_id="relazy", checkpoint_dir=str(second), llama_model=BASE_DESCRIPTOR,
                            skip_initialize=True)
        assert response.status_code == 200 and response.json()["status"] == "registered", response.text
        wait_until(lambda: server.registry.lifecycle_stats().loaded_models == 0, timeout_s=10,
                   what="the old engine to retire")
        assert completion_text(http, "relazy") == expected(second)  # loaded on first use, the new weights
    finally:
        unregister_all(http, "relazy")


def test_concurrent_registrations_of_one_id_share_one_load(server, http, base_checkpoint):
    loads_before = gauge(http, "model_loads_total")
    body = {"model_id": "shared-load", "checkpoint_dir": str(base_checkpoint), "llama_model": BASE_DESCRIPTOR}
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            responses = list(pool.map(lambda _: http.post("/v1/models", json=body), range(3)))
        assert [r.status_code for r in responses] == [200] * 3, [r.text for r in responses]
        assert {r.json()["status"] for r in responses} == {"ready"}
        assert gauge(http, "model_loads_total") == loads_before + 1
    finally:
        unregister_all(http, "shared-load")


def test_hf_style_id_finds_the_descriptor_folder(server, http, base_checkpoint):
    hf_id = "meta-llama/Llama-3.2-1B-Instruct"
    try:
        # No checkpoint_dir: not at <root>/meta-llama/..., so <root>/<its descriptor>, as `llama model download` names it.
        response = register(http, model_id=hf_id)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "ready" and response.json()["checkpoint_dir"] == shown(base_checkpoint)
        assert http.get(f"/v1/models/{hf_id}").json()["id"] == hf_id  # ids with '/' route
        with server.openai() as sdk:
            assert sdk.models.retrieve(hf_id).id == hf_id
            reply = sdk.chat.completions.create(model=hf_id, messages=[{"role": "user", "content": "hi"}],
                                                temperature=0, max_tokens=4)
            assert reply.choices[0].message.content and reply.model == hf_id
        assert http.delete(f"/v1/models/{hf_id}").status_code == 200
    finally:
        unregister_all(http, hf_id)


def test_delete_lets_a_running_stream_finish_then_unloads(server, http, base_checkpoint):
    body = {"model": "draining", "prompt": PROMPT_IDS, "temperature": 0, "max_tokens": 48}
    try:
        assert register(http, model_id="draining", checkpoint_dir=str(base_checkpoint),
                        llama_model=BASE_DESCRIPTOR).status_code == 200
        expected_text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        unloads_before = gauge(http, "model_unloads_total")
        with server.http() as own, own.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
            text = json.loads(next(events))["choices"][0]["text"]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                deleted = pool.submit(http.delete, "/v1/models/draining")
                wait_until(lambda: http.get("/v1/models/draining").status_code == 404, timeout_s=10,
                           what="the id to be unregistered")
                assert complete(http, "draining").status_code == 404  # no new requests
                rest = list(events)
                assert deleted.result(timeout=60).status_code == 200
        assert rest[-1] == "[DONE]"
        text += "".join(json.loads(e)["choices"][0]["text"] for e in rest[:-1])
        assert text == expected_text  # the running request was not cut
        assert gauge(http, "model_unloads_total") == unloads_before + 1 and gauge(http, "models_loaded") == 0
    finally:
        unregister_all(http, "draining")


def test_memory_budget_refuses_clearly_or_evicts_the_idle_lru_model(checkpoints, base_checkpoint):
    from engine.loader import LocalEngineFactory
    from server.config import ServerConfig
    from server.model_spec import ModelSpec

    second = checkpoints.get("second-weights", seed=1)
    need = LocalEngineFactory(engine_config()).estimate_memory_bytes(
        ModelSpec(model_id="x", checkpoint_dir=base_checkpoint, llama_model=BASE_DESCRIPTOR))
    for evict in (False, True):
        config = ServerConfig(models=[], checkpoint_roots=[checkpoints.root], engine=engine_config(),
                              memory_budget_bytes=int(1.5 * need), evict_idle_lru=evict)
        live = LiveServer(config).start()
        try:
            with live.http() as http:
                assert register(http, model_id="a", checkpoint_dir=str(base_checkpoint),
                                llama_model=BASE_DESCRIPTOR).status_code == 200
                response = register(http, model_id="b", checkpoint_dir=str(second), llama_model=BASE_DESCRIPTOR)
                if not evict:
                    assert response.status_code == 507, response.text
                    error = response.json()["error"]
                    assert error["code"] == "memory_budget_exceeded" and "DELETE /v1/models" in error["message"]
                    assert http.get("/v1/models/b").json()["status"] == "failed"
                    assert completion_text(http, "a")  # the loaded model keeps serving
                    assert http.delete("/v1/models/a").status_code == 200
                    assert completion_text(http, "b")  # room now: the next request loads it
                else:
                    assert response.status_code == 200 and response.json()["status"] == "ready", response.text
                    assert http.get("/v1/models/a").json()["status"] == "registered"  # evicted, still known
                    assert gauge(http, "model_evictions_total") == 1
                    assert completion_text(http, "a")  # loads again, evicting b (now the idle one)
                    assert http.get("/v1/models/b").json()["status"] == "registered"
                assert gauge(http, "model_memory_reserved_bytes") <= config.memory_budget_bytes
        finally:
            live.stop()


def test_llama_stack_register_body_and_per_model_max_seq_len(server, http, base_checkpoint):
    # What `llama-stack-client models register` sends; the base descriptor comes as provider_model_id.
    body = {"model_id": "stack-ft", "provider_model_id": BASE_DESCRIPTOR, "provider_id": "meta-reference",
            "model_type": "llm", "metadata": {"max_seq_len": 64}}
    try:
        response = register(http, **body)
        assert response.status_code == 200, response.text
        info = response.json()
        assert info["status"] == "ready" and info["llama_model"] == BASE_DESCRIPTOR and info["max_seq_len"] == 64
        assert info["checkpoint_dir"] == shown(base_checkpoint) and info["identifier"] == "stack-ft"
        too_long = http.post("/v1/completions", json={"model": "stack-ft", "prompt": "hi", "max_tokens": 100})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        assert "64" in too_long.json()["error"]["message"]
        # Refusals name the field and carry a string code, like every other error.
        refusals = {
            "model_type": register(http, **{**body, "model_id": "an-embedder", "model_type": "embedding"}),
            "model_id": register(http, provider_model_id=BASE_DESCRIPTOR, skip_initialize=True),
            "metadata.llama_model": register(http, model_id="x", llama_model=BASE_DESCRIPTOR, skip_initialize=True,
                                             metadata={"llama_model": "Llama3.1-8B-Instruct"}),
        }
        for param, refused in refusals.items():
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param and refused.json()["error"]["code"] == "invalid_value"
    finally:
        unregister_all(http, "stack-ft")


def test_ready_reports_a_configured_model_that_failed_to_load(checkpoints, base_checkpoint):
    from server.config import ServerConfig
    from server.model_spec import ModelSpec

    broken = checkpoints.corrupt("corrupt-shard")
    config = ServerConfig(
        models=[ModelSpec(model_id="fine", checkpoint_dir=base_checkpoint, llama_model=BASE_DESCRIPTOR, trusted=True),
                ModelSpec(model_id="broken-at-start", checkpoint_dir=broken, llama_model=BASE_DESCRIPTOR, trusted=True)],
        checkpoint_roots=[checkpoints.root], engine=engine_config())
    live = LiveServer(config).start()
    try:
        with live.http() as http:
            wait_until(lambda: {m["status"] for m in http.get("/v1/models").json()["data"]} == {"ready", "failed"},
                       timeout_s=60, what="both start-up loads to end")
            assert completion_text(http, "fine")  # the server keeps serving the good one
            response = http.get("/ready")
            body = response.json()
            assert response.status_code == 503 and body["status"] == "failed"  # not "loading": nothing is
            assert any("broken-at-start" in error for error in body.get("errors", []))  # and why it is not ready
    finally:
        live.stop()


@pytest.mark.slow  # spawns a model-parallel worker process
def test_model_parallel_2_registration_matches_mp1_and_delete_stops_its_worker(server, http, base_checkpoint, expected):
    import multiprocessing

    children_before = {child.pid for child in multiprocessing.active_children()}
    try:
        response = register(http, model_id="mp2", checkpoint_dir=str(base_checkpoint), llama_model=BASE_DESCRIPTOR,
                            model_parallel_size=2)
        assert response.status_code == 200 and response.json()["status"] == "ready", response.text
        workers = {child.pid for child in multiprocessing.active_children()} - children_before
        assert len(workers) == 1  # rank 1; rank 0 is this process
        assert completion_text(http, "mp2") == expected(base_checkpoint)  # float64: MP2 == MP1 exactly
        assert http.delete("/v1/models/mp2").status_code == 200
        wait_until(lambda: not workers & {child.pid for child in multiprocessing.active_children()}, timeout_s=30,
                   what="the model-parallel worker to exit")
    finally:
        unregister_all(http, "mp2")
