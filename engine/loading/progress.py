"""Progress of the long waits: reading checkpoint shards, resharding, packing, GGUF import, the
demo's download and conversion.

One `Progress` per stage. It shows a tqdm bar when stderr is a terminal, and otherwise writes a
structured log line at every tenth of the way (a container's log gets a dozen lines, not a bar's
carriage returns); either way each line carries sizes and the rate. An optional callback receives
every update as a `ProgressEvent`: the server keeps the latest per loading model and shows it in
GET /v1/models/{id}.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    stage: str  # e.g. "reading weights"
    done: float
    total: float  # 0 when unknown
    unit: str  # "B" (bytes) or a noun: "tensor", "layer"
    elapsed_s: float

    @property
    def fraction(self) -> float | None:
        return min(self.done / self.total, 1.0) if self.total else None

    def as_dict(self) -> dict[str, Any]:
        fraction = self.fraction
        return {
            "stage": self.stage,
            "done": self.done,
            "total": self.total,
            "unit": self.unit,
            "fraction": round(fraction, 4) if fraction is not None else None,
            "elapsed_s": round(self.elapsed_s, 3),
            "rate_per_s": round(self.done / self.elapsed_s, 1) if self.elapsed_s > 0 else None,
        }


ProgressCallback = Callable[[ProgressEvent], None]


def format_amount(amount: float, unit: str) -> str:
    if unit != "B":
        return f"{amount:,.0f} {unit}s" if amount != 1 else f"1 {unit}"
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if amount >= scale:
            return f"{amount / scale:.1f} {name}"
    return f"{amount:.0f} B"


class Progress:
    """One stage of a long task; use as a context manager and call update(n) as work is done."""

    def __init__(self, stage: str, total: float, *, unit: str = "B", callback: ProgressCallback | None = None,
                 bar: bool | None = None, logger: logging.Logger | None = None) -> None:
        self.stage, self.total, self.unit = stage, total, unit
        self.done = 0.0
        self._callback = callback
        self._log = logger or log
        self._started_s = time.monotonic()
        self._next_report = 0.1
        show_bar = sys.stderr.isatty() if bar is None else bar
        self._bar = None
        if show_bar:
            from tqdm import tqdm

            scale = unit == "B"
            self._bar = tqdm(total=total or None, desc=stage, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
                             file=sys.stderr, leave=False)
        self._emit()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(failed=exc[0] is not None)

    def event(self) -> ProgressEvent:
        return ProgressEvent(self.stage, self.done, self.total, self.unit, time.monotonic() - self._started_s)

    def update(self, amount: float) -> None:
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount)
        elif self.total and self.done / self.total >= self._next_report and self.done < self.total:
            self._log_line()
            self._next_report = (int(self.done / self.total * 10) + 1) / 10  # the next tenth
        self._emit()

    def close(self, *, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not failed:
            self._log_line(final=True)

    def _emit(self) -> None:
        if self._callback is not None:
            self._callback(self.event())

    def _log_line(self, *, final: bool = False) -> None:
        event = self.event()
        rate = f", {format_amount(event.done / event.elapsed_s, self.unit)}/s" if event.elapsed_s > 0 and event.done else ""
        if final:
            self._log.info("%s: %s in %.1f s%s", self.stage, format_amount(event.done, self.unit), event.elapsed_s, rate)
        else:
            self._log.info("%s: %s of %s (%.0f%%) in %.1f s%s", self.stage, format_amount(event.done, self.unit),
                           format_amount(self.total, self.unit), 100 * (event.fraction or 0), event.elapsed_s, rate)


def tensor_bytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()
