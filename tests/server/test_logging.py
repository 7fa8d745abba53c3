"""The CLI's logging: every line one JSON record, whichever thread and logger wrote it."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading

import pytest
import structlog

from server.logging import configure_logging


@pytest.fixture
def restore_logging():
    config, root = structlog.get_config(), logging.getLogger()
    handlers, level, interval = root.handlers[:], root.level, sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)
    structlog.configure(**config)
    root.handlers[:], root.level = handlers, level


class _FileLike(io.StringIO):
    """A stream whose write runs Python code, so threads can switch inside it, as they do when a
    real file's write releases the GIL."""

    def write(self, text: str) -> int:
        for char in text:
            super().write(char)
        return len(text)


def test_access_log_and_engine_logs_from_other_threads_never_share_a_line(restore_logging):
    stream = _FileLike()
    configure_logging("json", "info", stream)
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: interleaved writes would show
    access, engine = structlog.get_logger(), logging.getLogger("engine.test")

    def write(i: int) -> None:
        for n in range(300):
            access.info("request", thread=i, n=n) if i % 2 else engine.info("step %d %d", i, n)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 * 300
    records = [json.loads(line) for line in lines]
    assert sum(record.get("logger") == "engine.test" for record in records) == 2 * 300


def test_a_stdlib_log_with_an_exception_keeps_its_traceback_as_text(restore_logging):
    """Engine logs come through stdlib logging: log.exception must reach the JSON line as the
    traceback's text, not as a raw (type, value, traceback) tuple."""
    stream = io.StringIO()
    configure_logging("json", "info", stream)
    try:
        raise RuntimeError("step failed")
    except RuntimeError:
        logging.getLogger("engine.test").exception("engine step failed")
    record = json.loads(stream.getvalue().strip().splitlines()[-1])
    assert "Traceback (most recent call last)" in record["exception"]
    assert "RuntimeError: step failed" in record["exception"]
