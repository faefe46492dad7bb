"""The float32 4-bit GEMM kernel (worker_svc/kernels/cpu/csrc/q4_gemm.cpp) computes x @ W.T + bias over
exactly the GGUF weights, for every step size it serves, and Q4Linear routes to it
where the int16 kernels (test_vnni_kernel.py, test_int16_kernel.py) do not run."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from worker_svc.formats.q4_weights import Q4Blocks
from worker_svc.kernels.cpu import int16_gemm, library, q4_gemm, vnni_gemm
from worker_svc.kernels.cpu.q4_gemm import PackedQ4
from worker_svc.model.q4_linear import KERNEL_MAX_ROWS, DequantScratch, Q4Linear

KINDS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]

kernel = q4_gemm.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no AVX2/FMA/F16C CPU or no compiler")


@pytest.fixture(autouse=True)
def without_the_int16_kernels(monkeypatch):
    """Q4Linear as on a CPU without AVX-512 VNNI, and with its decode steps' AVX2 int16 kernel off."""
    monkeypatch.setattr(vnni_gemm, "load", lambda: None)
    monkeypatch.setattr(int16_gemm, "load", lambda: None)


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> Q4Blocks:
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    return Q4Blocks.from_gguf(quantize(weights, kind), kind)


def reference(blocks: Q4Blocks, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    weight = blocks.dequantize(torch.empty(blocks.codes.numel())).double()
    out = x.double() @ weight.T
    return (out if bias is None else out + bias.double()).float()


@needs_kernel
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 12, 17, 32])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_kernel_equals_the_float32_product(kind, rows, with_bias):
    # 7 blocks of 32 inputs (an odd count) and 195 outputs (odd: the last one is its own tile).
    blocks = random_blocks(kind, 195, 7 * 32, seed=rows)
    packed = PackedQ4.from_blocks(blocks)
    assert packed is not None
    x = torch.randn(rows, 7 * 32, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(195) if with_bias else None
    out = kernel.linear(packed, x, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 195)
    # Against a float64 product of the same weights: only float32 summation error remains.
    torch.testing.assert_close(out, reference(blocks, x, bias), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_packing_dequantizes_and_unpacks_to_exactly_the_blocks(kind):
    blocks = random_blocks(kind, 195, 7 * 32)
    packed = PackedQ4.from_blocks(blocks)
    expected = blocks.dequantize(torch.empty(blocks.codes.numel()))
    assert torch.equal(kernel.dequantize(packed, torch.empty(195 * 7 * 32 + 5)), expected)
    unpacked = packed.to_blocks()
    assert all(torch.equal(getattr(unpacked, field), getattr(blocks, field)) for field in ("codes", "scales", "offsets"))


@needs_kernel
def test_big_steps_dequantize_the_packing_and_keep_no_blocks():
    blocks = random_blocks(GGMLQuantizationType.Q4_0, 64, 96)
    layer = Q4Linear(blocks, None, DequantScratch(torch.float32))
    assert layer.blocks is None  # only the packing holds the weights
    x = torch.randn(KERNEL_MAX_ROWS + 1, 96)
    torch.testing.assert_close(layer(x), reference(blocks, x, None), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.int4_matmul(x[:3]), reference(blocks, x[:3], None), rtol=0.02, atol=0.02)


@needs_kernel
@pytest.mark.parametrize("rows", [2, KERNEL_MAX_ROWS + 1])
def test_a_bfloat16_model_keeps_its_blocks_for_big_steps(rows):
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 64, 96)
    layer = Q4Linear(blocks, None, DequantScratch(torch.bfloat16))
    assert layer.blocks is not None and layer.packed is not None  # the kernel dequantizes to float32 only
    x = torch.randn(rows, 96)
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(blocks, x, None), rtol=0.05, atol=0.05)


@needs_kernel
def test_kernel_takes_model_sized_rows_and_strided_inputs():
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 576, 1536)
    x = torch.randn(6, 3072)[:, ::2]  # not contiguous
    out = kernel.linear(PackedQ4.from_blocks(blocks), x, None)
    torch.testing.assert_close(out, reference(blocks, x, None), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_threads_split_output_rows_without_changing_a_bit(monkeypatch):
    monkeypatch.setattr(kernel, "min_parallel_macs", 0)  # however small the call
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 301, 5 * 32)
    packed = PackedQ4.from_blocks(blocks)
    x = torch.randn(9, 5 * 32)
    alone = kernel.linear(packed, x, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = kernel.linear(packed, x, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


@needs_kernel
def test_under_a_passive_wait_policy_small_calls_stay_on_one_thread(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert q4_gemm.Q4Kernel(kernel.library).min_parallel_macs == q4_gemm.PASSIVE_PARALLEL_MIN_MACS
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # idle threads spin: waking them costs nothing
    assert q4_gemm.Q4Kernel(kernel.library).min_parallel_macs == 0


def test_a_scale_float16_cannot_hold_keeps_the_layer_off_the_kernel():
    blocks = random_blocks(GGMLQuantizationType.Q4_0, 16, 64)
    huge = Q4Blocks(blocks.codes, blocks.scales * 1e4, blocks.offsets * 1e4)  # -8 x scale beyond float16
    assert PackedQ4.from_blocks(huge) is None
    assert Q4Linear(huge, None, DequantScratch(torch.float32)).int4_weight is not None


@needs_kernel
@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS])
def test_quantized_linear_routes_small_steps_to_the_kernel(rows, monkeypatch):
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 64, 96)
    bias = torch.randn(64)
    layer = Q4Linear(blocks, bias, DequantScratch(torch.float32))
    assert layer.int4_weight is None  # torch's int4 copy is not kept beside the kernel's
    monkeypatch.setattr(layer, "dequantized_matmul", lambda rows: pytest.fail("took the dequantized GEMM"))
    x = torch.randn(rows, 96)
    torch.testing.assert_close(layer(x), reference(blocks, x, bias), rtol=1e-5, atol=1e-5)


def test_without_the_kernel_small_steps_take_torchs_int4(monkeypatch):
    monkeypatch.setattr(q4_gemm, "load", lambda: None)
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 64, 96)
    layer = Q4Linear(blocks, None, DequantScratch(torch.float32))
    assert layer.packed is None and layer.int4_weight is not None
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), reference(blocks, x, None), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"])
def test_a_missing_or_failing_compiler_warns_and_serves_on(compiler, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setattr(library, "cpu_flags", lambda: set(library.AVX2_CPU_FLAGS))
    q4_gemm.load.cache_clear()
    try:
        assert q4_gemm.load() is None
    finally:
        q4_gemm.load.cache_clear()
    assert "the 4-bit GEMM kernel" in caplog.text and "using torch instead" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


@needs_kernel
def test_the_build_is_cached_and_loads_without_compiling(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    q4_gemm.load.cache_clear()
    try:
        assert q4_gemm.load() is not None
        (library,) = tmp_path.glob("kernels/q4_gemm-*.so")
        monkeypatch.setenv("CXX", "no-such-compiler")  # a second process finds the library built
        q4_gemm.load.cache_clear()
        assert q4_gemm.load() is not None
    finally:
        q4_gemm.load.cache_clear()
