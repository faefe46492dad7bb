"""Reference paged attention in plain torch, for the CPU.

Decodes (one query token each) are sorted by context length and cut into groups of
about DECODE_GROUP_TOKENS padded context tokens; each group gathers its KV blocks
and runs one masked SDPA call. Small groups keep the gathered K and V in the CPU
cache between the copy and the attention, which made decode attention about 5x
faster here than one gather over the whole batch. With the paged decode kernel
(float32, a C compiler at hand) decodes read K and V in place instead, with no
gather: decode attention was about half of a batched step's time, mostly copying. It
also takes a speculative step's token and drafts (up to SHORT_CHUNK_TOKENS), a row a
token: each draft then attends as the token it stands for would be decoded, to the bit.
With the paged prefill kernel, prompt chunks (whole prompts and chunks that continue
cached context alike) read the cache in place too, all in one call a layer; without it
each runs one SDPA call, a chunk with context over a gathered copy and a mask. Index
tensors and masks are built once per step and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.attention.backend import AttentionBackend, BatchLayout
from worker_svc.kernels.cpu.decoder_ops import DecoderKernel
from worker_svc.kernels.cpu.paged_decode import DecodeBatch, PagedDecodeKernel
from worker_svc.kernels.cpu.paged_prefill import PagedPrefillKernel, PrefillBatch, PrefillChunk

DECODE_GROUP_TOKENS = 4096
# With the decode kernel, a speculative step's token and its drafts, up to this many tokens
# in all, run as decode rows, each seeing the keys up to its own position, as each would be
# decoded alone: the prefill kernel's tile computes all its 48 lanes (16 tokens of
# SmolLM2's 3-head groups) however few rows it holds. (A prompt's chunk keeps the prefill
# kernel however short: a prompt whose prefix was cached gets the bits of one that was
# not.) Measured, one chunk against a float16 cache, 2 threads, us a layer, decode rows /
# prefill tile:
#   context     2 tokens    4 tokens    8 tokens    10 tokens
#   128          25 / 62     34 / 63     47 / 60     56 / 41
#   512          72 / 181   105 / 182   174 / 174   193 / 170
#   2048        270 / 721   396 / 696   615 / 653   731 / 431
SHORT_CHUNK_TOKENS = 8


@dataclass
class ContextGather:
    """Where a batch of sequences finds its context: whole blocks, then a mask."""

    block_ids: torch.Tensor  # [num_seqs * blocks_per_seq] flattened, padded block tables
    num_seqs: int
    num_slots: int  # blocks_per_seq * block_size
    mask: torch.Tensor | None  # [num_seqs, 1, queries, num_slots], True where a key is visible

    def keys_values(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_seqs, num_kv_heads, num_slots, head_dim] K and V, in `dtype`."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        shape = (self.num_seqs, self.num_slots, num_kv_heads, head_dim)
        key = kv_cache[0].index_select(0, self.block_ids).view(shape).transpose(1, 2)
        value = kv_cache[1].index_select(0, self.block_ids).view(shape).transpose(1, 2)
        return key.to(dtype), value.to(dtype)


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [g] batch rows of these single-token requests
    context: ContextGather


@dataclass
class PrefillSpan:
    start: int  # first row in the flattened batch
    end: int
    # None when the chunk is the whole context, so plain causal attention over the
    # chunk's own K and V works without touching the cache.
    context: ContextGather | None


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    decode_batch: DecodeBatch | None  # with the kernel, every decode (and no decode_groups)
    prefill_batch: PrefillBatch | None  # with the kernel, every prompt chunk (and no prefills)


def _as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == cache_dtype else x.to(cache_dtype).to(x.dtype)


def _gather(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_lens: list[int], block_size: int) -> ContextGather:
    num_blocks = -(-int(seq_lens.max()) // block_size)
    num_slots = num_blocks * block_size
    keys = torch.arange(num_slots, device=block_tables.device)
    # Query j of a sequence with L keys and n queries sits at position L - n + j.
    offsets = torch.arange(max(query_lens), device=block_tables.device)
    query_pos = seq_lens[:, None] - torch.tensor(query_lens, device=seq_lens.device)[:, None] + offsets[None, :]
    mask = keys[None, None, :] <= query_pos[:, :, None]
    return ContextGather(block_tables[:, :num_blocks].reshape(-1), len(query_lens), num_slots, mask[:, None])


def _prefill_spans(layout: BatchLayout, chunks: list[int], query_lens: list[int], seq_lens: list[int],
                   starts: list[int]) -> list[PrefillSpan]:
    spans = []
    for i in chunks:
        n = query_lens[i]
        context = None
        if seq_lens[i] != n:
            context = _gather(layout.block_tables[i : i + 1], layout.seq_lens[i : i + 1], [n], layout.block_size)
        spans.append(PrefillSpan(starts[i], starts[i + 1], context))
    return spans


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, decode_kernel: PagedDecodeKernel | None = None,
                 cache_writer: DecoderKernel | None = None, prefill_kernel: PagedPrefillKernel | None = None) -> None:
        """`decode_kernel`: run decodes with it. `cache_writer`:
        write new K and V with it, a row copy per token (index_copy_ went element by element:
        6% of a prompt's time). `prefill_kernel`: run prompt chunks with it."""
        self.decode_kernel = decode_kernel
        self.cache_writer = cache_writer
        self.prefill_kernel = prefill_kernel

    def build_metadata(self, layout: BatchLayout) -> TorchAttentionMetadata:
        query_lens = layout.query_lens.tolist()
        seq_lens = layout.seq_lens.tolist()
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        verifying = set(layout.verifying) if self.decode_kernel is not None else set()
        as_decodes = [n == 1 or (i in verifying and n <= SHORT_CHUNK_TOKENS) for i, n in enumerate(query_lens)]
        chunks = [i for i, decodes in enumerate(as_decodes) if not decodes]
        prefills, prefill_batch = [], None
        if self.prefill_kernel is not None:
            prefill_batch = self.prefill_kernel.batch(
                [PrefillChunk(starts[i], query_lens[i], seq_lens[i], i) for i in chunks], layout.block_tables,
            ) if chunks else None
        else:
            prefills = _prefill_spans(layout, chunks, query_lens, seq_lens, starts)
        if self.decode_kernel is not None:
            # (row, sequence, keys it sees): token j of n sees the context up to its own position.
            rows = [(starts[i] + j, i, seq_lens[i] - n + j + 1)
                    for i, n in enumerate(query_lens) if as_decodes[i] for j in range(n)]
            batch = self.decode_kernel.batch(*map(list, zip(*rows)), layout.block_tables) if rows else None
            return TorchAttentionMetadata(layout.slot_mapping, [], prefills, batch, prefill_batch)
        decodes = sorted((seq_lens[i], i) for i, n in enumerate(query_lens) if n == 1)
        groups = []
        while decodes:
            # Sorted ascending, so the group's last member sets its padded length.
            size = 1
            while size < len(decodes) and decodes[size][0] * (size + 1) <= DECODE_GROUP_TOKENS:
                size += 1
            members = torch.tensor([i for _, i in decodes[:size]], device=layout.block_tables.device)
            decodes = decodes[size:]
            context = _gather(
                layout.block_tables[members], layout.seq_lens[members], [1] * len(members), layout.block_size
            )
            rows = torch.tensor([starts[i] for i in members.tolist()], device=members.device)
            groups.append(DecodeGroup(rows, context))
        return TorchAttentionMetadata(layout.slot_mapping, groups, prefills, None, prefill_batch)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        if self.cache_writer is not None:
            self.cache_writer.write_kv(key, value, kv_cache, metadata.slot_mapping)
        else:
            kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key.to(kv_cache.dtype))
            kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value.to(kv_cache.dtype))

        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # query may be a view
        if metadata.decode_batch is not None:
            self.decode_kernel(query, output, kv_cache, metadata.decode_batch, scale)
        if metadata.prefill_batch is not None:
            self.prefill_kernel(query, output, kv_cache, metadata.prefill_batch, scale)
        for group in metadata.decode_groups:
            k, v = group.context.keys_values(kv_cache, query.dtype)
            q = query[group.rows].unsqueeze(2)  # [g, H, 1, D]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=group.context.mask, scale=scale, enable_gqa=True
            )
            output[group.rows] = out.squeeze(2)
        for span in metadata.prefills:
            q = query[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if span.context is None:
                # The values the cache holds, as a later step would read them (a 16-bit cache rounds them).
                k = _as_stored(key[span.start : span.end], kv_cache.dtype).transpose(0, 1).unsqueeze(0)
                v = _as_stored(value[span.start : span.end], kv_cache.dtype).transpose(0, 1).unsqueeze(0)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                k, v = span.context.keys_values(kv_cache, query.dtype)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=span.context.mask, scale=scale, enable_gqa=True
                )
            output[span.start : span.end] = out.squeeze(0).transpose(0, 1)
        return output
