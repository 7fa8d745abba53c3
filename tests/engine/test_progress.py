"""Progress of the long waits (engine/loading/progress.py): log lines with sizes and rates when no terminal,
callback events for the server, and the stages a real checkpoint load reports."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.loading.progress import Progress, ProgressEvent, format_amount


def test_log_lines_every_tenth_with_sizes_and_rate(caplog):
    events: list[ProgressEvent] = []
    with caplog.at_level(logging.INFO, logger="engine.loading.progress"):
        with Progress("reading weights", 100 * 2**20, callback=events.append, bar=False) as progress:
            for _ in range(20):
                progress.update(5 * 2**20)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10  # 10%, 20%, ... 90%, then the final line
    assert lines[0].startswith("reading weights: 10.0 MiB of 100.0 MiB (10%) in ") and lines[0].endswith("iB/s")
    assert [line.split("(")[1].split(")")[0] for line in lines[:-1]] == [f"{p}%" for p in range(10, 100, 10)]
    assert lines[-1].startswith("reading weights: 100.0 MiB in ")
    assert len(events) == 21 and events[0].done == 0 and events[-1].fraction == 1.0
    body = events[-1].as_dict()
    assert body["stage"] == "reading weights" and body["done"] == body["total"] == 100 * 2**20 and body["unit"] == "B"


def test_a_failed_stage_logs_no_completion(caplog):
    with caplog.at_level(logging.INFO, logger="engine.loading.progress"), pytest.raises(RuntimeError):
        with Progress("converting", 10, unit="tensor", bar=False) as progress:
            progress.update(1)
            raise RuntimeError("disk full")
    assert not any("in " in r.getMessage() and "of" not in r.getMessage() for r in caplog.records)


def test_format_amount():
    assert format_amount(3 * 2**30, "B") == "3.0 GiB" and format_amount(512, "B") == "512 B"
    assert format_amount(1, "tensor") == "1 tensor" and format_amount(1200, "tensor") == "1,200 tensors"


def test_checkpoint_load_reports_each_stage(tiny_checkpoint_2shards):
    """Two shards resharded to one rank: mapping/resharding, reading bytes, preparing (fusing, packing), in that order."""
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.config import EngineConfig
    from engine.executor.worker_group import WorkerGroup
    from tests.conftest import TINY_DESCRIPTOR

    events: list[ProgressEvent] = []
    spec = resolve_checkpoint(tiny_checkpoint_2shards, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    WorkerGroup(spec, EngineConfig(dtype="float32", cpu_kv_cache_bytes=1 << 20), max_seq_len=64, progress=events.append).shutdown()
    finals = {}
    for event in events:
        finals[event.stage] = event
    stages = list(finals)
    assert stages[0] == "rank 0: mapping 2 shard(s), resharding to 1" and stages[1] == "rank 0: reading weights"
    assert stages[2].startswith("rank 0: preparing weights (")  # the backend's name follows
    reading = finals["rank 0: reading weights"]
    assert reading.unit == "B" and reading.done == reading.total > 0
    assert finals[stages[0]].done == finals[stages[0]].total > 0 and finals[stages[0]].unit == "tensor"


async def test_models_route_shows_a_loading_models_progress(aiohttp_client, tiny_checkpoint, monkeypatch):
    """LocalEngineFactory keeps each load's latest event; GET /v1/models/{id} shows it while loading, not after."""
    import threading

    from engine import loader
    from engine.config import EngineConfig
    from server.model_spec import ModelSpec
    from server.registry import ModelRegistry
    from tests.conftest import TINY_DESCRIPTOR
    from tests.server.fake_engine import FakeEngine
    from tests.server.test_model_routes import build_app

    release, reported = threading.Event(), threading.Event()

    def slow_load(spec, config, *, chat_template_path=None, progress=None):
        progress(ProgressEvent("rank 0: reading weights", 3 << 20, 12 << 20, "B", 1.5))
        reported.set()
        release.wait(30)
        return FakeEngine(spec.model_id)

    monkeypatch.setattr(loader, "load_engine", slow_load)
    factory = loader.LocalEngineFactory(EngineConfig(dtype="float32", max_seq_len=64, cpu_kv_cache_bytes=1 << 20))
    registry = ModelRegistry(factory, checkpoint_roots=[tiny_checkpoint.parent])
    client = await aiohttp_client(build_app(registry))
    spec = ModelSpec(model_id="m", checkpoint_dir=tiny_checkpoint, llama_model=TINY_DESCRIPTOR, trusted=True)
    registering = asyncio.create_task(registry.register(spec, load=True))
    assert await asyncio.to_thread(reported.wait, 30)
    body = await (await client.get("/v1/models/m")).json()
    assert body["status"] == "loading"
    assert body["loading_progress"] == {"stage": "rank 0: reading weights", "done": 3 << 20, "total": 12 << 20, "unit": "B",
                                        "fraction": 0.25, "elapsed_s": 1.5, "rate_per_s": round((3 << 20) / 1.5, 1)}
    release.set()
    await asyncio.wait_for(registering, 30)
    body = await (await client.get("/v1/models/m")).json()
    assert body["status"] == "ready" and "loading_progress" not in body
