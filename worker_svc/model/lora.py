"""LoRA deltas over the model's fused projections, for a batch that mixes adapters.

Adapters sit in `max_loras` device slots. Per layer and fused projection (qkv_proj,
o_proj, gate_up_proj, down_proj) a slot holds A, the fused projection's parts' A matrices
stacked, [parts * max_rank, in], and B, their B matrices scaled and laid block-diagonally,
[out, parts * max_rank]: the delta of a row is then (x @ A.T) @ B.T, one shrink and one
expand, whatever the parts and whatever the adapter's rank (a smaller rank's columns, a
part it does not adapt, are zeros). The delta is added to the base projection's output,
whatever computes that (dense, 4- or 8-bit as stored).

A step's rows are sorted by slot once (LoraStep); each projection then runs the shrink
and expand of each adapter over its contiguous rows, the grouped products of punica's
SGMV kernels, and adds them back at the rows' places. Rows of the base model take no work.
For a float32 model on CPU the C++ kernel (worker_svc/kernels/cpu/sgmv.py) does all of a
projection's adapters in one call, reading only each adapter's rank and each part's block of
B; it keeps B transposed ([out, parts * max_rank] read as rows of out), so `b` is a view.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from worker_svc.kernels.cpu.sgmv import SgmvKernel
from worker_svc.kernels.triton.sgmv import segmented_mm

# Each fused projection of a layer and the modules (PEFT's names) it concatenates, in order.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoraSlots:
    """The device slots' weights: per layer, per fused projection, A and B for every slot."""

    def __init__(self, shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, transposed_b: bool = False) -> None:
        """`shapes`: (in, out) of each module (formats/peft_adapter.module_shapes).
        `transposed_b`: B stored as [slots, parts * max_rank, out] (`bt`, the CPU kernel's
        layout), `b` being its transposed view."""
        self.shapes, self.max_rank = shapes, max_rank
        self.ranks = [0] * max_loras  # each slot's adapter's rank: the kernel reads no further
        # Each fused projection's parts' last output column + 1, for the kernel.
        self.part_ends = {fused: torch.tensor(list(itertools.accumulate(shapes[part][1] for part in parts)))
                          for fused, parts in FUSED.items()}
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        self.bt: list[dict[str, torch.Tensor]] = []
        for _ in range(num_layers):
            a, b, bt = {}, {}, {}
            for fused, parts in FUSED.items():
                in_features = shapes[parts[0]][0]
                out_features = sum(shapes[part][1] for part in parts)
                a[fused] = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device)
                if transposed_b:
                    bt[fused] = torch.zeros(max_loras, len(parts) * max_rank, out_features, dtype=dtype,
                                            device=device)
                    b[fused] = bt[fused].transpose(1, 2)
                else:
                    b[fused] = torch.zeros(max_loras, out_features, len(parts) * max_rank, dtype=dtype, device=device)
            self.a.append(a)
            self.b.append(b)
            self.bt.append(bt)

    def write(self, slot: int, rank: int, scaling: float,
              weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Puts an adapter's (layer, module) -> (A, B) into `slot`, zeroing what it does not adapt."""
        self.ranks[slot] = rank
        for layer, (a_fused, b_fused) in enumerate(zip(self.a, self.b)):
            for fused, parts in FUSED.items():
                a, b = a_fused[fused][slot], b_fused[fused][slot]
                a.zero_()
                b.zero_()
                row = 0
                for index, part in enumerate(parts):
                    out = self.shapes[part][1]
                    if (pair := weights.get((layer, part))) is not None:
                        cols = slice(index * self.max_rank, index * self.max_rank + rank)
                        a[cols].copy_(pair[0])
                        b[row : row + out, cols].copy_(pair[1] * scaling)
                    row += out


@dataclass
class LoraStep:
    """One step's rows grouped by adapter: `rows` are the rows that have one, sorted by
    slot (a device tensor), `segments` each slot's (slot, start, end) in it, and `table`
    the same with each slot's rank, as the CPU kernel reads them (int64 [n, 4], on the host)."""

    rows: torch.Tensor
    segments: list[tuple[int, int, int]]
    table: torch.Tensor

    @classmethod
    def of(cls, token_slots: torch.Tensor, slot_counts: dict[int, int], ranks: list[int]) -> LoraStep | None:
        """`token_slots` [T]: each row's slot, -1 for the base model (on the device);
        `slot_counts`: the rows of each slot, known on the host from the plan's counts, so
        grouping needs no copy back; `ranks`: each slot's adapter's. None when no row has an adapter."""
        segments, start = [], 0
        for slot in sorted(s for s in slot_counts if s >= 0):
            segments.append((slot, start, start + slot_counts[slot]))
            start += slot_counts[slot]
        if not segments:
            return None
        order = torch.argsort(token_slots, stable=True)  # the base model's -1 rows first
        table = torch.tensor([(slot, begin, end, ranks[slot]) for slot, begin, end in segments])
        return cls(order[len(token_slots) - start :], segments, table)

    def add(self, slots: LoraSlots, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor,
            kernel: bool = False, cpu_kernel: SgmvKernel | None = None) -> torch.Tensor:
        """`out` (the base projection of `x`) plus each row's adapter delta; with `kernel`,
        the shrink and the expand as one Triton launch each (worker_svc/kernels/triton/sgmv.py);
        with `cpu_kernel` (slots with `transposed_b`, float32), one C++ call for all of them."""
        if cpu_kernel is not None:
            return cpu_kernel.add_(x, out, self.rows, self.table, slots.a[layer][fused], slots.bt[layer][fused],
                                   slots.part_ends[fused])
        a, b = slots.a[layer][fused], slots.b[layer][fused]
        grouped = x.index_select(0, self.rows)
        if kernel:
            deltas = segmented_mm(segmented_mm(grouped, a, self.segments), b, self.segments)
            return out.index_add_(0, self.rows, deltas)
        deltas = out.new_empty(len(self.rows), out.shape[-1])
        for slot, start, end in self.segments:  # one shrink and one expand per adapter, written in place
            torch.mm(grouped[start:end] @ a[slot].T, b[slot].T, out=deltas[start:end])
        # In place: `out` is this projection's fresh output (a step with adapters runs no CUDA graph).
        return out.index_add_(0, self.rows, deltas)


class LoraContext:
    """What the layers read: the slots, and the step now running (None: no row has an adapter).
    `kernel`: the grouped products run as Triton kernels (where the model's other kernels do);
    `cpu_kernel`: as the C++ kernel (the slots must keep B transposed)."""

    def __init__(self, slots: LoraSlots, kernel: bool = False, cpu_kernel: SgmvKernel | None = None) -> None:
        self.slots = slots
        self.kernel = kernel
        self.cpu_kernel = cpu_kernel
        self.step: LoraStep | None = None

    def project(self, linear: torch.nn.Module, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor:
        out = linear(x)
        return out if self.step is None else self.step.add(self.slots, layer, fused, x, out, self.kernel,
                                                           self.cpu_kernel)
