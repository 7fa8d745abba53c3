"""A .gguf file as a checkpoint (engine/loading/gguf_cache.py): converted once into the cache dir
with progress, reused while the file is unchanged, converted again when it changes; the
checkpoint-root guard applies to the file; the memory estimate reads the header alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.loading import gguf_cache
from engine.loading.file_guard import OutsideRoots
from engine.types import CheckpointError

gguf = pytest.importorskip("gguf")
from tests.engine.test_gguf_import import DIM, N_LAYERS, hf_weights, write_gguf  # noqa: E402


@pytest.fixture
def gguf_file(tmp_path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    write_gguf(root / "tiny.gguf", hf_weights(seed=1, tied=False))
    return root / "tiny.gguf"


def test_converted_once_then_reused(tmp_path, gguf_file):
    events = []
    cache = tmp_path / "cache"
    first = gguf_cache.ensure_converted(gguf_file, allowed_roots=(gguf_file.parent,), cache_dir=cache, progress=events.append)
    assert first.parent == cache / "gguf" and first.name.startswith("tiny-")
    assert (first / "params.json").is_file() and gguf_cache.is_converted(first)
    stages = {event.stage for event in events}
    assert "converting tiny.gguf" in stages and any(s.startswith("writing ") for s in stages)
    assert events[-1].done > 0
    marker_mtime = (first / "params.json").stat().st_mtime_ns
    again = []
    assert gguf_cache.ensure_converted(gguf_file, cache_dir=cache, progress=again.append) == first
    assert again == [] and (first / "params.json").stat().st_mtime_ns == marker_mtime  # nothing converted
    # the file changed (its mtime): another key, converted again
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = gguf_cache.ensure_converted(gguf_file, cache_dir=cache)
    assert changed != first and gguf_cache.is_converted(changed)
    assert not list((cache / "gguf").glob(".tiny-*"))  # no scratch dirs left


def test_the_checkpoint_root_guard_applies_to_the_file(tmp_path, gguf_file):
    other_root = tmp_path / "other"
    other_root.mkdir()
    with pytest.raises(OutsideRoots):
        gguf_cache.ensure_converted(gguf_file, allowed_roots=(other_root,), cache_dir=tmp_path / "cache")
    link = other_root / "link.gguf"
    link.symlink_to(gguf_file)  # a link inside the roots to a file outside them
    with pytest.raises(OutsideRoots):
        gguf_cache.ensure_converted(link, allowed_roots=(other_root,), cache_dir=tmp_path / "cache")
    with pytest.raises(OutsideRoots):
        gguf_cache.gguf_params(link, (other_root,))


def test_header_params_and_bad_files(tmp_path, gguf_file):
    params = gguf_cache.gguf_params(gguf_file)
    assert params["dim"] == DIM and params["n_layers"] == N_LAYERS
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    with pytest.raises(CheckpointError, match="broken.gguf"):
        gguf_cache.ensure_converted(broken, cache_dir=tmp_path / "cache")
    assert not gguf_cache.is_gguf_file(tmp_path / "missing.gguf")


def test_loader_estimate_reads_the_header_and_load_converts(tmp_path, gguf_file, monkeypatch):
    from engine.config import EngineConfig
    from engine.loader import LocalEngineFactory, load_engine
    from server.model_spec import ModelSpec

    monkeypatch.setenv("LLAMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    spec = ModelSpec(model_id="tiny-gguf", checkpoint_dir=gguf_file, trusted=False, allowed_roots=(gguf_file.parent,))
    config = EngineConfig(dtype="float32", max_seq_len=64, cpu_kv_cache_bytes=1 << 20)
    estimate = LocalEngineFactory(config).estimate_memory_bytes(spec)
    assert not (tmp_path / "cache" / "gguf").exists()  # the estimate converted nothing
    assert estimate > 0
    import asyncio

    async def load_and_close():
        engine = load_engine(spec, config)
        await engine.shutdown()

    asyncio.run(load_and_close())
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()] == [gguf_cache.converted_dir(gguf_file).name]
    assert LocalEngineFactory(config).estimate_memory_bytes(spec) == estimate  # now from the conversion: the same architecture
