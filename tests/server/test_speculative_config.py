"""Speculative decoding's settings at the edge: the --speculative-config flag and run.yaml (server and
per model), registration metadata, and the metrics under our and vLLM's names."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.spec.config import SpeculativeConfig
from server.__main__ import make_parser
from server.config import ConfigError, build_config
from tests.server.test_api import client, factory  # noqa: F401 - the fixtures
from tests.server.test_model_routes import build_app, expect_error
from tests.server.test_registry import FakeFactory, checkpoint, make_registry

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def test_flag_and_env_as_vllm_spells_them():
    config = build_config(make_parser().parse_args(["--speculative-config", NGRAM]), env={})
    assert config.engine.speculative_config == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)
    config = build_config(make_parser().parse_args([]),
                          env={"LLAMASERVE_SPECULATIVE_CONFIG": '{"model": "small", "num_speculative_tokens": 3}'})
    assert config.engine.speculative_config == SpeculativeConfig("draft_model", 3, model="small")
    assert build_config(make_parser().parse_args([]), env={}).engine.speculative_config is None


@pytest.mark.parametrize("value, words", [
    ("{nope", "not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "speculative_config.num_speculative_tokens"),
])
def test_bad_flag_names_the_field(value, words):
    with pytest.raises(ConfigError, match=words):
        build_config(make_parser().parse_args(["--speculative-config", value]), env={})


def test_run_yaml_server_default_and_per_model(tmp_path: Path):
    (tmp_path / "m").mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(
        "engine:\n  speculative_config: {method: ngram, num_speculative_tokens: 2}\n"
        "models:\n"
        f"  - model_id: m\n    checkpoint_dir: {tmp_path / 'm'}\n"
        "    speculative_config: {model: m, num_speculative_tokens: 3}\n"
        f"  - model_id: n\n    checkpoint_dir: {tmp_path / 'm'}\n"
        "    metadata: {speculative_config: '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'}\n"
    )
    config = build_config(make_parser().parse_args(["--config", str(path)]), env={})
    assert config.engine.speculative_config == SpeculativeConfig("ngram", 2)
    by_id = {spec.model_id: spec for spec in config.models}
    assert by_id["m"].speculative_config == SpeculativeConfig("draft_model", 3, model="m")
    assert by_id["n"].speculative_config == SpeculativeConfig("ngram", 5)
    path.write_text(f"models:\n  - model_id: m\n    checkpoint_dir: {tmp_path / 'm'}\n"
                    "    speculative_config: {method: ngram}\n")
    with pytest.raises(ConfigError, match=r"models\[0\].*num_speculative_tokens is required"):
        build_config(make_parser().parse_args(["--config", str(path)]), env={})


async def test_registration_metadata(aiohttp_client, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name in ("m", "v2"):
        checkpoint(root, name)
    registry = make_registry([root], FakeFactory())
    routes_client = await aiohttp_client(build_app(registry))
    body = {"model_id": "m", "metadata": {"skip_initialize": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}}
    response = await routes_client.post("/v1/models", json=body)
    assert response.status == 200, await response.text()
    assert registry._entries["m"].spec.speculative_config == SpeculativeConfig("ngram", 3)
    shown = (await (await routes_client.get("/v1/models/m")).json())["speculative_config"]
    assert shown == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    # a draft model: registered ones only; the model itself may be its own draft
    draft = {"model_id": "v2", "skip_initialize": True, "speculative_config": {"model": "m", "num_speculative_tokens": 2}}
    assert (await routes_client.post("/v1/models", json=draft)).status == 200
    assert registry._with_draft(registry._entries["v2"].spec).draft.model_id == "m"
    unknown = {"model_id": "v2", "skip_initialize": True, "speculative_config": {"model": "nope", "num_speculative_tokens": 2}}
    await expect_error(await routes_client.post("/v1/models", json=unknown), 400, code="model_not_found",
                       param="speculative_config.model")
    bad = {"model_id": "m", "metadata": {"speculative_config": '{"method": "ngram"'}}
    error = await expect_error(await routes_client.post("/v1/models", json=bad), 400, param="metadata.speculative_config")
    assert "not valid JSON" in error["message"]
    bad = {"model_id": "m", "speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}
    await expect_error(await routes_client.post("/v1/models", json=bad), 400, param="speculative_config.num_speculative_tokens")


async def test_metrics_under_our_and_vllm_names(client, factory):  # noqa: F811
    from prometheus_client.parser import text_string_to_metric_families

    await client.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
    stats = factory.engines["fake"]._stats
    stats.spec_decode_num_drafts_total, stats.spec_decode_num_draft_tokens_total = 10, 40
    stats.spec_decode_num_accepted_tokens_total, stats.spec_decode_num_accepted_tokens_per_pos = 25, [9, 8, 5, 3]
    families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}

    def samples(name: str) -> dict[tuple, float]:
        return {tuple(sorted(s.labels.items())): s.value for s in families[name].samples if s.name == f"{name}_total"
                or s.name == name}

    fake = (("model_name", "fake"),)
    assert samples("vllm:spec_decode_num_drafts") == {fake: 10}
    assert samples("vllm:spec_decode_num_draft_tokens") == {fake: 40}
    assert samples("vllm:spec_decode_num_accepted_tokens") == {fake: 25}
    assert samples("vllm:spec_decode_num_accepted_tokens_per_pos") == {
        (("model_name", "fake"), ("position", str(i))): n for i, n in enumerate([9, 8, 5, 3])}
    assert samples("llamaserve:spec_decode_draft_tokens") == {fake: 40}
    assert samples("llamaserve:spec_decode_accepted_tokens") == {fake: 25}
    assert samples("llamaserve:spec_decode_acceptance_rate") == {fake: 25 / 40}
