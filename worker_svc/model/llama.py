"""The Llama family (Llama 2/3, SmolLM, Mistral, and Qwen2 with its QKV bias) over a paged KV cache.

Weights arrive with transformers' parameter names; q/k/v and gate/up are fused at
load time so each becomes one matmul. In a worker group each rank builds its shard
(worker_svc/group/shard.py): its heads and MLP columns, whose o_proj and down_proj sums
the stage's ranks all-reduce, its vocabulary rows, and its stage's layers.

The elementwise work between the matmuls (norms, rotary embedding, the MLP's activation)
runs through an ops object chosen at construction (worker_svc/model/ops.py); a stage's
output is the complete hidden state whichever it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.formats.model_config import ModelConfig
from worker_svc.formats.q4_weights import Q4Blocks
from worker_svc.formats.q8_weights import Q8Blocks
from worker_svc.group.rank_group import RankGroup
from worker_svc.model.layer_loop import LayerLoop
from worker_svc.model.layers import Linear, RMSNorm, RotaryEmbedding
from worker_svc.model.lora import LoraContext
from worker_svc.model.ops import Ops, Rope, TorchOps
from worker_svc.model.q4_linear import DequantScratch, Q4Linear
from worker_svc.model.q8_linear import Q8Linear
from worker_svc.model.weights import Weights


class Attention(nn.Module):
    lora: LoraContext | None = None  # set with the layer's, by LlamaForCausalLM.attach_lora
    layer_index = 0

    def __init__(self, config: ModelConfig, backend: AttentionBackend, group: RankGroup, ops: Ops) -> None:
        super().__init__()
        self.group = group
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(self, rope: Rope, qkv: torch.Tensor, kv_cache: torch.Tensor, metadata: object) -> torch.Tensor:
        """Attention of `qkv`, qkv_proj's output (the layer computes it with the norm before it)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotate(rope, q, k)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale).reshape(-1, self.q_size)
        lora = self.lora
        projected = self.o_proj(out) if lora is None else lora.project(self.o_proj, self.layer_index, "o_proj", out)
        return self.group.all_reduce(projected)


class MLP(nn.Module):
    lora: LoraContext | None = None
    layer_index = 0

    def __init__(self, config: ModelConfig, group: RankGroup, ops: Ops) -> None:
        super().__init__()
        self.group = group
        self.ops = ops
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's output from gate_up_proj's (the layer computes it with the norm before it)."""
        if self.lora is None or self.lora.step is None:
            return self.group.all_reduce(self.ops.silu_and_mul_linear(self.down_proj, gate_up))
        activated = self.ops.silu_and_mul(gate_up)
        return self.group.all_reduce(self.lora.project(self.down_proj, self.layer_index, "down_proj", activated))


class VocabEmbedding(nn.Embedding):
    """The embedding rows of this rank's vocabulary slice: the ranks' lookups sum to the
    whole one, each contributing zeros for the tokens it does not hold. Its rows may be
    8-bit blocks kept as stored (`keep_q8`), read as float rows for each lookup."""

    q8: Q8Blocks | None = None

    def __init__(self, rows: int, hidden_size: int, first_row: int, group: RankGroup) -> None:
        # An empty weight skips nn.Embedding's random init, whose normal_ imports torch._dynamo (2 s a start).
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size))
        self.first_row = first_row
        self.group = group

    def keep_q8(self, blocks: Q8Blocks, dtype: torch.dtype) -> None:
        self.q8, self.dtype = blocks, dtype
        self.register_parameter("weight", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.shard.tp_size == 1:
            return self._rows(input_ids)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = self._rows(local.masked_fill(outside, 0)).masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(hidden)

    def _rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) if self.q8 is None else self.q8.rows(input_ids, self.dtype)


class DecoderLayer(nn.Module):
    lora: LoraContext | None = None
    layer_index = 0

    def __init__(self, config: ModelConfig, backend: AttentionBackend, group: RankGroup, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, group, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, group, ops)

    def forward(
        self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor, metadata: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output and the residual stream it is yet to be added to. `hidden` is the
        previous layer's MLP output, not yet in `residual`; or, in a stage's first layer
        (residual None), the whole hidden state."""
        qkv, residual = self._norm_linear(self.input_layernorm, self.self_attn.qkv_proj, "qkv_proj", hidden, residual)
        attn = self.self_attn(rope, qkv, kv_cache, metadata)
        gate_up, residual = self._norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, "gate_up_proj",
                                              attn, residual)
        return self.mlp(gate_up), residual

    def _norm_linear(self, norm: RMSNorm, linear: nn.Module, fused: str, x: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """ops.add_norm_linear; in a step with adapters the norm's output is kept apart,
        as the adapters' input, and the projection runs unfused."""
        if self.lora is None or self.lora.step is None:
            return self.ops.add_norm_linear(norm, linear, x, residual)
        normed, summed = (self.ops.norm(norm, x), x) if residual is None else self.ops.add_norm(norm, x, residual)
        return self.lora.project(linear, self.layer_index, fused, normed), summed


class LlamaForCausalLM(nn.Module):
    # EAGLE-3 (worker_svc/runtime/eagle_drafter.py): the layers (the whole model's indices)
    # whose input hidden states each forward keeps in aux_hidden_states, for the head to
    # draft from; a pipeline's stages pass the earlier ones on with their output.
    aux_hidden_state_layers: tuple[int, ...] = ()
    aux_hidden_states: list[torch.Tensor] = []
    layer_loop: LayerLoop | None = None  # a step's layers in one C++ call, where they can be

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, max_positions: int, device: torch.device,
        group: RankGroup, ops: Ops | None = None,
    ) -> None:
        """Build under `torch.device("meta")` and call load_weights: parameters are
        assigned, never allocated twice; the rope tables live on `device` regardless.
        `config` is the whole model's; this rank builds `group.shard`'s part of it.
        `ops`: how the norms, rotary embedding and activation run (torch's operators by default)."""
        super().__init__()
        shard = group.shard
        self.config = config
        self.group = group
        self.ops: Ops = ops or TorchOps()
        local = shard.local_config(config)
        vocab_rows = shard.vocab_per_rank(config.vocab_size)
        if shard.is_first_stage:
            self.embed_tokens = VocabEmbedding(vocab_rows, config.hidden_size, shard.vocab_rows(config.vocab_size)[0],
                                               group)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, device)
        self.layers = nn.ModuleList(DecoderLayer(local, backend, group, self.ops) for _ in range(local.num_hidden_layers))
        if shard.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if config.labels:  # a classifier (--convert classify): its head, and no LM head, as it samples nothing
                self.score = nn.Linear(config.hidden_size, len(config.labels), bias=False)
            else:
                self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        """The model's compute dtype: its norms' weights are kept in it, whatever else is quantized."""
        return self.layers[0].input_layernorm.weight.dtype

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], metadata: object
    ) -> torch.Tensor:
        """The hidden states after this stage's layers; a later stage receives its input
        from the one before, and every stage but the last sends its output on."""
        shard = self.group.shard
        layers = shard.layers(self.config.num_hidden_layers)
        # EAGLE-3's layers before this stage: their hidden states come with the stage's input.
        earlier = sum(layer < layers.start for layer in self.aux_hidden_state_layers)
        if shard.is_first_stage:
            hidden = self.embed_tokens(input_ids)
            self.aux_hidden_states = []
        else:
            width = self.config.hidden_size
            received = self.group.receive_hidden(len(input_ids), width * (1 + earlier), self.dtype, positions.device)
            hidden = received[:, :width].contiguous() if earlier else received
            self.aux_hidden_states = list(received[:, width:].split(width, dim=1)) if earlier else []
        rope = self.ops.rope(self.rotary, positions, hidden.dtype)
        if self.layer_loop is not None and self.layer_loop.takes(metadata):
            hidden, residual = self.layer_loop(hidden, rope, kv_caches, metadata)
        else:
            kept = [layer - layers.start for layer in self.aux_hidden_state_layers if layer in layers]
            hidden, residual = self._run_layers(rope, hidden, kv_caches, metadata, kept)
        # The last MLP's output joins the stream here, not in a fused final norm: compute_logits
        # norms only the rows that sample, and the next stage expects the whole hidden state.
        hidden = residual + hidden
        if not shard.is_last_stage:
            self.group.send_hidden(torch.cat([hidden, *self.aux_hidden_states], dim=1)
                                   if self.aux_hidden_states else hidden)
        return hidden

    def _run_layers(self, rope: Rope, hidden: torch.Tensor, kv_caches: list[torch.Tensor], metadata: object,
                    kept: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last MLP's output, the residual stream it joins), appending the inputs of
        the layers `kept` (this stage's indices) to aux_hidden_states."""
        residual = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if index in kept:
                self.aux_hidden_states.append(hidden.clone() if residual is None else residual + hidden)
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        return hidden, residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits (float32) for the rows that sample; the final norm is per row, so only
        they need it. On the last stage only; None on its ranks that do not sample."""
        logits = self.group.gather_vocab(self.lm_head(self.ops.norm(self.norm, hidden)))
        return logits[:, : self.config.vocab_size].float() if logits is not None else None

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classifier's logits [N, labels] for pooled last hidden states [N, H] (final-normed)."""
        return self.score(pooled.to(self.score.weight.dtype))

    def attach_lora(self, lora: LoraContext) -> None:
        """Every layer reads the adapters' slots and the step's grouping from `lora`."""
        for index, layer in enumerate(self.layers):
            for module in (layer, layer.self_attn, layer.mlp):
                module.lora, module.layer_index = lora, index

    def load_weights(self, weights: Weights) -> None:
        """Copy transformers-named weights in, fusing q/k/v and gate/up; projections
        given as 4-bit blocks become Q4Linear layers. A rank's vocabulary slice
        is padded with zero rows to the size every rank's is."""
        fused: Weights = {}
        for i in range(len(self.layers)):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [weights.pop(f"{src}self_attn.{p}_proj.{kind}", None) for p in "qkv"]
                if all(p is not None for p in parts):
                    fused[f"{dst}self_attn.qkv_proj.{kind}"] = _cat(parts)
            gate_up = [weights.pop(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")]
            fused[f"{dst}mlp.gate_up_proj.weight"] = _cat(gate_up)
        for name, tensor in weights.items():
            fused[name.removeprefix("model.")] = tensor
        shard = self.group.shard
        if self.config.tie_word_embeddings and shard.is_last_stage and not self.config.labels:
            embedding = fused["embed_tokens.weight"] if shard.is_first_stage else fused.pop("embed_tokens.weight")
            fused["lm_head.weight"] = embedding
        vocab_rows = shard.vocab_per_rank(self.config.vocab_size)
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in fused and fused[name].shape[0] < vocab_rows:
                weight = fused[name]
                fused[name] = (weight.padded(vocab_rows) if isinstance(weight, Q8Blocks)
                               else F.pad(weight, (0, 0, 0, vocab_rows - weight.shape[0])))
        if self.config.tie_word_embeddings and "embed_tokens.weight" in fused and "lm_head.weight" in fused:
            fused["lm_head.weight"] = fused["embed_tokens.weight"]  # one tensor again after padding
        self._install_quantized(fused)
        # assign=True keeps tied embeddings one tensor and skips a copy.
        missing, unexpected = self.load_state_dict(fused, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        self.layer_loop = LayerLoop.for_model(self)

    def _install_quantized(self, fused: Weights) -> None:
        """Replace each Linear whose weight is 4-bit blocks, and the LM head given as 8-bit
        blocks, taking their weights and biases out of `fused`; an 8-bit embedding keeps its blocks."""
        quantized = [name for name, value in fused.items() if isinstance(value, (Q4Blocks, Q8Blocks))]
        if not quantized:
            return
        dtype = fused["layers.0.input_layernorm.weight"].dtype  # the model's
        scratch = DequantScratch(dtype)
        for name in quantized:
            blocks = fused.pop(name)
            if name == "embed_tokens.weight":
                self.embed_tokens.keep_q8(blocks, dtype)
                continue
            module_name = name.removesuffix(".weight")
            parent, _, child = module_name.rpartition(".")
            if isinstance(blocks, Q8Blocks):
                layer = Q8Linear(blocks, dtype)
            else:
                layer = Q4Linear(blocks, fused.pop(f"{module_name}.bias", None), scratch)
            setattr(self.get_submodule(parent), child, layer)


def _cat(parts: list[torch.Tensor] | list[Q4Blocks]) -> torch.Tensor | Q4Blocks:
    return Q4Blocks.cat(parts) if isinstance(parts[0], Q4Blocks) else torch.cat(parts)
