"""Which part of a model one rank of a TP x PP worker group holds, as vLLM splits it.

Tensor parallel ranks split each layer: q/k/v and gate/up by output rows (column
parallel), o_proj and down_proj by input columns (row parallel, one all-reduce each),
the embedding and LM head by vocabulary rows. Heads split by KV group, as evenly as
they go: unlike vLLM, a model whose heads do not divide by the ranks still splits
(the default model's 3 KV heads on 2 ranks). A model with fewer KV heads than ranks
gives each rank one KV head, shared by the ranks whose query heads it serves.
Pipeline stages split the layers into contiguous runs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from services.config import ConfigError
from worker_svc.formats.model_config import ModelConfig

Slice = tuple[int, int, int]  # (dim, start, length) of a stored tensor that a rank reads


@dataclass(frozen=True)
class Shard:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def rank(self) -> int:
        """The global rank: stages are consecutive runs of tp_size ranks."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def samples(self) -> bool:
        """The rank that gathers the logits and samples: the last stage's first TP rank."""
        return self.is_last_stage and self.tp_rank == 0

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> Shard:
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size)

    def layers(self, num_layers: int) -> range:
        """This stage's layers: an even split, the first stages taking one more when it is uneven."""
        first, count = _even_part(num_layers, self.pp_size, self.pp_rank)
        return range(first, first + count)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of the embedding and LM head. Every rank's share is padded to
        vocab_per_rank rows, so the gathered logits are one cat."""
        per_rank = self.vocab_per_rank(vocab_size)
        start = self.tp_rank * per_rank
        return start, max(0, min(per_rank, vocab_size - start))

    def vocab_per_rank(self, vocab_size: int) -> int:
        return -(-vocab_size // self.tp_size)

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds. They split as evenly as they
        can (SmolLM2's 3 heads on 2 ranks: 2 and 1), each taking its query heads along;
        with fewer KV heads than ranks, each rank holds the one its query heads use."""
        kv_heads = config.num_key_value_heads
        if kv_heads < self.tp_size:
            return self.tp_rank * kv_heads // self.tp_size, 1
        return _even_part(kv_heads, self.tp_size, self.tp_rank)

    def query_heads(self, config: ModelConfig) -> tuple[int, int]:
        kv_heads = config.num_key_value_heads
        if kv_heads < self.tp_size:
            return _even_part(config.num_attention_heads, self.tp_size, self.tp_rank)
        group = config.num_attention_heads // kv_heads
        first, count = self.kv_heads(config)
        return first * group, count * group

    def mlp_columns(self, config: ModelConfig) -> tuple[int, int]:
        return _even_part(config.intermediate_size, self.tp_size, self.tp_rank)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shape this rank computes: its layers, heads and MLP columns (the vocabulary stays whole)."""
        return replace(
            config,
            num_hidden_layers=len(self.layers(config.num_hidden_layers)),
            num_attention_heads=self.query_heads(config)[1],
            num_key_value_heads=self.kv_heads(config)[1],
            intermediate_size=self.mlp_columns(config)[1],
        )

    def check(self, config: ModelConfig) -> None:
        """A ConfigError naming the flag when the model cannot be split this way."""
        tp, pp = self.tp_size, self.pp_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if kv_heads < tp and (tp % kv_heads or heads % tp):
            raise ConfigError(f"--tensor-parallel-size {tp}: with fewer KV heads ({kv_heads}) than ranks, the ranks "
                              f"must divide by the KV heads and the {heads} attention heads by the ranks")
        if config.num_hidden_layers < pp:
            raise ConfigError(f"--pipeline-parallel-size {pp}: the model has only {config.num_hidden_layers} layers")

    def slice_of(self, name: str, config: ModelConfig) -> Slice | None:
        """The part of the transformers-named tensor `name` this rank reads; None: all of it."""
        kind = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else name.rsplit(".", 1)[0]
        if kind in ("model.embed_tokens", "lm_head"):
            return (0, *self.vocab_rows(config.vocab_size))
        if self.tp_size == 1:
            return None
        head_dim = config.head_dim
        if kind in ("q_proj", "o_proj"):
            first, count = self.query_heads(config)
            return (0 if kind == "q_proj" else 1), first * head_dim, count * head_dim
        if kind in ("k_proj", "v_proj"):
            first, count = self.kv_heads(config)
            return 0, first * head_dim, count * head_dim
        if kind in ("gate_proj", "up_proj", "down_proj"):
            return (0 if kind != "down_proj" else 1), *self.mlp_columns(config)
        return None  # norms

    def holds(self, name: str, config: ModelConfig) -> bool:
        """Whether this rank needs the tensor at all: its own layers', and the embedding
        on the first stage, the final norm and LM head (or the tied embedding) on the last."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.layers(config.num_hidden_layers)
        if name == "model.embed_tokens.weight":
            return self.is_first_stage or (self.is_last_stage and config.tie_word_embeddings)
        return self.is_last_stage  # model.norm, lm_head

    def local_name(self, name: str, config: ModelConfig) -> str:
        """`name` with its layer index counted from this stage's first layer."""
        if not name.startswith("model.layers."):
            return name
        _, _, index, rest = name.split(".", 3)
        return f"model.layers.{int(index) - self.layers(config.num_hidden_layers).start}.{rest}"


SINGLE = Shard()


def _even_part(total: int, parts: int, index: int) -> tuple[int, int]:
    """(first, count) of part `index` when `total` splits into `parts`, the first ones one larger."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)
