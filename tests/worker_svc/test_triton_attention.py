"""The Triton attention kernels against plain torch attention over the gathered blocks,
run by Triton's interpreter on the CPU: random caches with shuffled block tables,
contexts that cross block and tile edges, GQA groups of 1, 3, 4 and 8, decodes mixed
with whole prompts and chunks after a cached prefix, padding rows (slot -1), bfloat16
and float32. Shapes stay small: the interpreter runs Python for every program."""
from __future__ import annotations

import pytest
import torch

import worker_svc.kernels.triton.interpreter  # noqa: F401  (before the kernels: the interpreter without CUDA)
from worker_svc.attention.backend import BatchLayout
from worker_svc.attention.cpu import TorchAttentionBackend
from worker_svc.attention.gpu import TritonAttentionBackend
from worker_svc.kernels.triton.cache_write import reshape_and_cache
from worker_svc.kernels.triton.paged_decode import MAX_SPLITS, choose_num_splits, paged_decode_attention
from worker_svc.kernels.triton.paged_prefill import paged_prefill_attention

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_layout(query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int) -> BatchLayout:
    """Each request's blocks drawn at random from the pool, its table padded with 0 as the
    worker's are; its new tokens' slots after its context."""
    needed = [-(-n // block_size) for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int64)
    pool = torch.randperm(num_blocks).tolist()
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(pool[:count])
        pool = pool[count:]
    slots = []
    for table, queries, length in zip(tables.tolist(), query_lens, seq_lens):
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(length - queries, length)]
    return BatchLayout(torch.tensor(query_lens), torch.tensor(seq_lens), tables, torch.tensor(slots), block_size,
                       max(query_lens))


def reference(
    query: torch.Tensor, kv_cache: torch.Tensor, layout: BatchLayout, scale: float
) -> torch.Tensor:
    """Each request's K and V gathered from its blocks, causal softmax in float32."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    outputs, start = [], 0
    for table, queries, length in zip(layout.block_tables, layout.query_lens.tolist(), layout.seq_lens.tolist()):
        blocks = table[: -(-length // block_size)]
        k, v = (kv_cache[i, blocks].flatten(0, 1)[:length].float().repeat_interleave(group, 1) for i in (0, 1))
        q = query[start : start + queries].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(length - queries, length)
        scores.masked_fill_(torch.arange(length)[None, :] > positions[:, None], float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += queries
    return torch.cat(outputs)


def random_step(
    query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype,
) -> tuple[BatchLayout, torch.Tensor, torch.Tensor]:
    """A layout, a query and a random cache with the step's K and V already written."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5  # some blocks belong to nobody
    layout = random_layout(query_lens, seq_lens, block_size, num_blocks)
    query = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    return layout, query, kv_cache


def block_tables(layout: BatchLayout) -> torch.Tensor:
    return layout.block_tables.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_each_slot_and_skips_padding(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    block_size, num_kv_heads, head_dim = 16, 3, 24  # neither 3 heads nor 24 dims is a power of two
    kv_cache = torch.randn(2, 6, block_size, num_kv_heads, head_dim).to(dtype)
    slots = torch.tensor([5, -1, 16, 17, 95, -1, 40])  # across blocks 0, 1, 5 and 2; two padding rows
    key = torch.randn(len(slots), num_kv_heads, head_dim).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_dim).to(dtype)
    expected = kv_cache.clone()
    real = slots >= 0
    expected[0].view(-1, num_kv_heads, head_dim)[slots[real]] = key[real]
    expected[1].view(-1, num_kv_heads, head_dim)[slots[real]] = value[real]
    reshape_and_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits",
    [
        (2, 2, 64, 16, torch.float32, None),  # one split (the automatic choice here): the direct store
        (3, 1, 128, 32, torch.bfloat16, 3),  # a group of 3, padded
        (8, 2, 16, 16, torch.float32, 8),  # more splits than most sequences have tiles: empty splits
        (8, 1, 32, 32, torch.bfloat16, 2),
    ],
)
def test_decode_equals_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, num_splits: int | None
) -> None:
    torch.manual_seed(1)
    seq_lens = [1, 17, 64, 65, 300]  # one key, block and tile edges, several tiles
    layout, query, kv_cache = random_step([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim,
                                          block_size, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(query, kv_cache, block_tables(layout), layout.seq_lens.to(torch.int32), scale,
                                 num_splits=num_splits)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(query, kv_cache, layout, scale),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_decode_of_a_padding_row_is_zero() -> None:
    """A CUDA graph pads the batch with rows of no keys: they must come out finite."""
    torch.manual_seed(2)
    layout, query, kv_cache = random_step([1, 1], [40, 1], 4, 2, 16, 16, torch.float32)
    seq_lens = torch.tensor([40, 0], dtype=torch.int32)
    for num_splits in (1, 2):
        out = paged_decode_attention(query, kv_cache, block_tables(layout), seq_lens, 0.25, num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[:1], reference(query[:1], kv_cache, layout_rows(layout, [0]), 0.25))


def layout_rows(layout: BatchLayout, rows: list[int]) -> BatchLayout:
    return BatchLayout(layout.query_lens[rows], layout.seq_lens[rows], layout.block_tables[rows],
                       layout.slot_mapping, layout.block_size, int(layout.query_lens[rows].max()))


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, dtype",
    [
        (2, 2, 64, 16, torch.float32),
        (6, 2, 32, 32, torch.bfloat16),
        (4, 1, 128, 16, torch.bfloat16),
        (8, 1, 16, 32, torch.float32),
    ],
)
def test_prefill_equals_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(3)
    # A decode, a whole prompt, a chunk after a cached prefix, a decode on a long context,
    # and a prompt longer than one query tile.
    query_lens = [1, 37, 20, 1, 70]
    seq_lens = [9, 37, 150, 200, 70]
    layout, query, kv_cache = random_step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    scale = head_dim**-0.5
    out = paged_prefill_attention(query, kv_cache, block_tables(layout), query_start_loc,
                                  layout.seq_lens.to(torch.int32), max(query_lens), scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(query, kv_cache, layout, scale),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("query_lens, seq_lens", [([1, 30, 1], [33, 30, 80]), ([1, 1, 1], [5, 48, 130])])
def test_backend_equals_torch_backend(query_lens: list[int], seq_lens: list[int], cache_dtype: torch.dtype) -> None:
    """A mixed step (the prefill kernel) and a decode-only step (the decode kernel), cache
    writes included, against the CPU reference backend; the Triton backend's batch also
    ends in a padding row, as a CUDA graph's would (no keys, slot -1). A float16 cache under
    the float32 model (--kv-cache-dtype float16) is written and read alike by both."""
    torch.manual_seed(4)
    num_heads, num_kv_heads, head_dim = 4, 1, 32
    layout, query, kv_cache = random_step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32)
    kv_cache = kv_cache.to(cache_dtype)
    key = torch.randn(len(query), num_kv_heads, head_dim)
    value = torch.randn(len(query), num_kv_heads, head_dim)
    expected_cache = kv_cache.clone()
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(query, key, value, expected_cache, torch_backend.build_metadata(layout), 0.2)

    padded = BatchLayout(
        torch.tensor(query_lens + [1]), torch.tensor(seq_lens + [0]),
        torch.cat([layout.block_tables, torch.zeros_like(layout.block_tables[:1])]),
        torch.cat([layout.slot_mapping, torch.tensor([-1])]), layout.block_size, layout.max_query_len,
    )
    query, key, value = (torch.cat([x, torch.randn_like(x[:1])]) for x in (query, key, value))
    backend = TritonAttentionBackend(num_splits=2)
    out = backend.forward(query, key, value, kv_cache, backend.build_metadata(padded), 0.2)
    assert torch.equal(kv_cache, expected_cache)
    torch.testing.assert_close(out[:-1], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_num_splits_grow_with_the_context_up_to_a_cap() -> None:
    assert choose_num_splits(1) == 1
    assert choose_num_splits(512) == 1
    assert choose_num_splits(513) == 2
    assert choose_num_splits(10**6) == MAX_SPLITS
