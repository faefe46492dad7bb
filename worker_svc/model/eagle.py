"""EAGLE and EAGLE-3 heads (worker_svc/formats/eagle_head.py describes both checkpoints):
small Llama decoder layers over a paged KV cache of their own, which predict the target's
next hidden state from its current one and the next token's embedding.

Both return (prenorm, out): `prenorm` is the hidden state the head feeds itself for its
next draft, `out` what its logits are computed from (EAGLE: the same, through the
target's LM head as it is; EAGLE-3: after its final norm, through its own LM head).
"""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.attention.backend import AttentionBackend
from worker_svc.formats.eagle_head import EagleHead, layer_prefix
from worker_svc.group.rank_group import RankGroup
from worker_svc.model.layers import Linear, RMSNorm, RotaryEmbedding
from worker_svc.model.llama import MLP, Attention
from worker_svc.model.ops import Ops, Rope
from worker_svc.model.weights import Weights


class EagleLayer(nn.Module):
    def __init__(self, head: EagleHead, backend: AttentionBackend, ops: Ops, first: bool) -> None:
        super().__init__()
        config = head.config
        eagle3 = head.method == "eagle3"
        # EAGLE's first layer takes fc's output unnormed (as the paper's code and vLLM do).
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if eagle3 or not first else None
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if eagle3 else None
        self.self_attn = Attention(config, backend, RankGroup(), ops)
        if eagle3:  # attends over [embedding, hidden state]: twice as wide
            q, kv = self.self_attn.q_size, self.self_attn.kv_size
            self.self_attn.qkv_proj = Linear(2 * config.hidden_size, q + 2 * kv, bias=config.attention_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, RankGroup(), ops)

    def attend_and_mlp(self, ops: Ops, rope: Rope, x: torch.Tensor, residual: torch.Tensor,
                       kv_cache: torch.Tensor, metadata: object) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output and the residual stream, from the attention's (normed) input."""
        attn = self.self_attn(rope, self.self_attn.qkv_proj(x), kv_cache, metadata)
        normed, residual = ops.add_norm(self.post_attention_layernorm, attn, residual)
        return self.mlp(self.mlp.gate_up_proj(normed)), residual


class EagleHeadModel(nn.Module):
    def __init__(self, head: EagleHead, backend: AttentionBackend, ops: Ops, max_positions: int,
                 device: torch.device) -> None:
        super().__init__()
        config = head.config
        self.head, self.ops = head, ops
        inputs = 3 if head.method == "eagle3" else 2
        self.fc = Linear(inputs * config.hidden_size, config.hidden_size, bias=head.fc_bias)
        self.layers = nn.ModuleList(EagleLayer(head, backend, ops, i == 0) for i in range(config.num_hidden_layers))
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, device)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        if head.add_para_norm:  # HASS's variant of EAGLE: both fc inputs normed
            self.embedding_layernorm, self.hidden_states_layernorm = norm(), norm()
        if head.method == "eagle3":
            self.norm = norm()
        if head.has_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if head.has_lm_head:
            self.lm_head = Linear(config.hidden_size, head.draft_vocab_size, bias=False)
        if head.draft_vocab_size != config.vocab_size:
            self.register_buffer("d2t", torch.zeros(head.draft_vocab_size, dtype=torch.long))

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """EAGLE-3: the target's three layers' hidden states, as one input."""
        return self.fc(torch.cat(aux, dim=-1))

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: object) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`: EAGLE: the target's last hidden state, or the head's own; EAGLE-3: the
        target's combined ones, or the head's own prenorm output."""
        ops = self.ops
        rope = ops.rope(self.rotary, positions, hidden.dtype)
        if self.head.method == "eagle3":
            layer = self.layers[0]
            embeds = ops.norm(layer.input_layernorm, embeds)
            normed = ops.norm(layer.hidden_norm, hidden)
            residual = normed if self.head.norm_before_residual else hidden
            x, residual = layer.attend_and_mlp(ops, rope, torch.cat([embeds, normed], dim=-1), residual,
                                               kv_caches[0], metadata)
            out, prenorm = ops.add_norm(self.norm, x, residual)
            return prenorm, out
        if self.head.add_para_norm:
            embeds = ops.norm(self.embedding_layernorm, embeds)
            hidden = ops.norm(self.hidden_states_layernorm, hidden)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        residual = x
        for layer, kv_cache in zip(self.layers, kv_caches):
            if layer.input_layernorm is not None:
                x, residual = ops.add_norm(layer.input_layernorm, x, residual)
            x, residual = layer.attend_and_mlp(ops, rope, x, residual, kv_cache, metadata)
        out = x + residual
        return out, out

    def load_weights(self, weights: Weights) -> None:
        """The checkpoint's tensors (vLLM's names), q/k/v and gate/up fused; the embedding an
        EAGLE head may carry is the target's, which it shares (as vLLM does)."""
        fused: Weights = {}
        for i in range(len(self.layers)):
            src, dst = layer_prefix(weights, i), f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [weights.pop(f"{src}self_attn.{p}_proj.{kind}", None) for p in "qkv"]
                if all(p is not None for p in parts):
                    fused[f"{dst}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
            fused[f"{dst}mlp.gate_up_proj.weight"] = torch.cat([weights.pop(f"{src}mlp.{p}_proj.weight")
                                                                for p in ("gate", "up")])
            for name in [name for name in weights if name.startswith(src)]:
                fused[dst + name.removeprefix(src)] = weights.pop(name)
        weights.pop("t2d", None)  # the target-to-draft mask: drafts never need it
        if not self.head.has_embedding:
            weights.pop("embed_tokens.weight", None)
        if not self.head.has_lm_head:
            weights.pop("lm_head.weight", None)
        fused.update(weights)
        missing, unexpected = self.load_state_dict(fused, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"the {self.head.method} head's weights do not fit: missing {missing}, "
                             f"unexpected {unexpected}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
