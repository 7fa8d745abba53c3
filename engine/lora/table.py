"""Which LoRA adapters an engine serves: adapter name -> engine lora id, on the engine thread.

An engine lora id names one loaded version of an adapter and is never reused: loading a name
again (a hot swap) binds it to a new id while the sequences already running keep the old one,
whose weights are unloaded once no sequence holds it. The prefix cache keys blocks by this id
(engine.core.kv_blocks.lora_root). Plain Python: the scheduler's side of LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class AdapterTable:
    ids: dict[str, int] = field(default_factory=dict)  # name -> its current engine lora id
    bytes_by_id: dict[int, int] = field(default_factory=dict)  # lora id -> bytes its weights hold (all ranks)
    retired: set[int] = field(default_factory=set)  # ids no name points at, unloaded once unused
    requests_total: dict[str, int] = field(default_factory=dict)  # name -> sequences admitted with it
    _next_id: int = 1  # 0 is the base

    def new_id(self) -> int:
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def bind(self, name: str, lora_id: int, num_bytes: int) -> None:
        old = self.ids.get(name)
        self.ids[name] = lora_id
        self.bytes_by_id[lora_id] = num_bytes
        if old is not None:
            self.retired.add(old)

    def unbind(self, name: str) -> bool:
        """Forget a name (its weights go once unused); False when it was not loaded."""
        old = self.ids.pop(name, None)
        if old is None:
            return False
        self.retired.add(old)
        return True

    def releasable(self, in_use: set[int]) -> list[int]:
        """Retired ids no sequence holds, forgotten here: the caller unloads their weights."""
        free = sorted(self.retired - in_use)
        for lora_id in free:
            self.retired.discard(lora_id)
            self.bytes_by_id.pop(lora_id, None)
        return free

    def bytes_of(self, name: str) -> int:
        lora_id = self.ids.get(name)
        return 0 if lora_id is None else self.bytes_by_id.get(lora_id, 0)
