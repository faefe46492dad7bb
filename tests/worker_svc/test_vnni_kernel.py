"""The int16 GEMM over GGUF blocks (worker_svc/kernels/cpu/csrc/vnni_gemm.cpp, AVX-512 VNNI): its
activation quantization is the one written here in torch, its product is that of the
quantized activations and exactly the GGUF weights (4-bit and 8-bit), it stays within
about 1e-5 of the float32 product, and Q4Linear and Q8Linear send every step to it
where it runs. The norm and the activation it computes as it quantizes are those of the
decoder kernels to the bit, so a fused step equals an unfused one."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.worker_svc.quantized_blocks import dense, quantized, random_blocks, random_q8
from worker_svc.formats.q4_weights import GROUP_SIZE, Q4Blocks
from worker_svc.kernels.cpu import decoder_ops, library, vnni_gemm
from worker_svc.kernels.cpu.vnni_gemm import QUANTIZE_PARALLEL_MIN_ELEMENTS, Q4Panels, Q8Panels
from worker_svc.model.layers import RMSNorm
from worker_svc.model.ops import CpuOps
from worker_svc.model.q4_linear import DequantScratch, Q4Linear
from worker_svc.model.q8_linear import Q8Linear

KINDS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]

kernel = vnni_gemm.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no AVX-512 VNNI CPU or no compiler")


@needs_kernel
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_kernel_computes_the_quantized_activations_product(kind, rows, with_bias):
    # 7 blocks of 32 inputs (an odd count) and 48 outputs (three panels).
    blocks = random_blocks(kind, 48, 7 * 32)
    x = torch.randn(rows, 7 * 32, generator=torch.Generator().manual_seed(rows))
    x[0, :GROUP_SIZE] = 0.0  # a block of zeros: scale 0, no division by it
    bias = torch.randn(48) if with_bias else None
    out = kernel.linear(Q4Panels.from_blocks(blocks), x, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 48)
    expected = quantized(x) @ dense(blocks).T + (0 if bias is None else bias.double())
    # Only float32 rounding of the scales' products remains.
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    exact = x.double() @ dense(blocks).T + (0 if bias is None else bias.double())
    assert (out.double() - exact).abs().max() <= 1e-4 * exact.abs().max()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 40])
def test_kernel_computes_the_8_bit_heads_product(rows):
    blocks = random_q8(64, 5 * 32, seed=rows)
    x = torch.randn(rows, 5 * 32, generator=torch.Generator().manual_seed(rows))
    out = kernel.linear(Q8Panels.from_blocks(blocks), x, None)
    weight = blocks.dequantize().double()
    torch.testing.assert_close(out.double(), quantized(x) @ weight.T, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 13, 100])
def test_the_head_sends_every_step_to_it_and_keeps_no_float32_copy(rows):
    blocks = random_q8(48, 3 * 32)
    head = Q8Linear(blocks, torch.float32)
    assert head.panels is not None and head.dense is None
    x = torch.randn(rows, 3 * 32)
    torch.testing.assert_close(head(x).double(), quantized(x) @ blocks.dequantize().double().T, rtol=1e-5,
                               atol=1e-5)
    assert Q8Linear(random_q8(40, 3 * 32), torch.float32).dense is not None  # 40 rows: no whole panels


@needs_kernel
@pytest.mark.parametrize("rows", [33, 350])  # 350: widened runs, in passes of 168 rows and a last of 14 (160 and 30 on AMX)
def test_model_sized_layers_and_strided_inputs(rows):
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 576, 1536)
    x = torch.randn(rows, 3072)[:, ::2]  # not contiguous
    panels = Q4Panels.from_blocks(blocks)
    out = kernel.linear(panels, x, None)
    torch.testing.assert_close(out.double(), quantized(x.contiguous()) @ dense(blocks).T, rtol=1e-5, atol=1e-5)
    gate = torch.cat([x, torch.randn(rows, 1536)], dim=1)[:, :1536]  # rows 3072 apart, read in place
    assert torch.equal(kernel.linear(panels, gate, None), out)


@needs_kernel
@pytest.mark.parametrize("rows", [19, QUANTIZE_PARALLEL_MIN_ELEMENTS // (5 * 32) + 3])  # quantized on 1, then 2 threads
def test_threads_split_panels_without_changing_a_bit(rows):
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 160, 5 * 32)
    panels = Q4Panels.from_blocks(blocks)
    x = torch.randn(rows, 5 * 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = kernel.linear(panels, x, None)
        torch.set_num_threads(2)
        together = kernel.linear(panels, x, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


needs_amx = pytest.mark.skipif(kernel is None or not kernel.amx, reason="no AMX-INT8 CPU, or Linux refused it")


@needs_amx
@pytest.mark.parametrize("rows", [48, 49, 63, 64, 350])  # 350: passes of 160 rows and a last one of 30
@pytest.mark.parametrize("head", [False, True], ids=["q4", "q8_head"])
def test_amx_tiles_give_the_vnni_kernels_output_to_the_bit(rows, head):
    plain = vnni_gemm.VnniKernel(vnni_gemm.plain_library(), amx=False)
    panels = (Q8Panels.from_blocks(random_q8(96, 1536, seed=rows)) if head
              else Q4Panels.from_blocks(random_blocks(GGMLQuantizationType.Q4_1, 96, 1536)))
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(96)
    assert torch.equal(kernel.linear(panels, x, bias), plain.linear(panels, x, bias))
    if not head:
        norm_weight = torch.rand(1536) + 0.5
        assert all(torch.equal(a, b) for a, b in zip(kernel.add_norm_linear(panels, x, x * 0.5, norm_weight, 1e-5, None),
                                                     plain.add_norm_linear(panels, x, x * 0.5, norm_weight, 1e-5, None)))
        gate_up = torch.randn(rows, 2 * 1536)
        assert torch.equal(kernel.silu_and_mul_linear(panels, gate_up, None),
                           plain.silu_and_mul_linear(panels, gate_up, None))


@needs_kernel
@pytest.mark.parametrize("rows", [13, 61])  # 61: the batch's runs widened, a row's not
def test_a_row_does_not_depend_on_its_batch(rows):
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 64, 4 * 32)
    panels = Q4Panels.from_blocks(blocks)
    x = torch.randn(rows, 4 * 32)
    together = kernel.linear(panels, x, None)
    assert all(torch.equal(kernel.linear(panels, x[i:i + 1], None)[0], together[i]) for i in range(rows))


fused_rows = pytest.mark.parametrize("rows", [1, 7, 37, QUANTIZE_PARALLEL_MIN_ELEMENTS // (18 * 32) + 5],
                                     ids=lambda rows: f"{rows}rows")  # the last quantized on 2 threads
needs_both_kernels = pytest.mark.skipif(kernel is None or decoder_ops.load() is None,
                                        reason="no AVX-512 VNNI CPU or no compiler")


@needs_both_kernels
@fused_rows
@pytest.mark.parametrize("with_residual", [False, True], ids=["first_layer", "residual"])
def test_the_norm_computed_as_it_quantizes_is_the_decoder_kernels_to_the_bit(rows, with_residual):
    layer = Q4Linear(random_blocks(GGMLQuantizationType.Q4_1, 64, 18 * 32), torch.randn(64),
                     DequantScratch(torch.float32))
    norm = RMSNorm(18 * 32, 1e-5)
    norm.weight.data = torch.rand(18 * 32) + 0.5
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 18 * 32, generator=generator) * 4 for _ in range(2))
    residual = residual if with_residual else None
    ops = CpuOps(decoder_ops.load())
    with torch.inference_mode():
        fused, fused_sum = ops.add_norm_linear(norm, layer, x, residual)
        hidden, summed = (ops.norm(norm, x), x) if residual is None else ops.add_norm(norm, x, residual)
        unfused = layer(hidden)
    assert torch.equal(fused, unfused) and torch.equal(fused_sum, summed)


@needs_both_kernels
@fused_rows
def test_the_activation_computed_as_it_quantizes_is_the_decoder_kernels_to_the_bit(rows):
    layer = Q4Linear(random_blocks(GGMLQuantizationType.Q4_0, 32, 18 * 32), None,
                     DequantScratch(torch.float32))
    gate_up = torch.randn(rows, 2 * 18 * 32, generator=torch.Generator().manual_seed(rows)) * 6
    ops = CpuOps(decoder_ops.load())
    with torch.inference_mode():
        fused = ops.silu_and_mul_linear(layer, gate_up)
        unfused = layer(ops.silu_and_mul(gate_up.clone()))
    assert torch.equal(fused, unfused)


@needs_kernel
def test_ops_fuse_only_where_the_projection_quantizes_its_input(monkeypatch):
    norm = RMSNorm(64, 1e-5)
    dense_layer = torch.nn.Linear(64, 32)
    x = torch.randn(5, 64)
    ops = CpuOps(decoder_ops.load())
    layer = Q4Linear(random_blocks(GGMLQuantizationType.Q4_1, 32, 64), None, DequantScratch(torch.float32))
    monkeypatch.setattr(layer, "kernel_matmul", lambda rows: pytest.fail("a fusable call took the unfused path"))
    with torch.inference_mode():
        ops.add_norm_linear(norm, layer, x, None)
        ops.silu_and_mul_linear(layer, torch.randn(5, 128))
        hidden, _ = ops.add_norm_linear(norm, dense_layer, x, x)
    torch.testing.assert_close(hidden, dense_layer(norm(x + x)))


def test_shapes_that_do_not_tile_or_scales_float16_cannot_hold_are_refused():
    blocks = random_blocks(GGMLQuantizationType.Q4_0, 24, 64)  # 24 rows: not whole panels
    assert Q4Panels.from_blocks(blocks) is None
    blocks = random_blocks(GGMLQuantizationType.Q4_0, 16, 64)
    huge = Q4Blocks(blocks.codes, blocks.scales * 1e4, blocks.offsets * 1e4)  # -8 x scale beyond float16
    assert Q4Panels.from_blocks(huge) is None


@needs_kernel
@pytest.mark.parametrize("rows", [1, 24, 25, 300])
def test_quantized_linear_sends_every_step_to_it_and_keeps_nothing_else(rows, monkeypatch):
    blocks = random_blocks(GGMLQuantizationType.Q4_1, 64, 96)
    bias = torch.randn(64)
    scratch = DequantScratch(torch.float32)
    layer = Q4Linear(blocks, bias, scratch)
    assert layer.panels is not None and layer.packed is None and layer.blocks is None and layer.int4_weight is None
    assert scratch.buffer.numel() == 0  # no dequantized copy is ever made
    for path in ("int4_matmul", "dequantized_matmul"):
        monkeypatch.setattr(layer, path, lambda rows, path=path: pytest.fail(f"took {path}"))
    x = torch.randn(rows, 96)
    torch.testing.assert_close(layer(x).double(), quantized(x) @ dense(blocks).T + bias.double(), rtol=1e-5,
                               atol=1e-5)


def test_a_cpu_without_vnni_keeps_the_float32_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(library, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    vnni_gemm.load.cache_clear()
    try:
        assert vnni_gemm.load() is None
        layer = Q4Linear(random_blocks(GGMLQuantizationType.Q4_1, 64, 96), None, DequantScratch(torch.float32))
    finally:
        vnni_gemm.load.cache_clear()
    assert layer.panels is None and (layer.packed is not None or layer.int4_weight is not None)
    assert "the AVX-512 VNNI int16 GEMM kernel for GGUF blocks" in caplog.text and "avx512_vnni" in caplog.text
    assert not list(tmp_path.rglob("vnni_gemm-*.so"))


@needs_kernel
def test_a_decode_step_gives_it_every_thread(monkeypatch):
    """As the AVX2 int16 kernel (test_int16_kernel.py): in a step of few tokens of a model
    whose decode GEMMs take every thread, each call takes them, with the same bits."""
    from worker_svc.kernels.cpu.threads import decode_threads, step_threads

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # kvfleet's default: a small step runs torch on one thread
    panels = Q4Panels.from_blocks(random_blocks(GGMLQuantizationType.Q4_1, 48, 7 * 32))
    x = torch.randn(1, 7 * 32)
    alone = kernel.linear(panels, x, None)  # a call this small takes one thread outside a step
    function, threads_taken = kernel._functions[Q4Panels], []
    monkeypatch.setitem(kernel._functions, Q4Panels, lambda *args: (threads_taken.append(args[-2]), function(*args))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with step_threads(torch.device("cpu"), 1, decode_gemms=True):
            assert torch.get_num_threads() == 1 and decode_threads() == 2
            in_step = kernel.linear(panels, x, None)
    finally:
        torch.set_num_threads(before)
    assert threads_taken == [2] and torch.equal(in_step, alone)  # each output panel on one thread: the same bits
