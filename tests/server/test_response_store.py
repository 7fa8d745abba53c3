"""server/response_store.py: private files, owners, the per-owner bounds, retention, and a restart
that finds background responses still running."""

from __future__ import annotations

import json
import stat

from server.response_store import DB_NAME, ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_000_000.0

    def __call__(self) -> float:
        return self.now_s


def body(response_id: str, status: str = "completed", size: int = 0) -> bytes:
    return json.dumps({"id": response_id, "status": status, "pad": "x" * size}).encode()


def put(store: ResponseStore, owner: str, response_id: str, created_at: int, size: int = 0,
        status: str = "completed") -> None:
    store.put(owner, response_id, created_at=created_at, status=status, response=body(response_id, status, size),
              input_items=b"[]")


def test_private_files_and_owners(tmp_path):
    store = ResponseStore(tmp_path / "r", max_stored=0, max_bytes=0, retention_s=0)
    put(store, "alice", "resp_a", 1)
    assert stat.S_IMODE((tmp_path / "r").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "r" / DB_NAME).stat().st_mode) == 0o600
    assert store.get("resp_a", "alice").status == "completed"
    assert store.get("resp_a", "bob") is None and not store.delete("resp_a", "bob")
    assert store.delete("resp_a", "alice") and store.get("resp_a", "alice") is None
    assert not store.update("resp_a", status="failed", response=b"{}")  # deleted meanwhile
    store.close()


def test_count_and_byte_bounds_evict_the_owners_oldest(tmp_path):
    store = ResponseStore(tmp_path, max_stored=2, max_bytes=0, retention_s=0)
    put(store, "bob", "resp_bob", 0)
    for k in range(3):
        put(store, "alice", f"resp_{k}", 10 + k)
    assert [store.get(f"resp_{k}", "alice") is not None for k in range(3)] == [False, True, True]
    assert store.get("resp_bob", "bob") is not None  # another owner's responses are not touched
    store.close()
    store = ResponseStore(tmp_path, max_stored=0, max_bytes=2500, retention_s=0)
    put(store, "carol", "resp_big1", 1, size=1000)
    put(store, "carol", "resp_big2", 2, size=1000)
    put(store, "carol", "resp_big3", 3, size=1000)  # 3 x ~1,050 bytes > 2,500: the oldest goes
    assert [store.get(f"resp_big{k}", "carol") is not None for k in (1, 2, 3)] == [False, True, True]
    store.close()


def test_retention(tmp_path):
    clock = Clock()
    store = ResponseStore(tmp_path, max_stored=0, max_bytes=0, retention_s=100, clock=clock)
    put(store, "alice", "resp_old", int(clock.now_s))
    clock.now_s += 101
    assert store.get("resp_old", "alice") is None  # reads as absent at once
    put(store, "alice", "resp_new", int(clock.now_s))  # and is deleted at the next write
    assert store._db.execute("SELECT count(*) FROM responses").fetchone()[0] == 1
    store.close()


def test_restart_fails_what_was_running(tmp_path):
    store = ResponseStore(tmp_path, max_stored=0, max_bytes=0, retention_s=0)
    put(store, "alice", "resp_run", 1, status="in_progress")
    put(store, "alice", "resp_done", 2)
    store.close()
    store = ResponseStore(tmp_path, max_stored=0, max_bytes=0, retention_s=0)
    stored = store.get("resp_run", "alice")
    response = json.loads(stored.response)
    assert stored.status == response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert store.get("resp_done", "alice").status == "completed"
    store.close()
