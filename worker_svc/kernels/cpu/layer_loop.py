"""A step's decoder layers in one call to csrc/layer_loop.cpp, which calls the GGUF int16
GEMMs (the AVX-512 VNNI kernel, or the AVX2 one), the decoder kernels and the paged
attention kernels in the order llama.py's layers do, with the same arguments: the same
output to the bit, without the Python between the calls (worker_svc/model/layer_loop.py
builds its arguments).

Built once per machine (library.py); without a compiler `load()` is None, warned, and the
layers run one by one from Python."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from worker_svc.kernels.cpu.library import bind, load_library

SOURCE = Path(__file__).parent / "csrc" / "layer_loop.cpp"
FLAGS = ["-O2", "-shared", "-fPIC"]

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class Kernels(ctypes.Structure):
    """The addresses of the kernels' entry points it calls: the VNNI kernel's three, or the AVX2
    int16 kernel's and the decoder kernels' norm and activation (the others' NULL)."""

    _fields_ = [(name, _ptr) for name in ("add_norm_linear", "linear", "silu_and_mul_linear", "int16_linear",
                                          "add_rms_norm", "silu_and_mul", "rotary", "write_kv", "decode_attention",
                                          "prefill_attention")]


class ModelSizes(ctypes.Structure):
    _fields_ = [(name, _i64) for name in
                ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size", "cache_slots")] + [
        ("eps", _f32), ("scale", _f32)]


class Projection(ctypes.Structure):
    """A projection's weights (VNNI panels, scales NULL; or the AVX2 kernel's codes and scale
    pairs) and its bias or NULL."""

    _fields_ = [("weights", _ptr), ("scales", _ptr), ("bias", _ptr)]


class Layer(ctypes.Structure):
    """One layer's weights (norms' float32 weights, projections) and KV cache."""

    _fields_ = [("input_norm", _ptr), ("qkv", Projection), ("o", Projection), ("post_norm", _ptr),
                ("gate_up", Projection), ("down", Projection), ("key_cache", _ptr), ("value_cache", _ptr)]


class Attention(ctypes.Structure):
    """A step's attention call over its decodes or over its prompt chunks (threads 0: none):
    the block tables, the kernel's work arrays and each thread's bounds."""

    _fields_ = [("block_tables", _ptr), ("table_stride", _i64), ("work", _ptr * 3), ("bounds", _ptr),
                ("threads", _i64)]


class GemmThreads(ctypes.Structure):
    _fields_ = [("threads", _i32), ("quantize", _i32)]


class Step(ctypes.Structure):
    _fields_ = [("tokens", _i64)] + [(name, _ptr) for name in (
        "embeddings", "qkv", "attention", "o", "gate_up", "normed", "hidden", "residual", "positions", "cos", "sin",
        "slots")] + [
        ("decodes", Attention), ("chunks", Attention)] + [
        (name, GemmThreads) for name in ("qkv_threads", "o_threads", "gate_up_threads", "down_threads")] + [
        (name, _i32) for name in ("norm_threads", "activation_threads", "rotary_threads", "write_threads")]


def address(function: ctypes._CFuncPtr) -> int:
    """A loaded kernel function's address, for Kernels."""
    return ctypes.cast(function, _ptr).value


@functools.cache
def load() -> ctypes._CFuncPtr | None:
    """layer_loop(kernels, sizes, layers, count, step) -> 0, or 1 + the layer whose KV slots
    lay outside its cache; None where it cannot be built (warned once)."""
    library = load_library(SOURCE, FLAGS, "the step's layer loop")
    if library is None:
        return None
    return bind(library.layer_loop, [ctypes.POINTER(Kernels), ctypes.POINTER(ModelSizes), ctypes.POINTER(Layer),
                                     _i64, ctypes.POINTER(Step)], _i64)
