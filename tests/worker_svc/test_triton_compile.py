"""Every Triton kernel compiles for an H200 (sm_90), on this machine without a GPU.

The interpreter tests check what the kernels compute; they cannot see what only a GPU
compile refuses (a `tl.dot` too small for tensor cores, a type the hardware lacks, more
shared memory than a multiprocessor has). Here the kernels' own launch functions run on
CPU tensors with each kernel swapped for a recorder, so the arguments and constants are
exactly the ones a GPU launch would get; each recorded launch is then compiled ahead of
time to a cubin with the ptxas that ships in Triton's wheel.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
H200_SHARED_MEMORY = 227 * 1024  # bytes a block may use on sm_90

SCRIPT = r"""
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from worker_svc.kernels.triton import cache_write, decoder_ops, paged_decode, paged_prefill, sgmv

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}
launches = []


class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))


for module in (cache_write, paged_decode, paged_prefill, decoder_ops, sgmv):
    for name, value in list(vars(module).items()):
        if isinstance(value, JITFunction) and name.endswith("_kernel"):
            setattr(module, name, Recorder(value))


def attention(heads, kv_heads, head_dim, block_size, dtype, batch=3, context=300):
    cache = torch.zeros(2, 64, block_size, kv_heads, head_dim, dtype=dtype)
    tables = torch.zeros(batch, -(-context // block_size), dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    key = torch.zeros(batch, kv_heads, head_dim, dtype=dtype)
    cache_write.reshape_and_cache(key, key, cache, torch.zeros(batch, dtype=torch.int64))
    query = torch.zeros(batch, heads, head_dim, dtype=dtype)
    paged_decode.paged_decode_attention(query, cache, tables, seq_lens, 0.1, num_splits=4)
    paged_decode.paged_decode_attention(query, cache, tables, seq_lens, 0.1, num_splits=1)
    starts = torch.arange(batch + 1, dtype=torch.int32) * 5
    chunk = torch.zeros(batch * 5, heads, head_dim, dtype=dtype)
    paged_prefill.paged_prefill_attention(chunk, cache, tables, starts, seq_lens, 5, 0.1)


def elementwise(hidden, heads, kv_heads, head_dim, intermediate, dtype):
    x = torch.zeros(4, hidden, dtype=dtype)
    decoder_ops.rms_norm(x, torch.ones(hidden, dtype=dtype), 1e-5)
    decoder_ops.rms_norm(x, torch.ones(hidden, dtype=dtype), 1e-5, x.clone())
    qkv = torch.zeros(4, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    table = torch.zeros(64, head_dim)
    decoder_ops.rotary_(q.view(4, heads, head_dim), k.view(4, kv_heads, head_dim), torch.zeros(4, dtype=torch.long),
                        table, table)
    decoder_ops.silu_and_mul(torch.zeros(4, 2 * intermediate, dtype=dtype))


def lora(hidden, rank, out, dtype):
    # A LoRA shrink and expand (docs/lora.md): rows of three adapters of four slots.
    segments = [(2, 0, 3), (0, 3, 40), (3, 40, 41)]
    shrunk = torch.zeros(41, rank, dtype=dtype)
    sgmv.segmented_mm(torch.zeros(41, hidden, dtype=dtype), torch.zeros(4, rank, hidden, dtype=dtype), segments)
    sgmv.segmented_mm(shrunk, torch.zeros(4, out, rank, dtype=dtype), segments)


# Llama-3-8B, SmolLM2 (GQA 3, head dim 64, also as one TP=2 rank: 6 heads on 2), GQA 1 and 8, both block sizes.
attention(32, 8, 128, 16, torch.bfloat16)
attention(9, 3, 64, 16, torch.float32)
attention(6, 2, 64, 32, torch.bfloat16)
attention(8, 8, 128, 32, torch.float16)
attention(64, 8, 128, 16, torch.bfloat16)
elementwise(4096, 32, 8, 128, 14336, torch.bfloat16)
elementwise(576, 9, 3, 64, 1536, torch.float32)
lora(4096, 3 * 16, 6144, torch.bfloat16)
lora(576, 2 * 16, 3072, torch.float32)


def signature(kernel, args, kwargs):
    constexpr = [param.is_constexpr for param in kernel.params]
    names = kernel.arg_names
    assert all(constexpr[names.index(name)] for name in kwargs), f"{kernel.__name__}: constants by keyword only"
    runtime = [name for name, is_const in zip(names, constexpr) if not is_const]
    types, constants = {}, dict(kwargs)
    for name, value in zip(runtime, args, strict=True):
        if value is None:  # a pointer left out: Triton makes it a constant
            types[name], constants[name] = "constexpr", None
        elif isinstance(value, torch.Tensor):
            types[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, float):
            types[name] = "fp32"
        else:
            types[name] = "i32" if -2**31 <= value < 2**31 else "i64"
    types.update({name: "constexpr" for name in kwargs})
    return types, constants


LAUNCH_OPTIONS = ("num_warps", "num_stages")
results, seen = [], set()
for kernel, args, kwargs in launches:
    options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
    types, constants = signature(kernel, args, kwargs)
    key = (kernel.__name__, json.dumps(types, sort_keys=True), repr(sorted(constants.items())), repr(options))
    if key in seen:
        continue
    seen.add(key)
    compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=options)
    results.append({"kernel": kernel.__name__, "constants": {k: str(v) for k, v in kwargs.items()},
                    "shared_bytes": compiled.metadata.shared, "cubin_bytes": len(compiled.asm["cubin"])})
print(json.dumps(results))
"""


def test_every_kernel_compiles_for_sm90_within_its_shared_memory() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(Path.home() / ".cache/kvfleet/triton")}
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    kernels = {result["kernel"] for result in results}
    assert kernels == {"_reshape_and_cache_kernel", "_decode_split_kernel", "_merge_splits_kernel", "_prefill_kernel",
                       "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_segmented_mm_kernel"}, kernels
    for result in results:
        assert result["cubin_bytes"] > 0 and result["shared_bytes"] <= H200_SHARED_MEMORY, result
