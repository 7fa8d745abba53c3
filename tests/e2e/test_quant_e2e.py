"""A quantized model through the whole server (issue 18): registered with metadata.quantization,
batched greedy requests equal the same requests alone, and /v1/models/{id} reports the format and
the resident weight bytes. (MP=2 == MP=1 over quantized shards: tests/engine/test_quant_model.py
and test_quant_checkpoint.py; the QUANTIZATION_TYPE and run.yaml paths: below, without a load.)"""

from __future__ import annotations

import concurrent.futures

import pytest

from engine.loading.checkpoint import estimate_weight_bytes, resolve_checkpoint
from server.__main__ import make_parser
from server.config import build_config
from tests.e2e.conftest import BASE_DESCRIPTOR, ready_server

QUANTIZED = "tiny-int4"
PROMPTS = [f"Request number {i}: tell me something" for i in range(6)]


@pytest.fixture(scope="module")
def server(base_checkpoint, checkpoints):
    with ready_server(BASE_DESCRIPTOR, base_checkpoint, checkpoints.root, dtype="float32") as live:
        with live.http() as http:
            response = http.post("/v1/models", json={"model_id": QUANTIZED, "checkpoint_dir": str(base_checkpoint),
                                                     "metadata": {"llama_model": BASE_DESCRIPTOR, "quantization": {"type": "int4_mixed"}}})  # fmt: skip
            assert response.status_code == 200, response.text
        yield live


def _greedy(client, prompt: str) -> str:
    return client.completions.create(model=QUANTIZED, prompt=prompt, temperature=0, max_tokens=12).choices[0].text


def test_batched_equals_alone(server):
    with server.openai() as client:
        alone = [_greedy(client, p) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            batched = list(pool.map(lambda p: _greedy(client, p), PROMPTS))
    assert batched == alone and all(alone)


def test_models_route_reports_format_and_resident_bytes(server, base_checkpoint):
    with server.http() as http:
        quantized = http.get(f"/v1/models/{QUANTIZED}").json()["weights"]
        dense = http.get(f"/v1/models/{BASE_DESCRIPTOR}").json()["weights"]
    assert quantized["quantization"] == "int4_mixed" and quantized["formats"] == ["float32", "int4"]
    assert dense["quantization"] is None and dense["formats"] == ["float32"]
    args = resolve_checkpoint(base_checkpoint, model_id="x", llama_model=BASE_DESCRIPTOR).model_args
    block_params = args.n_layers * (2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * args.kv_heads * args.head_dim
                                    + 3 * args.dim * args.ffn_hidden_dim)  # fmt: skip
    float_block_bytes = 4 * block_params
    # the float32 embedding and head (vocab 128256) dominate this tiny model: the saving is in the blocks
    assert quantized["resident_bytes"] <= estimate_weight_bytes(args, "float32") - float_block_bytes + float_block_bytes // 6
    assert quantized["resident_bytes"] < dense["resident_bytes"]


def test_quantization_env_and_run_yaml_reach_the_engine_config(tmp_path):
    assert build_config(make_parser().parse_args([]), env={"QUANTIZATION_TYPE": "int8"}).engine.quantization == "int8"
    path = tmp_path / "run.yaml"
    path.write_text("engine:\n  quantization: int4_mixed\n")
    assert build_config(make_parser().parse_args(["--config", str(path)]), env={}).engine.quantization == "int4_mixed"
