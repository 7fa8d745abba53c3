"""The engine as the server sees it: `generate()` per request, the model stepping on its own thread.

The event loop only does I/O: `generate()` checks the request (once), hands the request to the engine thread and
awaits the request's own slot. The engine thread applies adds and aborts, runs one step, and sends
each event loop the step's deltas in one `call_soon_threadsafe`. A slot merges deltas its consumer
has not taken yet, so a slow reader never holds up the step or anyone else. When idle the engine
thread sleeps on a condition variable; nothing polls. A CPU engine idle for a while after steps
hands the C heap's free pages back once (engine.kernels.memory.idle_heap_trim).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from engine.config import EngineConfig, QueueClass, queue_class
from engine.core.engine_core import EngineCore
from engine.core.scheduler import queue_full
from engine.kernels.memory import IDLE_TRIM_AFTER_S, idle_heap_trim
from engine.core.output import DetokenizerFactory
from engine.quant.policy import WeightsReport
from engine.types import EngineDead, EngineError, EngineRequest, EngineStats, RequestOutput
from engine.types import SamplingDefaults, request_id_in_use
from engine.vision import ImagePreprocessor

if TYPE_CHECKING:
    from engine.executor.executor import Executor

log = logging.getLogger(__name__)


def merge_outputs(*outputs: RequestOutput) -> RequestOutput:
    """Consecutive deltas of one request as one, joined once (linear in their total size)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprobs = None
    if any(out.logprobs is not None for out in outputs):
        logprobs = [lp for out in outputs for lp in out.logprobs or ()]
    prompt_logprobs = next((out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=[t for out in outputs for t in out.new_token_ids],
        text_delta="".join(out.text_delta for out in outputs),
        logprobs=logprobs,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        error=last.error,
        prompt_logprobs=prompt_logprobs,
    )


class _Mailbox:
    """One request's mailbox, living on the event loop that awaits it.

    Its one consumer waits on a bare future, made only when the box is empty: an asyncio.Event (its
    waiter deque, clear, loop check) made the same put-and-wake 2.6 us a token instead of 1.85 (32
    boxes on uvloop; bench/NOTES.md, 'Many streams: between the engine and the clients')."""

    __slots__ = ("loop", "pending", "error", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[RequestOutput] = []  # deltas not taken yet, merged once on get()
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None  # the consumer's, while it waits on an empty box

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        else:
            self.pending.append(item)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():  # done: the consumer was cancelled while it waited
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self.pending and self.error is None:
            waiter = self.waiter = self.loop.create_future()
            await waiter
        if self.pending:  # deltas that came before an error are still delivered
            pending, self.pending = self.pending, []
            return merge_outputs(*pending)
        raise self.error  # type: ignore[misc]


def _deliver(items: list[tuple[_Mailbox, RequestOutput | BaseException]]) -> None:
    for slot, item in items:
        slot.put(item)


class AsyncEngine:
    """engine.types.EngineClient over an EngineCore stepping on a dedicated thread."""

    def __init__(
        self,
        model_id: str,
        runner: Executor,
        tokenizer: Any,
        chat_format: Any,
        config: EngineConfig,
        *,
        max_seq_len: int,
        detokenizer_factory: DetokenizerFactory | None = None,
        sampling_defaults: SamplingDefaults = SamplingDefaults(),
        weights: WeightsReport | None = None,
        image_preprocessor: ImagePreprocessor | None = None,
        draft_runner: Executor | None = None,
    ) -> None:
        self.model_id = model_id
        self.image_preprocessor = image_preprocessor  # None: the model takes text only
        self.sampling_defaults = sampling_defaults
        self.weights = weights  # quantization, formats, resident bytes (/v1/models/{id})
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.config = config
        self.runner = runner
        self.core = EngineCore(runner, tokenizer, config, max_seq_len, detokenizer_factory=detokenizer_factory,
                               draft_runner=draft_runner)
        self.max_seq_len = self.core.max_seq_len  # never more than the KV pool can hold for one request
        # n x prompts of one request (compat checks it); a request whose sequences could not all wait in
        # either bound would be refused part way every time, so the cap is never more than the bounds.
        self.max_sequences_per_request = min(config.max_sequences_per_request, config.max_waiting_requests,
                                             config.max_waiting_batch_sequences)
        self._cond = threading.Condition()
        # ("add", (request, its CompiledGrammar or None), slot) and ("abort", request_id, None), in posting order
        self._inbox: list[tuple[str, Any, _Mailbox | None]] = []  # guarded by _cond
        self._num_adds_posted: dict[QueueClass, int] = {"online": 0, "batch": 0}  # adds in the inbox, per bound
        self._dead: EngineDead | None = None  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._active: dict[str, _Mailbox] = {}  # event-loop side: requests whose generator is open
        self._slots: dict[str, _Mailbox] = {}  # engine-thread side: where each request's deltas go
        self._runner_shut_down = False
        self._heap_trim = idle_heap_trim(config.device)  # None: nothing to trim (CUDA, not glibc)
        self._idle_trim_after_s = IDLE_TRIM_AFTER_S
        self._thread = threading.Thread(target=self._run, name=f"engine-{model_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ EngineClient
    @property
    def num_running_requests(self) -> int:
        """Requests in flight (queued, running, or with deltas not yet taken)."""
        return len(self._active)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Validate now (raising InvalidRequest, ContextLengthExceeded, QueueFull or EngineDead
        before anything is yielded), queue on first iteration, then yield deltas."""
        self._check_open()
        self.core.check(request)  # the request's one check: pure, so nothing later repeats it
        self._check_can_queue(request)
        return self._stream(request)

    async def abort(self, request_id: str) -> None:
        self._post_abort(request_id)

    @property
    def is_dead(self) -> bool:
        """A step failed (a worker died, a bug) or the engine was shut down: it serves nothing more."""
        return self._dead is not None

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)
        if not self._runner_shut_down:
            self._runner_shut_down = True
            await asyncio.to_thread(self.runner.shutdown)
            await asyncio.to_thread(self.core.shutdown_speculator)  # the draft model's executor, if any

    # ------------------------------------------------------------------ LoRA adapters
    async def load_adapter(self, name: str, folder: Path, *, roots: tuple[Path, ...] = ()) -> int:
        """Read and check an adapter folder (off the loop; InvalidRequest naming what differs from
        this base), then install it under `name` between two steps; loading a name again swaps it
        with no request dropped. The bytes its weights hold."""
        adapter = await asyncio.to_thread(self.runner.read_adapter, folder, roots)  # type: ignore[attr-defined]
        return await self._on_engine_thread(lambda: self.core.load_adapter(name, adapter, str(folder)))

    async def unload_adapter(self, name: str) -> bool:
        """Stop serving an adapter; requests running with it finish first. False if it was not loaded."""
        return await self._on_engine_thread(lambda: self.core.unload_adapter(name))

    def adapter_names(self) -> list[str]:
        return sorted(self.core.adapters.ids)

    def adapter_bytes(self, name: str) -> int:
        return self.core.adapters.bytes_of(name)

    def adapter_activity(self) -> tuple[list[str], list[str]]:
        """(running, waiting) adapter names."""
        return self.core.adapter_activity()

    def adapter_requests_total(self) -> dict[str, int]:
        return dict(self.core.adapters.requests_total)

    async def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between two steps (what a model-parallel group needs: its
        broadcasts stay in order with the steps'); its result or exception comes back here."""
        self._check_open()
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._dead is not None or self._stopping:
                raise EngineDead(f"model {self.model_id!r} is not available")
            self._inbox.append(("call", fn, done))
            self._cond.notify()
        return await asyncio.wrap_future(done)

    # ------------------------------------------------------------------ event-loop side
    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"model {self.model_id!r} is not available: {self._dead}")
        if self._stopping:
            raise EngineDead(f"model {self.model_id!r} is shutting down")

    def _check_can_add(self, request: EngineRequest) -> None:
        """What may have changed since generate() checked the request: checked again before queueing."""
        self._check_open()
        self._check_can_queue(request)

    def num_waiting_sequences(self, priority: int) -> int:
        """Sequences waiting in the bound a request at `priority` counts against, those posted included."""
        queue = queue_class(priority)
        return self.core.scheduler.num_waiting_in(queue) + self._num_adds_posted[queue]

    def _check_can_queue(self, request: EngineRequest) -> None:
        if request.request_id in self._active:
            raise request_id_in_use(request.request_id)
        queue = queue_class(request.priority)
        num_waiting, bound = self.num_waiting_sequences(request.priority), self.config.max_waiting_sequences(queue)
        if num_waiting >= bound:
            raise queue_full(queue, num_waiting, bound, model_id=self.model_id)

    async def _stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        self._check_can_add(request)  # again: time may have passed since generate()
        grammar = None
        if request.params.grammar is not None:  # compiled here, off the engine thread, under a time limit
            grammar = await self.core.grammars.prepare(request.params.grammar)  # held until admission
            self._check_can_add(request)
        slot = _Mailbox(asyncio.get_running_loop())
        self._active[request_id] = slot
        with self._cond:
            if self._dead is not None or self._stopping:
                del self._active[request_id]
                raise EngineDead(f"model {self.model_id!r} is not available")
            self._inbox.append(("add", (request, grammar), slot))
            self._num_adds_posted[queue_class(request.priority)] += 1
            self._cond.notify()
        finished = False
        try:
            while not finished:
                output = await slot.get()
                finished = output.finished
                yield output
        finally:
            self._active.pop(request_id, None)
            if not finished:  # the consumer left early (client gone, cancelled): free the blocks
                self._post_abort(request_id)

    def _post_abort(self, request_id: str) -> None:
        with self._cond:
            self._inbox.append(("abort", request_id, None))
            self._cond.notify()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        trim_owed = False  # steps ran since the heap was last trimmed
        while True:
            with self._cond:
                trim_owed = self._wait_for_work(trim_owed)
                inbox, self._inbox = self._inbox, []
                self._num_adds_posted = {"online": 0, "batch": 0}
                stopping = self._stopping
            if stopping:
                self._fail_everything(EngineDead(f"model {self.model_id!r} was shut down"), inbox)
                return
            items: list[tuple[_Mailbox, Any]] = []
            steps_before = self.core.timing.num_steps
            try:
                items = self._apply(inbox)
                items += self._route(self.core.step())
                self.core.release_adapters()  # swapped or unloaded adapter versions whose last sequence finished
            except BaseException as exc:  # a dead worker, or a bug: every request fails, the model goes away
                log.exception("engine for %s stopped", self.model_id)
                dead = exc if isinstance(exc, EngineDead) else EngineDead(f"engine step crashed: {exc!r}")
                self._send(items)
                self._fail_everything(dead, inbox)
                return
            self._send(items)
            trim_owed = trim_owed or self.core.timing.num_steps != steps_before
            if self.core.has_unfinished and self.core.timing.num_steps == steps_before:
                with self._cond:  # nothing could be scheduled (should not happen): wait for news, not spin
                    self._cond.wait(timeout=0.01)

    def _wait_for_work(self, trim_owed: bool) -> bool:
        """With _cond held: sleep until there is work. Idle for _idle_trim_after_s with a trim owed,
        trim the heap (a few ms; a request posted meanwhile waits that long). Returns trim_owed."""
        while not (self._inbox or self._stopping or self.core.has_unfinished):
            if not trim_owed or self._heap_trim is None:
                self._cond.wait()
            elif not self._cond.wait(timeout=self._idle_trim_after_s):
                self._heap_trim()
                trim_owed = False
        return trim_owed

    def _apply(self, inbox: list[tuple[str, Any, _Mailbox | None]]) -> list[tuple[_Mailbox, Any]]:
        """Adds and aborts, in the order they were posted."""
        items: list[tuple[_Mailbox, Any]] = []
        for kind, payload, slot in inbox:
            if kind == "add":
                request, grammar = payload
                try:
                    self.core.admit(request, grammar)  # checked by generate(), on the caller's side
                except EngineError as exc:
                    items.append((slot, exc))
                else:
                    self._slots[request.request_id] = slot  # type: ignore[assignment]
            elif kind == "call":
                try:
                    slot.set_result(payload())  # type: ignore[union-attr]
                except Exception as exc:  # noqa: BLE001 - the caller's to handle (a bad adapter, a dead group)
                    slot.set_exception(exc)  # type: ignore[union-attr]
            elif (output := self.core.abort_request(payload)) is not None:
                items += self._route([output])
        return items

    def _route(self, outputs: list[RequestOutput]) -> list[tuple[_Mailbox, Any]]:
        items: list[tuple[_Mailbox, Any]] = []
        for output in outputs:
            slot = self._slots.pop(output.request_id) if output.finished else self._slots.get(output.request_id)
            if slot is not None:
                items.append((slot, output))
        return items

    def _send(self, items: list[tuple[_Mailbox, Any]]) -> None:
        """One call_soon_threadsafe per event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Mailbox, Any]]] = defaultdict(list)
        for slot, item in items:
            by_loop[slot.loop].append((slot, item))
        for loop, loop_items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, loop_items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _fail_everything(self, error: EngineDead, inbox: list[tuple[str, Any, _Mailbox | None]]) -> None:
        with self._cond:
            self._dead = self._dead or error
            inbox = inbox + self._inbox
            self._inbox = []
        self.core.fail_all(str(error))  # frees every block
        slots = {id(slot): slot for slot in self._slots.values()}
        slots.update((id(slot), slot) for kind, _, slot in inbox if kind == "add" and slot is not None)
        for kind, _, call in inbox:
            if kind == "call" and not call.done():  # type: ignore[union-attr]
                call.set_exception(error)  # type: ignore[union-attr]
        self._slots.clear()
        self._send([(slot, error) for slot in slots.values()])
