"""Optional subsystems (the Batch API; the Responses store): each one fails alone.

Inference is the server's job; a subsystem beside it (its own storage, its own background task)
must never take it down. Each subsystem registers here under a name and reports its state:

    idle      registered, not started yet (it starts on first use)
    starting  opening its storage or (re)starting its task
    up        working
    down      failed, with a reason; its routes answer 503 with that reason (`unavailable`) while
              `supervise` retries it after a growing delay

/ready lists every subsystem's state and /metrics exports `llamaserve:subsystem_up{subsystem=...}`
(0 only while down), so an operator sees what is down without the server going unready. One
`Subsystems` per app (no module state): tests build as many apps as they like.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Literal

import structlog
from aiohttp import web

from server.errors import ApiError

SubsystemStatus = Literal["idle", "starting", "up", "down"]
_MAX_REASON_CHARS = 300  # a reason is shown in /ready and in 503 bodies: one readable line

log = structlog.get_logger("llamaserve.subsystems")


@dataclass(frozen=True, slots=True)
class SubsystemState:
    name: str
    status: SubsystemStatus
    reason: str | None = None  # why it is down (or was, while starting again)
    restarts: int = 0  # times `supervise` has started it again after a failure
    retry_at_s: float | None = None  # time.monotonic() of the next attempt while down

    @property
    def is_up(self) -> bool:
        """For the metric: everything but `down` counts as up (idle and starting are not failures)."""
        return self.status != "down"

    def to_json(self) -> dict:
        body: dict = {"status": self.status}
        if self.reason is not None:
            body["reason"] = self.reason
        if self.restarts:
            body["restarts"] = self.restarts
        return body


class Subsystems:
    """The app's optional subsystems and their current state."""

    def __init__(self) -> None:
        self._states: dict[str, SubsystemState] = {}

    def register(self, name: str, status: SubsystemStatus = "idle") -> None:
        self._states[name] = SubsystemState(name, status)

    def get(self, name: str) -> SubsystemState:
        return self._states[name]

    def all(self) -> list[SubsystemState]:
        return sorted(self._states.values(), key=lambda state: state.name)

    def starting(self, name: str) -> None:
        self._set(name, status="starting")

    def up(self, name: str) -> None:
        self._set(name, status="up", reason=None, retry_at_s=None)

    def down(self, name: str, reason: str, *, retry_in_s: float | None = None) -> None:
        retry_at_s = None if retry_in_s is None else time.monotonic() + retry_in_s
        self._set(name, status="down", reason=reason[:_MAX_REASON_CHARS], retry_at_s=retry_at_s)

    def restarted(self, name: str) -> None:
        self._set(name, status="starting", restarts=self.get(name).restarts + 1)

    def unavailable(self, name: str, what: str) -> ApiError:
        """The 503 a down subsystem's routes answer: what is unavailable, why, and when to retry."""
        state = self.get(name)
        headers = {}
        if state.retry_at_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(state.retry_at_s - time.monotonic())))
        return ApiError(503, f"{what} is unavailable on this server: {state.reason or state.status}. Inference "
                        "is not affected; the server retries on its own.", code=f"{name}_unavailable",
                        headers=headers)

    def _set(self, name: str, **changes: object) -> None:
        self._states[name] = replace(self._states[name], **changes)  # type: ignore[arg-type]


SUBSYSTEMS_KEY = web.AppKey("subsystems", Subsystems)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between restarts: initial_s, doubling up to max_s; a run that lasted max_s or longer
    counts as healthy, so the next failure starts again from initial_s."""

    initial_s: float = 1.0
    max_s: float = 60.0

    def delay_s(self, consecutive_failures: int) -> float:
        return min(self.max_s, self.initial_s * 2 ** min(consecutive_failures, 32))


def describe_failure(exc: BaseException) -> str:
    """A reason for clients and /ready: the kind of failure without file system paths (the log,
    written with the traceback, has those)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not text.startswith(type(exc).__name__) else text


async def supervise(subsystems: Subsystems, name: str, body: Callable[[], Awaitable[None]], *,
                    backoff: Backoff) -> None:
    """Run `body` until cancelled. When it raises (or returns, which a service loop never should),
    mark the subsystem down with the reason, log it with its traceback, wait, and run it again.
    `body` marks the subsystem up itself once it works."""
    consecutive_failures = 0
    while True:
        started_s = time.monotonic()
        try:
            await body()
            reason, exc_info = "its task ended unexpectedly", False
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of an optional subsystem stays inside it
            reason, exc_info = describe_failure(exc), exc
        if time.monotonic() - started_s >= backoff.max_s:
            consecutive_failures = 0
        delay_s = backoff.delay_s(consecutive_failures)
        consecutive_failures += 1
        subsystems.down(name, reason, retry_in_s=delay_s)
        log.error("subsystem down; retrying", subsystem=name, reason=reason, retry_in_s=delay_s, exc_info=exc_info)
        await asyncio.sleep(delay_s)
        subsystems.restarted(name)
