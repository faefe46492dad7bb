"""The planner's decision logic on its own: no server, no clock (planner/decision.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.decision import (
    Bounds,
    Capacity,
    Observation,
    PlannerConfig,
    PlannerState,
    PoolObservation,
    decide,
)

CAPACITY = Capacity(prefill_tokens_per_s=5000, decode_sequences=40)


def config(**overrides) -> PlannerConfig:
    values = dict(ttft_target_s=1.0, itl_target_s=0.05, capacity=CAPACITY, interval_s=30.0, utilization=0.8,
                  cooldown_s=120.0, scale_down_window_s=300.0,
                  bounds={"prefill": Bounds(1, 10), "decode": Bounds(1, 10)})
    values.update(overrides)
    return PlannerConfig(**values)


def seen(prompt_rate: float, prefill: tuple[int, int, int], decode: tuple[int, int, int], ttft=0.5, itl=0.03,
         rate: float = 5.0) -> Observation:
    return Observation(ttft, itl, rate, prompt_rate,
                       {"prefill": PoolObservation(*prefill), "decode": PoolObservation(*decode)})


def test_counts_follow_from_demand_over_capacity_with_headroom():
    decision = decide(config(), PlannerState(CAPACITY), seen(10_000, (3, 0, 0), (4, 100, 0)), now_s=0)
    # 10000 tok/s / 5000 / 0.8 = 2.5 -> 3; 100 sequences / 40 / 0.8 = 3.125 -> 4
    assert decision.replicas == {"prefill": 3, "decode": 4}


def test_the_queue_counts_a_prefill_backlog_and_waiting_sequences():
    # 30 requests of 1000 tokens waiting, to clear in one 30 s interval: 1000 tok/s more
    decision = decide(config(), PlannerState(CAPACITY), seen(5_000, (2, 0, 30), (2, 60, 40), rate=5.0), now_s=0)
    assert decision.wanted == {"prefill": 2, "decode": 4}  # (5000+1000)/4000 -> 2; 100/32 -> 4


def test_a_rising_load_is_met_one_interval_ahead():
    config_, state = config(), PlannerState(CAPACITY)
    decide(config_, state, seen(4_000, (1, 0, 0), (1, 30, 0)), now_s=0)
    decision = decide(config_, state, seen(8_000, (2, 0, 0), (2, 60, 0)), now_s=30)
    # extrapolated: 12000 tok/s -> 3 prefill; 90 sequences -> 3 decode (not 2 and 2)
    assert decision.replicas == {"prefill": 3, "decode": 3}


def test_decode_demand_is_the_generation_rate_not_the_sequence_count():
    # 40 fast sequences on 4 replicas generate 4000 tok/s; a replica holds 40 sequences
    # within the 50 ms ITL target: 800 tok/s. 4000/800/0.8 = 6.25 -> 7, where the count of
    # sequences (40/40/0.8 -> 2) would leave 2 replicas to step 20 each, far past the target.
    observation = Observation(0.5, 0.03, 5.0, 4_000, {"prefill": PoolObservation(1, 0, 0),
                                                      "decode": PoolObservation(4, 40, 0)}, generation_tokens_rate=4_000)
    assert decide(config(), PlannerState(CAPACITY), observation, now_s=0).wanted["decode"] == 7
    # Waiting sequences count at the rate the running ones step: 4000 x 50/40 = 5000 -> 8.
    observation = replace(observation, pools={"prefill": PoolObservation(1, 0, 0), "decode": PoolObservation(4, 40, 10)})
    assert decide(config(), PlannerState(CAPACITY), observation, now_s=0).wanted["decode"] == 8
    # A missed ITL lowers the capacity to the load per replica in sequences at the target:
    # 1200 tok/s over 2 replicas x 50 ms = 30 sequences.
    observation = Observation(0.5, 0.09, 5.0, 4_000, {"prefill": PoolObservation(1, 0, 0),
                                                      "decode": PoolObservation(2, 80, 0)}, generation_tokens_rate=1_200)
    state = PlannerState(CAPACITY)
    decide(config(), state, observation, now_s=0)
    assert state.capacity.decode_sequences == 30


def test_the_trend_provisions_one_startup_ahead():
    # A replica takes 90 s to serve: each demand is carried 90 + 30 s ahead, by the line
    # through its samples of the last 120 s. Prompt tokens rise 1000/s every 30 s, 4000 to
    # 7000: 11000 tok/s, 3 replicas of 4000 (one interval ahead: 8000, 2). The sequences
    # in flight rise 10 every 30 s to 40: 80, 3 replicas of 32 (one interval ahead: 50, 2).
    for startup, expected in ((90.0, {"prefill": 3, "decode": 3}), (0.0, {"prefill": 2, "decode": 2})):
        config_, state = config(startup_s=startup), PlannerState(CAPACITY)
        for now, rate, sequences in ((0, 4_000, 10), (30, 5_000, 20), (60, 6_000, 30), (90, 7_000, 40)):
            decision = decide(config_, state, seen(rate, (1, 0, 0), (1, sequences, 0)), now_s=now)
        assert decision.wanted == expected


def test_an_overloaded_decode_pool_is_asked_what_its_sequences_need_at_the_target():
    # 2 replicas stepping 512 sequences generate 5000 tok/s, far slower than the 50 ms
    # target; at the target those sequences need 512 / 0.05 = 10240 tok/s. A replica holds
    # 40 sequences at the target, 800 tok/s: 10240 / 800 / 0.8 = 16 (the rate alone: 8).
    observation = Observation(0.5, 0.03, 5.0, 4_000, {"prefill": PoolObservation(1, 0, 0),
                                                      "decode": PoolObservation(2, 512, 0)}, generation_tokens_rate=5_000)
    config_ = config(bounds={"prefill": Bounds(1, 20), "decode": Bounds(1, 20)})
    assert decide(config_, PlannerState(CAPACITY), observation, now_s=0).wanted["decode"] == 16


def test_a_combined_pool_adds_both_shares():
    observation = Observation(0.5, 0.03, 5.0, 2_000, {"combined": PoolObservation(2, 20, 0)})
    decision = decide(config(bounds={"combined": Bounds(1, 8)}), PlannerState(CAPACITY), observation, now_s=0)
    assert decision.replicas == {"combined": 2}  # (2000/5000 + 20/40) / 0.8 = 1.125 -> 2


def test_a_short_decode_pool_takes_the_prefill_replicas_the_prompts_leave_idle():
    # Prompts shrank: 5000 tok/s ask for 2 of the 6 prefill replicas; 300 sequences ask for
    # 10 decode replicas where 2 serve. 4 move at once, 4 more are added.
    decision = decide(config(), PlannerState(CAPACITY), seen(5_000, (6, 0, 0), (2, 300, 0)), now_s=0)
    assert decision.wanted == {"prefill": 2, "decode": 10} and decision.moves == 4
    # (hysteresis holds the prefill pool's count; what moves leaves it all the same)
    assert decision.replicas["prefill"] == 6
    # As many as the decode pool lacks, no more; none where no prefill replica idles.
    assert decide(config(), PlannerState(CAPACITY), seen(5_000, (6, 0, 0), (9, 300, 0)), now_s=0).moves == 1
    # Pods still loading serve only later: the idle replicas stand in for them now.
    loading = Observation(0.5, 0.03, 5.0, 5_000, {"prefill": PoolObservation(6, 0, 0),
                                                  "decode": PoolObservation(10, 300, 0, serving=7)})
    assert decide(config(), PlannerState(CAPACITY), loading, now_s=0).moves == 3
    assert decide(config(), PlannerState(CAPACITY), seen(8_000, (2, 0, 0), (2, 300, 0)), now_s=0).moves == 0
    # Never a decode replica into the prefill pool: its sequences would share steps with prompts.
    assert decide(config(), PlannerState(CAPACITY), seen(40_000, (2, 0, 0), (9, 30, 0)), now_s=0).moves == 0
    # Nor in a fleet without both pools.
    combined = Observation(0.5, 0.03, 5.0, 1_000, {"combined": PoolObservation(2, 10, 0)})
    assert decide(config(bounds={"combined": Bounds(1, 10)}), PlannerState(CAPACITY), combined, now_s=0).moves == 0


def test_bounds_hold_both_ways():
    config_ = config(bounds={"prefill": Bounds(2, 3), "decode": Bounds(1, 2)})
    decision = decide(config_, PlannerState(CAPACITY), seen(100_000, (3, 0, 0), (1, 0, 0)), now_s=0)
    assert decision.replicas == {"prefill": 3, "decode": 1}
    decision = decide(config_, PlannerState(CAPACITY), seen(0, (1, 0, 0), (5, 400, 0)), now_s=1000)
    assert decision.replicas == {"prefill": 2, "decode": 2}  # a bound wins over the cooldown
    # Without one, a planner that starts removes nothing within its cooldown.
    decision = decide(config(), PlannerState(CAPACITY), seen(0, (3, 0, 0), (5, 0, 0)), now_s=1000)
    assert decision.wanted == {"prefill": 1, "decode": 1} and decision.replicas == {"prefill": 3, "decode": 5}


def test_scale_down_waits_for_the_cooldown_and_the_window_but_scale_up_does_not():
    config_, state = config(cooldown_s=120.0, scale_down_window_s=300.0), PlannerState(CAPACITY)
    # (TTFT missed at 10000 tok/s a replica, above the estimate: the estimate stands.)
    assert decide(config_, state, seen(20_000, (2, 0, 0), (4, 120, 0), ttft=3.0), now_s=0).replicas == {
        "prefill": 5, "decode": 4}
    # The load falls at once: nothing goes down within the cooldown, nor while the window
    # still holds the peak's ask.
    for now in (30, 60, 150, 290):
        assert decide(config_, state, seen(4_000, (5, 0, 0), (4, 30, 0)), now_s=now).replicas == {
            "prefill": 5, "decode": 4}
    # Past the window: down to the highest ask since.
    assert decide(config_, state, seen(4_000, (5, 0, 0), (4, 30, 0)), now_s=301).replicas == {
        "prefill": 1, "decode": 1}
    # Up again at once, cooldown or not.
    # (20000 tok/s extrapolated from 4000: 36000, over 4000 a replica.)
    assert decide(config_, state, seen(20_000, (1, 0, 0), (1, 120, 0), ttft=3.0), now_s=331).replicas["prefill"] == 9


def test_a_missed_target_lowers_the_capacity_for_that_interval_only():
    config_, state = config(), PlannerState(CAPACITY)
    # TTFT missed at 2000 tok/s per replica, far below 5000: at most half off, 2500.
    decision = decide(config_, state, seen(4_000, (2, 0, 0), (2, 40, 0), ttft=3.0), now_s=0)
    assert state.capacity.prefill_tokens_per_s == 2500 and decision.wanted["prefill"] == 2  # 4000/2000 -> 2
    # Missed at 4000 a replica: 4000.
    decide(config_, state, seen(8_000, (2, 0, 0), (2, 40, 0), ttft=3.0), now_s=30)
    assert state.capacity.prefill_tokens_per_s == 4000
    # Met again: the profile's capacity, never more, whatever load it was met at.
    decide(config_, state, seen(8_000, (2, 0, 0), (2, 120, 0), itl=0.04), now_s=60)
    assert state.capacity == CAPACITY
    # A missed ITL at a load above the capacity says nothing the rule does not know.
    decide(config_, state, seen(4_000, (2, 0, 0), (2, 200, 0), itl=0.5), now_s=90)
    assert state.capacity.decode_sequences == 40
    # Missed at 10 sequences a replica: 20 (half off) for this decision.
    decide(config_, state, seen(4_000, (2, 0, 0), (2, 20, 0), itl=0.5), now_s=120)
    assert state.capacity.decode_sequences == 20


@pytest.mark.parametrize("bad", [dict(utilization=0), dict(ttft_target_s=0), dict(bounds={"gpu": Bounds(0, 1)}),
                                 dict(startup_s=-1), dict(forecast_window_s=0),
                                 dict(season_s=-1)])
def test_bad_settings_are_refused_by_name(bad):
    with pytest.raises(ValueError):
        config(**bad)
    with pytest.raises(ValueError, match="min"):
        Bounds(3, 2)
