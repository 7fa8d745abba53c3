"""Durable storage of the Batch API: one SQLite database plus a directory of file bodies.

    <root>/batches.sqlite3   files, batches and batch items (WAL journal)
    <root>/files/<file id>   uploaded inputs and materialized outputs, written to a temporary name,
                             fsynced and renamed, so a crash never leaves half a file under an id
    <root>/.lock             held (flock) by the one server process that owns this root

Private to the server's user whatever its umask: dirs 0700, files 0600 (the database's WAL and
shared-memory files take its mode); a store left with looser modes is tightened when opened.

Every state change is one transaction. An item's result is committed as a row the moment it
finishes (`finish_item` only moves a pending item, so an item is recorded exactly once even if a
restart runs it again), and the output and error files are written from those rows only when the
batch finalizes, in the transaction that deletes the rows: a result is stored once, as a row
while its batch runs and in a file after. A server killed mid-batch restarts with every finished
result kept and nothing duplicated or cut off. Results are never held in memory.

Retention: a file expires at its `expires_at` (the client's `expires_after`, at most `retention_s`;
by default `retention_s` after its creation) and reads as absent from then on; a finished batch is
kept `retention_s` after it finished. `purge()` deletes both (rows and bodies); the input file of an
unfinished batch stays until the batch finishes. `retention_s` 0 keeps everything until deleted.

Owners: every file and batch belongs to the API key name that created it (server/auth.py); a
call that names an owner finds only that owner's objects (another owner's read as absent). The
runner, which works for every owner, names none.

Quotas (per owner; 0: none): files kept, their bytes, batches kept. An upload or a batch beyond
one is refused with 429 `insufficient_quota`, as OpenAI answers a spent quota; a batch's output
and error files are never refused (its results would be lost): they count, and may go past it.

Schema changes are numbered migrations (PRAGMA user_version): a store written by an older version
is brought up to date when it is opened.

Synchronous and single-threaded by design: the server runs every call on one dedicated thread
(`BatchStore.io`), tests call it directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import json
import os
import secrets
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Literal, TypeVar

from server.auth import DEFAULT_OWNER

T = TypeVar("T")

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
# The runner's order of work: a cancel or a finalize first (they are quick), then oldest first.
_WORK_ORDER = "CASE status WHEN 'cancelling' THEN 0 WHEN 'finalizing' THEN 1 ELSE 2 END, created_at, rowid"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, bytes INTEGER NOT NULL, filename TEXT NOT NULL,
    purpose TEXT NOT NULL, expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, metadata TEXT, model TEXT,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, errors TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
-- state: pending (to run), done (result written; ok says which file it goes to), cancelled.
CREATE TABLE IF NOT EXISTS items (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, body BLOB, state TEXT NOT NULL,
    ok INTEGER, result BLOB, PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""
_UNFINISHED = "('validating', 'in_progress', 'finalizing', 'cancelling')"
_FINISHED = "('completed', 'failed', 'expired', 'cancelled')"
_FINISHED_AT = "COALESCE(completed_at, failed_at, expired_at, cancelled_at)"
DEFAULT_RETENTION_S = 30 * 24 * 3600  # OpenAI's default for batch files


class StoreError(Exception):
    """A request the store refuses; the API renders status, code, param and type as an OpenAI error."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.error_type = error_type


class StoreBusy(Exception):
    """Another process owns this storage root."""


@dataclass(frozen=True, slots=True)
class FileRow:
    id: str
    created_at: int
    bytes: int
    filename: str
    purpose: str
    expires_at: int | None
    owner: str = DEFAULT_OWNER


@dataclass(frozen=True, slots=True)
class BatchRow:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int | None
    metadata: dict[str, str] | None
    model: str | None
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    output_file_id: str | None
    error_file_id: str | None
    errors: list[dict[str, Any]] | None  # [{code, message, line, param}] of a batch that failed as a whole
    total: int
    completed: int
    failed: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    output_expires_after_s: int | None  # the client's output_expires_after; None: the store's retention
    owner: str


@dataclass(frozen=True, slots=True)
class Quota:
    """What one owner may keep; 0: no limit."""

    files: int = 0
    bytes: int = 0
    batches: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    files: int
    bytes: int
    batches: int


@dataclass(frozen=True, slots=True)
class PurgeCounts:
    files: int
    batches: int


@dataclass(frozen=True, slots=True)
class CheckedLine:
    """One input line after validation: a body to run, or the error line that stands for it."""

    custom_id: str | None
    body: bytes | None = None  # the request body to run
    error_result: bytes | None = None  # the error file's line for it (JSON, no newline)
    model: str | None = None


@dataclass(frozen=True, slots=True)
class PendingItem:
    line: int
    custom_id: str
    body: bytes


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class BatchStore:
    def __init__(self, root: Path, *, max_file_bytes: int, max_requests: int,
                 retention_s: int = DEFAULT_RETENTION_S, quota: Quota = Quota(),
                 clock: Callable[[], float] = time.time) -> None:
        """Open (creating if needed) the store under `root`. Raises StoreBusy, OSError or
        sqlite3.Error; a store that fails to open holds nothing (no lock, no connection).
        `clock` gives the time in seconds since the epoch (tests move it)."""
        self.root = Path(root).expanduser()
        self.files_dir = self.root / "files"
        for directory in (self.root, self.files_dir):
            make_private_dir(directory)
        self.max_file_bytes = max_file_bytes
        self.max_requests = max_requests
        self.retention_s = retention_s
        self.quota = quota
        self._clock = clock
        self._lock_file = open_private(self.root / ".lock", "a+b")  # held for the store's life
        with contextlib.ExitStack() as on_failure:  # else a retry in this process finds its own lock: "busy"
            on_failure.callback(self._lock_file.close)
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreBusy(f"batch storage {self.root} is in use by another server process") from None
            _make_private(self.root / ".lock", _FILE_MODE)
            self._db = _connect(self.root / "batches.sqlite3")
            on_failure.callback(self._db.close)
            self._migrate()
            self._remove_orphans()
            on_failure.pop_all()  # opened: both stay until close()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")

    async def io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call on the store's own thread: the event loop never waits on disk."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._db.close()
        self._lock_file.close()

    # ------------------------------------------------------------------ transactions
    def _transaction(self) -> "Transaction":
        return Transaction(self._db)

    def _now_s(self) -> int:
        return int(self._clock())

    def _migrate(self) -> None:
        """Bring a store written by an older version up to date, one numbered step at a time."""
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        for number, step in enumerate(_MIGRATIONS[version:], start=version + 1):
            with self._transaction() as db:
                step(db, now_s=self._now_s(), retention_s=self.retention_s)
                db.execute(f"PRAGMA user_version = {number}")

    def _expiry(self, created_at: int, expires_after_s: int | None) -> int | None:
        """When a file created at `created_at` expires: the client's wish, capped by the retention."""
        wanted = [s for s in (expires_after_s, self.retention_s) if s]
        return created_at + min(wanted) if wanted else None

    def _visible(self, owner: str | None) -> tuple[str, tuple]:
        """The condition (and its arguments) of a file `owner` may see: not expired, and its own
        (any owner's when None)."""
        live = "(expires_at IS NULL OR expires_at > ?)"
        if owner is None:
            return live, (self._now_s(),)
        return f"{live} AND owner = ?", (self._now_s(), owner)

    def _remove_orphans(self) -> None:
        """Temporary files of a write that was cut off, and bodies whose row never committed; the
        rest made private (a previous version left them 0644)."""
        known = {row["id"] for row in self._db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.is_dir():
                continue  # a folder is not ours to remove, nor a reason to fail
            if path.name in known:
                _make_private(path, _FILE_MODE)
            else:
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ files
    def upload_path(self) -> Path:
        """A fresh temporary path in the files dir for an upload in progress."""
        return self.files_dir / f".upload-{secrets.token_hex(8)}.tmp"

    def add_file(self, temp_path: Path, *, filename: str, purpose: str, num_bytes: int,
                 expires_after_s: int | None = None, owner: str = DEFAULT_OWNER) -> FileRow:
        """Move a fully written temporary file under a new id and record it as `owner`'s; it expires
        `expires_after_s` from now (at most the retention)."""
        _make_private(temp_path, _FILE_MODE)  # whoever wrote it
        _fsync(temp_path)
        now_s = self._now_s()
        row = FileRow(new_id("file-"), now_s, num_bytes, filename, purpose, self._expiry(now_s, expires_after_s),
                      owner)
        os.replace(temp_path, self.files_dir / row.id)
        try:
            _fsync_dir(self.files_dir)
            with self._transaction() as db:
                self.check_file_quota(owner, num_bytes)  # in the transaction: concurrent uploads cannot both fit
                _insert_file(db, row)
        except BaseException:
            (self.files_dir / row.id).unlink(missing_ok=True)  # no row, no body: a full disk gets its space back
            raise
        return row

    # ------------------------------------------------------------------ quotas
    def usage(self, owner: str) -> Usage:
        visible, args = self._visible(owner)
        files, num_bytes = self._db.execute(f"SELECT count(*), coalesce(sum(bytes), 0) FROM files WHERE {visible}",
                                            args).fetchone()
        batches = self._db.execute("SELECT count(*) FROM batches WHERE owner = ?", (owner,)).fetchone()[0]
        return Usage(files, num_bytes, batches)

    def check_file_quota(self, owner: str, num_bytes: int) -> None:
        """Raise the 429 an upload of `num_bytes` more by `owner` gets, if it does not fit."""
        used, quota = self.usage(owner), self.quota
        if quota.files and used.files + 1 > quota.files:
            raise _quota_error("file_quota_exceeded", f"This API key keeps {used.files} files, its limit "
                               f"(--batch-quota-files). {_FREE_FILES}")
        if quota.bytes and used.bytes + num_bytes > quota.bytes:
            raise storage_quota_error(used.bytes, quota.bytes)

    def upload_room(self, owner: str) -> int | None:
        """The bytes `owner` may still upload in one file (None: no limit); the 429 if no file fits."""
        self.check_file_quota(owner, 0)
        return max(0, self.quota.bytes - self.usage(owner).bytes) if self.quota.bytes else None

    def get_file(self, file_id: str, owner: str | None = None) -> FileRow:
        """The file, unless it is unknown, expired or another owner's (then it is absent, as after a delete)."""
        visible, args = self._visible(owner)
        row = self._db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ? AND {visible}",
                               (file_id, *args)).fetchone()
        if row is None:
            raise StoreError(404, f"No such File object: {file_id}", code="file_not_found", param="file_id")
        return FileRow(**dict(row))

    def file_path(self, file_id: str, owner: str | None = None) -> Path:
        self.get_file(file_id, owner)
        return self.files_dir / file_id

    def list_files(self, *, after: str | None, limit: int, order: str, purpose: str | None,
                   owner: str | None = None) -> tuple[list[FileRow], bool]:
        visible, args = self._visible(owner)
        rows = self._page("files", after=after, limit=limit, descending=order == "desc",
                          where=f"{visible} AND purpose = ?" if purpose else visible,
                          args=(*args, purpose) if purpose else args)
        return [FileRow(**dict(row)) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str | None = None) -> None:
        self.get_file(file_id, owner)
        with self._transaction() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        (self.files_dir / file_id).unlink(missing_ok=True)

    def _page(self, table: str, *, after: str | None, limit: int, descending: bool, where: str | None = None,
              args: tuple = ()) -> list[sqlite3.Row]:
        """limit + 1 rows matching `where` after the cursor `after` (an id of a row matching it too),
        ordered by creation (rowid breaks ties)."""
        conditions, params = [where] if where else [], list(args)
        op = "<" if descending else ">"
        if after is not None:
            cursor = self._db.execute(f"SELECT rowid FROM {table} WHERE id = ?{f' AND {where}' if where else ''}",
                                      (after, *args)).fetchone()
            if cursor is None:
                raise StoreError(400, f"after: no object with id {after!r}", code="invalid_value", param="after")
            conditions.append(f"rowid {op} ?")
            params.append(cursor[0])
        sql = f"SELECT {_FILE_COLUMNS if table == 'files' else _BATCH_COLUMNS} FROM {table}"
        if conditions:
            sql += " WHERE " + " AND ".join(conditions)
        sql += f" ORDER BY rowid {'DESC' if descending else 'ASC'} LIMIT ?"
        return self._db.execute(sql, (*params, limit + 1)).fetchall()

    # ------------------------------------------------------------------ batches
    def create_batch(self, *, input_file_id: str, endpoint: str, completion_window_s: int, completion_window: str,
                     metadata: dict[str, str] | None, output_expires_after_s: int | None = None,
                     owner: str = DEFAULT_OWNER) -> BatchRow:
        """A batch of `owner`'s, over one of its files."""
        file = self.get_file(input_file_id, owner)
        if file.purpose != "batch":
            raise StoreError(400, f"File {input_file_id} has purpose '{file.purpose}'; a batch needs purpose 'batch'",
                             code="invalid_value", param="input_file_id")
        batch_id, now_s = new_id("batch_"), self._now_s()
        with self._transaction() as db:
            kept = self.usage(owner).batches
            if self.quota.batches and kept + 1 > self.quota.batches:
                raise _quota_error("batch_quota_exceeded", f"This API key keeps {kept} batches, its limit "
                                   f"(--batch-quota-batches); finished batches are purged {self.retention_s} s "
                                   "after they finish.")
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, "
                       "expires_at, metadata, output_expires_after_s, owner) "
                       "VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, ?, ?)",
                       (batch_id, endpoint, input_file_id, completion_window, now_s, now_s + completion_window_s,
                        json.dumps(metadata) if metadata is not None else None, output_expires_after_s, owner))
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str, owner: str | None = None) -> BatchRow:
        """The batch, unless it is unknown or another owner's (any owner's when None)."""
        where, args = ("", ()) if owner is None else (" AND owner = ?", (owner,))
        row = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?{where}",
                               (batch_id, *args)).fetchone()
        if row is None:
            raise StoreError(404, f"No batch found with id '{batch_id}'", code="batch_not_found", param="batch_id")
        return _batch_row(row)

    def list_batches(self, *, after: str | None, limit: int, owner: str | None = None) -> tuple[list[BatchRow], bool]:
        where, args = (None, ()) if owner is None else ("owner = ?", (owner,))
        rows = self._page("batches", after=after, limit=limit, descending=True,  # newest first, as OpenAI lists them
                          where=where, args=args)
        return [_batch_row(row) for row in rows[:limit]], len(rows) > limit

    def next_batch(self) -> BatchRow | None:
        """The batch the runner should work on next, or None when every batch is finished."""
        row = self._db.execute(
            f"SELECT {_BATCH_COLUMNS} FROM batches WHERE status IN {_UNFINISHED} ORDER BY {_WORK_ORDER} LIMIT 1").fetchone()
        return None if row is None else _batch_row(row)

    def request_cancel(self, batch_id: str, owner: str | None = None) -> BatchRow:
        batch = self.get_batch(batch_id, owner)
        if batch.status in TERMINAL_STATUSES or batch.status == "cancelling":
            return batch  # OpenAI answers a cancel of a finished batch with the batch as it is
        if batch.status == "finalizing":
            raise StoreError(409, f"Batch {batch_id} is finalizing and can no longer be cancelled",
                             code="batch_not_cancellable", param="batch_id")
        with self._transaction() as db:
            db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                       (self._now_s(), batch_id))
        return self.get_batch(batch_id)

    def fail_batch(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        """The input cannot be run at all (missing file, too many lines): the batch fails as a whole."""
        with self._transaction() as db:
            db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?",
                       (self._now_s(), json.dumps(errors), batch_id))
            db.execute("DELETE FROM items WHERE batch_id = ?", (batch_id,))  # a failed batch has no result files

    def start_items(self, batch_id: str, lines: Iterable[tuple[int, CheckedLine]]) -> None:
        """Record every input line (validated) and move the batch to in_progress, in one transaction:
        a crash during validation leaves the batch validating, with no items."""
        now_s = self._now_s()
        total = failed = 0
        model = None
        with self._transaction() as db:
            db.execute("DELETE FROM items WHERE batch_id = ?", (batch_id,))
            for line, checked in lines:
                total += 1
                if total > self.max_requests:
                    raise StoreError(400, f"the input file has more than {self.max_requests} requests",
                                     code="too_many_requests", param="input_file_id")
                if checked.error_result is not None:
                    failed += 1
                    db.execute("INSERT INTO items VALUES (?, ?, ?, NULL, 'done', 0, ?)",
                               (batch_id, line, checked.custom_id, checked.error_result))
                else:
                    model = model or checked.model
                    db.execute("INSERT INTO items VALUES (?, ?, ?, ?, 'pending', NULL, NULL)",
                               (batch_id, line, checked.custom_id, checked.body))
            if total == 0:
                raise StoreError(400, "the input file has no requests", code="empty_file", param="input_file_id")
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ?, failed = ?, "
                       "model = ? WHERE id = ? AND status = 'validating'", (now_s, total, failed, model, batch_id))

    def pending_items(self, batch_id: str, *, after_line: int, limit: int) -> list[PendingItem]:
        rows = self._db.execute(
            "SELECT line, custom_id, body FROM items WHERE batch_id = ? AND state = 'pending' AND line > ? "
            "ORDER BY line LIMIT ?", (batch_id, after_line, limit)).fetchall()
        return [PendingItem(row["line"], row["custom_id"], bytes(row["body"])) for row in rows]

    def finish_item(self, batch_id: str, line: int, *, ok: bool, result: bytes, input_tokens: int = 0,
                    cached_tokens: int = 0, output_tokens: int = 0) -> bool:
        """Commit one item's result line; False (nothing written) if it was not pending any more."""
        counter = "completed" if ok else "failed"
        with self._transaction() as db:
            moved = db.execute("UPDATE items SET state = 'done', ok = ?, result = ?, body = NULL "
                               "WHERE batch_id = ? AND line = ? AND state = 'pending'",
                               (int(ok), result, batch_id, line)).rowcount
            if moved:
                db.execute(f"UPDATE batches SET {counter} = {counter} + 1, input_tokens = input_tokens + ?, "
                           "cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                           (input_tokens, cached_tokens, output_tokens, batch_id))
        return bool(moved)

    def num_pending(self, batch_id: str) -> int:
        return self._db.execute("SELECT count(*) FROM items WHERE batch_id = ? AND state = 'pending'",
                                (batch_id,)).fetchone()[0]

    def cancel_pending(self, batch_id: str) -> int:
        with self._transaction() as db:
            return db.execute("UPDATE items SET state = 'cancelled', body = NULL WHERE batch_id = ? AND state = 'pending'",
                              (batch_id,)).rowcount

    def expire_pending(self, batch_id: str, error_result: Callable[[int, str | None], bytes]) -> None:
        """Pending items of an expired batch go to the error file (OpenAI's `batch_expired` lines)."""
        with self._transaction() as db:
            rows = db.execute("SELECT line, custom_id FROM items WHERE batch_id = ? AND state = 'pending'",
                              (batch_id,)).fetchall()
            for row in rows:
                db.execute("UPDATE items SET state = 'done', ok = 0, result = ?, body = NULL "
                           "WHERE batch_id = ? AND line = ?", (error_result(row["line"], row["custom_id"]), batch_id,
                                                              row["line"]))
            db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(rows), batch_id))

    def set_finalizing(self, batch_id: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? AND status = 'in_progress'",
                       (self._now_s(), batch_id))

    def finalize(self, batch_id: str, final_status: Literal["completed", "cancelled", "expired"]) -> BatchRow:
        """Write the output and error files from the result rows (in line order, so custom_ids come
        in input order), then record them and the final status in one transaction."""
        batch = self.get_batch(batch_id)
        file_ids: dict[int, FileRow | None] = {}
        for ok in (1, 0):
            file_ids[ok] = self._materialize(batch, ok, "batch_output", f"{batch_id}_{'output' if ok else 'error'}.jsonl")
        column = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[final_status]
        with self._transaction() as db:
            for file_row in filter(None, file_ids.values()):
                _insert_file(db, file_row)
            db.execute(f"UPDATE batches SET status = ?, {column} = ?, output_file_id = ?, error_file_id = ? "
                       "WHERE id = ?", (final_status, self._now_s(), _id(file_ids[1]), _id(file_ids[0]), batch_id))
            db.execute("DELETE FROM items WHERE batch_id = ?", (batch_id,))  # the files hold the results now
        return self.get_batch(batch_id)

    def _materialize(self, batch: BatchRow, ok: int, purpose: str, filename: str) -> FileRow | None:
        batch_id = batch.id
        rows = self._db.execute("SELECT result FROM items WHERE batch_id = ? AND state = 'done' AND ok = ? "
                                "ORDER BY line", (batch_id, ok))
        temp = self.files_dir / f".{batch_id}-{ok}.tmp"
        num_lines = num_bytes = 0
        with open_private(temp, "wb") as out:
            for row in rows:
                data = bytes(row["result"]) + b"\n"
                out.write(data)
                num_lines += 1
                num_bytes += len(data)
        if num_lines == 0:
            temp.unlink()
            return None
        _fsync(temp)
        now_s = self._now_s()
        row = FileRow(new_id("file-"), now_s, num_bytes, filename, purpose,
                      self._expiry(now_s, batch.output_expires_after_s), batch.owner)
        os.replace(temp, self.files_dir / row.id)  # an orphan until the transaction below commits
        _fsync_dir(self.files_dir)
        return row

    def results(self, batch_id: str) -> Iterator[tuple[int, bool, bytes]]:
        """(line, ok, result) of every finished item, in line order (tests and diagnostics)."""
        for row in self._db.execute("SELECT line, ok, result FROM items WHERE batch_id = ? AND state = 'done' "
                                    "ORDER BY line", (batch_id,)):
            yield row["line"], bool(row["ok"]), bytes(row["result"])

    # ------------------------------------------------------------------ retention
    def purge(self) -> PurgeCounts:
        """Delete expired files (rows, then bodies) but the input of an unfinished batch, and finished
        batches older than the retention."""
        now_s = self._now_s()
        with self._transaction() as db:
            expired = [row["id"] for row in db.execute(
                f"SELECT id FROM files WHERE expires_at <= ? AND id NOT IN "
                f"(SELECT input_file_id FROM batches WHERE status IN {_UNFINISHED})", (now_s,))]
            db.executemany("DELETE FROM files WHERE id = ?", [(file_id,) for file_id in expired])
            batches = 0
            if self.retention_s:
                batches = db.execute(f"DELETE FROM batches WHERE status IN {_FINISHED} AND {_FINISHED_AT} <= ?",
                                     (now_s - self.retention_s,)).rowcount
        for file_id in expired:
            (self.files_dir / file_id).unlink(missing_ok=True)  # a crash before this: an orphan, removed at open
        return PurgeCounts(files=len(expired), batches=batches)


_FREE_FILES = "Delete files (DELETE /v1/files/{file_id}) or wait until they expire."


def _quota_error(code: str, message: str, param: str | None = None) -> StoreError:
    return StoreError(429, message, code=code, param=param, error_type="insufficient_quota")


def storage_quota_error(used_bytes: int, quota_bytes: int) -> StoreError:
    """The 429 of an upload that would take its owner past `quota_bytes` (the store's check, and the
    upload handler's while the file streams in)."""
    return _quota_error("storage_quota_exceeded", f"This API key keeps {used_bytes} bytes of files; this file would "
                        f"pass its limit of {quota_bytes} (--batch-quota-bytes). {_FREE_FILES}", "file")


# --------------------------------------------------------------------------- schema migrations
def _v1_retention(db: sqlite3.Connection, *, now_s: int, retention_s: int) -> None:
    """Retention and results stored once: batches remember the output expiry their client asked
    for; finished batches' result rows go (their files hold the results); files from before
    retention are kept one retention period from now."""
    db.execute("ALTER TABLE batches ADD COLUMN output_expires_after_s INTEGER")
    db.execute(f"DELETE FROM items WHERE batch_id IN (SELECT id FROM batches WHERE status IN {_FINISHED})")
    if retention_s:
        db.execute("UPDATE files SET expires_at = ? WHERE expires_at IS NULL", (now_s + retention_s,))


def _v2_owners(db: sqlite3.Connection, **_: int) -> None:
    """Owners: what was stored before belongs to the --api-key (or the keyless server's clients)."""
    for table in ("files", "batches"):
        db.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT '{DEFAULT_OWNER}'")
        db.execute(f"CREATE INDEX {table}_by_owner ON {table} (owner)")


_MIGRATIONS: tuple[Callable[..., None], ...] = (_v1_retention, _v2_owners)
_FILE_COLUMNS = ", ".join(FileRow.__dataclass_fields__)
_BATCH_COLUMNS = ", ".join(BatchRow.__dataclass_fields__)


def _insert_file(db: sqlite3.Connection, row: FileRow) -> None:
    db.execute(f"INSERT INTO files ({_FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)", _file_values(row))


_DIR_MODE, _FILE_MODE = 0o700, 0o600


def open_private(path: Path, mode: str) -> BinaryIO:
    """open(path, mode) for bytes, creating the file 0600 whatever the umask."""
    flags = os.O_CREAT | (os.O_RDWR | os.O_APPEND if mode.startswith("a") else os.O_WRONLY | os.O_TRUNC)
    return os.fdopen(os.open(path, flags | os.O_CLOEXEC, _FILE_MODE), mode)


def _make_private(path: Path, mode: int) -> None:
    if stat.S_IMODE(path.stat().st_mode) != mode:
        os.chmod(path, mode)


def make_private_dir(path: Path) -> None:
    """mkdir -p, then 0700 whatever the umask (a looser existing dir is tightened)."""
    path.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    _make_private(path, _DIR_MODE)


def _connect(path: Path) -> sqlite3.Connection:
    return connect_private(path, _SCHEMA)


def connect_private(path: Path, schema: str) -> sqlite3.Connection:
    """A SQLite database private to the server's user (0600, its WAL files too), in WAL mode with
    full syncs, `schema` applied; autocommit (use Transaction for each change)."""
    open_private(path, "a+b").close()  # SQLite gives its -wal and -shm files the database's mode
    for existing in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if existing.exists():
            _make_private(existing, _FILE_MODE)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a commit survives power loss, not only a crash
        db.executescript(schema)
    except BaseException:
        db.close()
        raise
    return db


class Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK when the block raises."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self._rollback()
            return
        try:
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()  # a COMMIT that failed (disk full) leaves the transaction open: every BEGIN after it would fail
            raise

    def _rollback(self) -> None:
        if self.db.in_transaction:  # SQLite may have rolled back already (some I/O errors do)
            self.db.execute("ROLLBACK")


def _batch_row(row: sqlite3.Row) -> BatchRow:
    values = dict(row)
    values["metadata"] = json.loads(values["metadata"]) if values["metadata"] is not None else None
    values["errors"] = json.loads(values["errors"]) if values["errors"] is not None else None
    return BatchRow(**values)


def _file_values(row: FileRow) -> tuple:
    return tuple(getattr(row, name) for name in FileRow.__dataclass_fields__)


def _id(row: FileRow | None) -> str | None:
    return None if row is None else row.id


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
