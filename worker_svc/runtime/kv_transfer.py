"""The worker's side of the KV connector (docs/kv_connector.md): it moves the bytes the
scheduler's side decided to move, and reports what finished.

Each plan's moves are applied before its forward pass, in this order: a load's host
tier blocks are copied into the device pool at once (a memcpy, or on a GPU a copy on a
side stream the forward waits for; worker_svc/runtime/kv_host_copies.py); its file blocks are read on a loader thread while
the steps go on, and the request's count of whole leading blocks comes back in a later
StepResult. Then host tier saves are copied, and the blocks to save to files are
gathered into one staging tensor, which a writer thread turns into files: the step never
waits on a disk. Writes queued past a byte bound are dropped (counted as failed), so a
slow disk costs cache hits, never step time.

With prefill/decode disaggregation (docs/disaggregation.md) a load's blocks may come
from a producer replica's worker instead (KvLoad.remote): fetched on a loader thread,
block by block, through `peer` (worker_svc/runtime/kv_peer.py). A producer's worker
serves its held blocks through the same `peer`, and reports each request fetched.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import takewhile

import torch

from services.kv_block_files import HOST, BlockFiles
from services.kv_transfer_messages import KvBlock, KvFetchRequest
from services.messages import KvLoad, KvTierCounts, StepPlan
from worker_svc.runtime.kv_host_copies import HostCopies
from worker_svc.runtime.kv_peer import KvBlockSource

logger = logging.getLogger(__name__)

_MAX_QUEUED_WRITE_BYTES = 512 * 2**20
# A consumer may ask for a hold before the producer's next plan has told this worker of it.
_HOLD_WAIT_S = 2.0
# A streamed fetch's wait for the producer's prefill to publish its next block: a bound on a
# thread a consumer that left would hold (the consumer's own fetch timeout ends it sooner).
_PUBLISH_WAIT_S = 60.0
# How often that wait asks whether the producer's scheduler is gone.
_GONE_POLL_S = 0.25
# Fetches served at once, each on a server thread of its own (a streamed one for as long as
# the prefill runs): the worker's server has this many threads besides those the steps
# need, and refuses more (their consumers recompute) rather than starve its steps.
MAX_SERVED_FETCHES = 16


class KvTransfer:
    def __init__(self, kv_caches: list[torch.Tensor], host_caches: list[torch.Tensor],
                 files: Sequence[BlockFiles], peer: KvBlockSource | None = None,
                 scheduler_gone: Callable[[], bool] = lambda: False) -> None:
        """`peer`: the worker-to-worker transport (docs/disaggregation.md); `scheduler_gone`:
        whether this worker's scheduler is gone (its prefills will publish no more blocks)."""
        self.kv_caches = kv_caches
        self.host_caches = host_caches
        self._host = HostCopies(kv_caches, host_caches)
        self.files = list(files)
        cache = kv_caches[0]
        self._block_shape = (len(kv_caches), 2, *cache.shape[2:])  # one block: [layer][k|v][token][head][dim]
        self.block_bytes = cache[:, 0].nbytes * len(kv_caches)
        self._device = cache.device
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-kv-write")  # writes in order
        self._loader = ThreadPoolExecutor(2, thread_name_prefix="kvfleet-kv-load")  # reads overlap each other
        self._lock = threading.Lock()
        self._queued_write_bytes = 0
        self._counts: dict[str, KvTierCounts] = {}
        self._done: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._num_loading = 0
        self._load_finished = threading.Condition(self._lock)
        self.peer = peer
        self._scheduler_gone = scheduler_gone
        self._sent: list[str] = []  # held requests a consumer fetched, for the next result
        self._num_serving = 0
        # Per request, the blocks its scheduler holds for a consumer, in the prompt's order;
        # while its prefill runs (remote_streamed), those it has computed so far.
        self._holds: dict[str, list[int]] = {}

    def describe(self) -> str:
        """The start-up line on the tiers and the transfers."""
        tiers = []
        if self.host_caches:
            blocks = self.host_caches[0].shape[1]
            tiers.append(f"host memory {blocks} blocks ({blocks * self.block_bytes / 2**30:.2f} GiB)")
        tiers += [f"{tier.medium.lower()} {tier.directory} (up to {tier.max_bytes / 2**30:.1f} GiB)"
                  for tier in self.files]
        peer = ["blocks to and from other replicas' workers"] if self.peer is not None else []
        return f"KV connector: {', '.join(tiers + peer)}; {self.block_bytes / 2**20:.2f} MiB a block"

    def apply(self, plan: StepPlan) -> None:
        """The plan's moves, before its forward pass."""
        if plan.kv_holds or plan.kv_hold_ends:
            self._change_holds(plan)
        for load in plan.kv_loads:
            self._start_load(load)
        if plan.kv_host_saves:
            self._host.save(plan.kv_host_saves)
            saved = len(plan.kv_host_saves)
            self._count(KvTierCounts(HOST, stored_blocks=saved, stored_bytes=saved * self.block_bytes))
        if plan.kv_file_saves and self.files:
            self._save(plan.kv_file_saves)

    def take_loads_done(self) -> dict[str, int]:
        """Per request whose load finished since the last take, its whole leading blocks."""
        done = {}
        while True:
            try:
                request_id, count = self._done.get_nowait()
            except queue.Empty:
                return done
            done[request_id] = count

    def wait_for_loads(self, timeout_s: float) -> None:
        """For a step with nothing to compute: returns once a load finished (or, while it
        holds blocks for other replicas, one fetched them), or after the timeout, rather
        than have the scheduler spin on empty steps."""
        with self._load_finished:
            if (self._num_loading or self._holds) and self._done.empty() and not self._sent:
                self._load_finished.wait(timeout_s)

    def serve(self, request: KvFetchRequest) -> Iterator[KvBlock]:
        """A consumer's fetch of blocks held here; once it ended, the scheduler hears the
        request was fetched (and frees its blocks). Only blocks the scheduler
        holds for that request are served, and only while it holds them: a fetch that
        comes before the plan saying so waits for it a moment; the stream stops (ValueError)
        at a block not held for the request, and the consumer recomputes from there."""
        with self._load_finished:
            if self._num_serving >= MAX_SERVED_FETCHES:
                raise ValueError(f"this worker serves {MAX_SERVED_FETCHES} fetches already")
            self._num_serving += 1
            self._load_finished.wait_for(lambda: request.request_id in self._holds, _HOLD_WAIT_S)

        @contextmanager
        def held(first: int, most: int) -> Iterator[list[int]]:
            """The blocks to read for entries first, first + 1, ... of the request (at most
            `most`: the first, waited for, and those after it held already), held while
            they are read. An entry is a block id, or with by_position a place in the
            prompt, waited for until the prefill publishes it."""
            entries = request.block_ids[first:first + most]
            with self._load_finished:
                if request.by_position:
                    self._wait_for_publish(request.request_id, entries[0])
                    published = self._holds.get(request.request_id, [])
                    blocks = [published[entry] for entry in takewhile(lambda e: e < len(published), entries)]
                else:
                    holds = set(self._holds.get(request.request_id, ()))
                    blocks = list(takewhile(lambda e: e in holds, entries))
                if not blocks:
                    raise ValueError(f"block {entries[0]} is not held here for request {request.request_id!r} (its "
                                     "hold ended, or never began)")
                yield blocks

        try:
            yield from self.peer.serve(request, held)
        finally:  # however the fetch ended (whole, refused midway, cancelled), no one else comes for them
            with self._load_finished:
                self._num_serving -= 1
                self._sent.append(request.request_id)
                self._load_finished.notify_all()

    def abandon(self, request_id: str) -> None:
        """The consumer ended its fetch of the request's blocks early (it stopped, or died):
        what it was lent and has not read is the hold's again, for the hold's end not to
        wait for READs that will not come."""
        with self._load_finished:
            if request_id in self._holds:  # else its end settled it already
                self.peer.abandon(request_id)

    def _wait_for_publish(self, request_id: str, entry: int) -> None:
        """Until the prefill has published block `entry` of the prompt, its hold ended, or
        the scheduler that runs it is gone (then the consumer recomputes at once rather
        than after its fetch timeout). Called with the lock held."""
        deadline = time.monotonic() + _PUBLISH_WAIT_S
        while (request_id in self._holds and len(self._holds[request_id]) <= entry
               and time.monotonic() < deadline and not self._scheduler_gone()):
            self._load_finished.wait(_GONE_POLL_S)

    def end_holds(self) -> None:
        """Its scheduler is gone: no block is served for its requests any more."""
        with self._load_finished:
            ended = list(self._holds)
            self._holds.clear()
            self._load_finished.notify_all()
        self.peer.settle(ended)

    def _change_holds(self, plan: StepPlan) -> None:
        """Before the plan's forward pass, which may write into blocks whose hold ended:
        once they end no block of theirs is named to a consumer any more, and those named
        already have been read (over NIXL the consumer reads them after)."""
        with self._load_finished:
            for request_id in plan.kv_hold_ends:
                self._holds.pop(request_id, None)
            for request_id, blocks in plan.kv_holds.items():
                self._holds[request_id] = list(blocks)
            self._load_finished.notify_all()
        if plan.kv_hold_ends:
            self.peer.settle(plan.kv_hold_ends)

    def take_sent_done(self) -> list[str]:
        with self._lock:
            sent, self._sent = self._sent, []
        return sent

    def take_counts(self) -> list[KvTierCounts]:
        with self._lock:
            counts, self._counts = self._counts, {}
        for tier in self.files:
            taken = tier.take_counts()
            if taken.stored_blocks or taken.evicted_blocks or taken.failed:
                counts.setdefault(tier.medium, KvTierCounts(tier.medium)).add(taken)
        return list(counts.values())

    # -- loads -------------------------------------------------------------------------

    def _start_load(self, load: KvLoad) -> None:
        if load.remote is not None:
            with self._lock:
                self._num_loading += 1
            self._loader.submit(self._fetch, load)
            return
        from_host = [(host, device) for device, _, host in load.blocks if host >= 0]
        if from_host:
            started = time.perf_counter()
            self._host.load(from_host)
            self._count(KvTierCounts(HOST, loaded_blocks=len(from_host), loaded_bytes=len(from_host) * self.block_bytes,
                                     load_seconds=[time.perf_counter() - started]))
        if len(from_host) == len(load.blocks):
            self._done.put((load.request_id, len(load.blocks)))
            return
        with self._lock:
            self._num_loading += 1
        self._loader.submit(self._load_files, load)

    def _load_files(self, load: KvLoad) -> None:
        """Reads the file blocks in chain order up to the first miss, then copies them in."""
        started, count, arrived, sources = time.perf_counter(), 0, [], []
        try:
            for device_block, block_hash, host in load.blocks:
                if host < 0:
                    found = self._read(block_hash)
                    if found is None:
                        break
                    payload, medium = found
                    arrived.append((device_block, payload))
                    sources.append(medium)
                count += 1
            self._copy_in(arrived)
        except Exception:  # whatever went wrong, a miss: the blocks are recomputed
            logger.exception("KV load of %s failed; its blocks are recomputed", load.request_id)
            count = 0
        finally:
            seconds = time.perf_counter() - started
            for medium in set(sources):
                loaded = sources.count(medium)
                self._count(KvTierCounts(medium, loaded_blocks=loaded, loaded_bytes=loaded * self.block_bytes,
                                         load_seconds=[seconds]))
            self._done.put((load.request_id, count))
            with self._load_finished:
                self._num_loading -= 1
                self._load_finished.notify_all()

    def _fetch(self, load: KvLoad) -> None:
        """A producer's blocks, each landed in its device block as it arrives."""
        count = 0
        try:
            count = self.peer.fetch(load.remote, [source for _, _, source in load.blocks],
                                    [target for target, _, _ in load.blocks])
            if self._device.type == "cuda":
                torch.cuda.current_stream(self._device).synchronize()  # whole before the scheduler hears of it
        except Exception:  # whatever went wrong, a miss: the blocks are recomputed
            logger.exception("KV fetch of %s failed; its blocks are recomputed", load.request_id)
        finally:
            self._done.put((load.request_id, count))
            with self._load_finished:
                self._num_loading -= 1
                self._load_finished.notify_all()

    def _read(self, block_hash: bytes) -> tuple[torch.Tensor, str] | None:
        for tier in self.files:
            payload = tier.read(block_hash, self.block_bytes)
            if payload is not None:
                block = torch.frombuffer(payload, dtype=torch.uint8).view(self.kv_caches[0].dtype)
                return block.view(self._block_shape), tier.medium
        return None

    def _copy_in(self, arrived: list[tuple[int, torch.Tensor]]) -> None:
        if not arrived:
            return
        ids = torch.tensor([block for block, _ in arrived], device=self._device)
        blocks = torch.stack([payload for _, payload in arrived]).to(self._device)  # [n][layer][k|v]...
        for layer, cache in enumerate(self.kv_caches):
            cache[:, ids] = blocks[:, layer].transpose(0, 1)
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()  # whole before the scheduler hears of it

    # -- saves -------------------------------------------------------------------------

    def _save(self, saves: list[tuple[int, bytes]]) -> None:
        size = len(saves) * self.block_bytes
        with self._lock:
            if self._queued_write_bytes + size > _MAX_QUEUED_WRITE_BYTES:
                for tier in self.files:
                    self._counts.setdefault(tier.medium, KvTierCounts(tier.medium)).failed += len(saves)
                return
            self._queued_write_bytes += size
        ids = torch.tensor([block for block, _ in saves], device=self._device)
        staged = torch.stack([cache[:, ids] for cache in self.kv_caches], dim=1)  # [k|v][layer][n]...
        staged = staged.permute(2, 1, 0, 3, 4, 5).contiguous()  # [n][layer][k|v][token][head][dim]
        ready = None
        if self._device.type == "cuda":
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            staged = host
        self._writer.submit(self._write, [block_hash for _, block_hash in saves], staged, ready, size)

    def _write(self, hashes: list[bytes], staged: torch.Tensor, ready: torch.cuda.Event | None, size: int) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            rows = staged.reshape(len(hashes), -1).view(torch.uint8).numpy()
            for block_hash, row in zip(hashes, rows):
                for tier in self.files:
                    tier.write(block_hash, row.data)
        finally:
            with self._lock:
                self._queued_write_bytes -= size

    def _count(self, counts: KvTierCounts) -> None:
        with self._lock:
            self._counts.setdefault(counts.medium, KvTierCounts(counts.medium)).add(counts)
