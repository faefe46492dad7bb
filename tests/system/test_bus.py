"""Token streaming over a real nats-server: the publisher, called from a plain thread as
the scheduler's step loop calls it, sends one StepOutputs per step per gateway (never
one per token); each gateway's subscriber demultiplexes them into per-request queues.
Messages are numbered per gateway: a NATS restart, or a message lost on the way, is
made good by a replay from the publisher's window, and whatever cannot be (NATS away
past the grace, an oversized delta) ends requests with an explicit error."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec
import nats as nats_client
import pytest

from gateway.cluster.nats_subscriber import OutputSubscriber
from kvfleet.processes import start_nats, stop, wait_for_port
from scheduler_svc.nats_publisher import OutputPublisher
from scheduler_svc.replay_window import ReplayWindow
from services.engine_client import EngineUnavailable, RequestFailed, RequestLost
from services.messages import TokenDelta
from services.nats_link import subject
from services.request_stream import RequestStream
from services.scheduler_messages import StepOutputs

from servers import HOST, nats, nats_server  # noqa: F401  (fixture)

STEPS = 5
REQUESTS = {"g1": ["a", "b", "c"], "g2": ["d", "e"]}


def step_batches(step: int) -> dict[str, list[TokenDelta]]:
    """Every request gets two tokens per step (as with speculative decoding); the last step finishes all."""
    last = step == STEPS - 1
    return {
        gateway: [
            TokenDelta(
                request_id, [100 * step + i, 100 * step + i + 50], "length" if last else None,
                logprobs=[{100 * step + i: -0.5}, {100 * step + i + 50: -0.25}],
            )
            for i, request_id in enumerate(requests)
        ]
        for gateway, requests in REQUESTS.items()
    }


class WindowSource:
    """Replays from the publisher's window, as Scheduler.ReplayOutputs does over gRPC."""

    def __init__(self, publisher: OutputPublisher, gateway_id: str = "g") -> None:
        self.window = publisher.window
        self.gateway_id = gateway_id
        self.replays: list[int] = []

    def replay(self, instance_id: str, after_seq: int) -> list[StepOutputs] | None:
        assert instance_id == self.window.instance_id
        self.replays.append(after_seq)
        payloads = self.window.after(self.gateway_id, after_seq)
        return None if payloads is None else [msgspec.msgpack.decode(p, type=StepOutputs) for p in payloads]

    def instances(self) -> list[str]:
        return [self.window.instance_id]


class Spy:
    """Counts the NATS messages on every gateway's subject."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.arrived = asyncio.Event()

    async def start(self, url: str) -> Spy:
        self._nc = await nats_client.connect(url)
        await self._nc.subscribe("kvfleet.out.*", cb=self._count)
        await self._nc.flush()
        return self

    async def _count(self, msg) -> None:
        assert msgspec.msgpack.decode(msg.data, type=StepOutputs).deltas
        self.counts[msg.subject] += 1
        self.arrived.set()

    async def wait_for(self, gateways: list[str], count: int, publisher: OutputPublisher) -> None:
        while min(self.counts[subject(g)] for g in gateways) < count:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), 10)
            except TimeoutError:
                numbered = {g: len(publisher.window.after(g, 0) or ()) for g in gateways}
                raise AssertionError(f"NATS carried {dict(self.counts)} of {count} each; the publisher numbered "
                                     f"{numbered}, connected: {publisher.nats.connected}") from None

    async def close(self) -> None:
        await self._nc.close()


async def read_all(queue: RequestStream, timeout_s: float = 10.0) -> list[TokenDelta]:
    deltas = []
    while not deltas or deltas[-1].finish_reason is None:
        item = await asyncio.wait_for(queue.get(), timeout_s)
        if isinstance(item, BaseException):
            raise item
        deltas.append(item)
    return deltas


def test_one_message_per_step_per_gateway_demultiplexed(nats) -> None:
    publisher = OutputPublisher(nats.url, "s1")
    subscribers = {gateway: OutputSubscriber(nats.url, gateway, WindowSource(publisher, gateway)) for gateway in REQUESTS}

    async def main() -> None:
        spy = await Spy().start(nats.url)
        queues = {r: subscribers[g].open(r) for g, requests in REQUESTS.items() for r in requests}
        readers = {r: asyncio.create_task(read_all(q)) for r, q in queues.items()}
        loop = asyncio.get_running_loop()
        for step in range(STEPS):
            # Lockstep, so the publisher never has two steps queued to merge.
            await loop.run_in_executor(None, publisher.publish, step_batches(step))
            await spy.wait_for(list(REQUESTS), step + 1, publisher)
        results = {r: await task for r, task in readers.items()}
        await spy.close()

        assert spy.counts == {subject(g): STEPS for g in REQUESTS}  # 5 messages per gateway, for 10 tokens a request
        for _gateway, requests in REQUESTS.items():
            for i, request_id in enumerate(requests):
                deltas = results[request_id]
                assert [t for d in deltas for t in d.new_token_ids] == [
                    t for s in range(STEPS) for t in (100 * s + i, 100 * s + i + 50)
                ]
                assert [d.finish_reason for d in deltas] == [None] * (STEPS - 1) + ["length"]
                assert deltas[0].logprobs == [{i: -0.5}, {i + 50: -0.25}]

    try:
        asyncio.run(main())
    finally:
        publisher.close()
        for subscriber in subscribers.values():
            subscriber.close()


@pytest.mark.serial
def test_publish_from_the_step_thread_does_not_wait_for_nats(nats) -> None:
    """With the NATS thread busy, publish() still returns at once; the backlog goes out
    merged, one message per gateway, in step order."""
    publisher = OutputPublisher(nats.url, "s1")
    subscriber = OutputSubscriber(nats.url, "g1", WindowSource(publisher, "g1"))
    hold = threading.Event()
    publisher.nats.loop.call_soon_threadsafe(hold.wait)  # the NATS thread stalls until released
    threading.Timer(2.0, hold.set).start()  # a publish() that waited would hold the test up this long

    async def main() -> None:
        spy = await Spy().start(nats.url)
        queue = subscriber.open("a")
        started = time.monotonic()
        for step in range(STEPS):
            publisher.publish({"g1": step_batches(step)["g1"][:1]})
        assert time.monotonic() - started < 0.5 and not hold.is_set()
        deltas = await read_all(queue)
        await spy.close()
        assert [t for d in deltas for t in d.new_token_ids] == [t for s in range(STEPS) for t in (100 * s, 100 * s + 50)]
        assert spy.counts[subject("g1")] == 1  # the five held-up steps went out as one message

    try:
        asyncio.run(main())
    finally:
        hold.set()
        publisher.close()
        subscriber.close()


def test_errors_unknown_requests_and_discards(nats) -> None:
    publisher = OutputPublisher(nats.url, "s1")
    subscriber = OutputSubscriber(nats.url, "g", WindowSource(publisher))

    async def main() -> None:
        failing, kept, dropped = subscriber.open("failing"), subscriber.open("kept"), subscriber.open("dropped")
        carried = subscriber.open("carried")
        subscriber.discard("dropped")
        publisher.publish({"g": [
            TokenDelta("failing", [], "abort", error="engine step failed: a bug"),
            TokenDelta("carried", [], "abort", error="engine step failed: worker unreachable", lost=True),
            TokenDelta("unknown", [1]),
            TokenDelta("dropped", [2]),
            TokenDelta("kept", [3], "stop", stop_reason=3),
        ]})
        error = await asyncio.wait_for(failing.get(), 10)
        assert isinstance(error, RequestFailed) and not isinstance(error, RequestLost) and "a bug" in str(error)
        error = await asyncio.wait_for(carried.get(), 10)  # its worker failed, not it: a 503, and migratable
        assert isinstance(error, RequestLost) and "worker unreachable" in str(error)
        assert (await read_all(kept))[0].stop_reason == 3
        assert dropped.empty()

    try:
        asyncio.run(main())
    finally:
        publisher.close()
        subscriber.close()


def test_child_requests_stream_into_their_parent_until_the_last_ends(nats) -> None:
    """n > 1: deltas keep their child ids and share the parent's queue."""
    publisher = OutputPublisher(nats.url, "s1")
    subscriber = OutputSubscriber(nats.url, "g", WindowSource(publisher))

    async def main() -> list[TokenDelta]:
        queue = subscriber.open("p", 2)  # p#0 and p#1
        with pytest.raises(ValueError):
            subscriber.open("p")
        publisher.publish({"g": [TokenDelta("p#0", [1]), TokenDelta("p#1", [2])]})
        publisher.publish({"g": [TokenDelta("p#1", [3], "length")]})
        publisher.publish({"g": [TokenDelta("p#0", [4], "stop"), TokenDelta("p#1", [5])]})
        deltas = [await asyncio.wait_for(queue.get(), 10) for _ in range(4)]
        assert queue.empty()  # p#1's delta after its end came in the same message, and was dropped
        subscriber.open("p")  # both children ended: the request's routes are gone
        return deltas

    try:
        deltas = asyncio.run(main())
    finally:
        publisher.close()
        subscriber.close()
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in deltas] == [
        ("p#0", [1], None), ("p#1", [2], None), ("p#1", [3], "length"), ("p#0", [4], "stop"),
    ]


def test_oversized_batches_split_and_an_oversized_delta_fails_its_request(nats) -> None:
    publisher = OutputPublisher(nats.url, "s1")
    subscriber = OutputSubscriber(nats.url, "g", WindowSource(publisher))

    def big(request_id: str, positions: int) -> TokenDelta:
        # One position with as many candidates as it takes: 12 bytes each.
        return TokenDelta(request_id, [7], "length",
                          prompt_logprobs=[{t: -1.0 for t in range(10_000, 10_000 + positions)}])

    async def main() -> None:
        # 1 MiB is nats-server's default max_payload: two 0.9 MiB deltas need two messages.
        queues = {r: subscriber.open(r) for r in ("x", "y", "huge")}
        publisher.publish({"g": [big("x", 80_000), big("y", 80_000), big("huge", 200_000)]})
        for request_id in ("x", "y"):
            (delta,) = await read_all(queues[request_id])
            assert delta.new_token_ids == [7] and len(delta.prompt_logprobs[0]) == 80_000
        error = await asyncio.wait_for(queues["huge"].get(), 10)
        assert isinstance(error, RequestFailed) and "max_payload" in str(error)

    try:
        asyncio.run(main())
    finally:
        publisher.close()
        subscriber.close()


def test_nats_away_past_the_grace_fails_open_streams(tmp_path: Path) -> None:
    with nats_server(tmp_path) as server:
        publisher = OutputPublisher(server.url, "s1")
        subscriber = OutputSubscriber(server.url, "g", WindowSource(publisher), grace_s=1.0)

        async def main() -> None:
            queue = subscriber.open("a")
            server.stop()
            subscriber.open("b")  # within the grace: what it is sent is replayed once NATS is back
            error = await asyncio.wait_for(queue.get(), 10)
            assert isinstance(error, RequestFailed) and "disconnected for more than 1 s" in str(error)
            with pytest.raises(EngineUnavailable):  # nothing new may wait on a dead stream
                subscriber.open("c")

        try:
            asyncio.run(main())
        finally:
            subscriber.close()
            publisher.close(timeout_s=1.0)


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def test_a_lost_message_is_replayed_in_its_place(nats) -> None:
    publisher = OutputPublisher(nats.url, "s1")
    source = WindowSource(publisher)
    subscriber = OutputSubscriber(nats.url, "g", source)

    async def main() -> None:
        queue = subscriber.open("a")
        publisher.publish({"g": [TokenDelta("a", [1])]})
        assert (await asyncio.wait_for(queue.get(), 10)).new_token_ids == [1]
        publisher.window.record("g", StepOutputs([TokenDelta("a", [2])]))  # lost
        publisher.publish({"g": [TokenDelta("a", [3], "length")]})
        assert tokens(await read_all(queue)) == [2, 3]
        assert source.replays == [1]

    try:
        asyncio.run(main())
    finally:
        publisher.close()
        subscriber.close()


def test_a_hole_no_longer_held_is_skipped_and_the_stream_goes_on(nats) -> None:
    """The window lost it (here: aged out at once); the cluster client then fails the
    requests it carried (gateway/cluster/streams.py), and later messages still flow."""
    publisher = OutputPublisher(nats.url, "s1")
    publisher.window = ReplayWindow("s1", max_age_s=0.0)
    source = WindowSource(publisher)
    subscriber = OutputSubscriber(nats.url, "g", source)

    async def main() -> None:
        queue = subscriber.open("a")
        publisher.window.record("g", StepOutputs([TokenDelta("a", [1])]))  # lost
        publisher.publish({"g": [TokenDelta("a", [2], "length")]})
        assert tokens(await read_all(queue)) == [2]
        assert source.replays == [0]

    try:
        asyncio.run(main())
    finally:
        publisher.close()
        subscriber.close()


def test_a_nats_restart_loses_no_delta(tmp_path: Path) -> None:
    """kill -9 of nats-server mid-stream, restarted on its port: what was published while
    it was away (some of it lost in flight, some held in the client's buffer, some past
    that buffer) reaches the stream once, in order."""
    with nats_server(tmp_path) as server:
        port = int(server.url.rsplit(":", 1)[1])
        publisher = OutputPublisher(server.url, "s1")
        subscriber = OutputSubscriber(server.url, "g", WindowSource(publisher))
        restarted = None

        async def main() -> None:
            nonlocal restarted
            queue = subscriber.open("a")
            publisher.publish({"g": [TokenDelta("a", [0])]})
            assert (await asyncio.wait_for(queue.get(), 60)).new_token_ids == [0]  # generous: a loaded machine
            server.process.kill()
            server.process.wait()
            big = list(range(1, 200_001))  # ~0.6 MB a step: past the client's 2 MiB buffer within a few
            for step in range(8):
                publisher.publish({"g": [TokenDelta("a", big if step % 2 else [step + 1])]})
                await asyncio.sleep(0.1)
            restarted = start_nats(HOST, port)
            wait_for_port(HOST, port, restarted)
            publisher.publish({"g": [TokenDelta("a", [7], "length")]})
            expected = [*[t for step in range(8) for t in (big if step % 2 else [step + 1])], 7]
            assert tokens(await read_all(queue, timeout_s=60)) == expected

        try:
            asyncio.run(main())
        finally:
            subscriber.close()
            publisher.close(timeout_s=1.0)
            if restarted is not None:
                stop(restarted, grace_s=5.0)
