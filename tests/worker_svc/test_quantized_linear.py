"""4-bit GGUF weights run as stored: the blocks read back exactly what gguf's own
dequantizer reads, and Q4Linear's kernels compute the dense layer's product: the
float32 ones exactly, the int16 ones (AVX-512 VNNI where it runs, else AVX2 for decode
steps) within about 1e-5."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from worker_svc.formats.q4_weights import Q4Blocks
from worker_svc.kernels.cpu import vnni_gemm
from worker_svc.model.q4_linear import INT4_MAX_ROWS, INT16_MAX_ROWS, KERNEL_MAX_ROWS, DequantScratch, Q4Linear
from worker_svc.model.weights import _unpermute_rotary

KINDS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
SMALL_MAX_ROWS = max(KERNEL_MAX_ROWS, INT4_MAX_ROWS)  # beyond it every step takes the dequantized GEMM


def random_q4(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A matrix's GGUF bytes and the float weights gguf reads from them."""
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    raw = quantize(weights, kind)
    return raw, torch.from_numpy(dequantize(raw, kind).copy())


def dense(blocks: Q4Blocks) -> torch.Tensor:
    return blocks.dequantize(torch.empty(blocks.codes.numel())).clone()


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_blocks_hold_exactly_what_gguf_reads(kind):
    raw, expected = random_q4(kind, 96, 128)
    blocks = Q4Blocks.from_gguf(raw, kind)
    assert blocks.shape == (96, 128) and int(blocks.codes.max()) <= 15
    assert torch.equal(dense(blocks), expected)


def test_row_operations_match_the_dense_ones():
    kind = GGMLQuantizationType.Q4_1
    parts = [Q4Blocks.from_gguf(random_q4(kind, rows, 64, seed=rows)[0], kind) for rows in (32, 64)]
    fused = Q4Blocks.cat(parts)
    assert torch.equal(dense(fused), torch.cat([dense(part) for part in parts]))
    unpermuted = fused.map_rows(lambda rows: _unpermute_rotary(rows, 3))
    assert torch.equal(dense(unpermuted), _unpermute_rotary(dense(fused), 3))


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [1, SMALL_MAX_ROWS, SMALL_MAX_ROWS + 1, SMALL_MAX_ROWS + 8])
@pytest.mark.parametrize("int16_kernel", [True, False], ids=["int16", "float32"])
def test_the_kernels_compute_the_dense_product(kind, rows, int16_kernel, monkeypatch):
    if not int16_kernel:
        monkeypatch.setattr(vnni_gemm, "load", lambda: None)
    raw, weight = random_q4(kind, 192, 256)
    bias = torch.randn(192)
    layer = Q4Linear(Q4Blocks.from_gguf(raw, kind), bias, DequantScratch(torch.float32))
    x = torch.randn(rows, 256)
    out, expected = layer(x), F.linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    if layer.panels is not None or (layer.int16 is not None and rows <= INT16_MAX_ROWS):  # int16 activations
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    elif layer.packed is None and rows <= INT4_MAX_ROWS:  # torch's int4: bfloat16 activations, about 3 digits
        torch.testing.assert_close(out, expected, atol=0.02, rtol=0.02)
    else:  # kvfleet's 4-bit kernel or the float32 GEMM, over the same weights
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_layers_share_one_scratch_buffer_sized_for_the_largest(monkeypatch):
    monkeypatch.setattr(vnni_gemm, "load", lambda: None)  # which never dequantizes
    kind = GGMLQuantizationType.Q4_1
    scratch = DequantScratch(torch.float32)
    small = Q4Linear(Q4Blocks.from_gguf(random_q4(kind, 32, 64)[0], kind), None, scratch)
    large_raw, large_weight = random_q4(kind, 64, 128)
    large = Q4Linear(Q4Blocks.from_gguf(large_raw, kind), None, scratch)
    assert scratch.buffer.numel() == 64 * 128
    x = torch.randn(SMALL_MAX_ROWS + 3, 128)
    small(torch.randn(SMALL_MAX_ROWS + 3, 64))  # leaves its weights in the buffer
    torch.testing.assert_close(large(x), x @ large_weight.T, atol=1e-5, rtol=1e-5)
    assert scratch.buffer.numel() == 64 * 128
