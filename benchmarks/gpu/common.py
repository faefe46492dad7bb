"""What every section of the GPU check shares: the shapes of a run (the H200 one or the
CPU dry run), one timer for both devices, the copy bandwidth the speed targets are
measured against, and freeing the device between sections."""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Profile:
    """Everything that differs between the real check and its dry run."""

    name: str
    device: torch.device
    # section 1: one attention/decoder layer's shapes (Llama-3-8B on the GPU)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    block_size: int
    accuracy_tokens: int  # rows for the elementwise kernels and the cache write
    decode_contexts: tuple[int, ...]  # one decode sequence per context length
    # (query tokens, cached keys before them) per request of the mixed prefill call
    prefill_rows: tuple[tuple[int, int], ...]
    # section 2
    parity_model: dict[str, Any]
    parity_prompt_lens: tuple[int, ...]
    parity_new_tokens: int
    # section 3: (batch, context) cases of the decode kernel
    speed_cases: tuple[tuple[int, int], ...]
    warmup: int
    iters: int
    copy_bytes: int  # size of the tensor the copy bandwidth is measured with
    # section 4
    engine_model: dict[str, Any]
    engine_dtype: torch.dtype
    single_prompt_len: int
    single_new_tokens: int
    workload_requests: int
    workload_prompt_range: tuple[int, int]
    workload_output_range: tuple[int, int]
    hf_requests: int  # the workload's first requests, run through transformers too
    hf_batch_size: int
    # section 5: concurrent requests of the speculative decoding measurements
    spec_concurrency: tuple[int, ...]
    # Time caps (s) that keep the whole check inside its 9 minutes should a run be slow:
    # transformers starts no batch past hf_cap_s, kvfleet stops its whole workload at
    # engine_cap_s and the like-for-like subset at half that.
    hf_cap_s: float
    engine_cap_s: float

    def describe(self) -> dict[str, Any]:
        return {key: str(value) if isinstance(value, (torch.device, torch.dtype)) else value
                for key, value in asdict(self).items()}


def llama_config_fields(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                        vocab: int, max_positions: int) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                max_position_embeddings=max_positions)


GPU = Profile(
    name="gpu", device=torch.device("cuda"),
    num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, block_size=16,
    accuracy_tokens=512, decode_contexts=(1, 15, 16, 17, 500, 1024, 2047, 4096),
    prefill_rows=((700, 0), (300, 1024), (97, 33), (1, 2000), (1, 17), (64, 4000)),
    # head dim 128 and a GQA group of 4, as the big model; fp32 parity with transformers
    parity_model=dict(llama_config_fields(1024, 2048, 4, 8, 2, 32000, 4096), initializer_range=0.2,
                      tie_word_embeddings=True),
    parity_prompt_lens=(5, 37, 120, 300, 700, 16, 64, 1500), parity_new_tokens=32,
    speed_cases=((64, 4096), (256, 1024)), warmup=10, iters=20, copy_bytes=2 * 2**30,
    engine_model=dict(llama_config_fields(4096, 14336, 32, 32, 8, 128256, 8192), rope_theta=500000.0,
                      tie_word_embeddings=False),
    engine_dtype=torch.bfloat16, single_prompt_len=128, single_new_tokens=256,
    workload_requests=256, workload_prompt_range=(128, 2048), workload_output_range=(64, 512),
    hf_requests=64, hf_batch_size=32, spec_concurrency=(1, 8), hf_cap_s=60, engine_cap_s=100,
)

# Every code path of the GPU run, on this CPU through Triton's interpreter, in well under a minute.
DRY_RUN = Profile(
    name="dry-run", device=torch.device("cpu"),
    num_heads=4, num_kv_heads=2, head_dim=32, hidden=64, intermediate=96, block_size=16,
    accuracy_tokens=8, decode_contexts=(1, 16, 17, 70),
    prefill_rows=((20, 0), (9, 16), (1, 40), (5, 3)),
    parity_model=dict(llama_config_fields(64, 96, 2, 4, 2, 512, 512), initializer_range=0.2,
                      tie_word_embeddings=True),
    parity_prompt_lens=(3, 17, 40), parity_new_tokens=4,
    speed_cases=((2, 64), (4, 32)), warmup=1, iters=2, copy_bytes=2**20,
    engine_model=dict(llama_config_fields(64, 96, 2, 4, 2, 512, 512), tie_word_embeddings=False),
    engine_dtype=torch.float32, single_prompt_len=8, single_new_tokens=4,
    workload_requests=4, workload_prompt_range=(4, 24), workload_output_range=(2, 5),
    hf_requests=2, hf_batch_size=2, spec_concurrency=(1, 2), hf_cap_s=60, engine_cap_s=60,
)


# Batch sizes of the CUDA-graph buffers the sections attach on a CPU, where the worker
# captures no graphs: the static buffers and their padding run eagerly.
CPU_LADDER = (1, 2, 4)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Calls per timed sample on a GPU: back to back, so that the host's launch latency of
# one hides behind the others' work, as it does in a model's step; the first call's
# latency is the sample's only exposed overhead.
CALLS_PER_SAMPLE = 10


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds per call of `fn`, `iters` samples: CUDA events around CALLS_PER_SAMPLE calls
    on a GPU, the wall clock around one call elsewhere."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS_PER_SAMPLE):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / CALLS_PER_SAMPLE)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return times


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    return statistics.median(time_calls(fn, device, warmup, iters))


def copy_bandwidth(profile: Profile) -> float:
    """Bytes per second a device-to-device copy_ moves, reads and writes both counted:
    the most a memory-bound kernel can hope for on this device."""
    count = profile.copy_bytes // 2
    source = torch.randn(count, dtype=torch.bfloat16, device=profile.device)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), profile.device, profile.warmup, profile.iters)
    return 2 * source.nbytes / seconds


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get parameters of `dtype` at once: an 8B model never exists in float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def target(name: str, value: float | bool, goal: str, met: bool) -> dict[str, Any]:
    return {"name": name, "value": value, "target": goal, "met": bool(met)}
