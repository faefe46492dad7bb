"""The in-place paged prefill kernel against the torch backend's SDPA path (a gathered
copy and a mask for chunks with cached context), on random caches with scattered block
tables: whole prompts and chunks continuing cached context, of lengths either side of a
tile (24 rows with AVX2, 48 with AVX-512) and of a key block (64 keys), GQA groups that do
not divide a tile or outgrow it, head sizes from 24 to 320, decodes in the same batch,
split across threads; over float32 and 16-bit caches. Built for AVX2 alone, it gives the
same bits as built for this CPU."""
from __future__ import annotations

import pytest
import torch

from tests.worker_svc.paged_layout import random_layout
from worker_svc.attention.cpu import TorchAttentionBackend
from worker_svc.kernels.cpu import paged_decode, paged_prefill
from worker_svc.kernels.cpu.library import AVX2_CPU_FLAGS, AVX2_FLAGS, load_library

kernel = paged_prefill.load_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler or no AVX2 to build the kernel")


def attend(backend: TorchAttentionBackend, query_lens: list[int], seq_lens: list[int], num_heads: int,
           num_kv_heads: int, head_dim: int, threads: int, cache_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    torch.manual_seed(0)
    block_size, num_blocks = 16, 400
    layout = random_layout(query_lens, seq_lens, block_size, num_blocks)
    num_tokens = sum(query_lens)
    # The query a view of a wider row, as the fused QKV projection hands it over.
    query = torch.randn(num_tokens, num_heads + 1, head_dim)[:, :num_heads]
    key, value = torch.randn(num_tokens, num_kv_heads, head_dim), torch.randn(num_tokens, num_kv_heads, head_dim)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return backend.forward(query, key, value, cache, backend.build_metadata(layout), head_dim**-0.5)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim",
                         [(9, 3, 64), (4, 4, 32), (8, 1, 128), (10, 2, 80), (4, 2, 320), (32, 1, 64), (14, 2, 24)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_the_sdpa_path(num_heads: int, num_kv_heads: int, head_dim: int, threads: int) -> None:
    # Whole prompts of 2, 8, 23, 25 and 130 tokens; chunks of 3, 20 and 70 after 1, 64 and 200
    # cached tokens; and two decodes.
    query_lens = [2, 8, 3, 1, 23, 25, 20, 130, 1, 70]
    seq_lens = [2, 8, 4, 40, 23, 25, 84, 130, 65, 270]
    outputs = [attend(backend, query_lens, seq_lens, num_heads, num_kv_heads, head_dim, threads)
               for backend in (TorchAttentionBackend(), TorchAttentionBackend(prefill_kernel=kernel))]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (10, 2, 80), (14, 2, 24)])
def test_16_bit_caches(num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> None:
    """--kv-cache-dtype bfloat16/float16: blocks widened to float32 as the tile reads them,
    against SDPA over the values the cache holds (a whole prompt's own keys rounded too)."""
    query_lens, seq_lens = [2, 8, 3, 1, 25, 20, 130, 70], [2, 8, 4, 40, 25, 84, 130, 270]
    outputs = [attend(backend, query_lens, seq_lens, num_heads, num_kv_heads, head_dim, 2, cache_dtype)
               for backend in (TorchAttentionBackend(), TorchAttentionBackend(prefill_kernel=kernel))]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


def test_with_the_decode_kernel_too() -> None:
    """Both kernels in one step, as a CPU worker runs them: each writes only its own rows."""
    decode = paged_decode.load_kernel()
    if decode is None:
        pytest.skip("the decode kernel did not build")
    query_lens, seq_lens = [1, 40, 1, 1, 17], [30, 40, 1, 100, 90]
    outputs = [attend(backend, query_lens, seq_lens, 9, 3, 64, 2)
               for backend in (TorchAttentionBackend(), TorchAttentionBackend(decode, prefill_kernel=kernel))]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


def test_an_avx2_build_gives_the_bits_of_the_native_one() -> None:
    """Each lane is one row's sums in one order, whatever the vector's width: the AVX2 build
    (8 lanes, 24-row tiles), which CPUs without AVX-512 run, equals this CPU's to the bit."""
    avx2 = paged_prefill.PagedPrefillKernel(load_library(paged_prefill.SOURCE, AVX2_FLAGS, "the AVX2 prefill kernel",
                                                         needs=AVX2_CPU_FLAGS))
    assert avx2.tile_rows == 24
    query_lens, seq_lens = [2, 8, 3, 23, 25, 20, 130, 70], [2, 8, 4, 23, 25, 84, 130, 270]
    outputs = [attend(TorchAttentionBackend(prefill_kernel=built), query_lens, seq_lens, 9, 3, 64, 2)
               for built in (avx2, kernel)]
    assert torch.equal(outputs[0], outputs[1])


def test_threads_share_the_keys_read() -> None:
    """One long prompt on two threads: the tiles split where each has read about half the keys."""
    batch = kernel.batch([paged_prefill.PrefillChunk(0, 512, 512, 0)], torch.zeros(1, 32, dtype=torch.int64))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tiles, bounds = batch.tiles(9, 3)
    finally:
        torch.set_num_threads(previous)
    keys = [(row + kernel.tile_rows - 1) // 3 + 1 for row in tiles[:, 2].tolist()]  # its last token's
    first, split, last = bounds.tolist()
    assert (first, last) == (0, len(tiles))
    assert abs(sum(keys[:split]) - sum(keys) / 2) <= max(keys)  # within a tile of an even split
