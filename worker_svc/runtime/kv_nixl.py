"""KV blocks read over NIXL (NVIDIA's transfer library: what vLLM's NixlConnector, Dynamo
and llm-d move KV with), one agent per worker, made at its first use.

The consumer reads the blocks straight from the producer's memory into its own KV cache
(one-sided READs: RDMA or NVLink between GPUs, UCX's shared memory or TCP between hosts),
one READ for each run of blocks the gRPC fetch stream (kv_peer.py) names: which blocks
hold the next places, as soon as the producer holds them (a prefill chunk's, or all of a
finished prefill's). A READ is not seen by the producer, so the producer lends each run
it names until the consumer's READ of it completes (the READ's notification says so),
and a hold that ends waits for its lent runs (`settle`) before the step that may write
them again: a block is never rewritten while a consumer reads it.

The agents run without NIXL's progress thread, which spins a core: on a 2-core host it
halved the prefill replica's step rate. The consumer progresses its own READs as it
waits for them; the producer, whose part of a READ (over TCP) and its notification need
progress too, runs a thread of its own that does, only while it has blocks lent.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from collections.abc import Iterable

import msgspec
import torch

from services.kv_transfer_messages import NixlAgentInfo

logger = logging.getLogger(__name__)

# How long a hold that ends waits for its consumer's READs to complete: a READ of a block
# takes about a millisecond; one still running after this is a consumer that died.
_SETTLE_S = 2.0
# As long from when its fetch stream ended early (the consumer stopped or died): a live
# consumer's READs ended before it ended the stream, but a stream that failed on its own
# may leave some running a moment (a 24-block run took about 15 ms here, over UCX's TCP).
_ABANDONED_SETTLE_S = 0.25
_POLL_S = 0.0005  # how often a READ's state, and the producer's notifications, are looked at


class NixlBlocks:
    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        cache = kv_caches[0]  # [k|v][block][token][head][dim] per layer, contiguous
        self._num_blocks = cache.shape[1]
        self._region_bytes = cache[0, 0].nbytes  # one block's keys (or values) of one layer
        self.mem_type = "VRAM" if cache.is_cuda else "DRAM"
        self._device_id = cache.device.index or 0
        self._layer_addresses = [cache.data_ptr() for cache in kv_caches]  # the caches never move
        self._agent = None
        self._made = threading.Lock()
        self._peers: set[str] = set()  # producers' agents added
        self._lent: dict[str, set[int]] = {}  # per held request, the first places of the runs a consumer still reads
        self._abandoned: dict[str, float] = {}  # held requests whose fetch stream ended early: when
        self._lent_changed = threading.Condition()
        self._progress_thread: threading.Thread | None = None
        self._exiting = False
        # A thread still polling the agent while the interpreter exits aborts the process
        # (std::terminate): it stops first.
        atexit.register(self._stop_progress)

    def agent(self):
        """The agent, made and its KV caches registered at the first call (about 0.5 s)."""
        with self._made:
            if self._agent is None:
                from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

                # Thread-safe: the loader threads read, the serving threads name blocks, the
                # progress thread takes notifications.
                config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                           sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
                agent = nixl_agent(f"kvfleet-{uuid.uuid4().hex}", config)
                agent.register_memory(self.kv_caches)
                self._agent = agent
                logger.info("NIXL agent %s: %d KV caches registered (%s)", agent.name, len(self.kv_caches),
                            self.mem_type)
            return self._agent

    # -- producer ------------------------------------------------------------------------

    def info(self) -> bytes:
        """What a consumer needs to read this worker's blocks, encoded."""
        agent = self.agent()
        return msgspec.msgpack.encode(NixlAgentInfo(
            agent.name, agent.get_agent_metadata(), self.mem_type, self._device_id, self._num_blocks,
            self._layer_addresses))

    def lend(self, request_id: str, index: int) -> None:
        """The run of blocks from `index` of the request's fetch is named to its consumer: lent until read."""
        with self._lent_changed:
            if request_id in self._abandoned:
                return  # named into a stream nobody reads
            self._lent.setdefault(request_id, set()).add(index)
            if self._progress_thread is None and not self._exiting:
                self._progress_thread = threading.Thread(target=self._progress, name="kvfleet-nixl-progress",
                                                         daemon=True)
                self._progress_thread.start()

    def _progress(self) -> None:
        """While blocks are lent: progresses the agent, so that consumers' READs complete,
        and returns each block whose READ's notification came."""
        agent = self.agent()
        while True:
            notifications = agent.get_new_notifs()
            with self._lent_changed:
                for messages in notifications.values():
                    for message in messages:
                        request_id, _, index = message.decode().rpartition(":")
                        self._lent.get(request_id, set()).discard(int(index))
                self._lent_changed.notify_all()
                if not any(self._lent.values()) or self._exiting:
                    self._progress_thread = None
                    return
            time.sleep(_POLL_S)

    def _stop_progress(self) -> None:
        with self._lent_changed:
            self._exiting = True
            thread = self._progress_thread
        if thread is not None:
            thread.join(1.0)

    def abandon(self, request_id: str) -> None:
        """The request's fetch stream ended before the producer ended it: its consumer
        stopped (once every READ it posted had ended) or died. It reads none of the runs
        named after, and what it was lent is waited for only _ABANDONED_SETTLE_S."""
        with self._lent_changed:
            self._abandoned.setdefault(request_id, time.monotonic())
            self._lent_changed.notify_all()

    def settle(self, request_ids: Iterable[str]) -> None:
        """Returns once no consumer reads a block of these requests (their holds ended, so
        their blocks may be written again), or after _SETTLE_S (_ABANDONED_SETTLE_S from
        its end for a request whose fetch stream ended early)."""
        request_ids = list(request_ids)
        started = time.monotonic()
        with self._lent_changed:
            while reading := [request_id for request_id in request_ids if self._lent.get(request_id)]:
                deadline = max(self._abandoned[request_id] + _ABANDONED_SETTLE_S if request_id in self._abandoned
                               else started + _SETTLE_S for request_id in reading)
                if time.monotonic() >= deadline:
                    if not all(request_id in self._abandoned for request_id in reading):
                        logger.warning("NIXL: reads of the blocks of %s did not complete in %.0f s; their holds "
                                       "end", reading, _SETTLE_S)
                    break
                self._lent_changed.wait(deadline - time.monotonic())
            for request_id in request_ids:
                self._lent.pop(request_id, None)
                self._abandoned.pop(request_id, None)

    # -- consumer ------------------------------------------------------------------------

    def reads(self, producer: NixlAgentInfo, timeout_s: float) -> NixlReads:
        """One fetch's READs from `producer`."""
        agent = self.agent()
        with self._made:
            if producer.name not in self._peers:
                agent.add_remote_agent(producer.metadata)
                self._peers.add(producer.name)
        return NixlReads(self, agent, producer, timeout_s)

    def regions(self, layer_addresses: list[int], num_blocks: int, blocks: list[int], device_id: int
                ) -> list[tuple[int, int, int]]:
        """Each block's layers' keys, then values: (address, bytes, device)."""
        return [(address + (kv * num_blocks + block) * self._region_bytes, self._region_bytes, device_id)
                for block in blocks for address in layer_addresses for kv in (0, 1)]

    def local_regions(self, blocks: list[int]) -> list[tuple[int, int, int]]:
        return self.regions(self._layer_addresses, self._num_blocks, blocks, self._device_id)


class NixlReads:
    """One fetch's READs, one a run of blocks, each posted as its run is named and
    completed in order: the next run's READ runs while the stream brings the one after."""

    def __init__(self, blocks: NixlBlocks, agent, producer: NixlAgentInfo, timeout_s: float) -> None:
        self._blocks, self._agent, self._producer, self._timeout_s = blocks, agent, producer, timeout_s
        self._posted: list[tuple[object, int]] = []  # (handle, blocks it reads), in the blocks' order
        self._num_completed = 0  # leading READs completed
        self.num_done = 0  # the blocks they read
        self.failed: str | None = None
        self._finished = False

    def post(self, blocks: list[int], targets: list[int], tag: str) -> None:
        """Reads the producer's `blocks` into this worker's `targets`, in one READ; `tag`
        ("request:index", the run's first place) is the notification that tells the
        producer they were read."""
        producer = self._producer
        remote = self._agent.get_xfer_descs(
            self._blocks.regions(producer.layer_addresses, producer.num_blocks, blocks, producer.device_id),
            producer.mem_type)
        local = self._agent.get_xfer_descs(self._blocks.local_regions(targets), self._blocks.mem_type)
        try:
            handle = self._agent.initialize_xfer("READ", local, remote, producer.name, tag.encode())
            self._agent.transfer(handle)
        except Exception as exc:  # the producer disconnected: these blocks and those after them are recomputed
            self._collect(wait=True)
            self.failed = self.failed or f"the NIXL read of blocks from {tag} could not start: {exc}"
            return
        self._posted.append((handle, len(blocks)))
        self._collect(wait=False)

    def finish(self) -> int:
        """Waits for every posted READ (at most the timeout each; those after a failed one
        too, so that none lands in a block the scheduler has the worker recompute);
        returns how many leading blocks they completed. A READ still running then is left
        to the agent: its handle cannot be released. Called again, it only says that."""
        if not self._finished:
            self._finished = True
            self._collect(wait=True)
            for handle, _ in self._posted[self._num_completed + 1:]:
                if self._wait(handle) != "PROC":
                    self._release(handle)
        return self.num_done

    def _state(self, handle) -> str:
        """DONE, PROC or ERR; ERR too where the agent raises (the producer disconnected)."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as exc:  # the bindings' errors (nixlRemoteDisconnectError, ...) share no base of their own
            logger.warning("NIXL read from %s: %s", self._producer.name, exc)
            return "ERR"

    def _wait(self, handle) -> str:
        deadline = time.monotonic() + self._timeout_s
        while (state := self._state(handle)) == "PROC" and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return state

    def _collect(self, wait: bool) -> None:
        """Counts the leading READs completed; with `wait`, waits for each in turn."""
        while self._num_completed < len(self._posted) and self.failed is None:
            handle, count = self._posted[self._num_completed]
            state = self._wait(handle) if wait else self._state(handle)
            if state == "PROC" and not wait:
                return
            if state != "PROC":  # ended: its handle goes back (one still running cannot)
                self._release(handle)
            if state == "DONE":
                self._num_completed += 1
                self.num_done += count
            else:
                self.failed = (f"the NIXL read of blocks {self.num_done} to {self.num_done + count - 1} "
                               f"{'failed' if state == 'ERR' else 'timed out'}")
                logger.warning("%s from %s", self.failed, self._producer.name)

    def _release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # a failed READ's handle, its producer gone: nothing more to free
            logger.warning("NIXL: a read's handle could not be released: %s", exc)
