"""The registry's LoRA adapters over fake engines: leases load them once, eviction under the
memory budget (by adapter loads and by model loads), unregister while a lease holds one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.errors import ApiError
from tests.server.test_registry import FakeEngine, FakeFactory, checkpoint, make_registry, settle, spec_for, within


class AdapterEngine(FakeEngine):
    """A fake engine that records adapter loads and unloads."""

    def __init__(self, spec, events) -> None:
        super().__init__(spec, events)
        self.adapters: list[str] = []

    async def load_adapter(self, name: str, folder: Path, *, roots=()) -> int:
        self._events.append(f"load adapter {name}")
        self.adapters.append(name)
        return 1

    async def unload_adapter(self, name: str) -> bool:
        self._events.append(f"unload adapter {name}")
        self.adapters.remove(name)
        return True


class AdapterFactory(FakeFactory):
    async def load(self, spec):
        engine = AdapterEngine(spec, self.events)
        self.events.append(f"load {spec.checkpoint_dir.name}")
        self.engines.append(engine)
        return engine


def adapter_folder(root: Path, name: str, num_bytes: int) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * num_bytes)
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


async def test_leases_load_once_and_a_model_load_evicts_idle_adapters(root) -> None:
    factory = AdapterFactory(sizes={"a": 100, "b": 100})
    registry = make_registry([root], factory, memory_budget_bytes=250)
    checkpoint(root, "a"), checkpoint(root, "b")
    await registry.register(spec_for(root, "base", "a"), load=True)
    for name in ("x", "y"):
        adapter_folder(root, name, 60)
        await registry.register_adapter(name, name, "base", metadata={}, load=False)
    async with registry.lease("x") as engine, registry.lease("x"):
        assert engine.model_id == "x"
    async with registry.lease("y"):
        pass
    base = factory.engines[0]
    assert base.adapters == ["x", "y"] and registry.lifecycle_stats().memory_reserved_bytes == 220
    # a second model fits only once both idle adapters are gone (no model is evicted: evict_idle_lru is off)
    info = await within(registry.register(spec_for(root, "other", "b"), load=True))
    assert info.status == "ready" and base.adapters == []
    assert {registry.get(n).status for n in ("x", "y")} == {"registered"}
    assert registry.lifecycle_stats().memory_reserved_bytes == 200
    await within(registry.close())


async def test_an_adapter_in_use_is_never_evicted(root) -> None:
    factory = AdapterFactory(sizes={"a": 100, "b": 100})
    registry = make_registry([root], factory, memory_budget_bytes=250)
    checkpoint(root, "a"), checkpoint(root, "b")
    await registry.register(spec_for(root, "base", "a"), load=True)
    adapter_folder(root, "x", 60), adapter_folder(root, "y", 60)
    await registry.register_adapter("x", "x", "base", metadata={}, load=True)
    await registry.register_adapter("y", "y", "base", metadata={}, load=True)
    async with registry.lease("x"):
        with pytest.raises(ApiError) as caught:  # evicting y alone is not enough, and x is in use
            await within(registry.register(spec_for(root, "other", "b"), load=True))
        assert caught.value.status == 507
        assert factory.engines[0].adapters == ["x", "y"]
    await within(registry.close())


async def test_unregister_while_leased_then_404(root) -> None:
    factory = AdapterFactory()
    registry = make_registry([root], factory)
    checkpoint(root, "a")
    await registry.register(spec_for(root, "base", "a"), load=True)
    adapter_folder(root, "x", 10)
    await registry.register_adapter("x", "x", "base", metadata={}, load=True)
    async with registry.lease("x"):
        removal = asyncio.create_task(registry.unregister("x"))
        await settle()
        with pytest.raises(ApiError) as caught:
            async with registry.lease("x"):
                pass
        assert caught.value.status == 404
    await within(removal)
    assert factory.engines[0].adapters == [] and [m.id for m in registry.list()] == ["base"]
    with pytest.raises(ApiError) as caught:  # a model and an adapter never share a name
        await registry.register_adapter("base", "x", "base", metadata={}, load=False)
    assert caught.value.code == "model_id_in_use"
    await within(registry.close())
