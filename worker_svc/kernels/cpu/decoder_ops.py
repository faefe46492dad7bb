"""The float32 elementwise kernels of csrc/decoder_ops.cpp for a CPU decoder: residual add
with RMSNorm, rotary embedding, SiLU-and-multiply, and the paged KV cache write (to a
float32, bfloat16 or float16 cache).

Built once per machine (library.py) and called through ctypes. Without a compiler or
AVX2/FMA, `load()` is None with a logged warning and the decoder keeps torch's
operators: serving never fails on these kernels."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker_svc.kernels.cpu.library import AVX2_CPU_FLAGS, AVX2_FLAGS, CACHE_DTYPES, bind, load_library
from worker_svc.kernels.cpu.threads import idle_threads_sleep

SOURCE = Path(__file__).parent / "csrc" / "decoder_ops.cpp"
# Waking kvfleet's sleeping second thread (a pool helper between steps) costs about
# 0.1 ms, which is what one thread takes for this many elements of these passes.
PARALLEL_MIN_ELEMENTS = 1 << 18

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


class DecoderKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._add_rms_norm = bind(library.add_rms_norm, [_ptr] * 5 + [_i64, _i64, _f32, _int])
        self._silu_and_mul = bind(library.silu_and_mul, [_ptr, _i64, _i64, _int])
        self._rotary = bind(library.rotary, [_ptr] * 5 + [_i64] * 6 + [_int])
        self._write_kv = {dtype: bind(getattr(library, f"write_kv_{name}"), [_ptr] * 5 + [_i64] * 5 + [_int], _i64)
                          for dtype, name in CACHE_DTYPES.items()}
        self.parallel_min_elements = PARALLEL_MIN_ELEMENTS if idle_threads_sleep() else 0

    def threads(self, elements: int) -> int:
        """The threads a pass over this many elements takes."""
        return torch.get_num_threads() if elements >= self.parallel_min_elements else 1

    def functions(self, cache_dtype: torch.dtype) -> dict[str, ctypes._CFuncPtr]:
        """The entry points, by what they compute (for kernels/cpu/layer_loop.py)."""
        return {"add_rms_norm": self._add_rms_norm, "silu_and_mul": self._silu_and_mul, "rotary": self._rotary,
                "write_kv": self._write_kv[cache_dtype]}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h), h) for h = x + residual, or h = x without one; x [T, D] float32."""
        x = _rows(x)
        rows, hidden = x.shape
        out = torch.empty_like(x)
        summed = x if residual is None else torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), None if residual is None else _rows(residual).data_ptr(),
                           weight.data_ptr(), summed.data_ptr(), out.data_ptr(), rows, hidden, eps,
                           self.threads(x.numel()))
        return out, summed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 W] = [gate | up], written over the gate half and
        returned as a view of it ([T, W], gate_up's row stride): a new buffer's first writes
        faulted in a fifth of the 4-bit workload's page faults (12 MB at a 2048-token step)."""
        gate_up = _rows(gate_up)
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        self._silu_and_mul(gate_up.data_ptr(), rows, width, self.threads(gate_up.numel()))
        return gate_up[:, :width]

    def rotary_(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
        """query [T, H, D] and key [T, KH, D] rotated in place at `positions` [T] (int64) of the
        full tables [max_positions, D]; each may be a view with any token stride."""
        tokens, heads, dim = query.shape
        assert query.stride()[1:] == (dim, 1) and key.stride()[1:] == (dim, 1)
        assert positions.dtype == torch.int64 and cos.is_contiguous() and sin.is_contiguous()
        positions = positions.contiguous()
        self._rotary(query.data_ptr(), key.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     tokens, heads, key.shape[1], dim, query.stride(0), key.stride(0),
                     self.threads(query.numel() + key.numel()))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """key and value [T, KH, D] float32 (views with any token stride) to `slots` [T] of
        kv_cache [2, ...], converted to its dtype (one of CACHE_DTYPES)."""
        tokens, heads, dim = key.shape
        assert key.stride()[1:] == (dim, 1) and value.stride()[1:] == (dim, 1) and kv_cache.is_contiguous()
        assert slots.dtype == torch.int64
        slots = slots.contiguous()
        width = heads * dim
        outside = self._write_kv[kv_cache.dtype](
            key.data_ptr(), value.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), slots.data_ptr(), tokens,
            width, key.stride(0), value.stride(0), kv_cache[0].numel() // width, self.threads(2 * tokens * width))
        if outside:
            raise IndexError(f"{outside} of {tokens} KV slots are outside the cache")


def _rows(x: torch.Tensor) -> torch.Tensor:
    assert x.dtype == torch.float32 and x.device.type == "cpu"
    return x.reshape(-1, x.shape[-1]).contiguous()


@functools.cache
def load() -> DecoderKernel | None:
    """The kernels, built if this machine has not built them yet; None where they cannot run (warned once)."""
    library = load_library(SOURCE, [*AVX2_FLAGS, "-ffp-contract=off"], "the CPU decoder kernels",
                           needs=AVX2_CPU_FLAGS)
    return None if library is None else DecoderKernel(library)
