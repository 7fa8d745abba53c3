"""LoRA applied unmerged, per group of rows: y = base(x) + scale * (x A^T) B^T for the rows of
each adapter in the step.

A `LoraLinear` wraps one of a block's linears (the fused q|k|v and w1|w3 ones too: each part
has its own A and B and adds to its own output columns). The rows of one step that belong to
one adapter are runs of consecutive sequences (StepInputs.lora_ids, [num_seqs]); each run is a
row slice of x and y, so the delta is two small matmuls over a view, the second one adding into
the output's slice: no gather, no scatter, no padding to a common rank. The executor orders the
step's sequences by adapter (engine.executor.executor.build_step_inputs), so a step has one run
per adapter (and per prefill/decode split). torch ops, on whatever device the model is on (the
CUDA path is the same calls).

Where the model's backend has the C kernels (Backend.lora_kernels: the CPU kernel backend), each
adapted linear instead makes ONE call for all the step's runs (engine/kernels/csrc/lora.c's
segmented_lora): ~1900 small torch calls a step on the demo with 8 adapters become 120, and a fused
linear's parts each write their own columns (no block-diagonal zeros). Its weights (KernelLora)
are bound once per install into a descriptor table ([linears, slots] of lora_desc: A's and B's
addresses, each part's rank), and the step's runs into one int64 tensor (first row, end row, slot)
at begin_step, so a call is the kernel and a few Python attribute reads.

Row-parallel linears (wo, w2) are wrapped inside their all-reduce: each rank adds its partial
delta (its columns of A) before the sum, exactly as the base's partial products are summed.

`LoraSlots` (one per rank) holds the prepared weights of every loaded adapter by engine id and
this step's runs: the linears read it instead of taking another argument, because a Linear's
call is x -> y for every backend (engine/backends/base.py). The runs are set by the worker
around each forward and cleared after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.backends.base import ParallelLinear
from engine.executor.step_inputs import StepInputs
from engine.kernels.cpu import LORA_DESC_WORDS, LORA_MAX_PARTS, CpuKernels

# The model's linears LoRA can adapt, and the Meta linears (the parts, in row order) each one holds.
LORA_LINEARS = {
    "attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
    "attention.wo": ("attention.wo",),
    "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"),
    "feed_forward.w2": ("feed_forward.w2",),
}


@dataclass(slots=True)
class PreparedLora:
    """One adapter's weights for one model linear on this rank, as two matrices: the delta of a run
    of rows x is (x @ a_t) @ b_t, two calls whatever the number of parts. For a fused linear, b_t is
    block diagonal (part k's rows of t feed only part k's output columns): a few more multiply-adds
    by zeros (r per output, r being 16-64 against thousands of inputs) for one call instead of one
    per part."""

    a_t: torch.Tensor  # [in_local, sum of the parts' r]: the parts' A stacked, transposed
    b_t: torch.Tensor  # [sum of the parts' r, out_local]: scale * B^T of each part in its own block

    @property
    def num_bytes(self) -> int:
        return self.a_t.numel() * self.a_t.element_size() + self.b_t.numel() * self.b_t.element_size()


@dataclass(slots=True)
class KernelLora:
    """One adapter's weights for one model linear on this rank as segmented_lora reads them: each
    part's A and B as they are (no zeros), its descriptor bound once at install."""

    a: torch.Tensor  # [sum of the parts' r, in_local]: the parts' A stacked in part order, contiguous
    # [sum over parts of r_k * out_k]: each part's scale * B^T [r_k, out_k], in part order, each in
    # column blocks (CpuKernels.lora_expand_layout)
    b: torch.Tensor
    ranks: tuple[int, ...]  # [LORA_MAX_PARTS] each part's r (0: the adapter leaves that part alone)

    @property
    def num_bytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def descriptor(self) -> list[int]:
        """csrc/lora.c's lora_desc as int64 words (the tensors must outlive it: the adapter's dict holds them)."""
        return [self.a.data_ptr(), self.b.data_ptr(), *self.ranks]


@dataclass(slots=True)
class LoraSlots:
    """This rank's loaded adapters (engine lora id -> model linear name -> PreparedLora, or KernelLora
    where `kernels` is set) and the current step's runs of rows."""

    # the segmented LoRA kernel (Backend.lora_kernels, chosen once per model); None: torch matmuls per run
    kernels: CpuKernels | None = None
    adapters: dict[int, dict[str, PreparedLora | KernelLora]] = field(default_factory=dict)
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, end row, lora id), this step only
    # kernel path only: attach_lora numbers the adapted linears (rows of the descriptor table); each
    # loaded adapter holds a slot (a column), freed at remove and reused
    linear_index: dict[str, int] = field(default_factory=dict)
    slot_of: dict[int, int] = field(default_factory=dict)  # lora id -> slot
    descriptors: torch.Tensor | None = None  # [linears, capacity, LORA_DESC_WORDS] int64; a = 0: not adapted
    linear_tables: list[int] = field(default_factory=list)  # each linear's row of descriptors, by address
    run_rows: torch.Tensor | None = None  # [num_runs, 3] int64 (first row, end row, slot), this step only
    run_rows_address: int = 0

    def begin_step(self, inputs: StepInputs) -> bool:
        """Set this step's runs from inputs.lora_ids; whether any row has an adapter."""
        self.runs = []
        if inputs.lora_ids is None:
            return False
        starts = inputs.query_start_loc.tolist()
        for i, lora_id in enumerate(inputs.lora_ids.tolist()):
            if lora_id == 0:
                continue
            if self.runs and self.runs[-1][2] == lora_id and self.runs[-1][1] == starts[i]:
                self.runs[-1] = (self.runs[-1][0], starts[i + 1], lora_id)
            else:
                self.runs.append((starts[i], starts[i + 1], lora_id))
        missing = {lora_id for _, _, lora_id in self.runs} - set(self.adapters)
        if missing:
            self.runs = []
            raise RuntimeError(f"LoRA adapters {sorted(missing)} are not loaded on this rank")
        if self.kernels is not None and self.runs:
            self.run_rows = torch.tensor([(start, end, self.slot_of[lora_id]) for start, end, lora_id in self.runs], dtype=torch.int64)
            self.run_rows_address = self.run_rows.data_ptr()
        return bool(self.runs)

    def end_step(self) -> None:
        self.runs = []
        self.run_rows, self.run_rows_address = None, 0

    def install(self, lora_id: int, local: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float,
                layer_rows: dict[str, list[int]], *, dtype: torch.dtype, device: torch.device) -> int:
        """Prepare one adapter's per-rank (A, B) pairs (Meta linear names) for the model's linears;
        layer_rows: each model linear's part sizes (output rows on this rank), in row order. Bytes held."""
        prepared: dict[str, PreparedLora | KernelLora] = {}
        by_linear: dict[str, list[tuple[int, str]]] = {}
        for name in local:
            layer, part = name.split(".", 2)[1], name.split(".", 2)[2]
            for linear, parts in LORA_LINEARS.items():
                if part in parts:
                    by_linear.setdefault(f"layers.{layer}.{linear}", []).append((parts.index(part), name))
        for linear, members in by_linear.items():
            sizes = layer_rows[linear.split(".", 2)[2]]
            members.sort()
            if self.kernels is not None:
                prepared[linear] = _kernel_lora(local, members, sizes, scale, dtype=dtype, device=device)
                continue
            offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
            a_t = torch.cat([local[name][0] for _, name in members]).t().to(device=device, dtype=dtype).contiguous()
            b_t = torch.zeros(a_t.shape[1], offsets[-1], dtype=dtype, device=device)
            r0 = 0
            for index, name in members:
                b = local[name][1]
                b_t[r0 : r0 + b.shape[1], offsets[index] : offsets[index + 1]] = (b.double() * scale).t().to(dtype)
                r0 += b.shape[1]
            prepared[linear] = PreparedLora(a_t, b_t)
        self.remove(lora_id)  # an id is never reused (engine.lora.table); this keeps a slot from leaking if one were
        self.adapters[lora_id] = prepared
        if self.kernels is not None:
            self._bind(lora_id, prepared)  # type: ignore[arg-type]  # every entry a KernelLora here
        return sum(p.num_bytes for p in prepared.values())

    def remove(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None and self.descriptors is not None:
            self.descriptors[:, slot] = 0  # no descriptor points at the freed tensors

    def _bind(self, lora_id: int, prepared: dict[str, KernelLora]) -> None:
        """Write the adapter's descriptors into a free slot of the table (grown when full)."""
        used = set(self.slot_of.values())
        capacity = 0 if self.descriptors is None else self.descriptors.shape[1]
        slot = next((s for s in range(capacity) if s not in used), capacity)
        if slot == capacity:
            grown = torch.zeros(len(self.linear_index), max(4, 2 * capacity), LORA_DESC_WORDS, dtype=torch.int64)
            if self.descriptors is not None:
                grown[:, :capacity] = self.descriptors
            self.descriptors = grown
            row_bytes = grown.stride(0) * grown.element_size()
            self.linear_tables = [grown.data_ptr() + i * row_bytes for i in range(grown.shape[0])]
        self.descriptors[:, slot] = 0
        for linear, lora in prepared.items():
            self.descriptors[self.linear_index[linear], slot] = torch.tensor(lora.descriptor(), dtype=torch.int64)
        self.slot_of[lora_id] = slot


def _kernel_lora(local: dict[str, tuple[torch.Tensor, torch.Tensor]], members: list[tuple[int, str]], sizes: list[int],
                 scale: float, *, dtype: torch.dtype, device: torch.device) -> KernelLora:
    """One model linear's parts (members: (part index, Meta name), sorted) in segmented_lora's layout;
    sizes: each part's output rows on this rank."""
    ranks = [0] * LORA_MAX_PARTS
    b_parts = []
    for index, name in members:
        a, b = local[name]
        if b.shape[0] != sizes[index]:
            raise ValueError(f"{name}: B has {b.shape[0]} rows on this rank, the base part {sizes[index]}")
        ranks[index] = a.shape[0]
        b_parts.append(CpuKernels.lora_expand_layout((b.double() * scale).t().to(dtype)))
    a_stacked = torch.cat([local[name][0] for _, name in members]).to(device=device, dtype=dtype).contiguous()
    return KernelLora(a_stacked, torch.cat(b_parts).to(device).contiguous(), tuple(ranks))


class LoraLinear(nn.Module):
    """A base Linear plus the step's adapters on their rows (see the module docstring)."""

    def __init__(self, base: nn.Module, name: str, slots: LoraSlots, part_sizes: list[int]) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.name = name  # "layers.3.attention.wqkv"
        self.slots = slots
        if slots.kernels is None:
            self._add_delta = self._torch_delta
        else:  # the kernel's sizes bound once; the table row is looked up per call (it moves when the table grows)
            self._index = slots.linear_index.setdefault(name, len(slots.linear_index))
            self._segmented = slots.kernels.bind_segmented_lora(self.in_features, part_sizes)
            self._add_delta = self._kernel_delta

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # skips nn.Module's hook bookkeeping (no hooks)
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.slots.runs:
            self._add_delta(x, y)
        return y

    def _torch_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for start, end, lora_id in self.slots.runs:
            lora = self.slots.adapters[lora_id].get(self.name)
            if lora is None:  # this adapter leaves this linear alone
                continue
            y[start:end].addmm_(x[start:end] @ lora.a_t, lora.b_t)  # a row slice: a view, no gather

    def _kernel_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        slots = self.slots
        self._segmented(x.contiguous(), y, slots.linear_tables[self._index], slots.run_rows_address, len(slots.runs),
                        torch.get_num_threads())  # fmt: skip

    def resident_bytes(self) -> int:
        return self.base.resident_bytes()


def attach_lora(model: nn.Module, slots: LoraSlots) -> dict[str, list[int]]:
    """Wrap every LoRA-adaptable linear of a Llama 2/3 model (engine.models.llama.Transformer) in a
    LoraLinear reading `slots` (inside the all-reduce of a row-parallel one). Returns each model
    linear's part sizes on this rank (output rows of wq, wk, wv; w1, w3), for LoraSlots.install."""
    sizes: dict[str, list[int]] = {}
    for i, block in enumerate(model.layers):
        heads = block.attention.heads
        hidden = block.feed_forward.w13.out_features // 2
        sizes = {
            "attention.wqkv": [heads.heads * heads.head_dim, heads.kv_heads * heads.head_dim, heads.kv_heads * heads.head_dim],
            "attention.wo": [block.attention.wo.out_features],
            "feed_forward.w13": [hidden, hidden],
            "feed_forward.w2": [block.feed_forward.w2.out_features],
        }
        owners = {"attention.wqkv": block.attention, "attention.wo": block.attention,
                  "feed_forward.w13": block.feed_forward, "feed_forward.w2": block.feed_forward}
        for linear, owner in owners.items():
            attr = linear.split(".")[1]
            module = getattr(owner, attr)
            if isinstance(module, ParallelLinear):
                module.local = LoraLinear(module.local, f"layers.{i}.{linear}", slots, sizes[linear])
            else:
                setattr(owner, attr, LoraLinear(module, f"layers.{i}.{linear}", slots, sizes[linear]))
    return sizes
