"""Section 1: every Triton kernel against the torch reference, on one layer's real shapes.

The references run in float32 on the very inputs the kernel got (bfloat16 ones
widened), so they are the exact answer up to float32 rounding and the error is the
kernel's own. RMSNorm is the exception: its semantics (transformers') round the sum
and the normalized row to the model dtype before the weight multiplies them, so its
reference is the torch path itself in the model dtype, which a float32 reference
would count a rounding step apart. Attention goes through both backends whole (cache
write, then the decode or the varlen prefill kernel) on a paged cache with shuffled
blocks, where the cached prefixes hold random keys.

The target is the issue's: max |out - ref| within 1e-2 (bfloat16) or 1e-5 (float32).
Beside it each kernel reports the check we trust for bfloat16, torch.allclose's rule
|out - ref| <= atol + rtol * |ref| with rtol two units in the last place (2**-6): a
value of 4 cannot round to within 1e-2, and a double-rounded one (RMSNorm's) may land a
unit off at each rounding, so an absolute bound alone fails correct kernels on large
outputs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.common import Profile, target
from worker_svc.attention.backend import AttentionBackend, BatchLayout
from worker_svc.attention.cpu import TorchAttentionBackend
from worker_svc.attention.gpu import TritonAttentionBackend
from worker_svc.kernels.triton.cache_write import reshape_and_cache
from worker_svc.kernels.triton.decoder_ops import rms_norm, rotary_, silu_and_mul
from worker_svc.kernels.triton.paged_decode import MAX_SPLITS
from worker_svc.model.layers import RMSNorm, RotaryEmbedding, apply_rotary

TOLERANCES = {torch.bfloat16: (1e-2, 2**-6), torch.float32: (1e-5, 1e-5)}  # (atol, rtol)
EPS = 1e-5
ROPE_THETA = 500000.0
Pair = tuple[torch.Tensor, torch.Tensor]  # (kernel output, float32 reference)


def _paged_batch(profile: Profile, rows: tuple[tuple[int, int], ...], dtype: torch.dtype,
                 generator: torch.Generator) -> tuple[BatchLayout, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Requests of (new tokens, cached tokens before them) over a randomly filled cache
    whose blocks are handed out shuffled: (layout, cache, query, key, value)."""
    size, device = profile.block_size, profile.device
    blocks_per_row = [-(-(new + cached) // size) for new, cached in rows]
    num_blocks = sum(blocks_per_row) + 8  # some the tables never name
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(rows), max(blocks_per_row), dtype=torch.int32)
    slots = []
    for index, ((new, cached), count) in enumerate(zip(rows, blocks_per_row)):
        tables[index, :count] = torch.tensor(order[:count])
        order = order[count:]
        slots += [int(tables[index, pos // size]) * size + pos % size for pos in range(cached, cached + new)]
    tokens = sum(new for new, _ in rows)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    cache = randn(2, num_blocks, size, profile.num_kv_heads, profile.head_dim)
    layout = BatchLayout(
        query_lens=torch.tensor([new for new, _ in rows], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([new + cached for new, cached in rows], dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=size, max_query_len=max(new for new, _ in rows),
    )
    key, value = (randn(tokens, profile.num_kv_heads, profile.head_dim) for _ in range(2))
    return layout, cache, randn(tokens, profile.num_heads, profile.head_dim), key, value


def _attention(profile: Profile, rows: tuple[tuple[int, int], ...], dtype: torch.dtype, generator: torch.Generator,
               backend: AttentionBackend) -> Pair:
    """`backend`'s step output and cache against the torch backend's in float32."""
    layout, cache, query, key, value = _paged_batch(profile, rows, dtype, generator)
    scale = profile.head_dim**-0.5
    reference_cache = cache.float()
    torch_backend = TorchAttentionBackend()
    reference = torch_backend.forward(query.float(), key.float(), value.float(), reference_cache,
                                      torch_backend.build_metadata(layout), scale)
    out = backend.forward(query, key, value, cache, backend.build_metadata(layout), scale)
    # The cache too: both wrote this step's keys and values into it.
    return torch.cat([out.flatten(), cache.flatten()]), torch.cat([reference.flatten(), reference_cache.flatten()])


def _cache_write(profile: Profile, dtype: torch.dtype, generator: torch.Generator) -> Pair:
    tokens, device = profile.accuracy_tokens, profile.device
    num_blocks = -(-2 * tokens // profile.block_size)
    cache = torch.randn(2, num_blocks, profile.block_size, profile.num_kv_heads, profile.head_dim,
                        generator=generator).to(device, dtype)
    slots = torch.randperm(num_blocks * profile.block_size, generator=generator)[:tokens]
    slots[::5] = -1  # padding rows (a CUDA graph's) write nothing
    shape = (tokens, profile.num_kv_heads, profile.head_dim)
    key, value = (torch.randn(*shape, generator=generator).to(device, dtype) for _ in range(2))
    reference = cache.float()
    kept = slots >= 0
    for side, new in enumerate((key, value)):
        reference[side].view(-1, *shape[1:])[slots[kept].to(device)] = new[kept.to(device)].float()
    reshape_and_cache(key, value, cache, slots.to(device))
    return cache, reference


def _rms_norm(profile: Profile, dtype: torch.dtype, generator: torch.Generator, with_residual: bool) -> Pair:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(profile.device, dtype)

    x, residual = randn(profile.accuracy_tokens, profile.hidden), randn(profile.accuracy_tokens, profile.hidden)
    weight = 1 + 0.1 * randn(profile.hidden)
    norm = RMSNorm(profile.hidden, EPS).to(profile.device, dtype)
    norm.weight.data = weight
    if not with_residual:
        return rms_norm(x, weight, EPS), norm(x)
    out, summed = rms_norm(x, weight, EPS, residual)
    reference_sum = residual + x
    return torch.cat([out.flatten(), summed.flatten()]), torch.cat([norm(reference_sum).flatten(), reference_sum.flatten()])


def _rotary(profile: Profile, dtype: torch.dtype, generator: torch.Generator) -> Pair:
    heads, kv_heads, dim, tokens = profile.num_heads, profile.num_kv_heads, profile.head_dim, profile.accuracy_tokens
    max_positions = 8192
    # Query and key as views into a fused qkv projection's output, as the model passes them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(profile.device, dtype)
    query = qkv[:, : heads * dim].view(tokens, heads, dim)
    key = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    positions = torch.randint(0, max_positions, (tokens,), generator=generator).to(profile.device)
    rope = RotaryEmbedding(dim, max_positions, ROPE_THETA, None, profile.device)
    ref_query, ref_key = apply_rotary(rope.tables(positions, torch.float32), query.float(), key.float())
    rotary_(query, key, positions, rope.cos, rope.sin)
    return torch.cat([query.flatten(), key.flatten()]), torch.cat([ref_query.flatten(), ref_key.flatten()])


def _silu_and_mul(profile: Profile, dtype: torch.dtype, generator: torch.Generator) -> Pair:
    x = torch.randn(profile.accuracy_tokens, 2 * profile.intermediate, generator=generator).to(profile.device, dtype)
    gate, up = x.float().chunk(2, dim=-1)
    return silu_and_mul(x), F.silu(gate) * up


def _cases(profile: Profile) -> dict[str, Callable[[torch.dtype, torch.Generator], Pair]]:
    decodes = tuple((1, context - 1) for context in profile.decode_contexts)
    return {
        "reshape_and_cache": lambda dtype, gen: _cache_write(profile, dtype, gen),
        # Splits as the engine chooses them, one written directly, and the most the merge takes
        # (more than the short sequences have tiles: some splits find no keys).
        "paged_decode": lambda dtype, gen: _attention(profile, decodes, dtype, gen, TritonAttentionBackend()),
        "paged_decode_1_split": lambda dtype, gen: _attention(profile, decodes, dtype, gen,
                                                              TritonAttentionBackend(num_splits=1)),
        f"paged_decode_{MAX_SPLITS}_splits": lambda dtype, gen: _attention(
            profile, decodes, dtype, gen, TritonAttentionBackend(num_splits=MAX_SPLITS)),
        # Whole prompts, chunks after cached prefixes and decode rows in one varlen call.
        "paged_prefill_mixed": lambda dtype, gen: _attention(profile, profile.prefill_rows, dtype, gen,
                                                             TritonAttentionBackend()),
        "rms_norm": lambda dtype, gen: _rms_norm(profile, dtype, gen, with_residual=False),
        "rms_norm_residual": lambda dtype, gen: _rms_norm(profile, dtype, gen, with_residual=True),
        "rotary_": lambda dtype, gen: _rotary(profile, dtype, gen),
        "silu_and_mul": lambda dtype, gen: _silu_and_mul(profile, dtype, gen),
    }


def run(profile: Profile) -> dict[str, Any]:
    kernels: dict[str, dict[str, Any]] = {}
    targets = []
    with torch.inference_mode():
        for name, case in _cases(profile).items():
            for dtype, (atol, rtol) in TOLERANCES.items():
                out, reference = case(dtype, torch.Generator().manual_seed(0))
                error = (out.float() - reference).abs()
                # Above 1 somewhere: outside the tolerance there.
                worst = float((error / (atol + rtol * reference.abs())).max())
                finite = bool(out.isfinite().all())
                label = f"{name}/{str(dtype).removeprefix('torch.')}"
                kernels[label] = {"max_abs_err": float(error.max()), "atol": atol, "rtol": rtol,
                                  "err_over_tolerance": worst, "allclose": worst <= 1 and finite}
                targets.append(target(f"accuracy {label}", float(error.max()), f"<= {atol:g}",
                                      float(error.max()) <= atol and finite))
    return {"criterion": "target: max |out - ref| <= atol; beside it: |out - ref| <= atol + rtol * |ref| (allclose)",
            "kernels": kernels, "targets": targets}
