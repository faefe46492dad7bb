"""The BERT family's encoder (BertModel: all-MiniLM, bge, e5, ...): absolute positions,
token type ids, bidirectional attention over each sequence, post-norm layers.

A step's sequences arrive packed, as a decoder's do, each whole (an encoder's prefill is
never chunked: every token attends to every other). They go through the layers in groups
of like length (`_groups`), everything but attention on the packed tokens, no padding;
attention over each group's sequences padded to its longest, the padding masked out. An
encoder keeps no KV cache.
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
        """`hidden` [T, H], a group's sequences packed: only attention sees them padded."""
        q, k, v = layout.pad(self.qkv(hidden)).view(*layout.shape, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask)
        attended = layout.unpad(attended.transpose(1, 2).reshape(*layout.shape, -1))
        hidden = self.attention_norm(hidden + self.attention_out(attended))
        # BERT's gelu is the exact (erf) one.
        return self.output_norm(hidden + self.output(nn.functional.gelu(self.intermediate(hidden))))


class _Padding:
    """Where a group's packed sequences sit in a [B, L] batch padded to the longest; none
    of it when they are all as long."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.shape = (len(lengths), max(lengths))
        self.padded = min(lengths) != self.shape[1]
        self.rows = self.mask = None
        if self.padded:
            real = torch.arange(self.shape[1], device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
            self.mask = real[:, None, None, :]  # keys that are tokens, for every query
            # Each packed row's row in the padded batch, found once for every layer's copies.
            self.rows = real.flatten().nonzero().flatten()

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        if not self.padded:
            return packed
        # One indexed copy: 6-10x faster than pad_sequence over the split sequences, which
        # took 5% of an embedding step (2 CPU threads, 90 sequences of 60-100 tokens).
        padded = packed.new_zeros(self.shape[0] * self.shape[1], packed.shape[-1])
        return padded.index_copy_(0, self.rows, packed)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        flat = padded.reshape(-1, padded.shape[-1])
        return flat.index_select(0, self.rows) if self.padded else flat


# The most bytes of a group's largest tensor (its intermediate activations). A whole step
# at once (8,192 tokens of all-MiniLM-L6-v2) allocated 30-50 MB per layer, past glibc's
# largest mmap threshold (32 MB): each came fresh from the kernel, its pages faulted in
# and zeroed (0.8 s of system time and 650,000 page faults in 300 sentences, against
# 0.03 s and 17,000 in groups), and fell out of the caches. 12 MiB is 2,048 of its tokens.
GROUP_BYTES = 12 << 20
# A group ends where padding its attention would add more than this share to its work.
GROUP_PADDING_COST = 0.05


def _groups(lengths: list[int], config: ModelConfig, element_size: int) -> list[list[int]]:
    """The sequences (indices into `lengths`) in groups that go through the layers
    together: shortest first, at most GROUP_BYTES of intermediate activations a group (a
    longer sequence alone), of lengths alike enough that padding its attention to its
    longest costs little."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    max_tokens = GROUP_BYTES // (intermediate * element_size)
    # A token's work in the linears, in units of one query-key pair's in attention (4H flops).
    pairs_per_token = 2 * hidden * (4 * hidden + 2 * intermediate) / (4 * hidden)
    groups: list[list[int]] = []
    group: list[int] = []
    tokens = squares = 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[index]
        padding = (len(group) + 1) * length * length - squares - length * length  # pairs padded in
        if group and (tokens + length > max_tokens
                      or padding > GROUP_PADDING_COST * pairs_per_token * (tokens + length)):
            groups.append(group)
            group, tokens, squares = [], 0, 0
        group.append(index)
        tokens += length
        squares += length * length
    return groups + [group] if group else groups


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
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        out = torch.empty_like(hidden)
        for group in _groups(lengths, self.config, hidden.element_size()):
            rows = [(starts[i], starts[i + 1]) for i in group]
            contiguous = all(end == start for (_, end), (start, _) in zip(rows, rows[1:]))
            if contiguous:  # sequences in order already (LLM.embed sorts them): views, no copy
                index = None
                group_hidden = hidden[rows[0][0]:rows[-1][1]]
            else:
                index = torch.cat([torch.arange(start, end, device=hidden.device) for start, end in rows])
                group_hidden = hidden.index_select(0, index)
            layout = _Padding([lengths[i] for i in group], hidden.device)
            for layer in self.layers:
                group_hidden = layer(group_hidden, layout)
            if index is None:
                out[rows[0][0]:rows[-1][1]] = group_hidden
            else:
                out.index_copy_(0, index, group_hidden)
        return out

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
