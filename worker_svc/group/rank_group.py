"""What the ranks of one TP x PP worker group exchange, over torch.distributed process
groups of their own (gloo on CPU, NCCL for a GPU's tensors), and a count of it: each
collective a step runs is here.

Per step: the leader sends the plan to every rank; each layer's row-parallel
projections all-reduce their partial sums over the stage's TP ranks (and so does the
vocab-parallel embedding); a stage sends its hidden states to the next; the sampling
rank gathers the vocab-parallel logits, samples, and (when it is not the leader) sends
the outcome to the leader. The tokens sampled reach every rank in the next plans.
Plans and hidden states are sent without waiting for their receiver, so a pipeline's
stages work on different steps at once. A group of one rank does none of it.

The groups are built from the rendezvous store directly, not as torch.distributed's
global default group: a process can hold several worker groups (two LLM objects),
one after another or at once.
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

from worker_svc.group.shard import SINGLE, Shard

# Idle followers wait for the next plan: no timeout may end that. A dead rank is seen at
# once anyway (its sockets close), and a hung one by the scheduler's step deadline.
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
        # Every rank, over gloo: plans, and the KV pool size the ranks agree on.
        self._control: dist.ProcessGroup | None = None
        # Every rank, on the device's backend: hidden states from stage to stage.
        self._pipe: dist.ProcessGroup | None = None
        # This stage's TP ranks, on the device's backend (ranks in it are TP ranks).
        self._tp: dist.ProcessGroup | None = None
        # The leader (0) and the sampling rank (1): the leader takes outcomes on a thread of its own.
        self._outcomes: dist.ProcessGroup | None = None
        self._sending: deque[tuple[dist.Work, torch.Tensor]] = deque()  # posted sends, oldest first

    @staticmethod
    def open_store(host: str, port: int, world_size: int, leader: bool) -> dist.TCPStore:
        """Where the ranks meet: the leader listens (port 0 picks one: read `.port`), the others dial."""
        return dist.TCPStore(host, port, world_size, is_master=leader, timeout=_STARTUP_TIMEOUT,
                             wait_for_workers=False)

    @classmethod
    def join(cls, shard: Shard, store: dist.TCPStore, device: torch.device) -> RankGroup:
        """Joins the group; returns once every rank has."""
        group = cls(shard)
        on_device = device.type == "cuda"
        group._control = _process_group(store, "control", shard.rank, shard.world_size, cuda=False)
        group._pipe = (_process_group(store, "pipe", shard.rank, shard.world_size, cuda=True) if on_device
                       else group._control)
        group._tp = _process_group(store, f"tp{shard.pp_rank}", shard.tp_rank, shard.tp_size, on_device)
        if shard.pp_size > 1 and shard.rank in (0, group.sampling_rank):
            group._outcomes = _process_group(store, "outcomes", int(shard.rank != 0), 2, cuda=False)
        return group

    @property
    def distributed(self) -> bool:
        return self.shard.world_size > 1

    def close(self) -> None:
        """Lets go of the groups (their connections close with them)."""
        self._control = self._pipe = self._tp = self._outcomes = None
        self._sending.clear()

    # -- inside the forward ---------------------------------------------------------------

    def all_reduce(self, partial_sums: torch.Tensor) -> torch.Tensor:
        """The sum over this stage's TP ranks (in place)."""
        if self.shard.tp_size == 1:
            return partial_sums
        with self.counts.timed("all_reduce", partial_sums.nbytes):
            self._tp.allreduce([partial_sums]).wait()
        return partial_sums

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The TP ranks' vocabulary slices of the logits, joined on the sampling rank; None elsewhere."""
        if self.shard.tp_size == 1:
            return logits
        logits = logits.contiguous()
        first = self.shard.tp_rank == 0
        parts = [torch.empty_like(logits) for _ in range(self.shard.tp_size)] if first else None
        options = dist.GatherOptions()
        options.rootRank = 0
        with self.counts.timed("gather", logits.nbytes):
            self._tp.gather([parts] if first else [], [logits], options).wait()
        return torch.cat(parts, dim=-1) if parts is not None else None

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """To the same TP rank of the next stage, without waiting for it to take them."""
        with self.counts.timed("send", hidden.nbytes):
            self._post(self._pipe, hidden.contiguous(), self.shard.rank + self.shard.tp_size, _HIDDEN)

    def receive_hidden(self, num_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        hidden = torch.empty(num_tokens, width, dtype=dtype, device=device)
        with self.counts.timed("receive", hidden.nbytes):
            self._pipe.recv([hidden], self.shard.rank - self.shard.tp_size, _HIDDEN).wait()
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
                self._post(self._control, tensor, rank, _PLAN)
        self.counts.record("plan", payload[1].nbytes, started)

    def receive_plan(self) -> Any:
        return self._receive_object(self._control, 0, _PLAN, "plan")

    def send_outcome(self, outcome: Any) -> None:
        """From the sampling rank to the leader (nothing to send when they are one rank)."""
        started = time.perf_counter()
        for tensor in _payload(outcome):
            self._outcomes.send([tensor], 0, _OUTCOME).wait()
        self.counts.record("outcome", tensor.nbytes, started)

    def receive_outcome(self) -> Any:
        return self._receive_object(self._outcomes, 1, _OUTCOME, "outcome")

    def _receive_object(self, group: dist.ProcessGroup, source: int, tag: int, kind: str) -> Any:
        size = torch.empty(1, dtype=torch.long)
        group.recv([size], source, tag).wait()
        started = time.perf_counter()  # from the moment it is coming: waiting for it is idle time
        data = torch.empty(int(size), dtype=torch.uint8)
        group.recv([data], source, tag).wait()
        self.counts.record(kind, data.nbytes, started)
        return pickle.loads(data.numpy().tobytes())

    def _post(self, group: dist.ProcessGroup, tensor: torch.Tensor, destination: int, tag: int) -> None:
        """Sends without waiting for the receiver; the tensor is kept until the send is done."""
        self._sending.append((group.send([tensor], destination, tag), tensor))
        while self._sending and (len(self._sending) > _MAX_SENDING or self._sending[0][0].is_completed()):
            self._sending.popleft()[0].wait()

    def minimum(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.long)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._control.allreduce([tensor], options).wait()
        return int(tensor)

    @property
    def sampling_rank(self) -> int:
        """The last stage's first TP rank."""
        return (self.shard.pp_size - 1) * self.shard.tp_size


def _process_group(store: dist.Store, name: str, rank: int, size: int, cuda: bool) -> dist.ProcessGroup:
    """A group of `size` ranks (this one `rank` in it), met through `store` under `name`."""
    store = dist.PrefixStore(name, store)
    if cuda:
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, _NO_TIMEOUT)


def _payload(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` pickled, as its size and its bytes, the two messages an object travels in."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.long), data
