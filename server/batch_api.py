"""OpenAI's Batch API: /v1/files and /v1/batches over a BatchStore, run by a BatchRunner.

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files   GET /v1/files/{id}
    GET /v1/files/{id}/content                        DELETE /v1/files/{id}
    POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

The store lives in `batch_dir` (the CLI defaults it under the cache dir, so batches survive a
restart and resume); without one it is a temporary directory removed at exit. It is opened at
start when configured (unfinished batches resume at once), else on the first Batch API call.

The Batch API is an optional subsystem (server/subsystems.py): a store that cannot open (a dir the
server's user cannot write, a corrupt database) or a runner that fails takes only it down. Its
routes then answer 503 `batch_unavailable` with the reason, /ready and /metrics say so, and the
store and runner are tried again after a growing delay; inference serves on throughout.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator

import structlog
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from compat import batch_protocol as bp
from compat.protocol import decode
from server.app_keys import CONFIG_KEY
from server.auth import OWNER
from server.batch_runner import BatchRunner
from server.batch_store import BatchRow, BatchStore, FileRow, Quota, StoreError, open_private, storage_quota_error
from server.config import ServerConfig
from server.endpoints import KIND_BY_PATH
from server.drain import shutting_down_error
from server.errors import ApiError
from server.registry import REGISTRY_KEY, ModelRegistry
from server.subsystems import SUBSYSTEMS_KEY, Backoff, Subsystems, supervise

log = structlog.get_logger("llamaserve.batch")

_CHUNK_BYTES = 1 << 16
_MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose)
_EXPIRES_AFTER_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")  # OpenAI's form spelling
PURGE_INTERVAL_S = 600.0  # expired files read as absent at once; this is how soon their bytes go


BATCH_SUBSYSTEM = "batch"
RESTART_BACKOFF = Backoff(initial_s=1.0, max_s=60.0)  # between attempts to open the store or restart the runner


class BatchService:
    """The store and its runner for one app: an optional subsystem (server/subsystems.py). Opening
    the store and running the runner happen in one supervised task: when either fails, the Batch API
    routes answer 503 with the reason while inference serves on, and the task starts again later."""

    def __init__(self, config: ServerConfig, registry: ModelRegistry, subsystems: Subsystems | None = None) -> None:
        self.config = config
        self.registry = registry
        self.subsystems = subsystems if subsystems is not None else Subsystems()
        self.subsystems.register(BATCH_SUBSYSTEM)
        self._store: BatchStore | None = None
        self._runner: BatchRunner | None = None
        self._temp_dir: Path | None = None
        self._supervisor: asyncio.Task | None = None
        self._first_attempt_done = asyncio.Event()
        self._closed = False

    @property
    def max_in_flight(self) -> int:
        """Batch sequences (n x prompts of each item) in the engine at once. The scheduler preempts batch
        sequences for online requests (engine/core/scheduler.py), so by default a batch fills every
        sequence slot of an idle engine, plus as many again waiting so a finished item's slot is
        refilled at the next step; never more than batch sequences may wait (max_waiting_batch_sequences),
        a bound apart from the online requests' queue."""
        configured = self.config.batch_max_in_flight
        if configured > 0:
            return configured
        engine = self.config.engine
        return max(1, min(2 * engine.max_batch_size, engine.max_waiting_batch_sequences))

    def start(self) -> None:
        """Open the store and run the runner in the background, supervised; idempotent."""
        if self._supervisor is None and not self._closed:
            self.subsystems.starting(BATCH_SUBSYSTEM)
            self._supervisor = asyncio.create_task(
                supervise(self.subsystems, BATCH_SUBSYSTEM, self._serve, backoff=RESTART_BACKOFF),
                name="batch-supervisor")

    async def store(self) -> BatchStore:
        """The open store, or a 503 saying why the Batch API is down."""
        self.start()
        await self._first_attempt_done.wait()
        if self._closed:
            raise shutting_down_error()
        if self._store is None or self.subsystems.get(BATCH_SUBSYSTEM).status == "down":
            raise self.subsystems.unavailable(BATCH_SUBSYSTEM, "The Batch API")
        return self._store

    async def _serve(self) -> None:
        """One supervised run: open the store (once; it stays open across runner restarts), then run
        batches until cancelled. Raises when the store cannot open or the runner fails."""
        try:
            if self._store is None:
                self._store = await self._open()
        finally:
            self._first_attempt_done.set()
        self._runner = BatchRunner(self._store, self.registry, max_in_flight=self.max_in_flight, config=self.config)
        self.subsystems.up(BATCH_SUBSYSTEM)
        tasks = [asyncio.create_task(self._runner.run(), name="batch-runner"),
                 asyncio.create_task(_purge_periodically(self._store), name="batch-purge")]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # the failure, for the supervisor to report
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _open(self) -> BatchStore:
        root = self.config.batch_dir
        if root is None:
            if self._temp_dir is None:
                self._temp_dir = Path(tempfile.mkdtemp(prefix="llamaserve-batches-"))
            root = self._temp_dir
        return await asyncio.to_thread(BatchStore, root, max_file_bytes=self.config.batch_max_file_bytes,
                                       max_requests=self.config.batch_max_requests,
                                       retention_s=self.config.batch_retention_s,
                                       quota=Quota(files=self.config.batch_quota_files,
                                                   bytes=self.config.batch_quota_bytes,
                                                   batches=self.config.batch_quota_batches))

    def wake(self) -> None:
        if self._runner is not None:
            self._runner.wake()

    def cancel(self, batch_id: str) -> None:
        if self._runner is not None:
            self._runner.cancel(batch_id)

    async def close(self) -> None:
        self._closed = True
        self._first_attempt_done.set()  # a request still waiting for the store gets its 503
        if self._supervisor is not None:
            self._supervisor.cancel()  # cancels in-flight items: they stay pending for the next start
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


BATCH_KEY = web.AppKey("batch_service", BatchService)


async def _purge_periodically(store: BatchStore) -> None:
    """Delete expired files and old finished batches now and every PURGE_INTERVAL_S."""
    while True:
        purged = await store.io(store.purge)
        if purged.files or purged.batches:
            log.info("purged expired batch storage", files=purged.files, batches=purged.batches)
        await asyncio.sleep(PURGE_INTERVAL_S)


def add_batch_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", create_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
    app.cleanup_ctx.append(_batch_context)


async def _batch_context(app: web.Application) -> AsyncIterator[None]:
    service = BatchService(app[CONFIG_KEY], app[REGISTRY_KEY], app[SUBSYSTEMS_KEY])
    app[BATCH_KEY] = service
    if service.config.batch_dir is not None:
        service.start()  # resume what a previous run left unfinished; a failure stays in the subsystem
    try:
        yield
    finally:
        await service.close()


async def _store(request: web.Request) -> BatchStore:
    return await request.app[BATCH_KEY].store()


async def _io(request: web.Request, fn: Any, *args: Any) -> Any:
    store = await _store(request)
    try:
        return await store.io(fn, *args)
    except StoreError as exc:
        raise _api_error(exc) from None


def _api_error(exc: StoreError) -> ApiError:
    return ApiError(exc.status, str(exc), param=exc.param, code=exc.code, error_type=exc.error_type)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=bp.ENCODER.encode(obj), status=status, content_type="application/json")


# --------------------------------------------------------------------------- files
async def create_file(request: web.Request) -> web.Response:
    store = await _store(request)
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "upload a file as multipart/form-data with fields 'file' and 'purpose'",
                       code="invalid_request")
    owner = request[OWNER]
    bytes_left = await _io(request, store.upload_room, owner)  # a key whose quota is full is told before it sends
    purpose: str | None = None
    expires_after: dict[str, str] = {}
    upload: tuple[Path, str, int] | None = None
    try:
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise ApiError(400, "nested multipart bodies are not accepted", code="invalid_request")
                if part.name == "file":
                    if upload is not None:
                        raise ApiError(400, "send one file per upload", param="file", code="invalid_request")
                    upload = await _receive_file(part, store, bytes_left)
                elif part.name == "purpose":
                    purpose = (await _small_field(part)).decode("utf-8", "replace").strip()
                elif part.name in _EXPIRES_AFTER_FIELDS:
                    expires_after[part.name] = (await _small_field(part)).decode("utf-8", "replace").strip()
                else:
                    raise ApiError(400, f"Unrecognized request argument supplied: {part.name}", param=part.name,
                                   code="invalid_request")
        except (ValueError, HttpProcessingError) as exc:  # aiohttp's words for a malformed multipart body
            raise ApiError(400, f"the multipart body is malformed: {exc}", code="invalid_request") from None
        if upload is None:
            raise ApiError(400, "Missing required parameter: 'file'", param="file", code="invalid_request")
        if purpose != "batch":
            raise ApiError(400, f"purpose {purpose!r} is not served here; upload batch input files with "
                           "purpose 'batch'", param="purpose", code="invalid_value")
        expires_after_s = _expires_after_s(expires_after)
        path, filename, num_bytes = upload
        row = await _io(request, lambda: store.add_file(path, filename=filename, purpose="batch", num_bytes=num_bytes,
                                                        expires_after_s=expires_after_s, owner=owner))
        upload = None
        return _json(file_object(row))
    finally:
        if upload is not None:
            upload[0].unlink(missing_ok=True)


def _expires_after_s(fields: dict[str, str]) -> int | None:
    """`expires_after[anchor]` and `expires_after[seconds]` of an upload form -> seconds, or None."""
    if not fields:
        return None
    if fields.get("expires_after[anchor]") != "created_at":
        raise ApiError(400, "expires_after[anchor] must be 'created_at'", param="expires_after[anchor]",
                       code="invalid_value")
    text = fields.get("expires_after[seconds]", "")
    low, high = bp.MIN_EXPIRES_AFTER_S, bp.MAX_EXPIRES_AFTER_S
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(high)) and low <= int(text) <= high):
        raise ApiError(400, f"expires_after[seconds] must be an integer from {low} to {high}",
                       param="expires_after[seconds]", code="invalid_value")
    return int(text)


async def _small_field(part: BodyPartReader) -> bytes:
    data = b""
    while chunk := await part.read_chunk(_MAX_FIELD_BYTES):
        data += chunk
        if len(data) > _MAX_FIELD_BYTES:
            raise ApiError(400, f"form field {part.name!r} is longer than {_MAX_FIELD_BYTES} bytes", param=part.name,
                           code="invalid_value")
    return data


async def _receive_file(part: BodyPartReader, store: BatchStore, bytes_left: int | None) -> tuple[Path, str, int]:
    """Stream the file part to a temporary file, enforcing the size and request-count limits and the
    owner's quota (`bytes_left`): a file that passes one is refused as soon as it does."""
    path = store.upload_path()
    num_bytes = num_lines = 0
    try:
        with open_private(path, "wb") as out:
            while chunk := await part.read_chunk(_CHUNK_BYTES):
                num_bytes += len(chunk)
                if bytes_left is not None and num_bytes > bytes_left:
                    raise _api_error(storage_quota_error(store.quota.bytes - bytes_left, store.quota.bytes))
                if num_bytes > store.max_file_bytes:
                    raise ApiError(413, f"The file is larger than this server's limit of {store.max_file_bytes} "
                                   "bytes (--batch-max-file-bytes)", param="file", code="file_too_large")
                num_lines += chunk.count(b"\n")
                if num_lines > store.max_requests:
                    raise ApiError(400, f"The file has more than {store.max_requests} lines; a batch holds at "
                                   "most that many requests (--batch-max-requests)", param="file",
                                   code="too_many_requests")
                await asyncio.to_thread(out.write, chunk)  # a slow disk must not stall the event loop
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if num_bytes == 0:
        path.unlink(missing_ok=True)
        raise ApiError(400, "The file is empty", param="file", code="empty_file")
    return path, part.filename or "upload.jsonl", num_bytes


async def list_files(request: web.Request) -> web.Response:
    query = request.query
    limit = _int_query(request, "limit", default=10000, low=1, high=10000)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", param="order", code="invalid_value")
    store = await _store(request)
    rows, has_more = await _io(request, lambda: store.list_files(after=query.get("after"), limit=limit, order=order,
                                                                 purpose=query.get("purpose"), owner=request[OWNER]))
    return _json(_page([file_object(row) for row in rows], has_more))


async def retrieve_file(request: web.Request) -> web.Response:
    store = await _store(request)
    return _json(file_object(await _io(request, store.get_file, request.match_info["file_id"], request[OWNER])))


async def file_content(request: web.Request) -> web.StreamResponse:
    store = await _store(request)
    path = await _io(request, store.file_path, request.match_info["file_id"], request[OWNER])
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


async def delete_file(request: web.Request) -> web.Response:
    store = await _store(request)
    file_id = request.match_info["file_id"]
    await _io(request, store.delete_file, file_id, request[OWNER])
    return _json(bp.FileDeleted(id=file_id))


# --------------------------------------------------------------------------- batches
async def create_batch(request: web.Request) -> web.Response:
    body = decode(bp.CREATE_BATCH_DECODER, await request.read())
    if body.endpoint not in KIND_BY_PATH:
        raise ApiError(400, f"endpoint {body.endpoint!r} is not served in batches; use one of "
                       f"{', '.join(KIND_BY_PATH)}", param="endpoint", code="invalid_value")
    window_s = bp.COMPLETION_WINDOWS_S.get(body.completion_window)
    if window_s is None:
        raise ApiError(400, f"completion_window {body.completion_window!r} is not supported; use "
                       f"{', '.join(map(repr, bp.COMPLETION_WINDOWS_S))}", param="completion_window",
                       code="invalid_value")
    store = await _store(request)
    row = await _io(request, lambda: store.create_batch(
        input_file_id=body.input_file_id, endpoint=body.endpoint, completion_window=body.completion_window,
        completion_window_s=window_s, metadata=body.metadata,
        output_expires_after_s=body.output_expires_after.seconds if body.output_expires_after else None,
        owner=request[OWNER]))
    request.app[BATCH_KEY].wake()
    return _json(batch_object(row))


async def list_batches(request: web.Request) -> web.Response:
    limit = _int_query(request, "limit", default=20, low=1, high=100)
    store = await _store(request)
    rows, has_more = await _io(request, lambda: store.list_batches(after=request.query.get("after"), limit=limit,
                                                                   owner=request[OWNER]))
    return _json(_page([batch_object(row) for row in rows], has_more))


async def retrieve_batch(request: web.Request) -> web.Response:
    store = await _store(request)
    return _json(batch_object(await _io(request, store.get_batch, request.match_info["batch_id"], request[OWNER])))


async def cancel_batch(request: web.Request) -> web.Response:
    store = await _store(request)
    row = await _io(request, store.request_cancel, request.match_info["batch_id"], request[OWNER])
    if row.status == "cancelling":
        request.app[BATCH_KEY].cancel(row.id)
    return _json(batch_object(row))


# --------------------------------------------------------------------------- shapes and parsing
def file_object(row: FileRow) -> bp.FileObject:
    return bp.FileObject(id=row.id, bytes=row.bytes, created_at=row.created_at, filename=row.filename,
                         purpose=row.purpose, expires_at=row.expires_at)


def batch_object(row: BatchRow) -> bp.Batch:
    errors = None
    if row.errors:
        errors = bp.BatchErrors(data=[bp.BatchError(code=e.get("code"), message=e.get("message"), param=e.get("param"),
                                                    line=e.get("line")) for e in row.errors])
    usage = bp.BatchUsage(input_tokens=row.input_tokens,
                          input_tokens_details=bp.InputTokensDetails(cached_tokens=row.cached_tokens),
                          output_tokens=row.output_tokens, output_tokens_details=bp.OutputTokensDetails(),
                          total_tokens=row.input_tokens + row.output_tokens)
    return bp.Batch(
        id=row.id, endpoint=row.endpoint, model=row.model, errors=errors, input_file_id=row.input_file_id,
        completion_window=row.completion_window, status=row.status, output_file_id=row.output_file_id,
        error_file_id=row.error_file_id, created_at=row.created_at, in_progress_at=row.in_progress_at,
        expires_at=row.expires_at, finalizing_at=row.finalizing_at, completed_at=row.completed_at,
        failed_at=row.failed_at, expired_at=row.expired_at, cancelling_at=row.cancelling_at,
        cancelled_at=row.cancelled_at,
        request_counts=bp.RequestCounts(total=row.total, completed=row.completed, failed=row.failed),
        usage=usage, metadata=row.metadata,
    )


def _page(data: list[Any], has_more: bool) -> bp.ObjectList:
    return bp.ObjectList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=has_more)


def _int_query(request: web.Request, name: str, *, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    # ASCII digits only (str.isdigit also takes "²", which int() refuses) and no longer than `high`,
    # so int() never meets a 5,000-digit number
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(high))) or not low <= int(text) <= high:
        raise ApiError(400, f"{name} must be an integer in [{low}, {high}]", param=name, code="invalid_value")
    return int(text)
