"""LoRA adapters registered as model ids of their own over a registered base model.

An adapter id (`POST /v1/models` with `metadata.base_model`, vLLM's `/v1/load_lora_adapter`,
`--lora-modules`, run.yaml) is served by its base's engine: a lease on the adapter leases the base
(loading it if needed), makes sure the adapter is loaded on that engine (the first request loads
it; a request that finds it loading waits with it), and hands out an `AdapterEngine`, the base
engine with every request's `lora_name` set, so every route serves adapters unchanged.

- Hot swap: registering the same id with another folder bumps its version; the next lease loads
  the new weights under the same name, the engine swaps them between two steps, and requests
  already running finish on the old ones (engine/lora/table.py). Nothing is dropped.
- Unregister: the id is forgotten at once (404 from then on) and its weights leave the engine
  once the requests running with it finish; the base keeps serving.
- Memory: a load reserves the adapter's file size in the registry's memory budget (the weights it
  becomes hold no more than the file in float32) and gives it back on unload. A load that does not
  fit evicts idle adapters (no request holds them), least recently used first; their next
  request loads them again. If that is not enough: 507 `memory_budget_exceeded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from engine.types import EngineClient, EngineDead, EngineRequest, InvalidRequest
from server.errors import ApiError
from server.memory_budget import BudgetExceeded, MemoryBudget, Reservation, gib
from server.paths import redact_paths, shown_path

log = logging.getLogger(__name__)

ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")  # engine.lora.adapters' list
LeaseBase = Callable[[str], contextlib.AbstractAsyncContextManager[EngineClient]]


class AdapterEngine:
    """The base's engine as an adapter's: every request runs with the adapter (`lora_name`);
    everything else is the base engine's (tokenizer, chat format, limits, stats)."""

    def __init__(self, engine: EngineClient, adapter_id: str) -> None:
        self._engine = engine
        self.model_id = adapter_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, request: EngineRequest):
        return self._engine.generate(dataclasses.replace(request, lora_name=self.model_id))


@dataclass(eq=False, slots=True)
class _Loaded:
    """One adapter version loaded on one engine."""

    engine: EngineClient
    version: int
    reservation: Reservation
    source: tuple[Path, str, bool]  # (folder, base id, trusted) it was loaded from: what a failed swap goes back to
    leases: int = 0
    last_used: int = 0


@dataclass(eq=False, slots=True)
class _Adapter:
    adapter_id: str
    base_id: str
    folder: Path
    trusted: bool  # named by the server's own config: outside the checkpoint roots is fine
    created: int
    metadata: dict[str, Any]
    version: int = 1  # bumped by a registration with another folder (a hot swap)
    loaded: _Loaded | None = None
    loading: asyncio.Task | None = None
    error: ApiError | None = None  # the last load's failure, until a load succeeds

    @property
    def status(self) -> str:
        if self.loading is not None:
            return "loading"
        if self.loaded is not None and not self.loaded.engine.is_dead:
            return "ready"
        return "failed" if self.error is not None else "registered"


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What /v1/models says about one adapter (the registry renders it as a ModelInfo)."""

    id: str
    created: int
    status: str
    parent: str  # the base model id
    root: str  # the adapter folder, as clients may see it
    metadata: dict[str, Any]
    memory_bytes: int | None
    max_seq_len: int | None
    error: str | None


@dataclass
class AdapterSet:
    budget: MemoryBudget
    checkpoint_roots: list[Path]
    _adapters: dict[str, _Adapter] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _ticks: Any = field(default_factory=lambda: itertools.count(1))
    evictions_total: int = 0

    def has(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    def ids(self) -> list[str]:
        return list(self._adapters)

    # ------------------------------------------------------------------ registration
    def register(self, adapter_id: str, folder: Path, base_id: str, metadata: dict[str, Any], *, trusted: bool) -> None:
        """Add an adapter, or point an existing id at another folder or base (a hot swap on its next
        lease). `folder` is checked already (server/paths.py)."""
        weights = [name for name in ADAPTER_WEIGHT_FILES if (folder / name).is_file()]
        if not weights or not (folder / "adapter_config.json").is_file():
            raise ApiError(400, f"{shown_path(folder, self.checkpoint_roots)!r} is not a LoRA adapter folder: it needs "
                           f"adapter_config.json and one of {', '.join(ADAPTER_WEIGHT_FILES)}",
                           param="checkpoint_dir", code="invalid_adapter")
        entry = self._adapters.get(adapter_id)
        if entry is None:
            self._adapters[adapter_id] = _Adapter(adapter_id, base_id, folder, trusted, int(time.time()), dict(metadata))
            log.info("adapter %s registered over %s (%s)", adapter_id, base_id, folder)
            return
        entry.metadata = dict(metadata)
        if (entry.folder, entry.base_id) != (folder, base_id):
            entry.folder, entry.base_id, entry.trusted = folder, base_id, trusted
            entry.version += 1
            entry.error = None
            log.info("adapter %s: version %d from %s (swapped on its next request)", adapter_id, entry.version, folder)

    def forget_failed(self, adapter_id: str) -> None:
        """Drop an adapter whose first load failed and that holds nothing (vLLM's load route keeps
        no adapter it could not load)."""
        entry = self._adapters.get(adapter_id)
        if entry is not None and entry.loaded is None and entry.loading is None:
            del self._adapters[adapter_id]

    async def unregister(self, adapter_id: str) -> None:
        """Forget the adapter now (404 from here on); its weights leave the engine once the requests
        running with it finish."""
        entry = self._adapters.pop(adapter_id)
        if entry.loading is not None:
            await asyncio.wait({entry.loading})
        if entry.loaded is not None:
            await self._unload(entry.adapter_id, entry.loaded)
            entry.loaded = None
        log.info("adapter %s unregistered", adapter_id)

    # ------------------------------------------------------------------ leases
    @contextlib.asynccontextmanager
    async def lease(self, adapter_id: str, lease_base: LeaseBase) -> AsyncIterator[EngineClient]:
        entry = self._adapters[adapter_id]
        async with lease_base(entry.base_id) as engine:
            loaded = await self.ensure_loaded(entry, engine)
            loaded.leases += 1  # no await since it was found loaded: an eviction cannot slip in between
            try:
                yield AdapterEngine(engine, adapter_id)
            finally:
                loaded.leases -= 1
                loaded.last_used = next(self._ticks)

    async def load_now(self, adapter_id: str, lease_base: LeaseBase) -> None:
        """Load a registered adapter on its base now (registration without skip_initialize)."""
        async with self.lease(adapter_id, lease_base):
            pass

    async def ensure_loaded(self, entry: _Adapter, engine: EngineClient) -> _Loaded:
        """The adapter's current version loaded on `engine`, loading it (once, whoever asks) if needed."""
        while True:
            loaded = entry.loaded
            if loaded is not None and loaded.engine is engine and loaded.version == entry.version:
                return loaded
            if entry.loading is None:
                entry.loading = asyncio.ensure_future(self._load(entry, engine, entry.version))
                entry.loading.add_done_callback(_consume_exception)
            task = entry.loading
            await asyncio.wait({task})  # a caller that leaves does not cancel the load others wait on
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
            if self._adapters.get(entry.adapter_id) is not entry:
                raise adapter_not_found(entry.adapter_id)

    async def _load(self, entry: _Adapter, engine: EngineClient, version: int) -> None:
        folder = entry.folder
        try:
            load = getattr(engine, "load_adapter", None)
            if load is None:
                raise ApiError(400, f"model {entry.base_id!r} serves no LoRA adapters", param="metadata.base_model",
                               code="lora_disabled")
            try:
                need_bytes = sum((folder / n).stat().st_size for n in ADAPTER_WEIGHT_FILES if (folder / n).is_file())
            except OSError as exc:
                raise ApiError(400, f"adapter {entry.adapter_id!r}: its folder cannot be read ({exc.strerror})",
                               param="checkpoint_dir", code="invalid_adapter") from None
            reservation = await self.budget.admit(entry.adapter_id, need_bytes, functools.partial(self._make_room, entry))
            try:
                roots = () if entry.trusted else tuple(self.checkpoint_roots)
                await load(entry.adapter_id, folder, roots=roots)
            except BaseException:
                reservation.release()
                raise
            source = (folder, entry.base_id, entry.trusted)
            old, entry.loaded = entry.loaded, _Loaded(engine, version, reservation, source, last_used=next(self._ticks))
            entry.error = None
            if old is not None:  # the previous version (swapped in place) or a copy on a base engine now retired
                self._spawn(self._unload(entry.adapter_id, old, swapped=old.engine is engine))
            log.info("adapter %s (version %d) loaded on %s", entry.adapter_id, version, entry.base_id)
        except Exception as exc:
            error = self._error_of(exc, entry)
            loaded = entry.loaded
            if loaded is not None and loaded.version != version and entry.version == version:
                # a swap to a folder that does not load: the version loaded keeps serving, as a failed
                # hot switch of a model leaves the old engine (the caller that asked for it gets the error)
                entry.folder, entry.base_id, entry.trusted = loaded.source
                entry.version = loaded.version
                log.warning("adapter %s: swap to %s failed, version %d keeps serving: %s", entry.adapter_id, folder,
                            loaded.version, error.message)
            else:
                entry.error = error
            raise error from exc
        finally:
            entry.loading = None

    def _error_of(self, exc: Exception, entry: _Adapter) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, BudgetExceeded):
            return ApiError(507, str(exc), code="memory_budget_exceeded")
        if isinstance(exc, EngineDead):
            return ApiError(503, f"adapter {entry.adapter_id!r}: its base {entry.base_id!r} is not available: {exc}",
                            code="model_loading", headers={"Retry-After": "5"})
        if isinstance(exc, InvalidRequest):  # a bad adapter: what differs from the base, without server paths
            message = redact_paths(str(exc), [entry.folder], self.checkpoint_roots)
            return ApiError(400, f"cannot load adapter {entry.adapter_id!r}: {message}", param="checkpoint_dir",
                            code=exc.code or "invalid_adapter")
        log.error("adapter %s failed to load", entry.adapter_id, exc_info=exc)
        return ApiError(500, f"cannot load adapter {entry.adapter_id!r}: an internal error occurred (see the server log)",
                        code="adapter_load_failed")

    async def _unload(self, adapter_id: str, loaded: _Loaded, *, swapped: bool = False) -> None:
        """Give an engine's copy back: unload it there (unless a swap on the same engine replaced it
        already), then its bytes."""
        try:
            if not swapped and not loaded.engine.is_dead:
                await loaded.engine.unload_adapter(adapter_id)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an engine shutting down drops its adapters anyway
            log.debug("unloading adapter %s: engine gone", adapter_id, exc_info=True)
        finally:
            loaded.reservation.release()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ memory
    def _make_room(self, entry: _Adapter, need_bytes: int, budget: int) -> None:
        """Evict idle adapters, least recently used first, until need_bytes fits once they are
        gone; BudgetExceeded when even that is not enough (then nothing is evicted)."""
        if not self.evict_idle(need_bytes, budget, for_id=entry.adapter_id, exclude=entry):
            free = budget - self.budget.reserved_bytes()
            raise BudgetExceeded(f"adapter {entry.adapter_id!r} needs {gib(need_bytes)} but only {gib(max(0, free))} "
                                 f"of the {gib(budget)} memory budget is free, idle adapters included")

    def evict_idle(self, need_bytes: int, budget: int, *, for_id: str, exclude: _Adapter | None = None) -> bool:
        """Evict idle adapters (no request holds them), least recently used first, until need_bytes
        fits once they and whatever already drains are gone; False (and nothing evicted) when even
        all of them would not do. The registry calls it too, for a model load that does not fit."""
        self.drop_dead()
        draining = sum(r.num_bytes for r in self.budget.draining_reservations())
        free = budget - self.budget.reserved_bytes() + draining
        idle = sorted((a for a in self._adapters.values() if a is not exclude and a.loaded is not None
                       and a.loaded.leases == 0 and not a.loaded.reservation.draining), key=lambda a: a.loaded.last_used)
        victims = []
        for victim in idle:
            if need_bytes <= free:
                break
            victims.append(victim)
            free += victim.loaded.reservation.num_bytes  # type: ignore[union-attr]
        if need_bytes > free:
            return False
        for victim in victims:
            loaded, victim.loaded = victim.loaded, None
            loaded.reservation.draining = True  # type: ignore[union-attr]
            self.evictions_total += 1
            log.info("evicting idle adapter %s to make room for %s", victim.adapter_id, for_id)
            self._spawn(self._unload(victim.adapter_id, loaded))  # type: ignore[arg-type]
        return True

    def drop_dead(self) -> None:
        """Give back the bytes of adapters whose base engine is gone (unloaded, hot-switched, dead):
        they load again on the base's next engine with their next request."""
        for entry in self._adapters.values():
            if entry.loaded is not None and entry.loaded.engine.is_dead and entry.loaded.leases == 0:
                entry.loaded.reservation.release()
                entry.loaded = None

    # ------------------------------------------------------------------ queries
    def info(self, adapter_id: str) -> AdapterInfo:
        entry = self._adapters[adapter_id]
        loaded = entry.loaded
        live = loaded is not None and not loaded.engine.is_dead
        return AdapterInfo(
            id=entry.adapter_id,
            created=entry.created,
            status=entry.status,
            parent=entry.base_id,
            root=shown_path(entry.folder, self.checkpoint_roots),
            metadata=dict(entry.metadata),
            memory_bytes=loaded.reservation.num_bytes if live else None,  # type: ignore[union-attr]
            max_seq_len=loaded.engine.max_seq_len if live else None,  # type: ignore[union-attr]
            error=entry.error.message if entry.error is not None and entry.loading is None else None,
        )

    def infos(self) -> list[AdapterInfo]:
        self.drop_dead()
        return [self.info(adapter_id) for adapter_id in self._adapters]

    async def close(self) -> None:
        self._adapters.clear()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)


def adapter_not_found(adapter_id: str) -> ApiError:
    return ApiError(404, f"The model {adapter_id!r} does not exist", param="model", code="model_not_found")


def _consume_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
