"""LoRA's grouped shrink and expand (worker_svc/model/lora.py): the Triton kernel
(worker_svc/kernels/triton/sgmv.py, through Triton's interpreter on this CPU) against the
torch path, on rows of several adapters and of the base model mixed in one step, segments
of uneven lengths (one longer than a block of rows) and a slot the step does not use."""
from __future__ import annotations

import pytest
import torch

from worker_svc.kernels.triton.sgmv import segmented_mm
from worker_svc.model.lora import LoraSlots, LoraStep

SHAPES = {"q_proj": (40, 32), "k_proj": (40, 16), "v_proj": (40, 16), "o_proj": (32, 40),
          "gate_proj": (40, 24), "up_proj": (40, 24), "down_proj": (24, 40)}


def test_segmented_mm_multiplies_each_segment_by_its_slot_s_weights() -> None:
    torch.manual_seed(0)
    x, weights = torch.randn(23, 40), torch.randn(3, 70, 40)
    segments = [(2, 0, 4), (0, 4, 21), (1, 21, 23)]  # 17 rows: two blocks of rows
    expected = torch.cat([x[start:end] @ weights[slot].T for slot, start, end in segments])
    torch.testing.assert_close(segmented_mm(x, weights, segments), expected)


@pytest.mark.parametrize("fused", ["qkv_proj", "down_proj"])
def test_the_kernel_adds_what_the_torch_path_adds_to_a_mixed_step(fused: str) -> None:
    torch.manual_seed(0)
    slots = LoraSlots(SHAPES, num_layers=1, max_loras=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    for slot, (rank, modules) in enumerate([(8, ("q_proj", "v_proj", "down_proj")), (4, tuple(SHAPES))]):
        slots.write(slot, rank, 0.5, {(0, m): (torch.randn(rank, SHAPES[m][0]), torch.randn(SHAPES[m][1], rank))
                                      for m in modules})
    # Rows of slot 1, the base model (-1) and slot 0, interleaved as a plan's requests are.
    token_slots = torch.tensor([1, -1, 0, 0, 1, -1, 0] + [1] * 18)
    step = LoraStep.of(token_slots, {1: 20, -1: 2, 0: 3})
    in_features = SHAPES["down_proj"][0] if fused == "down_proj" else 40
    x = torch.randn(len(token_slots), in_features)
    base = torch.randn(len(token_slots), slots.b[0][fused].shape[1])
    by_torch = step.add(slots, 0, fused, x, base.clone())
    by_kernel = step.add(slots, 0, fused, x, base.clone(), kernel=True)
    torch.testing.assert_close(by_kernel, by_torch)
    assert torch.equal(by_torch[token_slots == -1], base[token_slots == -1])  # the base model's rows untouched
    assert not torch.allclose(by_torch[token_slots >= 0], base[token_slots >= 0])
