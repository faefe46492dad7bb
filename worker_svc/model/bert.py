"""The BERT family's encoder (BertModel: all-MiniLM, bge, e5, ...): absolute positions,
token type ids, bidirectional attention over each sequence, post-norm layers.

A step's sequences arrive packed, as a decoder's do, each whole (an encoder's prefill is
never chunked: every token attends to every other). Everything but attention runs on the
packed tokens, no padding; attention runs over the sequences padded to the longest, the
padding masked out. An encoder keeps no KV cache.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from worker_svc.formats.model_config import ModelConfig


class _Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = nn.Linear(hidden, 3 * hidden)  # query, key and value fused
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, hidden: torch.Tensor, layout: _Padding) -> torch.Tensor:
        """`hidden` [T, H], the step's sequences packed: only attention sees them padded."""
        q, k, v = layout.pad(self.qkv(hidden)).view(*layout.shape, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask)
        attended = layout.unpad(attended.transpose(1, 2).reshape(*layout.shape, -1))
        hidden = self.attention_norm(hidden + self.attention_out(attended))
        # BERT's gelu is the exact (erf) one.
        return self.output_norm(hidden + self.output(nn.functional.gelu(self.intermediate(hidden))))


class _Padding:
    """Where a step's packed sequences sit in a [B, L] batch padded to the longest."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.lengths = lengths
        self.shape = (len(lengths), max(lengths))
        self.real = torch.arange(self.shape[1], device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        self.mask = self.real[:, None, None, :]  # keys that are tokens, for every query

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        # One masked copy: 6-10x faster than pad_sequence over the split sequences, which
        # took 5% of an embedding step (2 CPU threads, 90 sequences of 60-100 tokens).
        padded = packed.new_zeros(*self.shape, packed.shape[-1])
        padded[self.real] = packed
        return padded

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded[self.real]


class BertModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), hidden)
        self.embeddings_norm = nn.LayerNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        if config.labels:  # BertForSequenceClassification: its pooler (tanh) and classifier on [CLS]
            self.pooler = nn.Linear(hidden, hidden)
            self.classifier = nn.Linear(hidden, len(config.labels))

    @torch.inference_mode()
    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """The classification head's logits [N, labels] for [CLS] hidden states [N, H]."""
        return self.classifier(torch.tanh(self.pooler(cls_hidden.to(self.classifier.weight.dtype))))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """The last hidden states [T, H] of packed whole sequences of `lengths` tokens."""
        hidden = self.embeddings_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions)
                                      + self.token_type_embeddings(token_type_ids))
        layout = _Padding(lengths, hidden.device)
        for layer in self.layers:
            hidden = layer(hidden, layout)
        return hidden

    @classmethod
    def load(cls, directory: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> BertModel:
        """From a HF directory's safetensors (transformers' names, with or without the "bert." prefix)."""
        tensors = {}
        for path in sorted(directory.glob("*.safetensors")):
            tensors.update({name.removeprefix("bert."): t for name, t in load_file(path).items()})
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(_our_names(tensors, config), assign=True, strict=True)
        return model.to(device=device, dtype=dtype).eval()


def _our_names(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' BertModel names to ours, query/key/value fused; its pooler only under a
    classification head (sentence-transformers' embeddings never use it)."""
    ours = {
        "word_embeddings.weight": tensors["embeddings.word_embeddings.weight"],
        "position_embeddings.weight": tensors["embeddings.position_embeddings.weight"],
        "token_type_embeddings.weight": tensors["embeddings.token_type_embeddings.weight"],
        "embeddings_norm.weight": tensors["embeddings.LayerNorm.weight"],
        "embeddings_norm.bias": tensors["embeddings.LayerNorm.bias"],
    }
    if config.labels:
        for kind in ("weight", "bias"):
            ours[f"pooler.{kind}"] = tensors[f"pooler.dense.{kind}"]
            ours[f"classifier.{kind}"] = tensors[f"classifier.{kind}"]
    for i in range(config.num_hidden_layers):
        theirs, mine = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            ours[f"{mine}qkv.{kind}"] = torch.cat(
                [tensors[f"{theirs}attention.self.{name}.{kind}"] for name in ("query", "key", "value")])
            for source, target in (("attention.output.dense", "attention_out"),
                                   ("attention.output.LayerNorm", "attention_norm"),
                                   ("intermediate.dense", "intermediate"), ("output.dense", "output"),
                                   ("output.LayerNorm", "output_norm")):
                ours[f"{mine}{target}.{kind}"] = tensors[f"{theirs}{source}.{kind}"]
    return ours
