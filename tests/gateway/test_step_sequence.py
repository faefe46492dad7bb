"""A gateway puts each scheduler's numbered messages back in order: duplicates dropped,
early ones held behind a hole, announced tails seen as holes, and a hole that cannot
be filled skipped so the stream goes on."""
from __future__ import annotations

from gateway.cluster.step_sequence import StepSequence
from services.scheduler_messages import StepOutputs


def numbered(seq: int, announce: bool = False) -> StepOutputs:
    return StepOutputs(scheduler_instance_id="s1", seq=seq, announce=announce)


def seqs(messages: list[StepOutputs]) -> list[int]:
    return [m.seq for m in messages]


def test_in_order_messages_pass_and_duplicates_are_dropped() -> None:
    sequence = StepSequence()
    assert seqs(sequence.accept(numbered(1))) == [1]
    assert seqs(sequence.accept(numbered(2))) == [2]
    assert sequence.accept(numbered(1)) == [] and sequence.accept(numbered(2)) == []
    assert not sequence.has_hole and sequence.delivered == 2


def test_messages_after_a_hole_wait_for_it() -> None:
    sequence = StepSequence()
    assert sequence.accept(numbered(2)) == [] and sequence.accept(numbered(4)) == []
    assert sequence.has_hole
    assert seqs(sequence.accept(numbered(1))) == [1, 2]
    assert sequence.has_hole
    assert seqs(sequence.accept(numbered(3))) == [3, 4]
    assert not sequence.has_hole


def test_an_announced_tail_is_a_hole_until_replayed() -> None:
    sequence = StepSequence()
    sequence.accept(numbered(1))
    assert sequence.accept(numbered(3, announce=True)) == []
    assert sequence.has_hole
    assert seqs(sequence.accept(numbered(2)) + sequence.accept(numbered(3))) == [2, 3]
    assert not sequence.has_hole
    sequence.accept(numbered(3, announce=True))  # nothing missed
    assert not sequence.has_hole


def test_a_hole_that_cannot_be_filled_is_skipped() -> None:
    sequence = StepSequence()
    sequence.accept(numbered(5, announce=True))
    sequence.accept(numbered(4))
    sequence.accept(numbered(3))
    assert seqs(sequence.skip_hole()) == [3, 4]
    assert not sequence.has_hole and sequence.delivered == 5
    assert seqs(sequence.accept(numbered(6))) == [6]
