"""Stored Responses (OpenAI's `store: true`): one SQLite table beside the Batch API's database.

    <batch dir>/responses.sqlite3   one row per response: its owner, status, the Response object
                                    and its input items (JSON, as the API returns them)

Private to the server's user as the batch store is (its helpers: dir 0700, database 0600). Each
owner (API key name, server/auth.py) sees only its own responses; another owner's id reads as
absent. Bounded per owner in count (`max_stored`) and bytes (`max_bytes`): storing past either
deletes that owner's oldest responses, so a client that never deletes cannot fill the disk; a
response older than `retention_s` reads as absent and is deleted at the next write. 0 lifts a bound.

A response still running (background) when the server stopped is marked failed when the store
opens again: nothing resumes it. Synchronous; the server runs every call on the store's own thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from server.batch_store import Transaction, connect_private, make_private_dir

T = TypeVar("T")
DB_NAME = "responses.sqlite3"
UNFINISHED_STATUSES = ("queued", "in_progress")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, status TEXT NOT NULL,
    bytes INTEGER NOT NULL, response BLOB NOT NULL, input_items BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_owner ON responses (owner, created_at);
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    status: str
    response: bytes  # the Response object's JSON
    input_items: bytes  # a JSON list of the input items


class ResponseStore:
    def __init__(self, root: Path, *, max_stored: int, max_bytes: int, retention_s: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root).expanduser()
        make_private_dir(self.root)
        self.max_stored = max_stored
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._clock = clock
        self._db = connect_private(self.root / DB_NAME, _SCHEMA)
        try:
            # Commits without an fsync each (WAL: a crash of the process loses nothing, a power cut the
            # last moments): a Responses request stores before its stream ends, and a sync per request
            # would cost every stream that wait. Batch results keep FULL: they are a job's only output.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._fail_unfinished()
        except BaseException:
            self._db.close()
            raise
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")

    async def io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call on the store's own thread: the event loop never waits on disk."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._db.close()

    def _oldest_kept_s(self) -> int:
        return int(self._clock()) - self.retention_s if self.retention_s else -1

    def put(self, owner: str, response_id: str, *, created_at: int, status: str, response: bytes,
            input_items: bytes) -> None:
        """Store (or replace) a response, then keep the owner within its bounds, oldest out first."""
        with Transaction(self._db) as db:
            db.execute("INSERT OR REPLACE INTO responses (id, owner, created_at, status, bytes, response, input_items) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (response_id, owner, created_at, status, len(response) + len(input_items), response,
                        input_items))
            if self.retention_s:
                db.execute("DELETE FROM responses WHERE created_at <= ?", (self._oldest_kept_s(),))
            rows = db.execute("SELECT id, bytes FROM responses WHERE owner = ? AND id != ? "
                              "ORDER BY created_at DESC, rowid DESC", (owner, response_id)).fetchall()
            count, total = 1, len(response) + len(input_items)
            evict = []
            for row in rows:
                count += 1
                total += row["bytes"]
                if (self.max_stored and count > self.max_stored) or (self.max_bytes and total > self.max_bytes):
                    evict.append((row["id"],))
            db.executemany("DELETE FROM responses WHERE id = ?", evict)

    def update(self, response_id: str, *, status: str, response: bytes) -> bool:
        """A running response's new state; False when it was deleted meanwhile."""
        with Transaction(self._db) as db:
            cursor = db.execute("UPDATE responses SET status = ?, response = ?, "
                                "bytes = length(input_items) + ? WHERE id = ?",
                                (status, response, len(response), response_id))
            return cursor.rowcount > 0

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        row = self._db.execute("SELECT id, status, response, input_items FROM responses "
                               "WHERE id = ? AND owner = ? AND created_at > ?",
                               (response_id, owner, self._oldest_kept_s())).fetchone()
        if row is None:
            return None
        return StoredResponse(row["id"], row["status"], bytes(row["response"]), bytes(row["input_items"]))

    def delete(self, response_id: str, owner: str) -> bool:
        with Transaction(self._db) as db:
            return db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).rowcount > 0

    def _fail_unfinished(self) -> None:
        """Background responses a stopped server left running: failed, saying why."""
        rows = self._db.execute(f"SELECT id, response FROM responses WHERE status IN {UNFINISHED_STATUSES}").fetchall()
        with Transaction(self._db) as db:
            for row in rows:
                response = json.loads(row["response"])
                response["status"] = "failed"
                response["error"] = {"code": "server_error", "message": "the server stopped before this response finished"}
                db.execute("UPDATE responses SET status = 'failed', response = ? WHERE id = ?",
                           (json.dumps(response).encode(), row["id"]))
