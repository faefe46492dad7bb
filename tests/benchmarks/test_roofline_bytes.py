"""The roofline arithmetic of benchmarks/roofline.py, on SmolLM2-135M's shapes as kvfleet
runs them with --quantization gguf (the numbers docs/cpu.md quotes)."""
from __future__ import annotations

import pytest

from benchmarks.roofline_bytes import DecodeBytes, kv_bytes_per_token

# 30 layers of q/k/v (576 -> 576 + 2 x 192), o (576 -> 576), gate/up (576 -> 2 x 1536), down (1536 -> 576).
PROJECTION_WEIGHTS = 30 * 576 * (960 + 576 + 3072 + 1536)
Q4_BYTES = PROJECTION_WEIGHTS * 20 // 32  # 16 bytes of codes and a float16 (scale, offset) per 32 weights
Q8_HEAD_BYTES = 49152 * 576 * 34 // 32  # 32 int8 codes and a float16 scale per 32 weights


def test_kv_bytes_count_k_and_v_of_every_layer() -> None:
    assert kv_bytes_per_token(layers=30, kv_heads=3, head_dim=64, element_bytes=2) == 23040
    assert kv_bytes_per_token(layers=30, kv_heads=3, head_dim=64, element_bytes=4) == 46080


def test_roofline_divides_bandwidth_by_weights_plus_the_context_kv() -> None:
    step = DecodeBytes(weights=Q4_BYTES + Q8_HEAD_BYTES, kv_per_token=23040)
    assert Q4_BYTES == 66_355_200 and Q8_HEAD_BYTES == 30_081_024
    assert step.per_token(0) == 96_436_224
    assert step.per_token(4096) == 96_436_224 + 4096 * 23040
    # At 10 GB/s: about 104 tokens/s with no context, half that where the KV equals the weights.
    assert step.roofline(10e9, 0) == pytest.approx(103.7, abs=0.1)
    assert step.roofline(10e9, step.weights / 23040) == pytest.approx(step.roofline(10e9, 0) / 2)
