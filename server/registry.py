"""The model registry: which models the server knows, which are loaded, and who is using them.

Lifecycle of one model id: registered -> loading -> ready (or failed). A registered model loads
on its first lease; concurrent first leases share one load task. Every request holds a lease on
one loaded engine (a `_LoadedEngine`) for as long as it runs, so that:

- hot switch (re-registering an id with another checkpoint) loads the new engine while the old
  one keeps serving, then points new leases at it; the old one serves the leases it has and shuts
  down when the last one ends. If the new load fails, the old engine stays;
- unregister, eviction and a dead engine never cut a running request: a retired engine shuts
  down when drained.

A dead engine (`EngineClient.is_dead`: a model-parallel worker exited, a step crashed) is noticed
when a lease on it ends (the request that saw the failure), by the next lease, or by `ready()` (the
/ready probe). It is retired and the model reloads at once in the background: until that load is
done /ready is 503 and leases answer 503 `model_loading` with Retry-After at once (they never wait
for a reload); a reload that fails leaves /ready 503 with the reason, and the next lease tries again.

Memory (server/memory_budget.py does the arithmetic; the registry retires what it chooses): with a
budget (bytes), a load reserves `factory.estimate_memory_bytes(spec)` before it starts and gives it
back only once its engine has shut down. A load that does not fit waits for
retired engines to drain, then may replace the old engine of the same id in place, then (if
`evict_idle_lru`) evicts idle models, least recently used first; otherwise it fails with
507 `memory_budget_exceeded` (a capacity problem of this server, not a malformed request), and
the model is `failed` with that reason. A lease retries such a load; other failures wait for a
new registration (POST /v1/models again).

Idle unload (Ollama's keep_alive): a loaded model with no lease for its keep_alive (the spec's,
else the server's) is unloaded back to `registered` by `sweep_idle`, which the app calls every
second (tests call it with their own clock); its next lease loads it again.

Status codes a caller sees: 404 `model_not_found` (unknown id); 503 `model_loading` with
Retry-After (a lease waited `load_wait_timeout_s` for a load); 503 `model_load_failed` (a lease
on a failed model); a registration that loads answers its load's own error: 400
`invalid_checkpoint` / the engine's InvalidRequest code, 507 `memory_budget_exceeded`, 500
`model_load_failed` for anything unexpected; 503 `shutting_down` after close(). Loads run in the
factory (the real one on a thread); the event loop only awaits them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Literal

import msgspec
from aiohttp import web

from engine.spec.config import SpeculativeConfig
from engine.types import CheckpointError, EngineClient, InvalidRequest
from server.adapters import AdapterInfo, AdapterSet
from server.drain import shutting_down_error
from server.errors import ApiError
from server.memory_budget import BudgetExceeded, MemoryBudget, Reservation
from server.model_spec import EngineFactory, ModelSpec
from server.paths import check_checkpoint_dir, find_checkpoint_dir, redact_paths, shown_path

log = logging.getLogger(__name__)

ModelStatus = Literal["registered", "loading", "ready", "failed"]
DescriptorResolver = Callable[[str], Any]

_DEFAULT_RETRY_AFTER_S = 5


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the registry says about one model id (the routes render it in OpenAI's shape)."""

    id: str
    created: int  # unix seconds of the first registration of this id
    owned_by: str = "llamaserve"
    status: ModelStatus
    llama_model: str | None
    max_seq_len: int | None  # the engine's once loaded, else what was asked for
    checkpoint_dir: str
    metadata: dict[str, Any]
    error: str | None = None  # why, when status == "failed"
    load_time_s: float | None = None  # of the engine serving now
    memory_bytes: int | None = None  # reserved for it (estimate), once loading or loaded
    sampling_defaults: dict[str, float] | None = None  # what requests that omit them get, once loaded
    weights: dict[str, Any] | None = None  # engine.quant.policy.WeightsReport of the loaded engine
    keep_alive_s: float | None = None  # seconds it stays loaded while idle; None: always
    parent: str | None = None  # vLLM's `parent`: a LoRA adapter's base model id (server/adapters.py); None for a model
    # what a request may carry (vLLM's and llama.cpp's name), once loaded: ["text"] or ["text", "image"]
    input_modalities: list[str] | None = None
    speculative_config: dict[str, Any] | None = None  # speculative decoding in force (its own, else the server's)


@dataclass(frozen=True, slots=True)
class LifecycleStats:
    """Cumulative counters and gauges for /metrics."""

    loads_total: int
    load_failures_total: int
    load_seconds_total: float
    unloads_total: int
    evictions_total: int
    idle_unloads_total: int
    loaded_models: int
    loading_models: int
    memory_reserved_bytes: int
    memory_budget_bytes: int | None


@dataclass(eq=False, slots=True)
class _LoadedEngine:
    """One loaded engine and the leases on it."""

    owner: _Entry
    engine: EngineClient
    spec: ModelSpec
    reservation: Reservation
    load_time_s: float
    idle_since_s: float  # the registry's clock when its last lease ended (or it loaded)
    leases: int = 0
    retired: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # set once shut down


@dataclass(eq=False, slots=True)
class _Load:
    spec: ModelSpec
    task: asyncio.Task
    started_s: float


@dataclass(eq=False, slots=True)
class _Failure:
    error: ApiError  # what the registering caller was told
    retry_on_lease: bool  # a transient cause (memory budget, a reload after a death): the next lease tries again


@dataclass(eq=False, slots=True)
class _Entry:
    model_id: str
    spec: ModelSpec  # the latest registered spec; the active slot may still run an older one
    created: int
    metadata: dict[str, Any]
    active: _LoadedEngine | None = None
    load: _Load | None = None
    failure: _Failure | None = None
    required: bool = False  # loaded at start by the server's own config, or reloading after a death: /ready waits
    recovering: bool = False  # its engine died: leases answer 503 + Retry-After until a load succeeds
    removed: bool = False
    last_used: int = 0  # a tick of the registry's use counter, for LRU order
    last_load_time_s: float | None = None
    retiring: set[_LoadedEngine] = field(default_factory=set)
    cleanups: set[asyncio.Task] = field(default_factory=set)  # shutdowns of loads given up on

    @property
    def status(self) -> ModelStatus:
        if self.active is not None:
            return "ready"
        if self.load is not None:
            return "loading"
        return "failed" if self.failure is not None else "registered"


class ModelRegistry:
    """Model ids -> engines, with lazy loads, hot switch, unload and a memory budget."""

    def __init__(
        self,
        factory: EngineFactory,
        *,
        checkpoint_roots: list[Path],
        memory_budget_bytes: int | None = None,
        evict_idle_lru: bool = False,
        load_wait_timeout_s: float = 60.0,
        descriptor_resolver: DescriptorResolver | None = None,  # None: engine.loading.descriptors.resolve_descriptor
        keep_alive_s: float = math.inf,  # models whose spec says nothing: unloaded after this long idle
        clock: Callable[[], float] = time.monotonic,  # idle time is measured on it (tests pass their own)
        default_speculative_config: SpeculativeConfig | None = None,  # --speculative-config; a model's own wins
    ) -> None:
        self._factory = factory
        self.checkpoint_roots = list(checkpoint_roots)
        self._budget = MemoryBudget(memory_budget_bytes, evict_idle_lru=evict_idle_lru)
        self._load_wait_timeout_s = load_wait_timeout_s
        self._descriptor_resolver = descriptor_resolver
        self.keep_alive_s = keep_alive_s
        self.default_speculative_config = default_speculative_config
        self._clock = clock
        self._idle_unloads_total = 0
        self._entries: dict[str, _Entry] = {}
        self._shutdowns: set[asyncio.Task] = set()
        self._closed = False
        self._loads_total = 0
        self._load_failures_total = 0
        self._load_seconds_total = 0.0
        self._unloads_total = 0
        self._evictions_total = 0
        self._use_ticks = itertools.count(1)
        self.adapters = AdapterSet(self._budget, self.checkpoint_roots)  # LoRA adapters over registered models

    # ------------------------------------------------------------------ registration
    def locate_checkpoint(
        self,
        model_id: str,
        *,
        checkpoint_dir: str | Path | None = None,
        llama_model: str | None = None,
        trusted: bool = False,
    ) -> Path:
        """The checkpoint dir for a model: the given one (checked), else found in the roots."""
        if llama_model is not None:
            self._resolve_descriptor(llama_model)  # an unknown one is a 400 with close matches, first
        if checkpoint_dir is not None:
            return check_checkpoint_dir(checkpoint_dir, self.checkpoint_roots, trusted=trusted)
        names = [model_id, llama_model or ""]
        names += [self._descriptor_name(n) or "" for n in (llama_model, model_id) if n]
        return find_checkpoint_dir(names, self.checkpoint_roots, trusted=trusted, model_id=model_id)

    async def register(self, spec: ModelSpec, *, load: bool) -> ModelInfo:
        """Add or update a model; with `load`, return once it is ready (or raise its load error)."""
        entry = self._register_entry(spec, load=load)
        if load and _needs_load(entry):
            task = self._ensure_loading(entry)
            await asyncio.wait({task})  # never cancels the load: a client that leaves does not undo it
            if entry.removed:
                raise _not_found(spec.model_id)
            if not task.cancelled() and task.exception() is not None and entry.load is None:
                raise _error_of(task.exception(), spec, self.checkpoint_roots)
        return self.get(spec.model_id)

    def register_background(self, spec: ModelSpec) -> asyncio.Task | None:
        """Register now (so /ready waits for it) and load in a task: for models loaded at start.
        None when it is loaded already. Raises ApiError for a bad spec, like `register`."""
        entry = self._register_entry(spec, load=True)
        return self._ensure_loading(entry) if _needs_load(entry) else None

    def _register_entry(self, spec: ModelSpec, *, load: bool) -> _Entry:
        if self._closed:
            raise shutting_down_error()
        spec = self._validated(spec)
        if self.adapters.has(spec.model_id):
            raise ApiError(400, f"{spec.model_id!r} is a registered LoRA adapter; register it again with "
                           "metadata.base_model, or choose another name", param="model_id", code="model_id_in_use")
        entry = self._entries.get(spec.model_id)
        if entry is None:
            entry = _Entry(spec.model_id, spec, int(time.time()), dict(spec.metadata))
            self._entries[spec.model_id] = entry
            log.info("model %s registered (checkpoint %s)", spec.model_id, spec.checkpoint_dir)
        elif not _same_model(spec, entry.spec):
            self._switch_spec(entry, spec, load=load)
        else:
            entry.metadata = dict(spec.metadata)
            entry.spec = dataclasses.replace(entry.spec, keep_alive_s=spec.keep_alive_s)  # never a reason to reload
            if load and entry.failure is not None:
                entry.failure = None  # registering again is how a failed model is retried
        entry.required = entry.required or (spec.trusted and load and _needs_load(entry))
        return entry

    def _validated(self, spec: ModelSpec) -> ModelSpec:
        """Checked paths and descriptor: every spec, whoever built it, passes here."""
        if not spec.model_id or len(spec.model_id) > 256 or "\x00" in spec.model_id:
            raise ApiError(400, "model_id must be a non-empty name of at most 256 characters", param="model_id",
                           code="invalid_value")
        self._refuse_unsupported(spec)
        checkpoint_dir = check_checkpoint_dir(spec.checkpoint_dir, self.checkpoint_roots, trusted=spec.trusted)
        allowed_roots = () if spec.trusted else tuple(self.checkpoint_roots)  # re-checked as files are opened
        return dataclasses.replace(spec, checkpoint_dir=checkpoint_dir, allowed_roots=allowed_roots)

    def _resolve_descriptor(self, name: str) -> Any:
        resolver = self._descriptor_resolver
        if resolver is None:
            from engine.loading.descriptors import resolve_descriptor  # torch-free; imported only when used

            resolver = resolve_descriptor
        try:
            return resolver(name)
        except InvalidRequest as exc:  # its message lists the close matches
            raise ApiError(400, str(exc), param="metadata.llama_model", code="unknown_llama_model") from exc

    def _refuse_unsupported(self, spec: ModelSpec) -> None:
        """A descriptor this engine cannot run (vision, classifiers) is a 400 with its reason, at
        registration rather than after a load. An unknown llama_model is a 400 with close matches."""
        if spec.llama_model is not None:
            descriptor, param = self._resolve_descriptor(spec.llama_model), "metadata.llama_model"
        else:
            try:
                descriptor, param = self._resolve_descriptor(spec.model_id), "model_id"
            except ApiError:  # a model id that names no descriptor: the checkpoint's params decide
                return
        reason = getattr(descriptor, "supported_reason", None)
        if isinstance(reason, str):
            raise ApiError(400, f"{getattr(descriptor, 'name', spec.model_id)}: {reason}", param=param,
                           code="unsupported_model")

    def _descriptor_name(self, name: str) -> str | None:
        """The descriptor's folder name for `name`, or None when it is not a descriptor."""
        try:
            descriptor = self._resolve_descriptor(name)
        except ApiError:
            return None
        found = getattr(descriptor, "name", None) or getattr(descriptor, "descriptor", None)
        return found if isinstance(found, str) else None

    def _switch_spec(self, entry: _Entry, spec: ModelSpec, *, load: bool) -> None:
        """Point the id at another checkpoint. Without `load` the old engine retires now; with it, the
        old engine keeps serving until the new one is ready (see `_load_task`)."""
        log.info("model %s re-registered: %s -> %s", entry.model_id, entry.spec.checkpoint_dir, spec.checkpoint_dir)
        entry.spec = spec
        entry.metadata = dict(spec.metadata)
        entry.failure = None
        if entry.load is not None:
            self._abandon_load(entry)
        if not load and entry.active is not None:
            self._retire(entry, entry.active)

    # ------------------------------------------------------------------ loading
    def _ensure_loading(self, entry: _Entry) -> asyncio.Task:
        if entry.load is None:
            spec = entry.spec
            task = asyncio.create_task(self._load_task(entry, spec), name=f"load {entry.model_id}")
            task.add_done_callback(_consume_exception)
            entry.load = _Load(spec, task, time.monotonic())
        return entry.load.task

    def _abandon_load(self, entry: _Entry) -> None:
        """Stop caring about a load in flight (superseded or unregistered); its engine, if one
        arrives, is shut down and its memory returned by `_load_task`'s cancellation path."""
        assert entry.load is not None
        entry.load.task.cancel()
        entry.cleanups.add(entry.load.task)
        entry.load.task.add_done_callback(entry.cleanups.discard)
        entry.load = None

    async def _load_task(self, entry: _Entry, spec: ModelSpec) -> None:
        started_s = time.monotonic()
        reservation: Reservation | None = None
        try:
            # Inline: the estimate reads metadata (params.json), not weights; on the loop, loads are
            # admitted in the order they were asked for.
            load_spec = self._with_draft(spec)
            need_bytes = self._factory.estimate_memory_bytes(load_spec)
            make_room = functools.partial(self._make_room, entry)
            reservation = await self._budget.admit(entry.model_id, need_bytes, make_room)
            engine = await self._factory_load(load_spec, reservation)
        except asyncio.CancelledError:
            if reservation is not None and not reservation.draining:
                reservation.release()  # cancelled before the factory started; else the factory path owns it
            raise
        except Exception as exc:
            if reservation is not None:
                reservation.release()
            if _is_current_load(entry):
                self._on_load_failed(entry, spec, exc)
            raise
        if not _is_current_load(entry):  # superseded at the last moment: nobody may lease it
            await self._shutdown_engine(engine)
            reservation.release()
            return
        load_time_s = time.monotonic() - started_s
        slot = _LoadedEngine(entry, engine, spec, reservation, load_time_s, self._clock())
        entry.load = None
        self._loads_total += 1
        self._load_seconds_total += load_time_s
        entry.last_load_time_s = load_time_s
        entry.last_used = self._next_tick()
        old, entry.active = entry.active, slot
        entry.failure = None
        entry.required = entry.recovering = False
        if old is not None:
            self._retire(entry, old)
        log.info(
            "model %s ready in %.2f s (%s, %d bytes reserved)",
            entry.model_id,
            load_time_s,
            spec.checkpoint_dir,
            reservation.num_bytes,
        )

    def _with_draft(self, spec: ModelSpec) -> ModelSpec:
        """spec with its draft model's spec attached when it speculates with a draft model (its own
        speculative_config, else the server's): the draft is a registered model, read when the target loads."""
        config = spec.speculative_config or self.default_speculative_config
        if config is None or config.method != "draft_model":
            return spec
        draft = self._entries.get(config.model or "")
        if draft is None:
            raise ApiError(400, f"speculative_config.model {config.model!r} is not a registered model",
                           param="speculative_config.model", code="model_not_found")
        return dataclasses.replace(spec, draft=draft.spec)

    async def _factory_load(self, spec: ModelSpec, reservation: Reservation) -> EngineClient:
        """The factory's load, shielded: if we stop waiting, whatever it builds is shut down later."""
        future = asyncio.ensure_future(self._factory.load(spec))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            reservation.draining = True  # no longer ours to use; back once the orphan is gone
            await self._discard_when_loaded(future, reservation)
            raise

    async def _discard_when_loaded(self, future: asyncio.Future, reservation: Reservation) -> None:
        try:
            engine = await future
        except Exception:  # noqa: BLE001 - an abandoned load failing is of no interest to anyone
            reservation.release()
            return
        await self._shutdown_engine(engine)
        reservation.release()

    def _on_load_failed(self, entry: _Entry, spec: ModelSpec, exc: Exception) -> None:
        self._load_failures_total += 1
        error = _error_of(exc, spec, self.checkpoint_roots)
        if isinstance(exc, (CheckpointError, InvalidRequest, BudgetExceeded)):  # others: logged by _error_of
            log.warning("model %s failed to load from %s: %s", spec.model_id, spec.checkpoint_dir, exc)
        entry.load = None
        if entry.active is not None:
            # A hot switch that failed: the old engine keeps serving under its own spec.
            entry.spec = entry.active.spec
            entry.metadata = dict(entry.active.spec.metadata)
            return
        entry.failure = _Failure(error, retry_on_lease=entry.recovering or isinstance(exc, BudgetExceeded))

    # ------------------------------------------------------------------ memory budget
    def _make_room(self, entry: _Entry, need_bytes: int, budget: int) -> None:
        """Retire what must go for `need_bytes` to fit once draining engines are gone, or raise."""
        own = entry.active
        in_place = own if own is not None and not _same_model(own.spec, entry.spec) else None
        idle_lru = [e.active for e in sorted(self._idle_entries(exclude=entry), key=lambda e: e.last_used)]
        holders = [(e.model_id, e.active.reservation.num_bytes) for e in self._entries.values() if e.active]
        try:
            victims = self._budget.choose_victims(
                entry.model_id, need_bytes, budget, in_place=in_place, idle_lru=idle_lru, holders=holders
            )
        except BudgetExceeded:
            if self.adapters.evict_idle(need_bytes, budget, for_id=entry.model_id):
                return  # idle LoRA adapters make room once unloaded (they reload on their next request)
            raise
        for slot in victims:
            owner = slot.owner
            if owner is not entry:
                self._evictions_total += 1
                log.info("evicting idle model %s to make room for %s", owner.model_id, entry.model_id)
            owner.active = None
            self._retire(owner, slot)

    def _idle_entries(self, *, exclude: _Entry) -> list[_Entry]:
        return [
            e
            for e in self._entries.values()
            if e is not exclude and e.active is not None and e.active.leases == 0 and e.load is None
        ]

    # ------------------------------------------------------------------ leases
    @contextlib.asynccontextmanager
    async def lease(self, model_id: str) -> AsyncIterator[EngineClient]:
        """The engine for `model_id`, loading it if needed; hold it for the whole request. A LoRA
        adapter's id leases its base's engine, the adapter loaded on it (server/adapters.py)."""
        if self.adapters.has(model_id):
            if self._closed:
                raise shutting_down_error()
            async with self.adapters.lease(model_id, self.lease) as engine:
                yield engine
            return
        slot = await self._acquire(model_id)
        try:
            yield slot.engine
        finally:
            self._release(slot)

    async def _acquire(self, model_id: str) -> _LoadedEngine:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._load_wait_timeout_s
        while True:
            if self._closed:
                raise shutting_down_error()
            entry = self._entries.get(model_id)
            if entry is None:
                raise _not_found(model_id)
            self._recover_if_dead(entry)
            if entry.active is not None:
                entry.active.leases += 1
                entry.last_used = self._next_tick()
                return entry.active
            if entry.load is None:
                if entry.failure is not None and not entry.failure.retry_on_lease:
                    raise _lease_failure(entry)
                entry.failure = None
                log.info("model %s loads on %s", model_id, "a request after a failed reload" if entry.recovering
                         else "first use")
                self._ensure_loading(entry)
            assert entry.load is not None
            if entry.recovering:
                raise self._still_loading(entry)  # a reload after a death: never held inside a request
            task = entry.load.task
            remaining_s = deadline - loop.time()
            if remaining_s > 0:
                await asyncio.wait({task}, timeout=remaining_s)
            if not task.done():
                raise self._still_loading(entry)
            if entry.load is None and entry.active is None and entry.failure is not None:
                raise _lease_failure(entry)  # the load this lease waited for failed
            # Ready, or superseded by a newer registration: look again.

    def _still_loading(self, entry: _Entry) -> ApiError:
        assert entry.load is not None
        elapsed_s = time.monotonic() - entry.load.started_s
        expected_s = entry.last_load_time_s
        if expected_s is None and self._loads_total:
            expected_s = self._load_seconds_total / self._loads_total  # a guess from other models
        retry_after_s = _DEFAULT_RETRY_AFTER_S if expected_s is None else max(1, math.ceil(expected_s - elapsed_s))
        what = "reloading after its engine failed" if entry.recovering else "loading"
        return ApiError(
            503,
            f"model {entry.model_id!r} is {what} ({elapsed_s:.0f} s so far); retry later",
            code="model_loading",
            headers={"Retry-After": str(retry_after_s)},
        )

    def _release(self, slot: _LoadedEngine) -> None:
        slot.leases -= 1
        if slot.leases == 0:
            slot.idle_since_s = self._clock()
        if slot.owner.active is slot:
            slot.owner.last_used = self._next_tick()
            # The request that saw the engine fail: reload now, not on the next lease (this retires
            # the slot, and shuts it down if that was its last lease).
            self._recover_if_dead(slot.owner)
        elif slot.retired and slot.leases == 0:
            self._start_shutdown(slot)

    def _recover_if_dead(self, entry: _Entry) -> None:
        """A dead active engine: retire it (requests holding it end with their own errors) and reload
        in the background; /ready waits for the reload."""
        slot = entry.active
        if slot is None or not slot.engine.is_dead or entry.removed or self._closed:
            return
        log.error("model %s: engine died; reloading it in the background", entry.model_id)
        self._retire(entry, slot)
        entry.recovering = entry.required = True
        entry.failure = None
        self._ensure_loading(entry)

    def _retire(self, entry: _Entry, slot: _LoadedEngine) -> None:
        """No new leases for `slot`; it shuts down once the ones it has end."""
        if entry.active is slot:
            entry.active = None
        slot.retired = True
        slot.reservation.draining = True
        entry.retiring.add(slot)
        if slot.leases == 0:
            self._start_shutdown(slot)

    def _start_shutdown(self, slot: _LoadedEngine) -> None:
        task = asyncio.ensure_future(self._shutdown_slot(slot))
        self._shutdowns.add(task)
        task.add_done_callback(self._shutdowns.discard)

    async def _shutdown_slot(self, slot: _LoadedEngine) -> None:
        await self._shutdown_engine(slot.engine)
        slot.reservation.release()
        self._unloads_total += 1
        slot.owner.retiring.discard(slot)
        slot.closed.set()
        log.info("model %s unloaded (%s)", slot.spec.model_id, slot.spec.checkpoint_dir)

    async def _shutdown_engine(self, engine: EngineClient) -> None:
        try:
            await engine.shutdown()
        except Exception:  # noqa: BLE001 - one engine failing to stop must not stop the others
            log.exception("shutting down the engine of %s failed", getattr(engine, "model_id", "?"))

    def _next_tick(self) -> int:
        return next(self._use_ticks)

    # ------------------------------------------------------------------ idle unload
    def sweep_idle(self, now_s: float | None = None) -> list[str]:
        """Unload, back to `registered`, every loaded model idle (no lease, no load) for its keep_alive
        by `now_s` (default: the clock); the ids unloaded. Their engines shut down in the background."""
        now_s = self._clock() if now_s is None else now_s
        unloaded: list[str] = []
        for entry in list(self._entries.values()):
            slot = entry.active
            if self._closed or slot is None or slot.leases or entry.load is not None:
                continue
            keep_alive_s = _keep_alive(entry.spec, self.keep_alive_s)
            if now_s - slot.idle_since_s >= keep_alive_s:
                log.info("model %s idle for %.0f s (keep_alive %g s): unloading it", entry.model_id,
                         now_s - slot.idle_since_s, keep_alive_s)
                self._idle_unloads_total += 1
                self._retire(entry, slot)
                unloaded.append(entry.model_id)
        return unloaded

    # ------------------------------------------------------------------ unregister, queries, close
    async def unregister(self, model_id: str) -> None:
        """Forget `model_id`: new leases get 404; returns once its engines are shut down (an
        adapter: once its base engines let go of it)."""
        if self.adapters.has(model_id):
            await self.adapters.unregister(model_id)
            return
        entry = self._entries.pop(model_id, None)
        if entry is None:
            raise _not_found(model_id)
        entry.removed = True
        if entry.load is not None:
            self._abandon_load(entry)
        if entry.active is not None:
            self._retire(entry, entry.active)
        log.info("model %s unregistered; waiting for %d engine(s) to drain", model_id, len(entry.retiring))
        await _wait_drained(entry)

    def has_model(self, model_id: str) -> bool:
        """Whether model_id is registered (in any state)."""
        return model_id in self._entries

    def get(self, model_id: str) -> ModelInfo:
        if self.adapters.has(model_id):
            return _adapter_info(self.adapters.info(model_id))
        entry = self._entries.get(model_id)
        if entry is None:
            raise _not_found(model_id)
        return _info(entry, self.checkpoint_roots, self.keep_alive_s, self.default_speculative_config)

    def load_progress(self, model_id: str) -> dict[str, Any] | None:
        """The factory's report on a load of `model_id` in progress (stage, bytes, rate), if it keeps one."""
        report = getattr(self._factory, "load_progress", None)
        return report(model_id) if report is not None else None

    def list(self) -> list[ModelInfo]:
        models = [_info(entry, self.checkpoint_roots, self.keep_alive_s, self.default_speculative_config)
                  for entry in self._entries.values()]
        return models + [_adapter_info(info) for info in self.adapters.infos()]

    # ------------------------------------------------------------------ LoRA adapters
    async def register_adapter(
        self, adapter_id: str, checkpoint_dir: str | Path, base_model: str | None, *, metadata: dict[str, Any],
        load: bool, trusted: bool = False, param: str = "checkpoint_dir",
    ) -> ModelInfo:
        """Register (or hot-swap) a LoRA adapter over a registered base (the one registered model
        when base_model is None); with `load`, return once it is loaded on its base, or raise why not."""
        if self._closed:
            raise shutting_down_error()
        if not adapter_id or len(adapter_id) > 256 or "\x00" in adapter_id:
            raise ApiError(400, "an adapter name must be a non-empty name of at most 256 characters", param="model_id",
                           code="invalid_value")
        if adapter_id in self._entries:
            raise ApiError(400, f"{adapter_id!r} is a registered model, not an adapter; choose another name",
                           param="model_id", code="model_id_in_use")
        if base_model is None:
            if len(self._entries) != 1:
                raise ApiError(400, f"name the adapter's base model: {len(self._entries)} models are registered",
                               param="base_model_name", code="invalid_value")
            base_model = next(iter(self._entries))
        if base_model not in self._entries:
            raise ApiError(404, f"the base model {base_model!r} is not registered", param="metadata.base_model",
                           code="model_not_found")
        try:
            folder = check_checkpoint_dir(checkpoint_dir, self.checkpoint_roots, trusted=trusted)
        except ApiError as exc:
            raise ApiError(exc.status, exc.message.replace("checkpoint_dir", param), param=param, code=exc.code) from None
        self.adapters.register(adapter_id, folder, base_model, metadata, trusted=trusted)
        if load:
            await self.adapters.load_now(adapter_id, self.lease)
        return self.get(adapter_id)

    def engines(self) -> list[tuple[str, EngineClient]]:
        return [(e.model_id, e.active.engine) for e in self._entries.values() if e.active is not None]

    def ready(self) -> bool:
        """True once every model the server's own config loads at start has been loaded, and no model
        is reloading after its engine died (this probe also notices a dead engine)."""
        for entry in list(self._entries.values()):
            self._recover_if_dead(entry)
        return not any(e.required for e in self._entries.values())

    def start_failures(self) -> list[str]:
        """'<id>: <why>' for each model loaded at start whose load failed: why /ready stays 503."""
        return [
            f"{e.model_id}: {e.failure.error.message}"
            for e in self._entries.values()
            if e.required and e.failure is not None and e.load is None
        ]

    def lifecycle_stats(self) -> LifecycleStats:
        return LifecycleStats(
            loads_total=self._loads_total,
            load_failures_total=self._load_failures_total,
            load_seconds_total=self._load_seconds_total,
            unloads_total=self._unloads_total,
            evictions_total=self._evictions_total,
            idle_unloads_total=self._idle_unloads_total,
            loaded_models=sum(1 for e in self._entries.values() if e.active is not None),
            loading_models=sum(1 for e in self._entries.values() if e.load is not None),
            memory_reserved_bytes=self._budget.reserved_bytes(),
            memory_budget_bytes=self._budget.budget_bytes,
        )

    async def close(self) -> None:
        """Unload everything now, leases or not: the server is stopping (it drained requests first)."""
        self._closed = True
        await self.adapters.close()
        entries = list(self._entries.values())
        self._entries.clear()
        for entry in entries:
            entry.removed = True
            if entry.load is not None:
                self._abandon_load(entry)
            if entry.active is not None:
                self._retire(entry, entry.active)
            for slot in list(entry.retiring):
                if not slot.closed.is_set() and slot.leases > 0:
                    slot.leases = 0
                    self._start_shutdown(slot)
        await asyncio.gather(*(_wait_drained(entry) for entry in entries))
        await asyncio.gather(*list(self._shutdowns), return_exceptions=True)


REGISTRY_KEY: web.AppKey[ModelRegistry] = web.AppKey("model_registry", ModelRegistry)


# ---------------------------------------------------------------------- helpers
async def _wait_drained(entry: _Entry) -> None:
    waits = [slot.closed.wait() for slot in list(entry.retiring)]
    waits += [asyncio.wait({task}) for task in list(entry.cleanups)]
    if waits:
        await asyncio.gather(*waits)


def _consume_exception(task: asyncio.Task) -> None:
    """Load errors reach callers through the entry; keep asyncio from logging them again."""
    if not task.cancelled():
        task.exception()


def _info(entry: _Entry, roots: list[Path], default_keep_alive_s: float,
          default_speculative: SpeculativeConfig | None = None) -> ModelInfo:
    slot = entry.active
    spec = slot.spec if slot is not None else entry.spec
    reserved = None
    if slot is not None:
        reserved = slot.reservation.num_bytes
    return ModelInfo(
        id=entry.model_id,
        created=entry.created,
        status=entry.status,
        llama_model=spec.llama_model,
        max_seq_len=slot.engine.max_seq_len if slot is not None else spec.max_seq_len,
        checkpoint_dir=shown_path(spec.checkpoint_dir, roots),  # never the absolute path
        metadata=dict(entry.metadata),
        error=entry.failure.error.message if entry.failure is not None and slot is None else None,
        load_time_s=round(slot.load_time_s, 3) if slot is not None else None,
        memory_bytes=reserved,
        sampling_defaults=dataclasses.asdict(slot.engine.sampling_defaults) if slot is not None else None,
        weights=_weights_report(slot.engine) if slot is not None else None,
        keep_alive_s=None if math.isinf(keep_alive_s := _keep_alive(entry.spec, default_keep_alive_s)) else keep_alive_s,
        input_modalities=input_modalities(slot.engine) if slot is not None else None,
        speculative_config=None if (speculative := spec.speculative_config or default_speculative) is None
        else speculative.as_dict(),
    )


def input_modalities(engine: EngineClient) -> list[str]:
    takes_images = getattr(engine, "image_preprocessor", None) is not None  # engines that predate images: text
    return ["text", "image"] if takes_images else ["text"]


def _keep_alive(spec: ModelSpec, default_s: float) -> float:
    """Seconds a model stays loaded while idle: its own keep_alive, else the server's."""
    return default_s if spec.keep_alive_s is None else spec.keep_alive_s


def _adapter_info(info: AdapterInfo) -> ModelInfo:
    return ModelInfo(
        id=info.id, created=info.created, status=info.status, llama_model=None,  # type: ignore[arg-type]
        max_seq_len=info.max_seq_len, checkpoint_dir=info.root, metadata=info.metadata, error=info.error,
        memory_bytes=info.memory_bytes, parent=info.parent,
    )


def _weights_report(engine: Any) -> dict[str, Any] | None:
    """The engine's WeightsReport (quantization, formats, resident bytes); engines that do not
    load weights themselves (remote, fakes) have none."""
    report = getattr(engine, "weights", None)
    return dataclasses.asdict(report) if report is not None else None


def _not_found(model_id: str) -> ApiError:
    return ApiError(
        404,
        f"The model {model_id!r} does not exist",
        param="model",
        code="model_not_found",
        error_type="invalid_request_error",
    )


def _error_of(exc: BaseException, spec: ModelSpec, roots: list[Path]) -> ApiError:
    """The error a registering caller sees for a failed load: what is wrong with the checkpoint,
    without the server's absolute paths; an unexpected failure only says where to look."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BudgetExceeded):
        return ApiError(507, str(exc), code="memory_budget_exceeded")
    if isinstance(exc, (CheckpointError, InvalidRequest)):
        message = f"cannot load model {spec.model_id!r}: {redact_paths(str(exc), [spec.checkpoint_dir], roots)}"
        if isinstance(exc, CheckpointError):
            return ApiError(400, message, param="checkpoint_dir", code="invalid_checkpoint")
        return ApiError(400, message, param=exc.param, code=exc.code or "invalid_model")
    incident = getattr(exc, "llamaserve_incident", None)
    if incident is None:  # the same failure reaches the registering caller and the model's entry
        incident = exc.llamaserve_incident = uuid.uuid4().hex[:12]  # type: ignore[attr-defined]
        log.error("model %s failed to load (incident %s)", spec.model_id, incident, exc_info=exc)
    return ApiError(500, f"cannot load model {spec.model_id!r}: an internal error occurred; the server log has "
                    f"the details under incident {incident}", code="model_load_failed")


def _lease_failure(entry: _Entry) -> ApiError:
    assert entry.failure is not None
    failure = entry.failure
    hint = "the next request tries again" if failure.retry_on_lease else "register it again to retry"
    message = f"model {entry.model_id!r} failed to load: {failure.error.message}; {hint}"
    return ApiError(503, message, code="model_load_failed")


def _is_current_load(entry: _Entry) -> bool:
    return not entry.removed and entry.load is not None and entry.load.task is asyncio.current_task()


def _same_model(a: ModelSpec, b: ModelSpec) -> bool:
    """Same weights and settings; who named them (config or API) does not matter."""
    return dataclasses.replace(a, trusted=False) == dataclasses.replace(b, trusted=False)


def _needs_load(entry: _Entry) -> bool:
    """Nothing serves the registered spec yet (unloaded, or a hot switch pending)."""
    return entry.active is None or not _same_model(entry.active.spec, entry.spec)

