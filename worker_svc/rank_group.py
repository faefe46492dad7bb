"""What the ranks of one TP x PP worker group exchange, over torch.distributed (gloo on
CPU, NCCL for a GPU's tensors), and a count of it: each collective a step runs is here.

Per step: the leader broadcasts the plan; each layer's row-parallel projections
all-reduce their partial sums over the stage's TP ranks (and so does the vocab-parallel
embedding); a stage sends its hidden states to the next; the sampling rank gathers the
vocab-parallel logits and broadcasts the step's outcome, which carries the sampled
tokens every rank appends. A group of one rank does none of it.
"""
from __future__ import annotations

import datetime
import pickle
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from worker_svc.shard import SINGLE, Shard

# Idle followers wait in a collective for the next plan: no timeout may end that. A dead
# rank is seen at once anyway (its sockets close), and a hung one by the scheduler's deadline.
_NO_TIMEOUT = datetime.timedelta(days=365)
# How long the ranks may take to meet: a spawned rank imports torch first (seconds; more on a loaded machine).
_STARTUP_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class CommCounts:
    """Collectives this rank took part in, by kind: how many, their payload bytes, and
    the seconds it spent in them (waiting for slower ranks included)."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    seconds: Counter[str] = field(default_factory=Counter)

    @contextmanager
    def timed(self, kind: str, num_bytes: int) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.record(kind, num_bytes, started)

    def record(self, kind: str, num_bytes: int, started: float) -> None:
        """One `kind` of `num_bytes` that began at perf_counter() `started` and has just ended."""
        self.calls[kind] += 1
        self.bytes[kind] += num_bytes
        self.seconds[kind] += time.perf_counter() - started

    def clear(self) -> None:
        for counter in (self.calls, self.bytes, self.seconds):
            counter.clear()


class RankGroup:
    def __init__(self, shard: Shard = SINGLE) -> None:
        self.shard = shard
        self.counts = CommCounts()
        self._tp_group: dist.ProcessGroup | None = None
        self._tp_ranks: list[int] = [shard.rank]

    @staticmethod
    def open_store(host: str, port: int, world_size: int, leader: bool) -> dist.TCPStore:
        """Where the ranks meet: the leader listens (port 0 picks one: read `.port`), the others dial."""
        return dist.TCPStore(host, port, world_size, is_master=leader, timeout=_STARTUP_TIMEOUT,
                             wait_for_workers=False)

    @classmethod
    def join(cls, shard: Shard, store: dist.TCPStore, device: torch.device) -> RankGroup:
        """Joins the group; returns once every rank has."""
        group = cls(shard)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=shard.rank, world_size=shard.world_size,
                                timeout=_NO_TIMEOUT)
        # Every rank creates every stage's TP group, in the same order, as new_group requires.
        for stage in range(shard.pp_size):
            ranks = [stage * shard.tp_size + tp_rank for tp_rank in range(shard.tp_size)]
            tp_group = dist.new_group(ranks)
            if stage == shard.pp_rank:
                group._tp_group, group._tp_ranks = tp_group, ranks
        return group

    @property
    def distributed(self) -> bool:
        return self.shard.world_size > 1

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    # -- inside the forward ---------------------------------------------------------------

    def all_reduce(self, partial_sums: torch.Tensor) -> torch.Tensor:
        """The sum over this stage's TP ranks (in place)."""
        if self.shard.tp_size == 1:
            return partial_sums
        with self.counts.timed("all_reduce", partial_sums.nbytes):
            dist.all_reduce(partial_sums, group=self._tp_group)
        return partial_sums

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The TP ranks' vocabulary slices of the logits, joined on the sampling rank; None elsewhere."""
        if self.shard.tp_size == 1:
            return logits
        logits = logits.contiguous()
        first = self._tp_ranks[0]
        parts = [torch.empty_like(logits) for _ in self._tp_ranks] if self.shard.rank == first else None
        with self.counts.timed("gather", logits.nbytes):
            dist.gather(logits, parts, dst=first, group=self._tp_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """To the same TP rank of the next stage."""
        with self.counts.timed("send", hidden.nbytes):
            dist.send(hidden.contiguous(), self.shard.rank + self.shard.tp_size)

    def receive_hidden(self, num_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        hidden = torch.empty(num_tokens, width, dtype=dtype, device=device)
        with self.counts.timed("receive", hidden.nbytes):
            dist.recv(hidden, self.shard.rank - self.shard.tp_size)
        return hidden

    # -- around the step ------------------------------------------------------------------

    def broadcast(self, value: Any, source: int, kind: str) -> Any:
        """`value` pickled from rank `source` to every rank (only the source's matters);
        `kind` names it in the counts."""
        if not self.distributed:
            return value
        started = time.perf_counter()
        payload = pickle.dumps(value) if self.shard.rank == source else b""
        size = torch.tensor([len(payload)], dtype=torch.long)
        dist.broadcast(size, source)
        buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.shard.rank == source
                  else torch.empty(int(size), dtype=torch.uint8))
        dist.broadcast(buffer, source)
        self.counts.record(kind, int(size), started)  # the pickling and both broadcasts
        return value if self.shard.rank == source else pickle.loads(buffer.numpy().tobytes())

    def minimum(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor)

    @property
    def sampling_rank(self) -> int:
        """The last stage's first TP rank."""
        return (self.shard.pp_size - 1) * self.shard.tp_size
