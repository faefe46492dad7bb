"""Building blocks of Llama-family decoders, numerically matching transformers."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The batch size oneDNN lays packed weights out for; decode batches sit around it, and
# prompt chunks (hundreds of rows) ran as fast with this layout as with their own.
_PACK_BATCH_HINT = 128


class Linear(nn.Linear):
    """nn.Linear, except that on CPU in float32 the weight can be packed once into
    oneDNN's blocked layout. Its GEMM ran 1.2-2x faster here than torch's default
    (MKL, which takes slow paths on non-Intel CPUs) from two rows up, and as fast for
    one row (single-request decode reads the whole weight either way)."""

    packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Packs the weight, if this build and dtype allow, and drops the dense one,
        which forward() no longer reads. Packing twice is a no-op."""
        if self.packed_weight is None and _onednn_packs(self.weight):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_BATCH_HINT)
            del self.weight
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def cpu_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows @ weight.T + bias for a weight in torch's plain layout, through oneDNN where it
    can: within 10% of the packed layout here, and 1.1-1.6x faster than F.linear (MKL)."""
    if _onednn_packs(weight):
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return F.linear(rows, weight, bias)


def _onednn_packs(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32  # in bfloat16 oneDNN was slower here (no AVX512-BF16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as transformers does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band
    # between interpolated smoothly.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half), with a cos/sin table per position."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, device: torch.device
    ) -> None:
        super().__init__()
        with torch.device(device):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for a step's positions: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(
    tables: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = tables
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
