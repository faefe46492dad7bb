"""The AVX2 int16 GEMM over GGUF blocks (worker_svc/kernels/cpu/csrc/int16_gemm.cpp), for decode
steps where AVX-512 VNNI does not run: its product is that of the activations quantized
per block of 32 to int16 (as the VNNI kernel's, test_vnni_kernel.py) and exactly the GGUF
weights (4-bit in PackedQ4's layout, 8-bit as Q8Blocks hold them), within about 1e-5 of
the float32 product, and Q4Linear and Q8Linear send their small steps to it, which in a
decode step take every thread though torch's ops take one (a worker whose model runs it
says so to its steps: test_q8_weights.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from worker_svc.formats.q4_weights import GROUP_SIZE, Q4Blocks
from worker_svc.formats.q8_weights import Q8Blocks
from worker_svc.kernels.cpu import int16_gemm, vnni_gemm
from worker_svc.kernels.cpu.q4_gemm import PackedQ4
from worker_svc.kernels.cpu.threads import decode_threads, step_threads
from worker_svc.model.q4_linear import INT16_MAX_ROWS, DequantScratch, Q4Linear
from worker_svc.model.q8_linear import Q8Linear

KINDS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]

kernel = int16_gemm.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no AVX2/FMA/F16C CPU or no compiler")


@pytest.fixture(autouse=True)
def without_the_vnni_kernel(monkeypatch):
    """Q4Linear and Q8Linear as on a CPU without AVX-512 VNNI, whose small steps this kernel serves."""
    monkeypatch.setattr(vnni_gemm, "load", lambda: None)


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> Q4Blocks:
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    return Q4Blocks.from_gguf(quantize(weights, kind), kind)


def random_q8(rows: int, cols: int, seed: int = 0) -> Q8Blocks:
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    return Q8Blocks.from_gguf(quantize(weights, GGMLQuantizationType.Q8_0))


def dense(blocks: Q4Blocks) -> torch.Tensor:
    return blocks.dequantize(torch.empty(blocks.codes.numel())).double()


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: per row and block of 32, int16 values times amax / 32767."""
    grouped = x.reshape(x.shape[0], -1, GROUP_SIZE)
    scale = grouped.abs().amax(-1, keepdim=True) / 32767
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))  # float32, as the kernel's
    return (torch.round(grouped * inverse).double() * scale.double()).reshape(x.shape)


def assert_the_quantized_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None) -> None:
    add = 0 if bias is None else bias.double()
    # Against float64 over the same quantized activations only float32 rounding of the
    # scales' products and the sums remains: outputs here are O(1), their error ~1e-7.
    # A wrong code, lane order or scale is off by O(0.01-1).
    torch.testing.assert_close(out.double(), quantized(x) @ weight.T + add, rtol=1e-5, atol=1e-5)
    # And int16 activations are within 2^-16 of a block's largest value: ~1e-5 relative overall.
    exact = x.double() @ weight.T + add
    assert (out.double() - exact).abs().max() <= 1e-4 * exact.abs().max()


@needs_kernel
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 9])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_4_bit_product_is_the_quantized_activations_one(kind, rows, with_bias):
    # 7 blocks of 32 inputs (a run of 4 and 3 alone) and 195 outputs (not whole tasks of 4).
    blocks = random_blocks(kind, 195, 7 * 32, seed=rows)
    x = torch.randn(rows, 7 * 32, generator=torch.Generator().manual_seed(rows))
    x[0, :GROUP_SIZE] = 0.0  # a block of zeros: scale 0, no division by it
    bias = torch.randn(195) if with_bias else None
    out = kernel.q4_linear(PackedQ4.from_blocks(blocks), x, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 195)
    assert_the_quantized_product(out, x, dense(blocks), bias)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_8_bit_product_is_the_quantized_activations_one(rows):
    blocks = random_q8(203, 5 * 32, seed=rows)
    x = torch.randn(rows, 5 * 32, generator=torch.Generator().manual_seed(rows))
    out = kernel.q8_linear(blocks, x)
    assert out.shape == (rows, 203)
    assert_the_quantized_product(out, x, blocks.dequantize().double(), None)


@needs_kernel
def test_model_sized_rows_read_in_place_and_split_over_threads(monkeypatch):
    monkeypatch.setattr(kernel, "min_parallel_macs", 0)  # however small the call
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 576, 1536)
    packed = PackedQ4.from_blocks(blocks)
    x = torch.randn(2, 3072)[:, :1536]  # rows 3072 apart, read in place
    alone = kernel.q4_linear(packed, x, None)
    assert_the_quantized_product(alone, x, dense(blocks), None)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = kernel.q4_linear(packed, x, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


@needs_kernel
@pytest.mark.parametrize("rows", [1, INT16_MAX_ROWS, INT16_MAX_ROWS + 1])
def test_layers_send_small_steps_to_it(rows):
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 64, 96)
    bias = torch.randn(64)
    layer = Q4Linear(blocks, bias, DequantScratch(torch.float32))
    x = torch.randn(rows, 96)
    out = layer(x)
    if rows <= INT16_MAX_ROWS:
        assert torch.equal(out, kernel.q4_linear(layer.packed, x, bias))
    else:  # the float32 kernel: exactly the GGUF weights, float32 summation error only
        torch.testing.assert_close(out.double(), x.double() @ dense(blocks).T + bias.double(), rtol=1e-5, atol=1e-5)
    head_blocks = random_q8(48, 3 * 32)
    head = Q8Linear(head_blocks, torch.float32)
    assert torch.equal(head(x[:, :96]), kernel.q8_linear(head_blocks, x[:, :96]))


@needs_kernel
def test_a_decode_step_gives_it_every_thread(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # kvfleet's default: a small step runs torch on one thread
    packed = PackedQ4.from_blocks(random_blocks(GGMLQuantizationType.Q4_1, 195, 7 * 32))
    x = torch.randn(1, 7 * 32)
    alone = kernel.q4_linear(packed, x, None)  # a call this small takes one thread outside a step
    function, threads_taken = kernel.q4_function, []
    monkeypatch.setattr(kernel, "q4_function", lambda *args: (threads_taken.append(args[-1]), function(*args))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with step_threads(torch.device("cpu"), 1):  # a model without these GEMMs: its helpers sleep
            assert torch.get_num_threads() == 1 and decode_threads() == 0
        with step_threads(torch.device("cpu"), 1, decode_gemms=True):
            assert torch.get_num_threads() == 1 and decode_threads() == 2
            in_step = kernel.q4_linear(packed, x, None)
        assert decode_threads() == 0
    finally:
        torch.set_num_threads(before)
    assert threads_taken == [2] and torch.equal(in_step, alone)  # each output row on one thread: the same bits

