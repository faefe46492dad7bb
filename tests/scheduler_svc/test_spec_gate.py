"""When not to speculate (scheduler_svc/spec_gate.py): a request whose first drafts keep
being rejected stops getting drafts, its held-back drafts still judged against the tokens
it produces, and speculates again once they would have been accepted; a new request starts
from what the requests before it saw; a step's drafts are cut for the least mean time a
token over its requests at the measured step costs, alone and in a batch, where a draft's
row lengthens every request's step, and a price not measured for a while is tried again; no
drafts while disable_by_batch_size requests run."""
from __future__ import annotations

import pytest

from scheduler_svc import spec_step_cost
from scheduler_svc.spec_gate import MIN_ACCEPTANCE, SpecGate
from scheduler_svc.spec_step_cost import SpecStepCosts
from services.messages import StepPlan


def _admit(gate: SpecGate, request_id: str, drafts: list[int], num_running: int = 1,
           probabilities: list[float] | None = None) -> list[int]:
    """The gate's choice for one request's proposal in a step of `num_running` requests."""
    return gate.choose({request_id: (drafts, probabilities)}, num_running).get(request_id, [])


def test_rejected_drafts_stop_speculation_until_held_back_ones_would_pass() -> None:
    gate = SpecGate(disable_by_batch_size=None)
    steps = 0
    while _admit(gate, "r", [5, 6]):  # each step: the first draft rejected (7 emitted instead)
        gate.observe("r", 2, [7])
        steps += 1
    assert 3 <= steps <= 8 and gate.acceptance("r") < MIN_ACCEPTANCE
    # Held back, not verified: a held-back draft the step then produces counts as a hit.
    gate.observe("r", 0, [5])
    assert _admit(gate, "r", [9]) == [9]
    # A step whose first draft is accepted (two tokens emitted) keeps it going.
    gate.observe("r", 1, [9, 4])
    assert _admit(gate, "r", [1, 2]) == [1, 2]
    # Each request has its own estimate; a finished one is forgotten.
    assert _admit(gate, "other", [3]) == [3]
    gate.finish("r")
    assert gate.acceptance("r") == gate.prior


def test_a_new_request_starts_from_the_acceptance_requests_before_it_saw() -> None:
    gate = SpecGate(disable_by_batch_size=None)
    for request in range(4):  # 20 steps each, every first draft missing, verified or held back
        for _ in range(20):
            gate.observe(f"r{request}", len(_admit(gate, f"r{request}", [5])), [7])
        gate.finish(f"r{request}")
    assert gate.prior < MIN_ACCEPTANCE
    assert _admit(gate, "next", [5]) == []  # held back from its first step, its drafts still judged
    gate.observe("next", 0, [5])
    for _ in range(40):  # drafts that pass raise the prior again: later requests speculate at once
        gate.observe("next", 1, [5, 6])
    assert _admit(gate, "later", [5]) == [5]


def test_no_drafts_while_the_batch_is_at_disable_by_batch_size() -> None:
    gate = SpecGate(disable_by_batch_size=4)
    assert _admit(gate, "r", [5], 3) == [5]
    assert _admit(gate, "r", [5], 4) == []


def _costs(seconds_by_rows: dict[int, float]) -> SpecStepCosts:
    costs = SpecStepCosts()
    for rows, seconds in seconds_by_rows.items():  # a step of `rows` decode rows: one request and its drafts
        drafts = {"r": [0] * (rows - 1)} if rows > 1 else {}
        costs.record(StepPlan(step_id=1, num_scheduled_tokens={"r": rows}, scheduled_spec_decode_tokens=drafts),
                     seconds)
    return costs


def test_alone_drafts_are_cut_to_the_length_with_the_most_tokens_a_second() -> None:
    fading = [0.5, 0.25, 0.1, 0.05]  # chance that the first 1, 2, 3, 4 drafts are all accepted
    gate = SpecGate(disable_by_batch_size=None, step_costs=SpecStepCosts())
    assert _admit(gate, "r", [1, 2, 3, 4], 1, fading) == [1, 2, 3, 4]  # nothing measured yet: all of them
    # 2 to 4 rows, unmeasured, are priced as 1 (tried, then measured); 5 rows cost 2x: the 4th draft's
    # 0.05 tokens do not pay for it, 3 drafts do (1.85 tokens a decode step's time).
    gate = SpecGate(disable_by_batch_size=None, step_costs=_costs({1: 0.010, 5: 0.020}))
    assert _admit(gate, "r", [1, 2, 3, 4], 1, fading) == [1, 2, 3]
    # 2 rows at 1.6x: a likely draft pays, an unlikely one does not (held back, still judged).
    gate = SpecGate(disable_by_batch_size=None, step_costs=_costs({1: 0.010, 2: 0.016}))
    assert _admit(gate, "r", [1], 1, [0.7]) == [1]
    assert _admit(gate, "r", [1], 1, [0.5]) == []
    acceptance = gate.acceptance("r")
    gate.observe("r", 0, [2])
    assert gate.acceptance("r") < acceptance  # the held-back draft was judged: a miss


def test_a_price_too_high_to_pay_is_forgotten_and_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches timed while the machine was busy priced every draft of a lone request out,
    and its 1-row steps never measured them again: stale prices go, and drafts are tried."""
    now = [100.0]
    monkeypatch.setattr(spec_step_cost.time, "monotonic", lambda: now[0])
    costs = _costs({rows: 0.020 * rows for rows in range(2, 9)} | {1: 0.010})  # each row costs two quiet steps
    gate = SpecGate(disable_by_batch_size=None, step_costs=costs)
    for _ in range(3):  # alone, sure drafts: none pays; only 1-row steps are measured
        assert _admit(gate, "r", [1, 2, 3], 1, [1.0, 1.0, 1.0]) == []
        now[0] += 0.4
        costs.record(StepPlan(step_id=1, num_scheduled_tokens={"r": 1}), 0.010)
    assert _admit(gate, "r", [1, 2, 3], 1, [1.0, 1.0, 1.0]) == [1, 2, 3]  # unmeasured now: priced as 1 row
    assert costs.prices(4) == [0.010] * 4


def test_without_probabilities_the_request_s_acceptance_prices_its_drafts() -> None:
    # A 3-row step 1.3x a 1-row one, a 5-row step 2.2x: at acceptance 0.64 (a, a^2, ...: 1.64, 2.05,
    # 2.31, 2.48 tokens) 2 drafts give the most tokens a second.
    gate = SpecGate(disable_by_batch_size=None, step_costs=_costs({1: 0.010, 2: 0.0125, 3: 0.013, 4: 0.0185,
                                                                  5: 0.022}))
    gate.prior = 0.64
    assert _admit(gate, "r", [1, 2, 3, 4]) == [1, 2]


def _linear_costs() -> SpecStepCosts:
    """3.3 ms and 1.1 ms a row, as decode steps of 8 to 23 rows took on a 2-core Xeon."""
    return _costs({rows: 0.0033 + 0.0011 * rows for rows in range(1, 65)})


def test_in_a_batch_a_draft_pays_for_the_time_it_adds_to_every_request_s_step() -> None:
    gate = SpecGate(disable_by_batch_size=None, step_costs=_linear_costs())
    gate.prior = 0.96  # drafts mostly accepted: 3.6 tokens for 4 drafts
    assert _admit(gate, "a", [1, 2, 3, 4], 1) == [1, 2, 3, 4]  # alone: 4.6 tokens for 2x the time
    # Among eight, one request's 4 drafts would make the others' step 36% longer for its 4.6x.
    assert _admit(gate, "a", [1, 2, 3, 4], 8) == []
    # Every request's: 3.8 tokens each for 2x the time with 3 drafts (the 4th's 0.85 tokens would not pay
    # for the step's 36% longer).
    proposals = {f"r{i}": ([1, 2, 3, 4], None) for i in range(8)}
    assert gate.choose(proposals, 8) == {f"r{i}": [1, 2, 3] for i in range(8)}
    # Half of them: none. One draft each would nearly double their speed and make the step 36% longer:
    # the mean time a token over the eight would grow 3%.
    proposals = {f"r{i}": ([1, 2, 3, 4], None) for i in range(4)}
    assert gate.choose(proposals, 8) == {}
    gate.prior = 0.6
    assert gate.choose({f"s{i}": ([1, 2, 3, 4], None) for i in range(4)}, 8) == {}


def test_drafts_go_where_they_add_the_most() -> None:
    gate = SpecGate(disable_by_batch_size=None, step_costs=_linear_costs())
    sure, likely, unlikely = [1.0] * 6, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [0.1, 0.01, 0.0, 0.0, 0.0, 0.0]
    chosen = gate.choose({"sure": (list(range(6)), sure), "likely": (list(range(6)), likely),
                          "unlikely": (list(range(6)), unlikely)}, 3)
    # The first drafts of the two likely ones cut the mean time a token by 10%; a second one of the sure
    # one would cut its own by a third and lengthen the three's step by 12%.
    assert {request_id: len(drafts) for request_id, drafts in chosen.items()} == {"sure": 1, "likely": 1}


def test_a_proposer_s_estimate_counts_no_more_than_the_request_s_record() -> None:
    # A tree of greedy answers is sure of its drafts; a request that has seen half its first drafts
    # accepted gets them priced at 0.5, 0.25, ...: among eight, not worth their rows.
    gate = SpecGate(disable_by_batch_size=None, step_costs=_linear_costs())
    sure = {f"r{i}": ([1, 2, 3, 4], [1.0] * 4) for i in range(8)}
    assert gate.choose(sure, 8) == {f"r{i}": [1, 2, 3, 4] for i in range(8)}
    gate.prior = 0.5
    assert gate.choose({f"s{i}": ([1, 2, 3, 4], [1.0] * 4) for i in range(8)}, 8) == {}
