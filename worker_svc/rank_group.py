"""What the ranks of one TP x PP worker group exchange, over torch.distributed (gloo on
CPU, NCCL for a GPU's tensors), and a count of it: each collective a step runs is here.

Per step: the leader sends the plan to every rank; each layer's row-parallel
projections all-reduce their partial sums over the stage's TP ranks (and so does the
vocab-parallel embedding); a stage sends its hidden states to the next; the sampling
rank gathers the vocab-parallel logits, samples, and (when it is not the leader) sends
the outcome to the leader. The tokens sampled reach every rank in the next plans.
Plans and hidden states are sent without waiting for their receiver, so a pipeline's
stages work on different steps at once. A group of one rank does none of it.
"""
from __future__ import annotations

import datetime
import pickle
import time
from collections import Counter, deque
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
# Tags of the point-to-point messages, one per kind, so that each pairs with its own kind.
_PLAN, _HIDDEN, _OUTCOME = 1, 2, 3
# Posted sends held at most: past it the oldest is waited for (a receiver that far behind is stuck anyway).
_MAX_SENDING = 64
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
        self._sending: deque[tuple[dist.Work, torch.Tensor]] = deque()  # posted sends, oldest first
        # Outcomes travel apart from plans and hidden states: the leader receives them on a thread of their own.
        self._outcome_group: dist.ProcessGroup | None = None

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
        if shard.pp_size > 1:
            group._outcome_group = dist.new_group([0, group.sampling_rank])
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
        """To the same TP rank of the next stage, without waiting for it to take them."""
        with self.counts.timed("send", hidden.nbytes):
            self._post(hidden.contiguous(), self.shard.rank + self.shard.tp_size, _HIDDEN)

    def receive_hidden(self, num_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        hidden = torch.empty(num_tokens, width, dtype=dtype, device=device)
        with self.counts.timed("receive", hidden.nbytes):
            dist.recv(hidden, self.shard.rank - self.shard.tp_size, tag=_HIDDEN)
        return hidden

    # -- around the step ------------------------------------------------------------------

    def send_plan(self, plan: Any) -> None:
        """From the leader to every other rank, without waiting for them: a pipeline's
        later stages take plan N+1 once they are done with plan N."""
        if not self.distributed:
            return
        started = time.perf_counter()
        payload = _payload(plan)
        for rank in range(1, self.shard.world_size):
            for tensor in payload:
                self._post(tensor, rank, _PLAN)
        self.counts.record("plan", payload[1].nbytes, started)

    def receive_plan(self) -> Any:
        return self._receive_object(0, _PLAN, "plan")

    def send_outcome(self, outcome: Any) -> None:
        """From the sampling rank to the leader (nothing to send when they are one rank)."""
        started = time.perf_counter()
        size, data = _payload(outcome)
        dist.send(size, 0, group=self._outcome_group, tag=_OUTCOME)
        dist.send(data, 0, group=self._outcome_group, tag=_OUTCOME)
        self.counts.record("outcome", data.nbytes, started)

    def receive_outcome(self) -> Any:
        return self._receive_object(self.sampling_rank, _OUTCOME, "outcome", self._outcome_group)

    def _receive_object(self, source: int, tag: int, kind: str, group: dist.ProcessGroup | None = None) -> Any:
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, source, group=group, tag=tag)
        started = time.perf_counter()  # from the moment it is coming: waiting for it is idle time
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, source, group=group, tag=tag)
        self.counts.record(kind, data.nbytes, started)
        return pickle.loads(data.numpy().tobytes())

    def _post(self, tensor: torch.Tensor, destination: int, tag: int) -> None:
        """Sends without waiting for the receiver; the tensor is kept until the send is done."""
        self._sending.append((dist.isend(tensor, destination, tag=tag), tensor))
        while self._sending and (len(self._sending) > _MAX_SENDING or self._sending[0][0].is_completed()):
            self._sending.popleft()[0].wait()

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


def _payload(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` pickled, as its size and its bytes, the two messages an object travels in."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.long), data
