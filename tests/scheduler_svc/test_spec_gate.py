"""When not to speculate (scheduler_svc/spec_gate.py): a request whose first drafts keep
being rejected stops getting drafts, its held-back drafts still judged against the tokens
it produces, and speculates again once they would have been accepted; a new request starts
from what the requests before it saw; a batch holds its drafts back while a step of its
rows with drafts costs more than they yield; no drafts while disable_by_batch_size
requests run."""
from __future__ import annotations

from scheduler_svc.spec_gate import EXPLORE_EVERY, MIN_ACCEPTANCE, SpecGate
from scheduler_svc.spec_step_cost import SpecStepCosts
from services.messages import StepPlan


def test_rejected_drafts_stop_speculation_until_held_back_ones_would_pass() -> None:
    gate = SpecGate(disable_by_batch_size=None)
    steps = 0
    while gate.admit("r", [5, 6], 1):  # each step: the first draft rejected (7 emitted instead)
        gate.observe("r", 2, [7])
        steps += 1
    assert 3 <= steps <= 8 and gate.acceptance("r") < MIN_ACCEPTANCE
    # Held back, not verified: a held-back draft the step then produces counts as a hit.
    gate.observe("r", 0, [5])
    assert gate.admit("r", [9], 1) == [9]
    # A step whose first draft is accepted (two tokens emitted) keeps it going.
    gate.observe("r", 1, [9, 4])
    assert gate.admit("r", [1, 2], 1) == [1, 2]
    # Each request has its own estimate; a finished one is forgotten.
    assert gate.admit("other", [3], 1) == [3]
    gate.finish("r")
    assert gate.acceptance("r") == gate.prior


def test_a_new_request_starts_from_the_acceptance_requests_before_it_saw() -> None:
    gate = SpecGate(disable_by_batch_size=None)
    for request in range(4):  # 20 steps each, every first draft missing, verified or held back
        for _ in range(20):
            gate.observe(f"r{request}", len(gate.admit(f"r{request}", [5], 1)), [7])
        gate.finish(f"r{request}")
    assert gate.prior < MIN_ACCEPTANCE
    assert gate.admit("next", [5], 1) == []  # held back from its first step, its drafts still judged
    gate.observe("next", 0, [5])
    for _ in range(40):  # drafts that pass raise the prior again: later requests speculate at once
        gate.observe("next", 1, [5, 6])
    assert gate.admit("later", [5], 1) == [5]


def test_no_drafts_while_the_batch_is_at_disable_by_batch_size() -> None:
    gate = SpecGate(disable_by_batch_size=4)
    assert gate.admit("r", [5], 3) == [5]
    assert gate.admit("r", [5], 4) == []


def _costs(seconds_by_rows: dict[int, float]) -> SpecStepCosts:
    costs = SpecStepCosts()
    for rows, seconds in seconds_by_rows.items():  # a step of `rows` decode rows: one request and its drafts
        drafts = {"r": [0] * (rows - 1)} if rows > 1 else {}
        costs.record(StepPlan(step_id=1, num_scheduled_tokens={"r": rows}, scheduled_spec_decode_tokens=drafts),
                     seconds)
    return costs


def test_a_batch_holds_its_drafts_back_while_its_verification_step_costs_more_than_they_yield() -> None:
    # A 5-row step 1.7x a 1-row one; a 40-row step (8 requests, 4 drafts each) 4.5x an 8-row one.
    gate = SpecGate(disable_by_batch_size=None, step_costs=_costs({1: 0.004, 5: 0.0068, 8: 0.012, 40: 0.054}))
    drafts = [1, 2, 3, 4]
    gate.start_step(8)
    assert gate.admit("r", drafts, 8) == drafts  # nothing yielded yet: speculate, and measure
    for _ in range(10):
        gate.observe("r", 4, [1, 2, 3, 0])  # 4 tokens a verification (the first draft always accepted)
    gate.start_step(1)
    assert gate.admit("r", drafts, 1) == drafts  # alone: its own acceptance decides (4 tokens for 1.7x the time)
    gate.start_step(8)
    assert gate.admit("r", drafts, 8) == []  # among eight: 4 tokens for 4.5x the time
    held = 1
    gate.start_step(8)
    while not gate.admit("r", drafts, 8):  # held back, then one step speculates to measure again
        held += 1
        gate.start_step(8)
    assert held == EXPLORE_EVERY - 1
