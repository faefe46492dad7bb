"""The scheduler's replay window: each gateway's messages numbered from 1, replayed
after any number it names, and a number no longer held is said to be gone."""
from __future__ import annotations

import time

import msgspec

from scheduler_svc.replay_window import ReplayWindow
from services.messages import TokenDelta
from services.scheduler_messages import StepOutputs

decode = msgspec.msgpack.Decoder(StepOutputs).decode


def message(*request_ids: str) -> StepOutputs:
    return StepOutputs([TokenDelta(r, [1]) for r in request_ids])


def numbers(payloads: list[bytes] | None) -> list[int]:
    assert payloads is not None
    return [decode(p).seq for p in payloads]


def test_each_gateway_is_numbered_from_one_and_replayed_in_order() -> None:
    window = ReplayWindow("s1")
    for index in range(3):
        stamped = decode(window.record("g1", message(f"a{index}")))
        assert (stamped.scheduler_instance_id, stamped.seq, stamped.deltas[0].request_id) == ("s1", index + 1, f"a{index}")
    window.record("g2", message("b"))
    assert numbers(window.after("g1", 0)) == [1, 2, 3]
    assert numbers(window.after("g1", 1)) == [2, 3]
    assert window.after("g1", 3) == [] and window.after("unknown", 0) == []
    assert numbers(window.after("g2", 0)) == [1]


def test_what_aged_out_or_overflowed_is_reported_gone() -> None:
    window = ReplayWindow("s1", max_age_s=0.2)
    window.record("g", message("a"))
    time.sleep(0.3)
    window.record("g", message("b"))
    assert window.after("g", 0) is None  # message 1 aged out
    assert numbers(window.after("g", 1)) == [2]

    small = ReplayWindow("s1", max_bytes=100)
    for index in range(20):
        small.record("g", message(f"request-{index}"))
    assert small.after("g", 0) is None
    assert numbers(small.after("g", 18)) == [19, 20]


def test_announcements_name_each_recent_gateways_last_number() -> None:
    window = ReplayWindow("s1", max_age_s=0.2)
    window.record("old", message("a"))
    time.sleep(0.3)
    for _ in range(2):
        window.record("new", message("b"))
    (announcement,) = window.announcements().values()
    parsed = decode(announcement)
    assert (parsed.announce, parsed.seq, parsed.scheduler_instance_id, list(parsed.deltas)) == (True, 2, "s1", [])
    assert list(window.announcements()) == ["new"]
    window.record("old", message("c"))  # numbering goes on where it was
    assert numbers(window.after("old", 1)) == [2]
