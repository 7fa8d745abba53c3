"""The memory budget of the model registry: reservations, the fit check and the choice of what to evict.

With a budget (bytes), a load reserves its engine's estimate before it starts and gives it back
only once its engine has shut down. A load that does not fit waits for retired (draining)
engines to give their bytes back, then may replace the old engine of the same id in place, then
(if `evict_idle_lru`) evicts idle models, least recently used first; otherwise it fails with
`BudgetExceeded` (507 `memory_budget_exceeded` to callers). Which models are idle, and retiring
the chosen ones, is the registry's business (server/registry.py); this module does the arithmetic.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol, Sequence, TypeVar


class BudgetExceeded(Exception):
    """A load that cannot fit in the memory budget now."""


class Reservation:
    """Bytes of the budget held by one engine, from before its load until after its shutdown."""

    def __init__(self, budget: MemoryBudget, num_bytes: int) -> None:
        self._budget = budget
        self.num_bytes = num_bytes
        self.draining = False  # its engine is retired: the bytes come back without anyone acting
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._budget._on_release(self)


class HoldsReservation(Protocol):
    reservation: Reservation


Holder = TypeVar("Holder", bound=HoldsReservation)


class MemoryBudget:
    """The bytes all loaded (and loading) engines may reserve; None: no limit."""

    def __init__(self, budget_bytes: int | None, *, evict_idle_lru: bool) -> None:
        self.budget_bytes = budget_bytes
        self.evict_idle_lru = evict_idle_lru
        self._reservations: set[Reservation] = set()
        self._memory_freed = asyncio.Event()

    async def admit(self, model_id: str, need_bytes: int, make_room: Callable[[int, int], None]) -> Reservation:
        """Reserve `need_bytes`, waiting for draining engines; `make_room(need_bytes, budget)` retires
        what must go (see `choose_victims`) or raises BudgetExceeded."""
        budget = self.budget_bytes
        if budget is not None and need_bytes > budget:
            raise BudgetExceeded(
                f"model {model_id!r} needs {gib(need_bytes)} but the whole memory budget is {gib(budget)}"
            )
        while budget is not None and need_bytes > budget - self.reserved_bytes():
            make_room(need_bytes, budget)
            freed = self._memory_freed
            await freed.wait()
        reservation = Reservation(self, need_bytes)
        self._reservations.add(reservation)
        return reservation

    def choose_victims(
        self,
        model_id: str,
        need_bytes: int,
        budget: int,
        *,
        in_place: Holder | None,
        idle_lru: Sequence[Holder],
        holders: Sequence[tuple[str, int]],
    ) -> list[Holder]:
        """What must be retired for `need_bytes` to fit once draining engines are gone (empty: just
        wait), or raise BudgetExceeded. `in_place`: the old engine of the same id (a hot switch that
        fits only in place); `idle_lru`: idle engines, least recently used first; `holders`: (model
        id, bytes) of every loaded model, for the error message."""
        covered = budget - self.reserved_bytes() + sum(r.num_bytes for r in self._reservations if r.draining)
        if need_bytes <= covered:
            return []  # draining engines will free enough: just wait
        victims: list[Holder] = []
        if in_place is not None:
            victims.append(in_place)
            covered += in_place.reservation.num_bytes
        if need_bytes > covered and self.evict_idle_lru:
            for idle in idle_lru:
                if need_bytes <= covered:
                    break
                victims.append(idle)
                covered += idle.reservation.num_bytes
        if need_bytes > covered:
            raise BudgetExceeded(self._budget_message(model_id, need_bytes, budget, holders))
        return victims

    def _budget_message(self, model_id: str, need_bytes: int, budget: int, holders: Sequence[tuple[str, int]]) -> str:
        free = max(0, budget - self.reserved_bytes())
        loaded = ", ".join(f"{holder_id} ({gib(num_bytes)})" for holder_id, num_bytes in holders)
        hint = "unload one with DELETE /v1/models/{id}"
        if not self.evict_idle_lru:
            hint += " or enable eviction of idle models"
        return (
            f"model {model_id!r} needs {gib(need_bytes)} but only {gib(free)} of the {gib(budget)} memory budget "
            f"is free (loaded: {loaded or 'none'}); {hint}"
        )

    def draining_reservations(self) -> list[Reservation]:
        """Reservations whose bytes come back without anyone acting (retired engines, evicted adapters)."""
        return [r for r in self._reservations if r.draining]

    def reserved_bytes(self) -> int:
        return sum(r.num_bytes for r in self._reservations)

    def _on_release(self, reservation: Reservation) -> None:
        self._reservations.discard(reservation)
        freed, self._memory_freed = self._memory_freed, asyncio.Event()
        freed.set()


def gib(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB ({num_bytes} bytes)"
    return f"{num_bytes} bytes"
