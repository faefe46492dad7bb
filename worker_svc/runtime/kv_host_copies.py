"""Copies between the device pool and the host tier (docs/kv_connector.md).

On a CPU both are host memory: a copy is a memcpy, done at once. On a GPU the host
tier is pinned and the copies run on a side stream, so the step never waits on them:
a save gathers its blocks on the side stream (the forward waits for that gather only,
since it may overwrite a saved block that was reallocated) and copies them to pinned
memory while the forward runs; a thread puts them into the host tier once they have
arrived. A load gathers its host blocks into pinned memory, copies them in on the side
stream, and the forward waits for that copy on the GPU, not the host. A load of a host
block whose save has not landed yet waits for it first (rare: a block is saved steps
before anything can evict it from the device pool and load it back).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from worker_svc.runtime.kv_cache import copy_blocks


class HostCopies:
    def __init__(self, kv_caches: list[torch.Tensor], host_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.host_caches = host_caches
        self.device = kv_caches[0].device
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._landing = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-kv-host") if self._cuda else None
        self._lock = threading.Lock()
        self._pending: dict[int, Future[None]] = {}  # host block -> its save, until it has landed
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # pinned buffers the GPU still reads

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        if not self._cuda:
            copy_blocks(pairs, self.kv_caches, self.host_caches)
            return
        main = torch.cuda.current_stream(self.device)
        device_ids = torch.tensor([device for device, _ in pairs], device=self.device)
        self._stream.wait_stream(main)  # the blocks' KV has been written
        with torch.cuda.stream(self._stream):
            gathered = torch.stack([cache[:, device_ids] for cache in self.kv_caches])
            taken = torch.cuda.Event()
            taken.record(self._stream)
            pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            pinned.copy_(gathered, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self._stream)
        main.wait_event(taken)
        host_ids = torch.tensor([host for _, host in pairs])
        landing = self._landing.submit(self._land, arrived, pinned, host_ids)
        with self._lock:
            self._pending.update(dict.fromkeys(host_ids.tolist(), landing))
        landing.add_done_callback(lambda _: self._landed(host_ids.tolist(), landing))

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        if not self._cuda:
            copy_blocks(pairs, self.host_caches, self.kv_caches)
            return
        with self._lock:
            waits = {self._pending[host] for host, _ in pairs if host in self._pending}
        for landing in waits:
            landing.result()
        host_ids = torch.tensor([host for host, _ in pairs])
        device_ids = torch.tensor([device for _, device in pairs], device=self.device)
        pinned = torch.stack([cache[:, host_ids] for cache in self.host_caches]).pin_memory()
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            arrived = pinned.to(self.device, non_blocking=True)
            for layer, cache in enumerate(self.kv_caches):
                cache[:, device_ids] = arrived[layer]
            copied = torch.cuda.Event()
            copied.record(self._stream)
        main.wait_event(copied)
        self._in_flight = [(event, buffer) for event, buffer in self._in_flight if not event.query()]
        self._in_flight.append((copied, pinned))

    def _land(self, arrived: torch.cuda.Event, pinned: torch.Tensor, host_ids: torch.Tensor) -> None:
        arrived.synchronize()
        for layer, cache in enumerate(self.host_caches):
            cache[:, host_ids] = pinned[layer]

    def _landed(self, host_ids: list[int], landing: Future[None]) -> None:
        with self._lock:
            for host in host_ids:
                if self._pending.get(host) is landing:
                    del self._pending[host]
