"""The CPU KV cache pool: zeroed, writable, and resident only where blocks were written."""
from __future__ import annotations

from pathlib import Path

import torch

from worker_svc.formats.model_config import ModelConfig
from worker_svc.runtime.kv_cache import allocate_kv_cache

CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False)


def resident_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def test_a_big_pool_is_zeros_that_cost_nothing_until_written():
    before = resident_mb()
    # 2 layers x 2 x 8192 blocks x 16 tokens x 2 heads x 64 x 4 bytes = 2 GiB
    caches = allocate_kv_cache(CONFIG, 8192, 16, torch.float32, torch.device("cpu"))
    assert [c.shape for c in caches] == [(2, 8192, 16, 2, 64)] * 2 and caches[0].dtype == torch.float32
    assert resident_mb() - before < 64
    caches[1][0, 4096] = 1.5  # one block: at most a huge page or two become resident
    assert resident_mb() - before < 64
    assert float(caches[1][0, 4096].sum()) == 1.5 * 16 * 2 * 64
    assert not caches[1][:, 4000:4096].any() and not caches[0].any()  # everything else reads as zeros
