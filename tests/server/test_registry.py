"""ModelRegistry over a fake EngineFactory: loads are gated by asyncio.Events, never by sleeps."""

from __future__ import annotations

import asyncio
import difflib
import math
import os
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.types import CheckpointError, InvalidRequest, SamplingDefaults
from server.errors import ApiError
from server.model_spec import ModelSpec
from server.registry import ModelRegistry

WAIT_S = 5.0  # a safety net so a broken test fails instead of hanging; nothing waits this long


# ---------------------------------------------------------------------- fakes
@dataclass(frozen=True)
class FakeDescriptor:
    name: str


DESCRIPTORS = {"Llama3.2-3B-Instruct": "meta-llama/Llama-3.2-3B-Instruct", "Llama3.1-8B": "meta-llama/Llama-3.1-8B"}


def fake_resolve_descriptor(name: str) -> FakeDescriptor:
    for descriptor, hf_id in DESCRIPTORS.items():
        if name in (descriptor, hf_id):
            return FakeDescriptor(descriptor)
    close = difflib.get_close_matches(name, list(DESCRIPTORS) + list(DESCRIPTORS.values()), n=3, cutoff=0.5)
    raise InvalidRequest(f"unknown llama model {name!r}; close matches: {', '.join(close) or 'none'}")


class FakeEngine:
    def __init__(self, spec: ModelSpec, events: list[str]) -> None:
        self.model_id = spec.model_id
        self.checkpoint = spec.checkpoint_dir.name
        self.max_seq_len = spec.max_seq_len or 128
        self.tokenizer = None
        self.chat_format = None
        self.sampling_defaults = SamplingDefaults()
        self.closed = asyncio.Event()
        self.is_dead = False
        self._events = events

    async def shutdown(self) -> None:
        self._events.append(f"shutdown {self.checkpoint}")
        self.closed.set()


@dataclass
class FakeFactory:
    """Engines keyed by checkpoint folder name: its size, an optional gate, an optional failure."""

    sizes: dict[str, int] = field(default_factory=dict)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    failures: dict[str, Exception] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    started: dict[str, asyncio.Event] = field(default_factory=dict)
    engines: list[FakeEngine] = field(default_factory=list)

    def estimate_memory_bytes(self, spec: ModelSpec) -> int:
        return self.sizes.get(spec.checkpoint_dir.name, 100)

    def gate(self, name: str) -> asyncio.Event:
        self.gates[name] = asyncio.Event()
        return self.gates[name]

    def load_started(self, name: str) -> asyncio.Event:
        return self.started.setdefault(name, asyncio.Event())

    async def load(self, spec: ModelSpec) -> FakeEngine:
        name = spec.checkpoint_dir.name
        self.events.append(f"load {name}")
        self.load_started(name).set()
        if name in self.gates:
            await self.gates[name].wait()
        if name in self.failures:
            raise self.failures[name]
        engine = FakeEngine(spec, self.events)
        self.engines.append(engine)
        return engine

    def loads(self) -> list[str]:
        return [e.split(" ", 1)[1] for e in self.events if e.startswith("load ")]


def make_registry(roots: list[Path], factory: FakeFactory, **kwargs) -> ModelRegistry:
    return ModelRegistry(factory, checkpoint_roots=roots, descriptor_resolver=fake_resolve_descriptor, **kwargs)


def checkpoint(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "params.json").write_text("{}")
    return path


async def within(awaitable):
    return await asyncio.wait_for(awaitable, WAIT_S)


async def settle() -> None:
    """Let every ready task run (yields to the loop; no wall-clock wait)."""
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory()


@pytest.fixture
async def registry(root: Path, factory: FakeFactory):
    reg = make_registry([root], factory)
    yield reg
    for gate in factory.gates.values():
        gate.set()
    await within(reg.close())


def spec_for(root: Path, model_id: str, folder: str | None = None, **kwargs) -> ModelSpec:
    folder = folder or model_id
    path = root / folder
    if not path.exists():
        checkpoint(root, folder)
    return ModelSpec(model_id=model_id, checkpoint_dir=path, **kwargs)


# ---------------------------------------------------------------------- lazy loading
async def test_starts_empty(registry: ModelRegistry) -> None:
    assert registry.list() == []
    assert registry.engines() == []
    assert registry.ready()
    stats = registry.lifecycle_stats()
    assert (stats.loads_total, stats.loaded_models, stats.memory_reserved_bytes) == (0, 0, 0)


async def test_skip_initialize_registers_without_loading(registry, root, factory) -> None:
    info = await registry.register(spec_for(root, "m"), load=False)
    assert info.status == "registered"
    assert info.memory_bytes is None and info.load_time_s is None
    assert info.owned_by == "llamaserve" and info.checkpoint_dir == "m"  # relative to its root
    assert factory.loads() == []
    assert registry.engines() == []


async def test_concurrent_first_leases_share_one_load(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m"), load=False)
    gate = factory.gate("m")
    got: list[FakeEngine] = []

    async def use() -> None:
        async with registry.lease("m") as engine:
            got.append(engine)

    users = [asyncio.create_task(use()) for _ in range(3)]
    await within(factory.load_started("m").wait())
    assert registry.get("m").status == "loading"
    gate.set()
    await within(asyncio.gather(*users))
    assert factory.loads() == ["m"]
    assert len(got) == 3 and got[0] is got[1] is got[2]
    info = registry.get("m")
    assert info.status == "ready" and info.memory_bytes == 100 and info.load_time_s is not None


async def test_register_with_load_returns_ready(registry, root, factory) -> None:
    info = await registry.register(spec_for(root, "m", max_seq_len=64), load=True)
    assert info.status == "ready" and info.max_seq_len == 64 and info.memory_bytes == 100
    assert factory.loads() == ["m"]
    assert [model_id for model_id, _ in registry.engines()] == ["m"]
    assert registry.lifecycle_stats().loads_total == 1


async def test_register_same_spec_again_does_not_reload(registry, root, factory) -> None:
    spec = spec_for(root, "m", metadata={"v": 1})
    await registry.register(spec, load=True)
    info = await registry.register(spec_for(root, "m", metadata={"v": 2}), load=True)
    assert factory.loads() == ["m"] and info.metadata == {"v": 2}


async def test_lease_of_model_still_loading_gets_503_with_retry_after(root, factory) -> None:
    registry = make_registry([root], factory, load_wait_timeout_s=0.01)
    await registry.register(spec_for(root, "m"), load=False)
    gate = factory.gate("m")
    with pytest.raises(ApiError) as caught:
        async with registry.lease("m"):
            pass
    assert caught.value.status == 503 and caught.value.code == "model_loading"
    assert int(caught.value.headers["Retry-After"]) >= 1
    gate.set()  # the load goes on without the lease that gave up
    async with registry.lease("m") as engine:
        assert engine.checkpoint == "m"
    await within(registry.close())


async def test_unknown_model_is_404(registry) -> None:
    with pytest.raises(ApiError) as caught:
        async with registry.lease("nope"):
            pass
    assert (caught.value.status, caught.value.code, caught.value.param) == (404, "model_not_found", "model")
    for call in (lambda: registry.get("nope"), lambda: registry.unregister("nope")):
        with pytest.raises(ApiError) as caught:
            result = call()
            if asyncio.iscoroutine(result):
                await result
        assert caught.value.status == 404


# ---------------------------------------------------------------------- hot switch
async def test_hot_switch_keeps_serving_and_drains_the_old_engine(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m", "v1"), load=True)
    async with AsyncExitStack() as held:
        old = await held.enter_async_context(registry.lease("m"))
        gate = factory.gate("v2")
        switch = asyncio.create_task(registry.register(spec_for(root, "m", "v2"), load=True))
        await within(factory.load_started("v2").wait())
        async with registry.lease("m") as during:  # while v2 loads, v1 still serves new requests
            assert during is old
        gate.set()
        info = await within(switch)
        assert info.status == "ready" and info.checkpoint_dir.endswith("v2")
        async with registry.lease("m") as new:
            assert new.checkpoint == "v2"
        await settle()
        assert not old.closed.is_set()  # a lease still runs on it
    await within(old.closed.wait())
    assert factory.events == ["load v1", "load v2", "shutdown v1"]
    assert registry.lifecycle_stats().unloads_total == 1


async def test_hot_switch_with_skip_initialize_loads_on_next_lease(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m", "v1"), load=True)
    async with registry.lease("m") as old:
        info = await registry.register(spec_for(root, "m", "v2"), load=False)
        assert info.status == "registered"
        await settle()
        assert not old.closed.is_set()
    await within(old.closed.wait())
    async with registry.lease("m") as new:
        assert new.checkpoint == "v2"
    assert factory.loads() == ["v1", "v2"]


async def test_failed_hot_switch_keeps_the_old_engine(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m", "v1"), load=True)
    factory.failures["v2"] = CheckpointError("v2/consolidated.00.pth: layers.0.attention.wq.weight has shape [3, 4]")
    with pytest.raises(ApiError) as caught:
        await registry.register(spec_for(root, "m", "v2"), load=True)
    assert caught.value.status == 400 and caught.value.code == "invalid_checkpoint"
    assert "wq.weight" in caught.value.message
    info = registry.get("m")
    assert info.status == "ready" and info.checkpoint_dir.endswith("v1")
    async with registry.lease("m") as engine:
        assert engine.checkpoint == "v1"


async def test_hot_switch_that_fits_only_in_place_drains_first(root, factory) -> None:
    registry = make_registry([root], factory, memory_budget_bytes=150)
    await registry.register(spec_for(root, "m", "v1"), load=True)
    async with registry.lease("m") as old:
        switch = asyncio.create_task(registry.register(spec_for(root, "m", "v2"), load=True))
        await settle()
        assert factory.loads() == ["v1"]  # v2 waits for v1's memory
        assert registry.get("m").status == "loading"
        assert not old.closed.is_set()
    info = await within(switch)
    assert info.status == "ready"
    assert factory.events == ["load v1", "shutdown v1", "load v2"]
    await within(registry.close())


# ---------------------------------------------------------------------- unregister
async def test_unregister_waits_for_leases_then_shuts_down(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m"), load=True)
    async with registry.lease("m") as engine:
        removal = asyncio.create_task(registry.unregister("m"))
        await settle()
        assert not removal.done() and not engine.closed.is_set()
        with pytest.raises(ApiError) as caught:
            async with registry.lease("m"):
                pass
        assert caught.value.status == 404
    await within(removal)
    assert engine.closed.is_set()
    assert registry.list() == [] and registry.lifecycle_stats().memory_reserved_bytes == 0


async def test_unregister_while_loading_shuts_the_late_engine_down(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m"), load=False)
    gate = factory.gate("m")
    lease_task = asyncio.create_task(registry.lease("m").__aenter__())
    await within(factory.load_started("m").wait())
    removal = asyncio.create_task(registry.unregister("m"))
    await settle()
    assert not removal.done()  # the load still runs: its memory is not free yet
    gate.set()
    await within(removal)
    assert factory.events == ["load m", "shutdown m"]
    assert registry.lifecycle_stats().memory_reserved_bytes == 0
    with pytest.raises(ApiError) as caught:
        await within(lease_task)
    assert caught.value.status == 404


# ---------------------------------------------------------------------- memory budget
async def test_budget_exceeded_is_a_clear_error_and_others_keep_serving(root, factory) -> None:
    registry = make_registry([root], factory, memory_budget_bytes=250)
    await registry.register(spec_for(root, "a"), load=True)
    await registry.register(spec_for(root, "b"), load=True)
    with pytest.raises(ApiError) as caught:
        await registry.register(spec_for(root, "c"), load=True)
    error = caught.value
    assert error.status == 507 and error.code == "memory_budget_exceeded"
    assert "needs 100 bytes" in error.message and "a (100 bytes)" in error.message and "DELETE" in error.message
    info = registry.get("c")
    assert info.status == "failed" and "memory budget" in info.error
    assert factory.loads() == ["a", "b"]
    for model_id in ("a", "b"):
        async with registry.lease(model_id) as engine:
            assert engine.checkpoint == model_id
    await registry.unregister("b")  # room again: the next lease of c retries its load
    async with registry.lease("c") as engine:
        assert engine.checkpoint == "c"
    await within(registry.close())


async def test_model_larger_than_the_whole_budget_fails(root, factory) -> None:
    registry = make_registry([root], factory, memory_budget_bytes=50, evict_idle_lru=True)
    with pytest.raises(ApiError) as caught:
        await registry.register(spec_for(root, "a"), load=True)
    assert caught.value.status == 507 and "whole memory budget" in caught.value.message
    await within(registry.close())


async def test_evicts_least_recently_used_idle_model(root, factory) -> None:
    registry = make_registry([root], factory, memory_budget_bytes=250, evict_idle_lru=True)
    await registry.register(spec_for(root, "a"), load=True)
    await registry.register(spec_for(root, "b"), load=True)
    async with registry.lease("a"):
        pass  # a is now more recently used than b
    info = await registry.register(spec_for(root, "c"), load=True)
    assert info.status == "ready"
    assert factory.events == ["load a", "load b", "shutdown b", "load c"]
    assert {i.id: i.status for i in registry.list()} == {"a": "ready", "b": "registered", "c": "ready"}
    stats = registry.lifecycle_stats()
    assert (stats.evictions_total, stats.memory_reserved_bytes, stats.loaded_models) == (1, 200, 2)
    async with registry.lease("b") as engine:  # an evicted model comes back on use, evicting another
        assert engine.checkpoint == "b"
    assert factory.events[-2:] == ["shutdown a", "load b"]
    await within(registry.close())


async def test_busy_models_are_not_evicted(root, factory) -> None:
    registry = make_registry([root], factory, memory_budget_bytes=250, evict_idle_lru=True)
    await registry.register(spec_for(root, "a"), load=True)
    await registry.register(spec_for(root, "b"), load=True)
    async with registry.lease("a"), registry.lease("b"):
        with pytest.raises(ApiError) as caught:
            await registry.register(spec_for(root, "c"), load=True)
    assert caught.value.status == 507
    assert factory.loads() == ["a", "b"]
    await within(registry.close())


async def test_load_starts_only_after_draining_memory_is_free(root, factory) -> None:
    registry = make_registry([root], factory, memory_budget_bytes=150)
    await registry.register(spec_for(root, "a"), load=True)
    async with registry.lease("a"):
        removal = asyncio.create_task(registry.unregister("a"))
        load_b = asyncio.create_task(registry.register(spec_for(root, "b"), load=True))
        await settle()
        assert factory.loads() == ["a"] and not load_b.done()
    await within(removal)
    assert (await within(load_b)).status == "ready"
    assert factory.events == ["load a", "shutdown a", "load b"]
    await within(registry.close())


# ---------------------------------------------------------------------- failures
async def test_failed_load_is_reported_and_others_keep_serving(registry, root, factory) -> None:
    await registry.register(spec_for(root, "good"), load=True)
    factory.failures["bad"] = CheckpointError("bad/consolidated.00.pth: truncated file")
    with pytest.raises(ApiError) as caught:
        await registry.register(spec_for(root, "bad"), load=True)
    assert (caught.value.status, caught.value.code) == (400, "invalid_checkpoint")
    info = registry.get("bad")
    assert info.status == "failed" and "truncated file" in info.error
    with pytest.raises(ApiError) as caught:
        async with registry.lease("bad"):
            pass
    assert (caught.value.status, caught.value.code) == (503, "model_load_failed")
    assert factory.loads() == ["good", "bad"]  # a lease does not retry a broken checkpoint
    async with registry.lease("good") as engine:
        assert engine.checkpoint == "good"
    stats = registry.lifecycle_stats()
    assert (stats.load_failures_total, stats.loads_total, stats.memory_reserved_bytes) == (1, 1, 100)
    del factory.failures["bad"]  # fixed on disk: registering again retries
    assert (await registry.register(spec_for(root, "bad"), load=True)).status == "ready"


async def test_unexpected_load_error_is_a_500_without_crashing(registry, root, factory) -> None:
    factory.failures["m"] = RuntimeError("CUDA out of memory")
    with pytest.raises(ApiError) as caught:
        await registry.register(spec_for(root, "m"), load=True)
    assert (caught.value.status, caught.value.code) == (500, "model_load_failed")
    error = registry.get("m").error  # the reason goes to the log, under the incident id clients are told
    assert "CUDA out of memory" not in error and "incident" in error and error == caught.value.message


async def test_lease_waiting_for_a_failing_load_gets_its_reason(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m"), load=False)
    factory.failures["m"] = CheckpointError("m: params.json has dim 7")
    with pytest.raises(ApiError) as caught:
        async with registry.lease("m"):
            pass
    assert caught.value.status == 503 and "dim 7" in caught.value.message


# ---------------------------------------------------------------------- /ready and close
async def test_ready_waits_for_models_loaded_at_start(registry, root, factory) -> None:
    gate = factory.gate("m")
    task = registry.register_background(spec_for(root, "m", trusted=True))
    assert not registry.ready()
    await registry.register(spec_for(root, "api-model"), load=False)  # API models do not count
    gate.set()
    await within(task)
    assert registry.ready()


async def test_ready_stays_false_when_a_start_model_fails(registry, root, factory) -> None:
    factory.failures["m"] = CheckpointError("broken")
    task = registry.register_background(spec_for(root, "m", trusted=True))
    await within(asyncio.wait({task}))
    assert not registry.ready() and registry.get("m").status == "failed"


async def test_close_shuts_down_everything(root, factory) -> None:
    registry = make_registry([root], factory)
    await registry.register(spec_for(root, "a"), load=True)
    await registry.register(spec_for(root, "b"), load=True)
    held = registry.lease("a")
    await held.__aenter__()
    await within(registry.close())
    assert all(engine.closed.is_set() for engine in factory.engines)
    assert registry.list() == [] and registry.lifecycle_stats().memory_reserved_bytes == 0
    await held.__aexit__(None, None, None)
    with pytest.raises(ApiError) as caught:
        await registry.register(spec_for(root, "c"), load=False)
    assert (caught.value.status, caught.value.code) == (503, "shutting_down")
    with pytest.raises(ApiError) as caught:
        async with registry.lease("a"):
            pass
    assert caught.value.status == 503


# ---------------------------------------------------------------------- checkpoint location and safety
def api_error(call) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


async def test_checkpoint_dir_outside_the_roots_is_refused(registry, tmp_path) -> None:
    outside = checkpoint(tmp_path, "elsewhere")
    error = api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir=str(outside)))
    assert error.code == "checkpoint_dir_outside_roots" and error.param == "checkpoint_dir"
    missing_outside = api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir="/no/such/dir"))
    assert missing_outside.code == "checkpoint_dir_outside_roots"  # existence outside is never revealed
    with pytest.raises(ApiError):
        await registry.register(ModelSpec(model_id="m", checkpoint_dir=outside), load=False)
    trusted = await registry.register(ModelSpec(model_id="m", checkpoint_dir=outside, trusted=True), load=False)
    assert trusted.checkpoint_dir == "elsewhere"  # listings never show absolute paths


async def test_dotdot_and_symlink_escapes_are_refused(registry, root, tmp_path) -> None:
    checkpoint(root, "inside")
    outside = checkpoint(tmp_path, "secret")
    dotdot = api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir=f"{root}/../secret"))
    assert "'..'" in dotdot.message
    api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir="inside/../../secret"))
    os.symlink(outside, root / "link")
    escape = api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir=str(root / "link")))
    assert escape.code == "checkpoint_dir_outside_roots" and "symlink" in escape.message
    api_error(lambda: registry.locate_checkpoint("link"))  # found by name, still an escape
    os.symlink(outside / "params.json", root / "inside" / "consolidated.00.pth")
    inner = api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir="inside"))
    assert "consolidated.00.pth" in inner.message


async def test_a_link_out_inside_a_linked_dir_is_refused_at_registration(registry, root, tmp_path) -> None:
    """The scan enters links to dirs inside the roots, as the loader's guard does (engine/loading/file_guard.py),
    so what the loader would refuse is refused when the model is registered."""
    inside, outside = checkpoint(root, "inside"), checkpoint(tmp_path, "secret")
    (root / "shared").mkdir()
    os.symlink(outside / "params.json", root / "shared" / "leak")
    os.symlink(root / "shared", inside / "extras", target_is_directory=True)  # a link that stays in the roots
    error = api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir="inside"))
    assert error.code == "checkpoint_dir_outside_roots" and "'leak', a symlink that leaves" in error.message
    os.unlink(root / "shared" / "leak")
    assert registry.locate_checkpoint("m", checkpoint_dir="inside") == inside.resolve()


async def test_missing_checkpoint_dir_is_a_400(registry, root) -> None:
    error = api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir=str(root / "absent")))
    assert error.code == "checkpoint_not_found"
    (root / "file").write_text("x")
    api_error(lambda: registry.locate_checkpoint("m", checkpoint_dir="file"))
    with pytest.raises(ApiError) as caught:
        await registry.register(ModelSpec(model_id="m", checkpoint_dir=root / "absent", trusted=True), load=False)
    assert caught.value.code == "checkpoint_not_found"


async def test_relative_checkpoint_dir_and_links_inside_the_roots_are_fine(registry, root) -> None:
    target = checkpoint(root, "real/ft-v3")
    os.symlink(target, root / "alias")
    assert registry.locate_checkpoint("m", checkpoint_dir="real/ft-v3") == target.resolve()
    assert registry.locate_checkpoint("m", checkpoint_dir=str(root / "alias")) == target.resolve()


async def test_lookup_by_model_id_then_llama_model(root, tmp_path, factory) -> None:
    second = tmp_path / "second"
    second.mkdir()
    registry = make_registry([root, second], factory)
    base = checkpoint(second, "Llama3.2-3B-Instruct")
    finetune = checkpoint(second, "my-ft")
    found = registry.locate_checkpoint("my-ft", llama_model="Llama3.2-3B-Instruct")
    assert found == finetune.resolve()
    assert registry.locate_checkpoint("other", llama_model="Llama3.2-3B-Instruct") == base.resolve()
    # An HF id, as model id or llama_model, finds the folder `llama model download` named after the descriptor.
    assert registry.locate_checkpoint("meta-llama/Llama-3.2-3B-Instruct") == base.resolve()
    assert registry.locate_checkpoint("x", llama_model="meta-llama/Llama-3.2-3B-Instruct") == base.resolve()
    error = api_error(lambda: registry.locate_checkpoint("nothing-here"))
    assert error.code == "checkpoint_not_found" and "nothing-here" in error.message and str(root) not in error.message
    api_error(lambda: registry.locate_checkpoint("../second/my-ft"))  # names are folder names, never paths
    await within(registry.close())


async def test_unknown_llama_model_lists_close_matches(registry, root) -> None:
    checkpoint(root, "m")
    error = api_error(lambda: registry.locate_checkpoint("m", llama_model="Llama3.2-3B-Instrct"))
    assert error.param == "metadata.llama_model" and "Llama3.2-3B-Instruct" in error.message
    with pytest.raises(ApiError) as caught:
        await registry.register(spec_for(root, "m", llama_model="Llama9"), load=False)
    assert caught.value.status == 400 and caught.value.code == "unknown_llama_model"


async def test_a_dead_engine_reloads_at_once_in_the_background_and_leases_meanwhile_get_503(registry, root,
                                                                                              factory) -> None:
    await registry.register(spec_for(root, "m"), load=True)
    assert registry.ready()
    gate = factory.gate("m")  # the reload waits here: the test watches it in progress
    factory.load_started("m").clear()
    async with registry.lease("m") as dead, registry.lease("m") as in_flight:
        dead.is_dead = True  # say a model-parallel worker exited during these requests' step
        assert not registry.ready()  # the probe notices, retires the engine and starts the reload
        await within(factory.load_started("m").wait())
        with pytest.raises(ApiError) as caught:  # at once: a request never waits inside a reload
            async with registry.lease("m"):
                pass
        assert caught.value.status == 503 and caught.value.code == "model_loading"
        assert int(caught.value.headers["Retry-After"]) >= 1 and "reloading" in caught.value.message
        assert in_flight is dead and not dead.closed.is_set()  # leases still held on it are never cut
    await within(dead.closed.wait())  # retired: shut down once its last lease ended
    assert not registry.ready() and registry.get("m").status == "loading"
    gate.set()
    await settle()
    assert registry.ready() and registry.get("m").status == "ready"
    async with registry.lease("m") as fresh:
        assert fresh is not dead and not fresh.is_dead
    assert factory.events == ["load m", "load m", "shutdown m"]


async def test_the_request_that_sees_the_engine_die_starts_the_reload_when_it_ends(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m"), load=True)
    async with registry.lease("m") as engine:
        engine.is_dead = True
        assert factory.loads() == ["m"]  # nothing has looked yet
    await settle()
    assert factory.loads() == ["m", "m"]  # releasing the lease did: reloading with no other request
    await within(engine.closed.wait())
    assert registry.ready()
    async with registry.lease("m") as fresh:
        assert fresh is not engine
    assert factory.events.count("shutdown m") == 1 and registry.lifecycle_stats().unloads_total == 1
    assert registry.lifecycle_stats().memory_reserved_bytes == 100  # the dead engine's bytes came back, once


async def test_a_failed_reload_keeps_ready_false_and_the_next_lease_tries_again(registry, root, factory) -> None:
    await registry.register(spec_for(root, "m"), load=True)
    factory.failures["m"] = CheckpointError("shard missing")
    async with registry.lease("m") as engine:
        engine.is_dead = True
    await settle()
    assert not registry.ready() and registry.start_failures() and registry.get("m").status == "failed"
    del factory.failures["m"]
    gate = factory.gate("m")
    with pytest.raises(ApiError) as caught:  # starts another reload and answers at once
        async with registry.lease("m"):
            pass
    assert caught.value.status == 503 and caught.value.headers.get("Retry-After")
    gate.set()
    await settle()
    assert registry.ready() and factory.loads() == ["m", "m", "m"]


async def test_real_descriptor_table_resolves_and_suggests(root, factory) -> None:
    registry = ModelRegistry(factory, checkpoint_roots=[root])  # engine.loading.descriptors, no fake
    base = checkpoint(root, "Llama3.2-3B-Instruct")
    assert registry.locate_checkpoint("x", llama_model="meta-llama/Llama-3.2-3B-Instruct") == base.resolve()
    error = api_error(lambda: registry.locate_checkpoint("x", llama_model="Llama3.2-3B-Instrct"))
    assert error.code == "unknown_llama_model" and "Llama3.2-3B-Instruct" in error.message


@pytest.mark.parametrize("budget_bytes", [200, 150])  # two engines fit side by side / only in place
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_hot_switches_under_a_stream_of_requests_drop_nothing(root, seed, budget_bytes) -> None:
    """Requests keep leasing while the id is switched v0 -> v1 -> v2 -> v3: no request fails, no
    engine stops while a request holds it, and all memory comes back."""
    import random

    rng = random.Random(seed)
    factory = FakeFactory()
    registry = make_registry([root], factory, memory_budget_bytes=budget_bytes)
    in_use: dict[int, int] = {}
    shut_while_busy: list[str] = []
    served: list[str] = []

    async def request() -> None:
        async with registry.lease("m") as engine:
            if engine.closed.is_set():
                shut_while_busy.append(engine.checkpoint)
            in_use[id(engine)] = in_use.get(id(engine), 0) + 1
            for _ in range(rng.randrange(1, 6)):
                await asyncio.sleep(0)  # a request spanning a few loop turns
            if engine.closed.is_set():
                shut_while_busy.append(engine.checkpoint)
            in_use[id(engine)] -= 1
            served.append(engine.checkpoint)

    await registry.register(spec_for(root, "m", "v0"), load=True)
    requests: list[asyncio.Task] = []
    for version in (1, 2, 3):
        gate = factory.gate(f"v{version}")
        switch = asyncio.create_task(registry.register(spec_for(root, "m", f"v{version}"), load=True))
        for _ in range(10):  # requests arriving while the new checkpoint loads
            requests.append(asyncio.create_task(request()))
            await asyncio.sleep(0)
        gate.set()
        while not switch.done():
            requests.append(asyncio.create_task(request()))
            await asyncio.sleep(0)
        await within(switch)
    requests += [asyncio.create_task(request()) for _ in range(5)]
    results = await within(asyncio.gather(*requests, return_exceptions=True))
    assert [r for r in results if r is not None] == [] and shut_while_busy == []
    assert served[-1] == "v3" and len(served) == len(requests) >= 35
    assert {"v0", "v1", "v2", "v3"} <= set(served)
    await within(registry.close())
    assert factory.events.count("shutdown v0") == 1 and all(e.closed.is_set() for e in factory.engines)
    assert registry.lifecycle_stats().memory_reserved_bytes == 0


async def test_registry_keeps_no_reference_to_unloaded_engines(registry, root, factory) -> None:
    import gc
    import weakref

    await registry.register(spec_for(root, "a"), load=True)
    await registry.register(spec_for(root, "a", "a2"), load=True)  # hot switch retires the first
    async with registry.lease("a") as engine:
        refs = [weakref.ref(e) for e in factory.engines]
        del engine
    factory.engines.clear()
    await registry.unregister("a")
    gc.collect()
    assert [ref() for ref in refs] == [None, None]  # their weights can be freed


async def test_load_errors_and_listings_never_show_absolute_paths(registry, root, factory) -> None:
    """Issue 16: a checkpoint error names files relative to the root; listings likewise."""
    real_dir = checkpoint(root, "m").resolve()
    factory.failures["m"] = CheckpointError(f"{real_dir}/params.json: not valid JSON")
    with pytest.raises(ApiError) as caught:
        await registry.register(spec_for(root, "m"), load=True)
    assert caught.value.status == 400 and "m/params.json: not valid JSON" in caught.value.message
    for text in (caught.value.message, registry.get("m").error, registry.get("m").checkpoint_dir):
        assert str(root) not in text and str(root.resolve()) not in text


# ---------------------------------------------------------------------- idle unload (keep_alive)
class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


async def test_an_idle_model_unloads_after_its_keep_alive_and_the_next_request_reloads_it(root, factory) -> None:
    clock = FakeClock()
    registry = make_registry([root], factory, keep_alive_s=30.0, clock=clock)
    await registry.register(spec_for(root, "m"), load=True)
    await registry.register(spec_for(root, "pinned", keep_alive_s=math.inf), load=True)  # its own: never
    assert registry.get("m").keep_alive_s == 30.0 and registry.get("pinned").keep_alive_s is None
    clock.now_s += 29
    assert registry.sweep_idle() == []
    async with registry.lease("m"):  # a request in flight is never unloaded, however long it runs
        clock.now_s += 100
        assert registry.sweep_idle() == []
    clock.now_s += 29.5  # idle time counts from the end of the last request
    assert registry.sweep_idle() == []
    clock.now_s += 0.5
    assert registry.sweep_idle() == ["m"]
    assert registry.get("m").status == "registered" and registry.get("pinned").status == "ready"
    await settle()
    assert "shutdown m" in factory.events and registry.lifecycle_stats().idle_unloads_total == 1
    async with registry.lease("m") as engine:  # loads again
        assert engine.model_id == "m"
    assert factory.loads() == ["m", "pinned", "m"] and registry.get("m").status == "ready"
    clock.now_s += 10**6
    assert registry.sweep_idle() == ["m"]
    await registry.close()


async def test_keep_alive_zero_unloads_when_idle_and_re_registering_changes_it_without_a_reload(root, factory) -> None:
    clock = FakeClock()
    registry = make_registry([root], factory, clock=clock)  # the server's default: never
    await registry.register(spec_for(root, "m"), load=True)
    clock.now_s += 10**6
    assert registry.sweep_idle() == []
    await registry.register(spec_for(root, "m", keep_alive_s=0.0), load=True)
    assert factory.loads() == ["m"] and registry.get("m").keep_alive_s == 0.0
    assert registry.sweep_idle() == ["m"]
    await registry.close()
