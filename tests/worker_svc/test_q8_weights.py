"""8-bit GGUF weights kept as stored (--quantization gguf): Q8Blocks read exactly what
gguf's dequantizer reads, the embedding looks its rows up from them, and the LM head
(csrc/q8_gemm.cpp for few rows, a packed float32 copy for more; the int16 kernels' own
tests hold theirs) computes x @ W.T over
exactly those weights; the model holds no float32 embedding."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvfleet import LLM
from worker_svc.formats.q8_weights import Q8Blocks
from worker_svc.kernels.cpu import int16_gemm, q8_gemm, vnni_gemm
from worker_svc.model.q8_linear import KERNEL_MAX_ROWS, Q8Linear

kernel = q8_gemm.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no AVX2/FMA/F16C CPU or no compiler")


def random_raw(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    return quantize(weights, GGMLQuantizationType.Q8_0)


def dense(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))


def test_blocks_rows_and_slices_are_ggufs_weights():
    raw = random_raw(203, 5 * 32)
    blocks, weight = Q8Blocks.from_gguf(raw), dense(raw)
    ids = torch.tensor([[0, 202], [17, 17]])
    assert torch.equal(blocks.rows(ids, torch.float32), weight[ids])
    assert blocks.rows(ids, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(blocks.dequantize(), weight)
    padded = blocks.padded(208)
    assert padded.shape == (208, 5 * 32)
    assert torch.equal(padded.rows(torch.arange(208), torch.float32), torch.cat((weight, torch.zeros(5, 5 * 32))))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "dense"])
def test_head_equals_the_float32_product(rows, use_kernel, monkeypatch):
    if use_kernel and kernel is None:
        pytest.skip("no kernel here")
    # The float32 paths (tests/worker_svc/test_vnni_kernel.py and test_int16_kernel.py have the int16 ones).
    monkeypatch.setattr(vnni_gemm, "load", lambda: None)
    monkeypatch.setattr(int16_gemm, "load", lambda: None)
    if not use_kernel:
        monkeypatch.setattr(q8_gemm, "load", lambda: None)
    # 203 outputs (not a multiple of the kernel's tiles) of 5 blocks (an odd count).
    raw = random_raw(203, 5 * 32, seed=rows)
    head = Q8Linear(Q8Blocks.from_gguf(raw), torch.float32)
    assert (head.panels, head.kernel is not None) == (None, use_kernel)
    x = torch.randn(rows, 5 * 32, generator=torch.Generator().manual_seed(rows))
    out = head(x)
    assert out.shape == (rows, 203) and out.dtype == torch.float32
    expected = (x.double() @ dense(raw).double().T).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def gguf_llm():
    llm = LLM("smollm2", quantization="gguf", max_model_len=256)
    yield llm
    llm.engine.worker.close()


def test_the_model_keeps_its_embedding_and_head_8_bit(gguf_llm):
    model = gguf_llm.engine.worker.model
    assert model.embed_tokens.q8 is not None and model.embed_tokens.weight is None
    assert isinstance(model.lm_head, Q8Linear) and model.lm_head.blocks is model.embed_tokens.q8  # tied: one copy
    # Its small steps' GEMMs take every thread where the AVX2 int16 or the AVX-512 VNNI kernel runs them
    # (test_int16_kernel.py, test_vnni_kernel.py).
    assert gguf_llm.engine.worker.decode_gemms == (model.lm_head.int16 is not None or model.lm_head.panels is not None)
    # Big steps take the head's packed float32 copy, or the int16 kernel (which needs none); nothing else
    # holds the vocabulary in float32.
    assert (model.lm_head.panels is None) == (model.lm_head.dense is not None)
    assert not any(p.numel() >= model.lm_head.blocks.codes.numel() for p in model.parameters())
