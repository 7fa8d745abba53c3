"""Runs stored batches through the live engine, one batch at a time, oldest first.

A batch moves validating -> in_progress -> finalizing -> completed (or failed / cancelling ->
cancelled / expired). Validation checks every input line once (JSON, shape, url, body against the
endpoint's own decoder, model registered) and records it in the store: a bad line becomes an error
line and the rest run. Items run through the same path as online requests (their endpoint kind's
plan and assembler, server/endpoints.py, and `merged_outputs`), planned at `BATCH_PRIORITY`: the
scheduler serves online requests' prefill first and preempts running batch items when an online
request finds no sequence slot or KV room, so a batch may fill an idle engine (`max_in_flight`
items at once, by default enough to) and online requests still start at the next step. Each finished item is committed on its own; after a
restart the runner carries on with the items still pending.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import msgspec
import structlog

from compat import batch_protocol as bp
from compat import limits
from compat import protocol as p
from compat import to_engine
from engine.types import EngineClient, InvalidRequest
from server import media
from server.config import ServerConfig
from server.batch_store import BatchRow, BatchStore, CheckedLine, PendingItem, StoreError
from server.endpoints import KIND_BY_PATH, EndpointKind
from server.errors import ApiError, from_exception
from server.registry import ModelRegistry
from server.request_flow import collect, merged_outputs, off_loop_if_large  # one request path for online and batch

log = structlog.get_logger("llamaserve.batch")  # structlog renders tracebacks; the stdlib bridge does not

BATCH_PRIORITY = 1  # online requests have 0; the scheduler runs lower values first
# Errors that say "not now" rather than "never": the item waits and tries again.
_RETRY_CODES = frozenset({"model_loading", "engine_unavailable", "queue_full", "shutting_down"})
_MAX_RETRY_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class ItemResult:
    ok: bool
    line: bytes  # the output or error file's line, JSON without the newline
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


# --------------------------------------------------------------------------- result lines
def _line(custom_id: str | None, response: bp.LineResponse | None = None, error: bp.LineError | None = None) -> bytes:
    return bp.ENCODER.encode(bp.OutputLine(id=f"batch_req_{uuid.uuid4().hex}", custom_id=custom_id,
                                           response=response, error=error))


def error_response_line(custom_id: str | None, error: ApiError) -> bytes:
    """A request that was refused: the error body the online endpoint would have sent."""
    return _line(custom_id, bp.LineResponse(status_code=error.status, request_id=uuid.uuid4().hex,
                                            body=error.to_body()))


def line_error(custom_id: str | None, code: str, message: str) -> bytes:
    """A line that never became a request (not JSON, wrong shape, wrong url)."""
    return _line(custom_id, error=bp.LineError(code=code, message=message))


def expired_line(line: int, custom_id: str | None) -> bytes:
    return line_error(custom_id, "batch_expired",
                      "This request could not be executed before the completion window expired.")


# --------------------------------------------------------------------------- validation
class LineChecker:
    """Checks input lines for one batch; remembers custom_ids to refuse duplicates."""

    def __init__(self, endpoint: str, known_models: frozenset[str]) -> None:
        self.endpoint = endpoint
        self.known_models = known_models
        self.decoder = KIND_BY_PATH[endpoint].decoder
        self.seen: set[str] = set()

    def check(self, line_no: int, raw: bytes) -> CheckedLine:
        """The line as a request, or its one error line. JSON nested past msgspec's recursion bound
        (a RecursionError from any of its decodes) is such a line too, never the whole batch's failure."""
        try:
            return self._check(line_no, raw)
        except RecursionError:
            return CheckedLine(None, error_result=line_error(None, "invalid_json_line",
                                                             f"Line {line_no}: {limits.too_deep().args[0]}"))

    def _check(self, line_no: int, raw: bytes) -> CheckedLine:
        try:
            line = bp.INPUT_LINE_DECODER.decode(raw)
        except msgspec.ValidationError as exc:
            custom_id = _loose_custom_id(raw)
            message = p.validation_param(str(exc))[0]
            return CheckedLine(custom_id, error_result=line_error(custom_id, "invalid_request",
                                                                  f"Line {line_no}: {message}"))
        except msgspec.DecodeError as exc:
            return CheckedLine(None, error_result=line_error(None, "invalid_json_line",
                                                             f"Line {line_no} is not valid JSON: {exc}"))
        custom_id = line.custom_id
        if custom_id in self.seen:
            return CheckedLine(custom_id, error_result=line_error(
                custom_id, "duplicate_custom_id", f"Line {line_no}: custom_id {custom_id!r} is used by an earlier line"))
        self.seen.add(custom_id)
        if line.url != self.endpoint:
            return CheckedLine(custom_id, error_result=line_error(
                custom_id, "invalid_url", f"Line {line_no}: url {line.url!r} does not match the batch's endpoint "
                                          f"{self.endpoint!r}"))
        body = bytes(line.body)
        try:
            req = p.decode(self.decoder, body)
        except Exception as exc:  # noqa: BLE001 - InvalidRequest: the 400 the endpoint would answer
            return CheckedLine(custom_id, error_result=error_response_line(custom_id, from_exception(exc)))
        if req.stream:
            error = ApiError(400, "stream is not supported in a batch", param="stream", code="invalid_value")
            return CheckedLine(custom_id, error_result=error_response_line(custom_id, error))
        if req.model not in self.known_models:
            error = ApiError(404, f"The model {req.model!r} does not exist", param="model", code="model_not_found",
                             error_type="invalid_request_error")
            return CheckedLine(custom_id, error_result=error_response_line(custom_id, error))
        return CheckedLine(custom_id, body=body, model=req.model)


def _loose_custom_id(raw: bytes) -> str | None:
    """The custom_id of a line that is JSON but not a valid request line, if it has one."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def checked_lines(path: Path, checker: LineChecker) -> Iterator[tuple[int, CheckedLine]]:
    """(1-based line number, checked line) for every non-blank line, read as a stream."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            raw = raw.strip()
            if raw:
                yield line_no, checker.check(line_no, raw)


# --------------------------------------------------------------------------- one item
async def run_item(registry: ModelRegistry, endpoint: str, item: PendingItem, config: ServerConfig | None = None) -> ItemResult:
    """One request, as the online endpoint would serve it, at batch priority (its images under
    `config`'s limits). Raises ApiError with a code in _RETRY_CODES when it should be tried again later."""
    kind = KIND_BY_PATH[endpoint]
    try:
        req = p.decode(kind.decoder, item.body)
        async with registry.lease(req.model) as engine:
            response = await _generate(kind, req, engine, len(item.body), config or ServerConfig())
    except Exception as exc:  # noqa: BLE001 - the item's own error line
        error = from_exception(exc)
        if error.code in _RETRY_CODES:
            raise error from exc
        if error.status >= 500:  # our fault, not the line's: the log keeps the traceback the line leaves out
            log.error("batch item failed", custom_id=item.custom_id, code=error.code, exc_info=exc)
        return ItemResult(False, error_response_line(item.custom_id, error))
    usage = response.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    line = _line(item.custom_id, bp.LineResponse(status_code=200, request_id=uuid.uuid4().hex, body=response))
    return ItemResult(True, line, usage.prompt_tokens, cached, usage.completion_tokens)


class _Fanout(msgspec.Struct):
    """The fields of an item's body that say how many engine sequences it becomes."""

    n: int | None = 1
    prompt: Any = None  # completions: one prompt or several; chat items have none


_FANOUT_DECODER = msgspec.json.Decoder(_Fanout)


def item_sequences(body: bytes) -> int:
    """The engine sequences an item asks for (n x prompts), which the runner counts against max_in_flight."""
    try:
        fanout = _FANOUT_DECODER.decode(body)
        num_prompts = 1 if fanout.prompt is None else len(to_engine.completion_prompts(fanout.prompt))
    except (msgspec.DecodeError, InvalidRequest):
        return 1  # refused when it is planned: it never reaches the engine
    return max(fanout.n or 1, 1) * num_prompts


async def _generate(kind: EndpointKind, req: Any, engine: EngineClient, body_bytes: int, config: ServerConfig) -> Any:
    images = await media.prepare_images(kind.image_refs(kind.prompt(req)), engine, config)
    plan, assembler = await off_loop_if_large(body_bytes, kind.prepare, req, kind.prompt(req), engine,
                                              kind.response_id(), priority=BATCH_PRIORITY, images=images)
    return await collect(merged_outputs(engine, plan.requests), assembler)


# --------------------------------------------------------------------------- the runner
class BatchRunner:
    """The background task that owns batch execution for one store."""

    def __init__(self, store: BatchStore, registry: ModelRegistry, *, max_in_flight: int,
                 config: ServerConfig | None = None) -> None:
        self.config = config  # image limits and fetching, as online
        self.store = store
        self.registry = registry
        self.max_in_flight = max_in_flight
        self._wake = asyncio.Event()  # a new batch, a cancel, or an item finished
        self._cancelled: set[str] = set()

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        self._cancelled.add(batch_id)
        self._wake.set()

    async def run(self) -> None:
        """Work through the batches until cancelled (in-flight items are then aborted in the engine and
        stay pending for the next start). Raises only when the store cannot record a failed batch:
        the caller (BatchService's supervisor) reports that and starts the runner again."""
        while True:
            self._wake.clear()
            batch = await self.store.io(self.store.next_batch)
            if batch is None:
                await self._wake.wait()
                continue
            try:
                await self._advance(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug fails this batch, never the runner
                log.error("batch failed", batch_id=batch.id, exc_info=True)
                await self.store.io(self.store.fail_batch, batch.id,
                                    [{"code": "internal_error", "message": f"the batch failed: {exc!r}"}])

    async def _advance(self, batch: BatchRow) -> None:
        """Move one batch one status further."""
        if batch.status == "validating":
            await self._validate(batch)
        elif batch.status == "in_progress":
            await self._run_items(batch)
        elif batch.status == "finalizing":
            await self.store.io(self.store.finalize, batch.id, "completed")
        elif batch.status == "cancelling":
            await self.store.io(self.store.cancel_pending, batch.id)
            await self.store.io(self.store.finalize, batch.id, "cancelled")
            self._cancelled.discard(batch.id)

    async def _validate(self, batch: BatchRow) -> None:
        known = frozenset(info.id for info in self.registry.list())
        checker = LineChecker(batch.endpoint, known)
        try:
            path = await self.store.io(self.store.file_path, batch.input_file_id)
            await self.store.io(lambda: self.store.start_items(batch.id, checked_lines(path, checker)))
        except StoreError as exc:
            await self.store.io(self.store.fail_batch, batch.id, [{"code": exc.code, "message": str(exc),
                                                                   "param": exc.param, "line": None}])
        except OSError as exc:
            await self.store.io(self.store.fail_batch, batch.id, [{"code": "file_unreadable",
                                                                   "message": f"cannot read the input file: {exc}"}])

    async def _run_items(self, batch: BatchRow) -> None:
        tasks: dict[asyncio.Task, int] = {}  # each item in flight and its sequences
        failures: list[BaseException] = []
        page_size = max(64, 4 * self.max_in_flight)
        after_line = 0
        try:
            while not self._stopping(batch) and not failures:
                page = await self.store.io(lambda: self.store.pending_items(batch.id, after_line=after_line,
                                                                             limit=page_size))
                if not page:
                    break
                for item in page:
                    num_sequences = item_sequences(item.body)  # an item bigger than max_in_flight runs alone
                    while (tasks and sum(tasks.values()) + num_sequences > self.max_in_flight
                           and not self._stopping(batch) and not failures):
                        self._wake.clear()
                        await self._wake.wait()
                    if self._stopping(batch) or failures:
                        break
                    task = asyncio.create_task(self._item(batch, item))
                    tasks[task] = num_sequences
                    task.add_done_callback(self._item_done(tasks, failures))
                after_line = page[-1].line
            while tasks and not self._stopping(batch) and not failures:
                self._wake.clear()
                await self._wake.wait()
        finally:
            for task in tasks:
                task.cancel()  # closing its output iterator aborts the engine request and frees its blocks
            await asyncio.gather(*tasks, return_exceptions=True)
        if failures:
            raise failures[0]  # the runner fails this batch as a whole
        await self._after_items(batch)

    def _item_done(self, tasks: dict[asyncio.Task, int], failures: list[BaseException]) -> Any:
        def done(task: asyncio.Task) -> None:
            tasks.pop(task, None)
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())  # e.g. the store could not write: stop, do not spin
            self._wake.set()
        return done

    def _stopping(self, batch: BatchRow) -> bool:
        return batch.id in self._cancelled or _expired(batch)

    async def _after_items(self, batch: BatchRow) -> None:
        if batch.id in self._cancelled:
            return  # the store says cancelling: the next round finalizes it as cancelled
        if _expired(batch):
            await self.store.io(self.store.expire_pending, batch.id, expired_line)
            await self.store.io(self.store.finalize, batch.id, "expired")
            return
        if await self.store.io(self.store.num_pending, batch.id) == 0:
            await self.store.io(self.store.set_finalizing, batch.id)

    async def _item(self, batch: BatchRow, item: PendingItem) -> None:
        while True:
            try:
                with structlog.contextvars.bound_contextvars(batch_id=batch.id):  # in what run_item logs
                    result = await run_item(self.registry, batch.endpoint, item, self.config)
                break
            except ApiError as exc:  # not now: wait as the server asks, then again
                if _expired(batch):
                    return
                wait_s = float(exc.headers.get("Retry-After", "1"))
                await asyncio.sleep(min(max(wait_s, 0.1), _MAX_RETRY_WAIT_S))
        await self.store.io(lambda: self.store.finish_item(
            batch.id, item.line, ok=result.ok, result=result.line, input_tokens=result.input_tokens,
            cached_tokens=result.cached_tokens, output_tokens=result.output_tokens))


def _expired(batch: BatchRow) -> bool:
    return batch.expires_at is not None and time.time() >= batch.expires_at
