"""What the C++ paged attention kernels (paged_decode.cpp, paged_prefill.cpp) share: their
entry points, one per cache dtype, called with the same arguments around each kernel's
own description of its work, and the models and head sizes they run."""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from worker_svc.kernels.cpu.library import CACHE_DTYPES, bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class PagedKernel:
    entry_point: str  # the library's functions are entry_point_float32, _bfloat16 and _float16
    work_arrays: int  # int64 arrays of the kernel's own that describe its work
    head_dim_multiple: int  # its vector loops take head sizes of this multiple

    def __init__(self, library: ctypes.CDLL) -> None:
        """Declares each entry point: query, out, key cache, value cache, block tables, the
        tables' stride, the query's row stride, the work arrays, heads, kv heads, head size,
        block size, scale, then each thread's bounds and the thread count."""
        argtypes = [_ptr] * 5 + [_i64, _i64] + [_ptr] * self.work_arrays + [_i64] * 4 + [ctypes.c_float, _ptr, _i64]
        self._functions: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, suffix in CACHE_DTYPES.items():
            self._functions[dtype] = bind(getattr(library, f"{self.entry_point}_{suffix}"), argtypes)

    @classmethod
    def supports(cls, dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        """A float32 model's attention (over a cache of any of the KV cache dtypes)."""
        return dtype == torch.float32 and device.type == "cpu" and head_dim % cls.head_dim_multiple == 0

    def function(self, cache_dtype: torch.dtype) -> ctypes._CFuncPtr:
        """The entry point for a cache of `cache_dtype` (for kernels/cpu/layer_loop.py)."""
        return self._functions[cache_dtype]

    def _run(self, query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
             work: Sequence[torch.Tensor], bounds: torch.Tensor, scale: float) -> None:
        """`query` [T, H, D] float32 may have rows at any stride (a view of the fused QKV
        projection); `out` is its shape, contiguous; `kv_cache` [2, blocks, block_size, kv
        heads, D] of a dtype in CACHE_DTYPES."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        assert query.stride()[1:] == (head_dim, 1) and out.is_contiguous() and kv_cache.is_contiguous()
        assert block_tables.is_contiguous() and all(array.is_contiguous() for array in (*work, bounds))
        self._functions[kv_cache.dtype](
            query.data_ptr(), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], query.stride(0), *(array.data_ptr() for array in work), num_heads, num_kv_heads,
            head_dim, block_size, scale, bounds.data_ptr(), len(bounds) - 1)
