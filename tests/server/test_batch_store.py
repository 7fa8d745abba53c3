"""BatchStore on its own: files, batch state transitions, exactly-once item results, materialized
outputs in line order, rollback, reopen after a crash, and one owner per directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.batch_store import BatchStore, CheckedLine, PurgeCounts, StoreBusy, StoreError


def open_store(root: Path, **limits: int) -> BatchStore:
    return BatchStore(root, max_file_bytes=limits.get("max_file_bytes", 1 << 20),
                      max_requests=limits.get("max_requests", 100))


def add_input(store: BatchStore, data: bytes = b"{}\n", purpose: str = "batch"):
    path = store.upload_path()
    path.write_bytes(data)
    return store.add_file(path, filename="in.jsonl", purpose=purpose, num_bytes=len(data))


def new_batch(store: BatchStore, num_items: int = 3, bad_lines: tuple[int, ...] = ()):
    batch = store.create_batch(input_file_id=add_input(store).id, endpoint="/v1/completions", completion_window="24h",
                               completion_window_s=3600, metadata={"k": "v"})
    lines = []
    for line in range(1, num_items + 1):
        if line in bad_lines:
            lines.append((line, CheckedLine(f"c{line}", error_result=json.dumps({"bad": line}).encode())))
        else:
            lines.append((line, CheckedLine(f"c{line}", body=b'{"n": %d}' % line, model="m")))
    store.start_items(batch.id, lines)
    return store.get_batch(batch.id)


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "store")
    yield s
    s.close()


def test_files_round_trip(store):
    row = add_input(store, b'{"a": 1}\n')
    assert row.id.startswith("file-") and row.bytes == 9 and row.purpose == "batch"
    assert store.get_file(row.id) == row
    assert store.file_path(row.id).read_bytes() == b'{"a": 1}\n'
    rows, has_more = store.list_files(after=None, limit=10, order="desc", purpose="batch")
    assert rows == [row] and not has_more
    assert store.list_files(after=None, limit=10, order="desc", purpose="batch_output") == ([], False)
    store.delete_file(row.id)
    with pytest.raises(StoreError) as missing:
        store.get_file(row.id)
    assert missing.value.status == 404 and not (store.files_dir / row.id).exists()


def test_items_finish_exactly_once_and_outputs_keep_line_order(store):
    batch = new_batch(store, num_items=4, bad_lines=(2,))
    assert batch.status == "in_progress" and batch.total == 4 and batch.failed == 1 and batch.model == "m"
    pending = store.pending_items(batch.id, after_line=0, limit=10)
    assert [item.line for item in pending] == [1, 3, 4] and pending[0].body == b'{"n": 1}'
    assert [item.line for item in store.pending_items(batch.id, after_line=1, limit=1)] == [3]
    # Finished out of order; a second finish of the same item (a restart re-ran it) writes nothing.
    assert store.finish_item(batch.id, 4, ok=True, result=b'"r4"', input_tokens=5, output_tokens=7)
    assert store.finish_item(batch.id, 1, ok=False, result=b'"e1"')
    assert not store.finish_item(batch.id, 4, ok=True, result=b'"again"', input_tokens=5, output_tokens=7)
    assert store.finish_item(batch.id, 3, ok=True, result=b'"r3"', input_tokens=1, cached_tokens=1, output_tokens=1)
    counted = store.get_batch(batch.id)
    assert (counted.completed, counted.failed, counted.input_tokens, counted.cached_tokens,
            counted.output_tokens) == (2, 2, 6, 1, 8)
    assert store.num_pending(batch.id) == 0
    store.set_finalizing(batch.id)
    assert store.get_batch(batch.id).status == "finalizing" and store.next_batch().id == batch.id
    done = store.finalize(batch.id, "completed")
    assert done.status == "completed" and done.completed_at is not None and store.next_batch() is None
    assert store.file_path(done.output_file_id).read_bytes() == b'"r3"\n"r4"\n'
    assert store.file_path(done.error_file_id).read_bytes() == b'"e1"\n{"bad": 2}\n'
    assert store.get_file(done.output_file_id).purpose == "batch_output"


def test_validation_is_one_transaction(store):
    batch = store.create_batch(input_file_id=add_input(store).id, endpoint="/v1/completions",
                               completion_window="24h", completion_window_s=60, metadata=None)
    too_many = ((line, CheckedLine("c", body=b"{}")) for line in range(1, 102))
    with pytest.raises(StoreError) as refused:
        store.start_items(batch.id, too_many)
    assert refused.value.code == "too_many_requests"
    assert store.get_batch(batch.id).status == "validating" and store.num_pending(batch.id) == 0  # rolled back
    with pytest.raises(StoreError) as empty:
        store.start_items(batch.id, iter(()))
    assert empty.value.code == "empty_file"


def test_cancel_and_expire(store):
    batch = new_batch(store, num_items=3)
    store.finish_item(batch.id, 1, ok=True, result=b'"r1"')
    assert store.request_cancel(batch.id).status == "cancelling"
    assert store.next_batch().status == "cancelling"
    assert store.cancel_pending(batch.id) == 2
    cancelled = store.finalize(batch.id, "cancelled")
    assert cancelled.status == "cancelled" and cancelled.error_file_id is None
    assert store.file_path(cancelled.output_file_id).read_bytes() == b'"r1"\n'
    assert store.request_cancel(batch.id).status == "cancelled"  # a finished batch stays as it is

    other = new_batch(store, num_items=2)
    store.expire_pending(other.id, lambda line, custom_id: json.dumps([line, custom_id]).encode())
    expired = store.finalize(other.id, "expired")
    assert expired.status == "expired" and expired.failed == 2 and expired.expired_at is not None
    assert store.file_path(expired.error_file_id).read_bytes() == b'[1, "c1"]\n[2, "c2"]\n'

    finalizing = new_batch(store, num_items=1)
    store.finish_item(finalizing.id, 1, ok=True, result=b"{}")
    store.set_finalizing(finalizing.id)
    with pytest.raises(StoreError) as late:
        store.request_cancel(finalizing.id)
    assert late.value.status == 409


def test_reopen_keeps_results_and_removes_orphans(tmp_path):
    root = tmp_path / "store"
    store = open_store(root)
    batch = new_batch(store, num_items=2)
    store.finish_item(batch.id, 2, ok=True, result=b'"r2"')
    (store.files_dir / ".upload-cut-off.tmp").write_bytes(b"half")  # an upload the crash cut off
    with pytest.raises(StoreBusy):
        open_store(root)  # one owner per directory
    store.close()

    reopened = open_store(root)
    try:
        assert not (reopened.files_dir / ".upload-cut-off.tmp").exists()
        assert reopened.next_batch().id == batch.id
        assert [item.line for item in reopened.pending_items(batch.id, after_line=0, limit=10)] == [1]
        assert list(reopened.results(batch.id)) == [(2, True, b'"r2"')]
    finally:
        reopened.close()


def test_wrong_purpose_and_paging_cursor(store):
    output = add_input(store, purpose="batch_output")
    with pytest.raises(StoreError) as refused:
        store.create_batch(input_file_id=output.id, endpoint="/v1/completions", completion_window="24h",
                           completion_window_s=60, metadata=None)
    assert refused.value.param == "input_file_id"
    with pytest.raises(StoreError) as cursor:
        store.list_batches(after="batch_unknown", limit=5)
    assert cursor.value.param == "after"


def test_a_store_that_fails_to_open_holds_nothing(tmp_path):
    """The server retries a store that failed to open; the retry must see the real error again, not
    the lock its own failed attempt kept ("in use by another server process")."""
    import sqlite3

    root = tmp_path / "store"
    root.mkdir()
    (root / "batches.sqlite3").write_bytes(b"not a database" * 300)
    failures = []
    for _ in range(2):
        with pytest.raises(sqlite3.DatabaseError) as failed:
            open_store(root)
        failures.append(failed)  # a caller may keep the error, and through its traceback the half-open store
    (root / "batches.sqlite3").unlink()
    open_store(root).close()


def test_a_folder_in_the_files_dir_does_not_stop_the_store(tmp_path):
    (tmp_path / "store" / "files" / "a-folder").mkdir(parents=True)
    open_store(tmp_path / "store").close()
    assert (tmp_path / "store" / "files" / "a-folder").is_dir()


class CommitFails:
    """The store's connection, with every COMMIT failing while `full` (as on a full disk)."""

    def __init__(self, db) -> None:
        self.db = db
        self.full = True

    def execute(self, sql: str, *args):
        import sqlite3

        if sql == "COMMIT" and self.full:
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


def test_a_failed_commit_rolls_back_and_the_next_write_works(store, monkeypatch):
    import sqlite3

    db = CommitFails(store._db)
    monkeypatch.setattr(store, "_db", db)
    with pytest.raises(sqlite3.OperationalError):
        add_input(store, b"lost\n")
    assert not db.in_transaction  # before: still inside the transaction, so every later BEGIN failed
    assert [path.name for path in store.files_dir.iterdir()] == []  # nor is the body left behind
    db.full = False
    row = add_input(store, b"kept\n")
    assert store.list_files(after=None, limit=10, order="asc", purpose=None) == ([row], False)


# --------------------------------------------------------------------------- retention (issue 29, finding 3)
class Clock:
    """A clock the test moves."""

    def __init__(self, now_s: float = 1_800_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def finished_batch(store: BatchStore, num_items: int = 2):
    batch = new_batch(store, num_items=num_items)
    for line in range(1, num_items + 1):
        store.finish_item(batch.id, line, ok=True, result=b'"r%d"' % line)
    store.set_finalizing(batch.id)
    return store.finalize(batch.id, "completed")


def test_a_result_is_stored_once(store):
    done = finished_batch(store)
    assert list(store.results(done.id)) == []  # the rows went when the output file was written
    assert store.file_path(done.output_file_id).read_bytes() == b'"r1"\n"r2"\n'
    failed = new_batch(store, num_items=2)
    store.finish_item(failed.id, 1, ok=True, result=b'"r1"')
    store.fail_batch(failed.id, [{"code": "x", "message": "y"}])
    assert list(store.results(failed.id)) == [] and store.num_pending(failed.id) == 0


def test_files_expire_and_purge_removes_them_and_old_batches(tmp_path):
    clock, day_s = Clock(), 24 * 3600
    store = BatchStore(tmp_path / "store", max_file_bytes=1 << 20, max_requests=100, retention_s=30 * day_s,
                       clock=clock)
    try:
        default = add_input(store)
        assert default.expires_at == default.created_at + 30 * day_s  # the retention by default
        path = store.upload_path()
        path.write_bytes(b"{}\n")
        short = store.add_file(path, filename="s.jsonl", purpose="batch", num_bytes=3, expires_after_s=3600)
        assert short.expires_at == short.created_at + 3600
        path = store.upload_path()
        path.write_bytes(b"{}\n")
        capped = store.add_file(path, filename="c.jsonl", purpose="batch", num_bytes=3, expires_after_s=60 * day_s)
        assert capped.expires_at == capped.created_at + 30 * day_s  # never longer than the retention
        done = finished_batch(store)
        running = new_batch(store)

        clock.now_s += 3600  # the short one has expired: absent at once, purged when purge runs
        with pytest.raises(StoreError):
            store.get_file(short.id)
        assert short.id not in [row.id for row in store.list_files(after=None, limit=100, order="asc", purpose=None)[0]]
        assert store.purge() == PurgeCounts(files=1, batches=0)
        assert not (store.files_dir / short.id).exists()

        clock.now_s += 30 * day_s  # every file has expired, the finished batch is past the retention
        counts = store.purge()
        assert counts.batches == 1 and store.list_batches(after=None, limit=10)[0] == [store.get_batch(running.id)]
        with pytest.raises(StoreError):
            store.get_batch(done.id)
        # The unfinished batch's input stays until the batch is done; everything else is gone.
        assert sorted(path.name for path in store.files_dir.iterdir()) == [running.input_file_id]
        assert counts.files == len({default.id, capped.id, done.input_file_id, done.output_file_id})
    finally:
        store.close()


def test_retention_zero_keeps_everything(tmp_path):
    clock = Clock()
    store = BatchStore(tmp_path / "store", max_file_bytes=1 << 20, max_requests=100, retention_s=0, clock=clock)
    try:
        kept = add_input(store)
        done = finished_batch(store)
        clock.now_s += 10 * 365 * 24 * 3600
        assert kept.expires_at is None and store.purge() == PurgeCounts(files=0, batches=0)
        assert store.get_file(kept.id) == kept and store.get_batch(done.id).status == "completed"
    finally:
        store.close()


# The schema of the stores the previous version wrote (before numbered migrations).
OLD_SCHEMA = """
CREATE TABLE files (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, bytes INTEGER NOT NULL, filename TEXT NOT NULL,
    purpose TEXT NOT NULL, expires_at INTEGER);
CREATE TABLE batches (id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER,
    metadata TEXT, model TEXT, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT,
    error_file_id TEXT, errors TEXT, total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0);
CREATE TABLE items (batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, body BLOB, state TEXT NOT NULL,
    ok INTEGER, result BLOB, PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
INSERT INTO files VALUES ('file-old', 1000, 3, 'in.jsonl', 'batch', NULL);
INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, completed_at)
    VALUES ('batch_done', '/v1/completions', 'file-old', '24h', 'completed', 1000, 1001);
INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, total)
    VALUES ('batch_running', '/v1/completions', 'file-old', '24h', 'in_progress', 1000, 2);
INSERT INTO items VALUES ('batch_done', 1, 'a', NULL, 'done', 1, CAST('"old result"' AS BLOB));
INSERT INTO items VALUES ('batch_running', 1, 'a', NULL, 'done', 1, CAST('"kept"' AS BLOB));
INSERT INTO items VALUES ('batch_running', 2, 'b', CAST('{}' AS BLOB), 'pending', NULL, NULL);
"""


def test_a_store_from_the_previous_version_is_migrated(tmp_path):
    import sqlite3

    root = tmp_path / "store"
    (root / "files").mkdir(parents=True)
    (root / "files" / "file-old").write_bytes(b"{}\n")
    with sqlite3.connect(root / "batches.sqlite3") as db:
        db.executescript(OLD_SCHEMA)
    clock = Clock()
    store = BatchStore(root, max_file_bytes=1 << 20, max_requests=100, retention_s=3600, clock=clock)
    try:
        old = store.get_file("file-old")
        assert old.expires_at == int(clock.now_s) + 3600  # one retention period from the upgrade
        assert list(store.results("batch_done")) == []  # results stored once
        assert list(store.results("batch_running")) == [(1, True, b'"kept"')]
        assert [item.line for item in store.pending_items("batch_running", after_line=0, limit=10)] == [2]
        assert store.get_batch("batch_done").output_expires_after_s is None
        # what was stored before owners belongs to the --api-key's owner (and a keyless server's clients)
        assert old.owner == "default" and store.get_batch("batch_done", owner="default").id == "batch_done"
        with pytest.raises(StoreError):
            store.get_file("file-old", owner="alice")
    finally:
        store.close()
    open_store(root).close()  # and opening it again changes nothing


# --------------------------------------------------------------------------- quotas (issue 29, finding 3)
def test_quotas_bound_each_owners_files_bytes_and_batches(tmp_path):
    from server.batch_store import Quota

    store = BatchStore(tmp_path / "store", max_file_bytes=1 << 20, max_requests=100,
                       quota=Quota(files=3, bytes=20, batches=1))

    def add(data: bytes, owner: str = "alice"):
        path = store.upload_path()
        path.write_bytes(data)
        return store.add_file(path, filename="in.jsonl", purpose="batch", num_bytes=len(data), owner=owner)

    def refused(call, code: str) -> None:
        with pytest.raises(StoreError) as raised:
            call()
        assert (raised.value.status, raised.value.code, raised.value.error_type) == (429, code, "insufficient_quota")
        assert [p for p in store.files_dir.iterdir() if p.name.startswith(".")] == []  # nothing left behind

    try:
        first, second = add(b"{}\n" * 3), add(b"{}\n" * 3)  # 18 of 20 bytes
        refused(lambda: add(b"{}\n"), "storage_quota_exceeded")
        assert add(b"{}\n" * 6, owner="bob")  # another owner's quota is its own
        store.delete_file(second.id)
        third, fourth = add(b"{}\n"), add(b"{}\n")
        refused(lambda: add(b"{}\n"), "file_quota_exceeded")
        usage = store.usage("alice")
        assert (usage.files, usage.bytes, usage.batches) == (3, 9 + 3 + 3, 0)
        batch = store.create_batch(input_file_id=first.id, endpoint="/v1/completions", completion_window="24h",
                                   completion_window_s=60, metadata=None, owner="alice")
        refused(lambda: store.create_batch(input_file_id=first.id, endpoint="/v1/completions", completion_window="24h",
                                           completion_window_s=60, metadata=None, owner="alice"),
                "batch_quota_exceeded")
        # A batch's results are never refused: its output files may go past the quota.
        store.start_items(batch.id, [(1, CheckedLine("c1", body=b"{}", model="m"))])
        store.finish_item(batch.id, 1, ok=True, result=b'"a result longer than what is left"')
        store.set_finalizing(batch.id)
        done = store.finalize(batch.id, "completed")
        assert store.usage("alice").files == 4 and store.get_file(done.output_file_id, owner="alice")
    finally:
        store.close()


# --------------------------------------------------------------------------- private files (issue 29, finding 11)
def modes(root: Path) -> dict[str, int]:
    """Permission bits of everything under root (root itself as '.')."""
    import stat

    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


@pytest.fixture
def loose_umask():
    import os

    previous = os.umask(0o022)  # the default: files 0644, dirs 0755
    yield
    os.umask(previous)


def test_the_store_is_private_to_the_server(tmp_path, loose_umask):
    root = tmp_path / "store"
    store = open_store(root)
    try:
        done = new_batch(store, num_items=1)
        store.finish_item(done.id, 1, ok=True, result=b'"r1"')
        store.set_finalizing(done.id)
        store.finalize(done.id, "completed")
        found = modes(root)
    finally:
        store.close()
    dirs = {name for name in found if (root / name).is_dir()}
    assert dirs == {".", "files"} and {found[name] for name in dirs} == {0o700}, found
    assert {mode for name, mode in found.items() if name not in dirs} == {0o600}, found
    assert len(found) >= 6  # the database (and its WAL), the lock, an input and an output file


def test_a_store_written_with_loose_modes_is_made_private_when_opened(tmp_path, loose_umask):
    import os

    root = tmp_path / "store"
    store = open_store(root)
    add_input(store)
    store.close()
    for path in [root, *root.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)  # as the previous version left them
    open_store(root).close()
    assert set(modes(root).values()) <= {0o700, 0o600}, modes(root)
