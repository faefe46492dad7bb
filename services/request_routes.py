"""Which front-end request each engine request belongs to.

A request with n or best_of > 1 runs in the engine as child requests
(`child_request_id`), so an engine loop must route every child's deltas to the
parent's consumer, end the parent once its last child ends, and abort a parent by
aborting each live child. Both engine loops (the embedded AsyncEngine and the
scheduler's StepLoop) and the gateway's NATS subscriber keep their requests here;
it does no locking of its own.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from services.parallel_sampling import engine_request_ids

Target = TypeVar("Target")


@dataclass(eq=False)
class Route(Generic[Target]):
    request_id: str
    target: Target  # where its deltas go: a stream, a gateway
    live: set[str] = field(default_factory=set)  # its engine requests still running


class RequestRoutes(Generic[Target]):
    def __init__(self) -> None:
        self._requests: dict[str, Route[Target]] = {}
        self._by_engine_id: dict[str, Route[Target]] = {}

    def add(self, request_id: str, num_children: int, target: Target) -> Route[Target]:
        ids = engine_request_ids(request_id, num_children)
        route = Route(request_id, target, set(ids))
        self._requests[request_id] = route
        self._by_engine_id.update(dict.fromkeys(ids, route))
        return route

    def of(self, engine_id: str) -> Route[Target] | None:
        return self._by_engine_id.get(engine_id)

    def get(self, request_id: str) -> Route[Target] | None:
        return self._requests.get(request_id)

    def engine_ids(self, request_id: str) -> list[str]:
        """What aborting `request_id` aborts: every live child of a request, or the one
        engine request (a child's own id aborts that child only)."""
        route = self._requests.get(request_id)
        return sorted(route.live) if route is not None else [request_id]

    def end(self, engine_id: str) -> Route[Target] | None:
        """Marks an engine request ended; its route, or None if it had none left."""
        route = self._by_engine_id.pop(engine_id, None)
        if route is not None:
            route.live.discard(engine_id)
            if not route.live:
                del self._requests[route.request_id]
        return route

    def remove(self, route: Route[Target]) -> list[str]:
        """Drops a whole request; returns its engine requests that were still live."""
        for engine_id in route.live:
            del self._by_engine_id[engine_id]
        del self._requests[route.request_id]
        live, route.live = sorted(route.live), set()
        return live

    def __iter__(self) -> Iterator[Route[Target]]:
        return iter(list(self._requests.values()))

    def __len__(self) -> int:
        return len(self._requests)
