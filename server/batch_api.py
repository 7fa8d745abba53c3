"""OpenAI's Batch API: /v1/files and /v1/batches over a BatchStore, run by a BatchRunner.

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files   GET /v1/files/{id}
    GET /v1/files/{id}/content                        DELETE /v1/files/{id}
    POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

The store lives in `batch_dir` (the CLI defaults it under the cache dir, so batches survive a
restart and resume); without one it is a temporary directory removed at exit. It is opened at
start when configured (unfinished batches resume at once), else on the first Batch API call.
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
from server.batch_runner import BatchRunner
from server.batch_store import BatchRow, BatchStore, FileRow, StoreBusy, StoreError
from server.config import ServerConfig
from server.endpoints import KIND_BY_PATH
from server.errors import ApiError
from server.registry import REGISTRY_KEY, ModelRegistry

_CHUNK_BYTES = 1 << 16
_MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose)
_IGNORED_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")  # files here live until deleted


class BatchService:
    """The store (opened once) and its runner, for one app."""

    def __init__(self, config: ServerConfig, registry: ModelRegistry) -> None:
        self.config = config
        self.registry = registry
        self._store: BatchStore | None = None
        self._runner: BatchRunner | None = None
        self._temp_dir: Path | None = None
        self._opening = asyncio.Lock()

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

    async def store(self) -> BatchStore:
        if self._store is None:
            async with self._opening:
                if self._store is None:
                    await self._open()
        assert self._store is not None
        return self._store

    async def _open(self) -> None:
        root = self.config.batch_dir
        if root is None:
            self._temp_dir = root = Path(tempfile.mkdtemp(prefix="llamaserve-batches-"))
        try:
            store = await asyncio.to_thread(BatchStore, root, max_file_bytes=self.config.batch_max_file_bytes,
                                            max_requests=self.config.batch_max_requests)
        except StoreBusy as exc:
            raise ApiError(503, str(exc), code="batch_storage_busy") from None
        self._store = store
        self._runner = BatchRunner(store, self.registry, max_in_flight=self.max_in_flight)
        self._runner.start()

    @property
    def runner(self) -> BatchRunner:
        assert self._runner is not None
        return self._runner

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.stop()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


BATCH_KEY = web.AppKey("batch_service", BatchService)


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
    service = BatchService(app[CONFIG_KEY], app[REGISTRY_KEY])
    app[BATCH_KEY] = service
    if service.config.batch_dir is not None:
        try:
            await service.store()  # resume what a previous run left unfinished
        except ApiError as exc:
            structlog.get_logger("llamaserve.batch").warning("batch API unavailable", error=exc.message)
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
        raise ApiError(exc.status, str(exc), param=exc.param, code=exc.code) from None


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=bp.ENCODER.encode(obj), status=status, content_type="application/json")


# --------------------------------------------------------------------------- files
async def create_file(request: web.Request) -> web.Response:
    store = await _store(request)
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "upload a file as multipart/form-data with fields 'file' and 'purpose'",
                       code="invalid_request")
    purpose: str | None = None
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
                    upload = await _receive_file(part, store)
                elif part.name == "purpose":
                    purpose = (await _small_field(part)).decode("utf-8", "replace").strip()
                elif part.name in _IGNORED_FIELDS:
                    await _small_field(part)
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
        path, filename, num_bytes = upload
        row = await store.io(lambda: store.add_file(path, filename=filename, purpose="batch", num_bytes=num_bytes))
        upload = None
        return _json(file_object(row))
    finally:
        if upload is not None:
            upload[0].unlink(missing_ok=True)


async def _small_field(part: BodyPartReader) -> bytes:
    data = b""
    while chunk := await part.read_chunk(_MAX_FIELD_BYTES):
        data += chunk
        if len(data) > _MAX_FIELD_BYTES:
            raise ApiError(400, f"form field {part.name!r} is longer than {_MAX_FIELD_BYTES} bytes", param=part.name,
                           code="invalid_value")
    return data


async def _receive_file(part: BodyPartReader, store: BatchStore) -> tuple[Path, str, int]:
    """Stream the file part to a temporary file, enforcing the size and request-count limits."""
    path = store.upload_path()
    num_bytes = num_lines = 0
    try:
        with open(path, "wb") as out:
            while chunk := await part.read_chunk(_CHUNK_BYTES):
                num_bytes += len(chunk)
                if num_bytes > store.max_file_bytes:
                    raise ApiError(413, f"The file is larger than this server's limit of {store.max_file_bytes} "
                                   "bytes (--batch-max-file-bytes)", param="file", code="file_too_large")
                num_lines += chunk.count(b"\n")
                if num_lines > store.max_requests:
                    raise ApiError(400, f"The file has more than {store.max_requests} lines; a batch holds at "
                                   "most that many requests (--batch-max-requests)", param="file",
                                   code="too_many_requests")
                out.write(chunk)
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
                                                                 purpose=query.get("purpose")))
    return _json(_page([file_object(row) for row in rows], has_more))


async def retrieve_file(request: web.Request) -> web.Response:
    store = await _store(request)
    return _json(file_object(await _io(request, store.get_file, request.match_info["file_id"])))


async def file_content(request: web.Request) -> web.StreamResponse:
    store = await _store(request)
    path = await _io(request, store.file_path, request.match_info["file_id"])
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


async def delete_file(request: web.Request) -> web.Response:
    store = await _store(request)
    file_id = request.match_info["file_id"]
    await _io(request, store.delete_file, file_id)
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
        completion_window_s=window_s, metadata=body.metadata))
    request.app[BATCH_KEY].runner.wake()
    return _json(batch_object(row))


async def list_batches(request: web.Request) -> web.Response:
    limit = _int_query(request, "limit", default=20, low=1, high=100)
    store = await _store(request)
    rows, has_more = await _io(request, lambda: store.list_batches(after=request.query.get("after"), limit=limit))
    return _json(_page([batch_object(row) for row in rows], has_more))


async def retrieve_batch(request: web.Request) -> web.Response:
    store = await _store(request)
    return _json(batch_object(await _io(request, store.get_batch, request.match_info["batch_id"])))


async def cancel_batch(request: web.Request) -> web.Response:
    store = await _store(request)
    row = await _io(request, store.request_cancel, request.match_info["batch_id"])
    if row.status == "cancelling":
        request.app[BATCH_KEY].runner.cancel(row.id)
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
    if not text.isdigit() or not low <= int(text) <= high:
        raise ApiError(400, f"{name} must be an integer in [{low}, {high}]", param=name, code="invalid_value")
    return int(text)
