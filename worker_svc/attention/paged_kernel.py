"""How the C++ paged attention kernels (paged_decode.cpp, paged_prefill.cpp) are called:
the same arguments around each kernel's own description of its work, through the entry
point for the cache's dtype."""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from worker_svc.kv_cache import CACHE_DTYPES

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


Functions = dict[torch.dtype, ctypes._CFuncPtr]  # a kernel's entry point for each cache dtype


def bind(library: ctypes.CDLL, name: str, work_arrays: int) -> Functions:
    """`name`_float32, _bfloat16 and _float16, each declared: query, out, key cache, value
    cache, block tables, the tables' stride, the query's row stride, `work_arrays` int64
    arrays of the kernel's own, heads, kv heads, head size, block size, scale, then each
    thread's bounds and the thread count."""
    functions = {}
    for dtype, suffix in CACHE_DTYPES.items():
        function = functions[dtype] = getattr(library, f"{name}_{suffix}")
        function.restype = None
        function.argtypes = [_ptr] * 5 + [_i64, _i64] + [_ptr] * work_arrays + [_i64] * 4 + [ctypes.c_float, _ptr, _i64]
    return functions


def call(functions: Functions, query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
         block_tables: torch.Tensor, work: Sequence[torch.Tensor], bounds: torch.Tensor, scale: float) -> None:
    """`query` [T, H, D] may have rows at any stride (a view of the fused QKV projection);
    `out` is its shape, contiguous; `kv_cache` [2, blocks, block_size, kv heads, D] of a
    dtype in CACHE_DTYPES. Query and out are float32."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    assert query.stride()[1:] == (head_dim, 1) and out.is_contiguous() and kv_cache.is_contiguous()
    assert block_tables.is_contiguous() and all(array.is_contiguous() for array in (*work, bounds))
    functions[kv_cache.dtype](
        query.data_ptr(), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], query.stride(0), *(array.data_ptr() for array in work), num_heads, num_kv_heads,
        head_dim, block_size, scale, bounds.data_ptr(), len(bounds) - 1)
