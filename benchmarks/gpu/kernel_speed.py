"""Section 3: the paged decode kernel's speed on Llama-3-8B's attention shapes (bfloat16).

Decode attention is memory-bound: every key and value of every sequence is read once
per step. So the kernel is judged by the bandwidth it reaches (the bytes of K and V,
the queries, outputs and block tables, over its time) as a fraction of what a plain
device-to-device copy_ reaches, and against torch's SDPA on the same keys and values
laid out contiguously ([B, KV heads, context, D], no block table to follow). The
cache's blocks are handed out shuffled, as a long-running server's are, and the
split count is the one the engine would choose for the table width.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.common import CALLS_PER_SAMPLE, Profile, copy_bandwidth, free_device, median_seconds, target
from worker_svc.kernels.triton.paged_decode import choose_num_splits, paged_decode_attention

DTYPE = torch.bfloat16


def _case(profile: Profile, batch: int, context: int, bandwidth: float) -> dict[str, Any]:
    device, size = profile.device, profile.block_size
    heads, kv_heads, dim = profile.num_heads, profile.num_kv_heads, profile.head_dim
    blocks_per_seq = -(-context // size)
    generator = torch.Generator(device).manual_seed(0)
    cache = torch.randn(2, batch * blocks_per_seq, size, kv_heads, dim, generator=generator, device=device, dtype=DTYPE)
    tables = torch.randperm(batch * blocks_per_seq, generator=generator, device=device)
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, dim, generator=generator, device=device, dtype=DTYPE)
    out = torch.empty_like(query)
    scale = dim**-0.5
    num_splits = choose_num_splits(blocks_per_seq * size)
    triton_s = median_seconds(lambda: paged_decode_attention(query, cache, tables, seq_lens, scale, out=out),
                              device, profile.warmup, profile.iters)

    # [B, KV heads, context, D], each sequence's keys in order.
    def contiguous(side: int) -> torch.Tensor:
        gathered = cache[side][tables.long()].view(batch, blocks_per_seq * size, kv_heads, dim)[:, :context]
        return gathered.transpose(1, 2).contiguous()

    key, value = contiguous(0), contiguous(1)
    sdpa_query = query.unsqueeze(2)  # [B, H, 1, D]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(sdpa_query, key, value, scale=scale, enable_gqa=True)

    sdpa_s = median_seconds(sdpa, device, profile.warmup, profile.iters)
    difference = float((sdpa().squeeze(2).float() - out.float()).abs().max())
    moved = (2 * key.nbytes + query.nbytes + out.nbytes + tables.nbytes + seq_lens.nbytes)
    fraction = moved / triton_s / bandwidth
    return {
        "batch": batch, "context": context, "num_splits": num_splits, "triton_ms": triton_s * 1e3,
        "sdpa_ms": sdpa_s * 1e3, "bytes_moved": moved, "achieved_GBps": moved / triton_s / 1e9,
        "fraction_of_copy_bandwidth": fraction, "sdpa_time_over_triton_time": sdpa_s / triton_s,
        "max_abs_diff_vs_sdpa": difference,
    }


def run(profile: Profile) -> dict[str, Any]:
    bandwidth = copy_bandwidth(profile)
    cases = []
    targets = []
    with torch.inference_mode():
        for batch, context in profile.speed_cases:
            case = _case(profile, batch, context, bandwidth)
            free_device()
            cases.append(case)
            label = f"decode B={batch} ctx={context}"
            fraction, versus = case["fraction_of_copy_bandwidth"], case["sdpa_time_over_triton_time"]
            targets.append(target(f"{label}: bandwidth / copy bandwidth", fraction, ">= 0.7", fraction >= 0.7))
            targets.append(target(f"{label}: SDPA time / Triton time", versus, ">= 1", versus >= 1))
    return {"dtype": str(DTYPE).removeprefix("torch."), "copy_bandwidth_GBps": bandwidth / 1e9,
            "timing": f"median of {profile.iters} samples after {profile.warmup} warm-up calls; a sample on a GPU is "
                      f"{CALLS_PER_SAMPLE} calls back to back", "cases": cases,
            "notes": [f"B={c['batch']} ctx={c['context']}: Triton {c['triton_ms']:.3f} ms ({c['achieved_GBps']:.0f} GB/s, "
                      f"copy_ {bandwidth / 1e9:.0f} GB/s), SDPA {c['sdpa_ms']:.3f} ms" for c in cases],
            "targets": targets}
