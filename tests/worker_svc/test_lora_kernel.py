"""LoRA's grouped shrink and expand (worker_svc/model/lora.py): the Triton kernel
(worker_svc/kernels/triton/sgmv.py, through Triton's interpreter on this CPU) and the C++
one (worker_svc/kernels/cpu/sgmv.py) against the torch path, on rows of several adapters
and of the base model mixed in one step, segments of uneven lengths (one longer than a
block of rows), ranks below the slots' and a slot the step does not use."""
from __future__ import annotations

import pytest
import torch

from worker_svc.kernels.cpu import library, sgmv
from worker_svc.kernels.triton.sgmv import segmented_mm
from worker_svc.model.lora import LoraSlots, LoraStep

cpu_kernel = sgmv.load()

SHAPES = {"q_proj": (40, 32), "k_proj": (40, 16), "v_proj": (40, 16), "o_proj": (32, 40),
          "gate_proj": (40, 24), "up_proj": (40, 24), "down_proj": (24, 40)}


def test_segmented_mm_multiplies_each_segment_by_its_slot_s_weights() -> None:
    torch.manual_seed(0)
    x, weights = torch.randn(23, 40), torch.randn(3, 70, 40)
    segments = [(2, 0, 4), (0, 4, 21), (1, 21, 23)]  # 17 rows: two blocks of rows
    expected = torch.cat([x[start:end] @ weights[slot].T for slot, start, end in segments])
    torch.testing.assert_close(segmented_mm(x, weights, segments), expected)


@pytest.mark.parametrize("fused", ["qkv_proj", "gate_up_proj", "down_proj"])
@pytest.mark.parametrize("which", ["triton", "cpu"])
def test_the_kernel_adds_what_the_torch_path_adds_to_a_mixed_step(fused: str, which: str) -> None:
    if which == "cpu" and cpu_kernel is None:
        pytest.skip("no AVX2/FMA CPU or no compiler")
    torch.manual_seed(0)
    # The C++ kernel's slots keep B transposed; the torch path reads the same slots.
    slots = LoraSlots(SHAPES, num_layers=1, max_loras=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu"),
                      transposed_b=which == "cpu")
    for slot, (rank, modules) in enumerate([(8, ("q_proj", "v_proj", "up_proj", "down_proj")), (5, tuple(SHAPES))]):
        slots.write(slot, rank, 0.5, {(0, m): (torch.randn(rank, SHAPES[m][0]), torch.randn(SHAPES[m][1], rank))
                                      for m in modules})
    # Rows of slot 1, the base model (-1) and slot 0, interleaved as a plan's requests are.
    token_slots = torch.tensor([1, -1, 0, 0, 1, -1, 0] + [1] * 18)
    step = LoraStep.of(token_slots, {1: 20, -1: 2, 0: 3}, slots.ranks)
    in_features = SHAPES["down_proj"][0] if fused == "down_proj" else 40
    # down_proj's input is a view with a longer row stride, as CpuOps.silu_and_mul returns.
    x = torch.randn(len(token_slots), 2 * in_features)[:, :in_features] if fused == "down_proj" \
        else torch.randn(len(token_slots), in_features)
    base = torch.randn(len(token_slots), slots.b[0][fused].shape[1])
    by_torch = step.add(slots, 0, fused, x, base.clone())
    if which == "cpu":
        by_kernel = step.add(slots, 0, fused, x, base.clone(), cpu_kernel=cpu_kernel)
    else:
        by_kernel = step.add(slots, 0, fused, x, base.clone(), kernel=True)
    torch.testing.assert_close(by_kernel, by_torch)
    assert torch.equal(by_torch[token_slots == -1], base[token_slots == -1])  # the base model's rows untouched
    assert not torch.allclose(by_torch[token_slots >= 0], base[token_slots >= 0])


def test_without_a_compiler_the_lora_kernel_is_none_and_warned(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(library, "cpu_flags", lambda: set(library.AVX2_CPU_FLAGS))
    sgmv.load.cache_clear()
    try:
        assert sgmv.load() is None
    finally:
        sgmv.load.cache_clear()
    assert "the LoRA SGMV kernel" in caplog.text and "using torch instead" in caplog.text
