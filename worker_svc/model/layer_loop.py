"""A Llama-family model's steps with its layers run in one C++ call (kernels/cpu/layer_loop.py),
where every projection is a 4-bit GGUF layer on one of kvfleet's int16 GEMMs, the norms,
rotary embedding and KV cache write are the C++ decoder kernels, and the attention is the
paged decode and prefill kernels: what `--quantization gguf` runs on a CPU with AVX-512
VNNI (every step), or with AVX2 (steps of up to INT16_MAX_ROWS rows, which the AVX2 int16
kernel takes). The same kernels with the same arguments as llama.py's layers give them, so
the same output to the bit, without the Python between them: one token's 3 of 8 ms on a
2-core Sapphire Rapids-class Xeon, and as much for a speculative verification step's few
rows.

A step it does not take (adapters in it, EAGLE's hidden states kept, or more rows than
the AVX2 kernel takes) runs layer by layer as before."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from worker_svc.attention.cpu import TorchAttentionBackend, TorchAttentionMetadata
from worker_svc.kernels.cpu import layer_loop
from worker_svc.kernels.cpu.int16_gemm import Int16Kernel
from worker_svc.kernels.cpu.layer_loop import Attention, GemmThreads, Kernels, Layer, ModelSizes, Projection, Step, address
from worker_svc.kernels.cpu.library import pointer
from worker_svc.kernels.cpu.vnni_gemm import VnniKernel
from worker_svc.model.ops import CpuOps, Rope
from worker_svc.model.q4_linear import INT16_MAX_ROWS, Q4Linear

if TYPE_CHECKING:
    from worker_svc.model.llama import LlamaForCausalLM


class LayerLoop:
    def __init__(self, model: LlamaForCausalLM, run: ctypes._CFuncPtr, ops: CpuOps, backend: TorchAttentionBackend,
                 gemm: VnniKernel | Int16Kernel) -> None:
        self.model, self.run, self.ops, self.backend, self.gemm = model, run, ops, backend, gemm
        self.max_rows = None if isinstance(gemm, VnniKernel) else INT16_MAX_ROWS  # as Q4Linear.forward sends them
        attention = model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.q_size, self.kv_size = attention.q_size, attention.kv_size
        self.hidden_size = model.layers[0].mlp.gate_up_proj.in_features
        self.intermediate = model.layers[0].mlp.down_proj.in_features
        self.eps, self.scale = model.layers[0].input_layernorm.eps, attention.scale
        self._kernels: dict[torch.dtype, Kernels] = {}
        self._layers: tuple[tuple[int, ...], ctypes.Array[Layer]] | None = None

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> LayerLoop | None:
        """None unless every layer runs on the kernels it calls, in one process (no tensor or
        pipeline parallel group), or where its loop did not build."""
        shard, ops = model.group.shard, model.ops
        if not isinstance(ops, CpuOps) or shard.tp_size != 1 or not (shard.is_first_stage and shard.is_last_stage):
            return None
        backend = model.layers[0].self_attn.backend
        if (not isinstance(backend, TorchAttentionBackend) or backend.decode_kernel is None
                or backend.prefill_kernel is None or backend.cache_writer is not ops.kernel):
            return None
        projections = [p for layer in model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not projections or not all(isinstance(p, Q4Linear) and (p.bias is None or p.bias.dtype == torch.float32)
                                      for p in projections):
            return None
        if all(p.quantizes_activations for p in projections):
            gemm = projections[0].vnni
        elif all(p.int16 is not None for p in projections):
            gemm = projections[0].int16
        else:
            return None
        eps = {norm.eps for layer in model.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)}
        run = layer_loop.load()
        return None if run is None or len(eps) != 1 else cls(model, run, ops, backend, gemm)

    def takes(self, metadata: object) -> bool:
        """Whether a step is one it runs: attention on the kernels, no adapters, no hidden states
        kept, and rows its GEMM kernel takes."""
        layer = self.model.layers[0]
        return (isinstance(metadata, TorchAttentionMetadata) and not metadata.decode_groups and not metadata.prefills
                and (self.max_rows is None or len(metadata.slot_mapping) <= self.max_rows)
                and (layer.lora is None or layer.lora.step is None) and not self.model.aux_hidden_state_layers)

    def __call__(self, hidden: torch.Tensor, rope: Rope, kv_caches: list[torch.Tensor],
                 metadata: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last MLP's output, the residual stream), as the layers' loop returns them."""
        tokens = hidden.shape[0]
        assert hidden.dtype == torch.float32 and hidden.shape == (tokens, self.hidden_size) and hidden.is_contiguous()
        positions, cos, sin = rope
        positions, slots = positions.contiguous(), metadata.slot_mapping.contiguous()
        assert positions.dtype == slots.dtype == torch.int64 and cos.is_contiguous() and sin.is_contiguous()
        buffers = {name: torch.empty(tokens, width) for name, width in (
            ("qkv", self.q_size + 2 * self.kv_size), ("attention", self.q_size), ("o", self.hidden_size),
            ("gate_up", 2 * self.intermediate), ("normed", self.hidden_size if self.max_rows else 0),
            ("hidden", self.hidden_size), ("residual", self.hidden_size))}
        decoder = self.ops.kernel
        step = Step(tokens, hidden.data_ptr(), *(buffer.data_ptr() for buffer in buffers.values()),
                    positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                    self._decodes(metadata), self._chunks(metadata, kv_caches[0]),
                    *(self._gemm_threads(tokens, *shape) for shape in (
                        (self.hidden_size, self.q_size + 2 * self.kv_size), (self.q_size, self.hidden_size),
                        (self.hidden_size, 2 * self.intermediate), (self.intermediate, self.hidden_size))),
                    decoder.threads(tokens * self.hidden_size), decoder.threads(tokens * 2 * self.intermediate),
                    decoder.threads(tokens * (self.heads + self.kv_heads) * self.head_dim),
                    decoder.threads(2 * tokens * self.kv_size))
        cache = kv_caches[0]
        sizes = ModelSizes(self.hidden_size, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                           cache.shape[2], cache[0].numel() // self.kv_size, self.eps, self.scale)
        layers = self._layer_array(kv_caches)
        failed = self.run(ctypes.byref(self._kernels_for(cache.dtype)), ctypes.byref(sizes), layers, len(layers),
                          ctypes.byref(step))
        if failed:
            raise IndexError(f"layer {failed - 1}: KV slots outside the cache")
        return buffers["hidden"], buffers["residual"]

    def _gemm_threads(self, rows: int, in_features: int, out_features: int) -> GemmThreads:
        if isinstance(self.gemm, VnniKernel):
            return GemmThreads(*self.gemm.threads(rows, in_features, out_features))
        return GemmThreads(self.gemm.threads(rows, in_features, out_features), 0)

    @staticmethod
    def _decodes(metadata: TorchAttentionMetadata) -> Attention:
        batch = metadata.decode_batch
        if batch is None:
            return Attention()
        return _attention(batch.block_tables, (batch.rows, batch.seqs, batch.seq_lens), batch.bounds)

    def _chunks(self, metadata: TorchAttentionMetadata, cache: torch.Tensor) -> Attention:
        batch = metadata.prefill_batch
        if batch is None:
            return Attention()
        tiles, bounds = batch.tiles(self.heads, cache.shape[3])
        return _attention(batch.block_tables, (batch.chunk_table, tiles), bounds)

    def _kernels_for(self, cache_dtype: torch.dtype) -> Kernels:
        if cache_dtype not in self._kernels:
            decoder = self.ops.kernel.functions(cache_dtype)
            if isinstance(self.gemm, VnniKernel):
                gemms = self.gemm.functions()
                projections = [address(gemms[name]) for name in ("add_norm_linear", "linear", "silu_and_mul_linear")]
                projections += [None] * 3
            else:
                projections = [None] * 3 + [address(self.gemm.q4_function), address(decoder["add_rms_norm"]),
                                            address(decoder["silu_and_mul"])]
            self._kernels[cache_dtype] = Kernels(
                *projections, address(decoder["rotary"]), address(decoder["write_kv"]),
                address(self.backend.decode_kernel.function(cache_dtype)),
                address(self.backend.prefill_kernel.function(cache_dtype)))
        return self._kernels[cache_dtype]

    def _layer_array(self, kv_caches: list[torch.Tensor]) -> ctypes.Array[Layer]:
        """The layers' weights and caches, built again only where the caches moved."""
        key = tuple(cache.data_ptr() for cache in kv_caches)
        if self._layers is None or self._layers[0] != key:
            assert len(kv_caches) == len(self.model.layers)
            assert all(c.is_contiguous() and c.dtype == kv_caches[0].dtype and c.shape == kv_caches[0].shape
                       for c in kv_caches)
            rows = []
            for layer, cache in zip(self.model.layers, kv_caches):
                attention, mlp = layer.self_attn, layer.mlp
                qkv, o, gate_up, down = (_projection(p) for p in (attention.qkv_proj, attention.o_proj,
                                                                   mlp.gate_up_proj, mlp.down_proj))
                rows.append(Layer(layer.input_layernorm.weight.data_ptr(), qkv, o,
                                  layer.post_attention_layernorm.weight.data_ptr(), gate_up, down,
                                  cache[0].data_ptr(), cache[1].data_ptr()))
            self._layers = (key, (Layer * len(rows))(*rows))
        return self._layers[1]


def _projection(layer: Q4Linear) -> Projection:
    if layer.panels is not None:
        return Projection(layer.panels.panels.data_ptr(), None, pointer(layer.bias))
    return Projection(layer.packed.codes.data_ptr(), layer.packed.scale_offsets.data_ptr(), pointer(layer.bias))


def _attention(block_tables: torch.Tensor, work: tuple[torch.Tensor, ...], bounds: torch.Tensor) -> Attention:
    assert all(array.dtype == torch.int64 and array.is_contiguous() for array in (block_tables, *work, bounds))
    pointers = (ctypes.c_void_p * 3)(*(array.data_ptr() for array in work))
    return Attention(block_tables.data_ptr(), block_tables.shape[1], pointers, bounds.data_ptr(), len(bounds) - 1)
