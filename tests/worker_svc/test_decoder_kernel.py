"""The CPU decoder kernels (worker_svc/kernels/cpu/decoder_ops.py) against the torch operators they
replace: the residual add, rotary embedding and cache write bit for bit; the norm and
SiLU within float32 rounding (another summation order, another exp). Odd widths, q and k
as strided views of a fused qkv projection, and one thread and two."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.kernels.cpu import decoder_ops
from worker_svc.model.layers import RMSNorm, RotaryEmbedding, apply_rotary

kernel = decoder_ops.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX2/FMA CPU or no compiler")
# Rows enough that the two-thread path runs too (PARALLEL_MIN_ELEMENTS).
TOKENS = [1, 7, 600]


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("width", [576, 60])
def test_add_rms_norm_matches_torch(width: int, num_tokens: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(width, 1e-5).requires_grad_(False)
    norm.weight.uniform_(0.5, 1.5)
    x, residual = torch.randn(num_tokens, width) * 3, torch.randn(num_tokens, width)
    normed, summed = kernel.rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(summed, residual + x)
    torch.testing.assert_close(normed, norm(residual + x), atol=1e-6, rtol=1e-6)
    alone, same = kernel.rms_norm(x, norm.weight, norm.eps)
    assert same is x or torch.equal(same, x)
    torch.testing.assert_close(alone, norm(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("width", [1536, 20])
def test_silu_and_mul_matches_torch_over_the_gate_half(width: int, num_tokens: int) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(num_tokens, 2 * width) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.0])  # past exp's range either way
    gate, up = (half.clone() for half in gate_up.chunk(2, dim=-1))
    out = kernel.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    assert out.data_ptr() == gate_up.data_ptr() and out.stride() == (2 * width, 1)  # no new buffer
    assert torch.equal(gate_up[:, width:], up)


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 24)])
def test_rotary_matches_torch_on_views_of_a_fused_projection(num_tokens: int, heads: int, kv_heads: int,
                                                             head_dim: int) -> None:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.device("cpu"))
    positions = torch.randint(0, 4096, (num_tokens,))
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
    expected_q, expected_k = apply_rotary(rotary.tables(positions, torch.float32), q, k)
    kernel.rotary_(q, k, positions, rotary.cos, rotary.sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 20])  # rows of whole vectors, and rows that end mid vector
def test_write_kv_copies_rows_to_their_slots_and_refuses_slots_outside_the_cache(cache_dtype: torch.dtype,
                                                                                 head_dim: int) -> None:
    """16-bit caches get torch's own rounding, to the bit: halfway cases, values past
    float16's range and NaN included."""
    torch.manual_seed(0)
    kv_heads, num_blocks, block_size = 3, 4, 16
    kv = torch.randn(5, (2 + 2 * kv_heads) * head_dim)  # [q | k | v] rows, as the projection gives them
    # bfloat16 halfway cases (ties to even, both ways), float16's overflow, and a NaN.
    kv[:, -8:] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 7e4, -7e4, float("nan"), 1e-8, 3.0])
    _, k, v = kv.split([2 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(5, kv_heads, head_dim), v.view(5, kv_heads, head_dim)
    slots = torch.tensor([63, 0, 17, 18, 40])
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    expected = cache.clone()
    expected[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(cache_dtype))
    expected[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(cache_dtype))
    kernel.write_kv(k, v, cache, slots)
    # To the bit, a zero's sign included; a NaN's payload aside: torch writes a bfloat16 NaN as
    # 0xFFFF, the kernel as a quiet NaN of the input's sign.
    nan = expected.isnan()
    bits = torch.int32 if cache_dtype == torch.float32 else torch.int16
    assert torch.equal(cache.isnan(), nan)
    assert torch.equal(cache.view(bits)[~nan], expected.view(bits)[~nan])
    with pytest.raises(IndexError, match="1 of 2 KV slots are outside the cache"):
        kernel.write_kv(k[:2], v[:2], cache, torch.tensor([3, num_blocks * block_size]))


def test_a_prompts_kv_rows_are_written_on_two_threads_as_on_one() -> None:
    """A prompt's rows (PARALLEL_MIN_ELEMENTS and more) are split over the threads; every
    slot outside the cache is still counted, and every one inside written."""
    kv_heads, head_dim, num_blocks, block_size = 3, 64, 256, 16
    tokens = decoder_ops.PARALLEL_MIN_ELEMENTS // (kv_heads * head_dim) + 7
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    outside = slots.clone()
    outside[::100] = num_blocks * block_size  # every 100th token's slot lies past the cache
    caches = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
            kernel.write_kv(k, v, cache, slots)
            with pytest.raises(IndexError, match=f"{len(outside[::100])} of {tokens} KV slots are outside"):
                kernel.write_kv(k * 2, v * 2, cache, outside)
            caches.append(cache)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(caches[0], caches[1])
    inside = torch.ones(tokens, dtype=torch.bool)
    inside[::100] = False
    assert torch.equal(caches[1][0].view(-1, kv_heads, head_dim)[slots[inside]], k[inside] * 2)
