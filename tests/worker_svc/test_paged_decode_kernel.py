"""The in-place paged decode kernel against the torch backend's gather-then-SDPA path,
on random caches with scattered block tables: decodes of many lengths (block edges,
one key, longer than a score chunk), GQA groups of several sizes (up to 32 query heads a
kv head), token rows that end mid cache line, mixed with prompt
chunks in one batch, split across threads; over float32 and 16-bit caches."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.worker_svc.paged_layout import random_layout
from worker_svc.attention.backend import BatchLayout
from worker_svc.attention.cpu import SHORT_CHUNK_TOKENS, TorchAttentionBackend
from worker_svc.kernels.cpu.paged_decode import load_kernel

kernel = load_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler or no AVX2 to build the kernel")


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim",
                         [(9, 3, 64), (4, 4, 32), (8, 1, 128), (10, 2, 80), (4, 2, 320), (32, 1, 64), (4, 1, 24)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_the_gather_path(num_heads: int, num_kv_heads: int, head_dim: int, threads: int,
                                       cache_dtype: torch.dtype = torch.float32) -> None:
    torch.manual_seed(0)
    block_size = 16
    # Decodes of 1, 16, 17, 64, 65 and 300 keys, a prompt chunk with earlier context between
    # them, and two speculative steps (a token and its drafts), which run as decodes.
    query_lens = [1, 1, 20, 1, 1, 1, 1, 3, SHORT_CHUNK_TOKENS]
    seq_lens = [1, 16, 50, 17, 64, 65, 300, 40, 100]
    num_blocks = 200  # more than the 9 x 19 the tables take: some blocks belong to nobody
    layout = replace(random_layout(query_lens, seq_lens, block_size, num_blocks), verifying=(7, 8))
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim)
    key, value = torch.randn(num_tokens, num_kv_heads, head_dim), torch.randn(num_tokens, num_kv_heads, head_dim)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outputs = []
        for backend in (TorchAttentionBackend(), TorchAttentionBackend(kernel)):
            written = cache.clone()
            outputs.append(backend.forward(query, key, value, written, backend.build_metadata(layout), head_dim**-0.5))
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (10, 2, 80), (4, 1, 24)])
def test_16_bit_caches(num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> None:
    """--kv-cache-dtype bfloat16/float16: the kernel reads 16-bit rows (half the bytes) and
    attends over the same values the gather path widens to float32."""
    test_kernel_equals_the_gather_path(num_heads, num_kv_heads, head_dim, 2, cache_dtype)


def test_a_speculative_step_gets_the_bits_of_its_tokens_decoded_one_by_one() -> None:
    """A speculative step's token and drafts attend as decodes, each over the keys up to its
    own position: what each row gets is what decoding that token alone gets, to the bit. A
    prompt's chunk as short keeps the prompt path (a cached prefix changes no bits)."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 40
    chunk, context = 5, 70
    prompt_chunk = random_layout([chunk], [context], block_size, num_blocks)
    assert TorchAttentionBackend(kernel).build_metadata(prompt_chunk).prefills
    layout = replace(prompt_chunk, verifying=(0,))
    query = torch.randn(chunk, num_heads, head_dim)
    key, value = torch.randn(chunk, num_kv_heads, head_dim), torch.randn(chunk, num_kv_heads, head_dim)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    backend = TorchAttentionBackend(kernel)
    together = backend.forward(query, key, value, cache, backend.build_metadata(layout), head_dim**-0.5)
    for token in range(chunk):  # the cache holds every token's key: each sees up to its own
        alone = BatchLayout(torch.tensor([1]), torch.tensor([context - chunk + token + 1]), layout.block_tables,
                            layout.slot_mapping[token : token + 1], block_size, 1)
        rows = slice(token, token + 1)
        out = backend.forward(query[rows], key[rows], value[rows], cache, backend.build_metadata(alone), head_dim**-0.5)
        assert torch.equal(out[0], together[token])
