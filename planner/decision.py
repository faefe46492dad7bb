"""How many replicas each pool should have: the planner's decision, as pure functions
of what it observed (no I/O, no clock: the caller passes the time).

Three pools: `prefill` (kv_producer replicas), `decode` (kv_consumer and kv_both) and
`combined` (replicas without P/D, which compute their prompts and decode). A P/D fleet
has the first two, a plain fleet the third.

The rule is predictive, from each replica's measured capacity, as NVIDIA Dynamo's
planner is, not a threshold on one queue-length number as KEDA's and the HPA's are:

- prefill replicas = the prompt tokens per second to compute (the arrival rate, plus the
  tokens already waiting, spread over one interval) / one replica's prefill tokens per
  second at the TTFT target;
- decode replicas = the tokens per second to generate / one replica's at the ITL
  target. Where the fleet's generation rate is known (the gateways'
  `vllm:generation_tokens_total`), the demand is that rate, or, where more, what the
  running sequences would generate each stepping at the ITL target (an overloaded pool
  generates less than it is asked for: its rate alone reads as what it can do), the
  waiting sequences added at the same rate per sequence; a replica that holds C
  sequences within the ITL target generates C / target tokens a second (Little's law).
  Not the count of sequences itself: that count grows as the steps slow (a sequence
  stays as many steps as it has tokens), so at a light load per replica it understates
  what fewer replicas would hold (on the simulator's afternoon, 150 fast sequences on 16
  replicas asked for 3, where those 3 would hold 900 slow ones). Without the rate, the
  sequences / the sequences one replica decodes within the ITL target;
- combined replicas: the sum of the two fractions (one replica time-shares both).

Each demand is forecast to the end of the time a count decided now must hold: a new
replica serves `startup_s` after it is asked for (it loads its model), and the next
decision's replicas one interval later still, so the rule provisions for the load
`startup_s` + one interval ahead: the least-squares line through the demand's samples
of the last `forecast_window_s` (by default that same horizon), read that far ahead
when it rises, read now when it falls (planner/forecast.py says why a line and not a
change between two samples); with a `season_s` (a load that repeats daily), at least
what the demand was over that horizon one season ago. Then divided by a utilization
below 1 (headroom for bursts within an interval).

Capacity is measured (a profile of one replica at the targets), then corrected by what
the fleet shows, for one interval at a time: a pool that misses its latency target at a
load per replica below its capacity gets, for this decision, that load as its capacity
(at most half off): a reactive push on top of the predictive rule where the profile is
too optimistic for today's workload. The correction never outlives the misses, and
never raises the capacity above the profile: latencies are lagging and noisy signals (an
ITL p90 is over the requests that ended, which began at a lighter load), and an
estimate that ratcheted on them would drift off for good. (A first version did ratchet,
both ways: on the simulator's day it sat at half the prefill capacity, over-provisioning
that pool twice over; docs/planner.md has both runs.)

Where the decode pool needs more replicas and the prefill pool's demand leaves some of
its replicas idle, the decode pool takes those first (`Decision.moves`; the replicas that
can serve either pool move, planner/actuator.py): they serve decode at once, where a new
replica loads its model first.

Then bounds (min and max per pool), a cooldown after any change, and hysteresis on the
way down: a pool scales down only to the highest count any decision asked for during
the last `scale_down_window_s`, and only after `cooldown_s` since its last change, so a
dip in the load does not remove a replica a minute before the load comes back.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from planner.forecast import Forecast

POOLS = ("prefill", "decode", "combined")
# How far a miss can lower the capacity: a latency spike with another cause (a slow
# node, a noisy neighbour) must not make the planner ask for many times the replicas.
MAX_CAPACITY_DROP = 0.5


@dataclass(frozen=True)
class Capacity:
    """One replica's measured capacity (by profiling, e.g. benchmarks/planner_sim.py's
    model, or a load test at the targets)."""

    prefill_tokens_per_s: float  # prompt tokens per second computed, TTFT within its target
    decode_sequences: float  # sequences decoded at once, ITL within its target

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_sequences <= 0:
            raise ValueError(f"capacities must be positive, got {self}")


@dataclass(frozen=True)
class Bounds:
    min: int
    max: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max:
            raise ValueError(f"bounds need 0 <= min <= max, got min {self.min}, max {self.max}")

    def clamp(self, count: int) -> int:
        return max(self.min, min(self.max, count))


@dataclass(frozen=True)
class PlannerConfig:
    ttft_target_s: float
    itl_target_s: float
    capacity: Capacity
    bounds: dict[str, Bounds]  # per pool the fleet has
    interval_s: float = 15.0
    # The share of a replica's capacity the rule plans to use.
    utilization: float = 0.8
    cooldown_s: float = 120.0  # after a change, no scale-down of that pool for this long
    scale_down_window_s: float = 300.0  # scale down only to the highest count asked for over it
    # Seconds from a scale-up to the new replica serving (its pod scheduled, its model
    # loaded): the demand is provisioned for this far ahead, plus one interval.
    startup_s: float = 0.0
    # Each demand's trend line is fit through its samples of the last this many seconds
    # (None: startup_s + one interval, as far back as the forecast looks ahead).
    forecast_window_s: float | None = None
    # The period the load repeats with (a day), for a seasonal term in the forecast; 0: none.
    season_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ttft_target_s <= 0 or self.itl_target_s <= 0 or self.interval_s <= 0:
            raise ValueError("the targets and the interval must be positive")
        if self.season_s < 0:
            raise ValueError(f"season_s must be at least 0, got {self.season_s}")
        if self.forecast_window_s is not None and self.forecast_window_s <= 0:
            raise ValueError(f"forecast_window_s must be positive, got {self.forecast_window_s}")
        if self.startup_s < 0:
            raise ValueError(f"startup_s must be at least 0, got {self.startup_s}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        unknown = set(self.bounds) - set(POOLS)
        if unknown:
            raise ValueError(f"unknown pools {sorted(unknown)}; pools are {', '.join(POOLS)}")

    @property
    def ahead_s(self) -> float:
        """How far ahead a count decided now must hold: until the next decision's replicas serve."""
        return self.startup_s + self.interval_s

    @property
    def window_s(self) -> float:
        return self.ahead_s if self.forecast_window_s is None else self.forecast_window_s


@dataclass(frozen=True)
class PoolObservation:
    replicas: int  # the pool's count: its Deployment's, less the replicas draining
    running: int  # sequences running on its serving replicas
    waiting: int  # requests queued on them
    serving: int | None = None  # replicas up and registered (None: all of them); the others still load

    @property
    def up(self) -> int:
        return self.replicas if self.serving is None else self.serving


@dataclass(frozen=True)
class Observation:
    """What the fleet showed over the last interval. A p90 is None when no request gave one."""

    ttft_p90_s: float | None
    itl_p90_s: float | None
    request_rate: float  # requests per second arriving
    prompt_tokens_rate: float  # prompt tokens per second to compute (cache hits excluded where known)
    pools: dict[str, PoolObservation]
    # tokens per second the fleet generated (None: not known, e.g. from an older gateway)
    generation_tokens_rate: float | None = None

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens_rate / self.request_rate if self.request_rate > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    at_s: float
    replicas: dict[str, int]  # the count each pool should have
    wanted: dict[str, int]  # what the rule asked for, before the cooldown and hysteresis
    capacity: Capacity  # the estimate the rule used
    reasons: dict[str, str]  # one line per pool, for the log
    # Prefill replicas the decode pool takes, of those the prefill pool's demand leaves
    # idle, before new ones are added (those that can move: planner/actuator.py).
    moves: int = 0


@dataclass
class PlannerState:
    """What the planner remembers between decisions."""

    capacity: Capacity  # the one the last decision used
    last_change_s: dict[str, float] = field(default_factory=dict)
    # (time, count asked for) per pool, over the scale-down window
    asked: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    # per demand ("prompt", "decode:<pool>"): its recent samples and their trend line
    forecasts: dict[str, Forecast] = field(default_factory=dict)


def decode_tokens_rate(seen: Observation, pool: PoolObservation, itl_target_s: float) -> float | None:
    """The tokens per second a pool is asked to generate: what the fleet generated, or,
    where that is less, what its running sequences would generate each stepping at the
    ITL target (a pool stepping slower than its target, overloaded, generates less than
    it is asked for, and its rate alone would say the load is what it can do); the
    waiting sequences added at the same rate per sequence. None without a rate."""
    if seen.generation_tokens_rate is None or pool.running <= 0:
        return None
    rate = max(seen.generation_tokens_rate, pool.running / itl_target_s)
    return rate * (pool.running + pool.waiting) / pool.running


def corrected_capacity(config: PlannerConfig, seen: Observation) -> Capacity:
    """This interval's capacity: the profile's, lowered where a target was missed at a
    lower load per replica."""
    prefill = config.capacity.prefill_tokens_per_s
    decode = config.capacity.decode_sequences
    prefill_pool = seen.pools.get("prefill")
    decode_pool = seen.pools.get("decode")
    # A combined replica time-shares both kinds of work: its load per kind understates how
    # busy it is, so its misses say little about either capacity alone.
    if prefill_pool and prefill_pool.up and seen.ttft_p90_s is not None and seen.ttft_p90_s > config.ttft_target_s:
        prefill = _lowered(prefill, seen.prompt_tokens_rate / prefill_pool.up)
    if decode_pool and decode_pool.up and seen.itl_p90_s is not None and seen.itl_p90_s > config.itl_target_s:
        # The load per replica in sequences; from the generation rate, the sequences that
        # rate would be at the ITL target (C sequences at the target step C / target a second).
        rate = seen.generation_tokens_rate
        load = decode_pool.running if rate is None else rate * config.itl_target_s
        decode = _lowered(decode, load / decode_pool.up)
    return Capacity(prefill, decode)


def _lowered(capacity: float, load: float) -> float:
    return max(capacity * MAX_CAPACITY_DROP, min(capacity, load))


def wanted_replicas(config: PlannerConfig, state: PlannerState, seen: Observation,
                    now_s: float) -> dict[str, tuple[int, str]]:
    """The predictive rule: per pool, (replicas, why), each demand its forecast
    `startup_s` + one interval ahead (planner/forecast.py)."""
    capacity, interval = state.capacity, config.interval_s
    wanted: dict[str, tuple[int, str]] = {}

    def forecast(key: str, value: float) -> float:
        series = state.forecasts.setdefault(key, Forecast(config.window_s, config.season_s))
        series.add(now_s, value)
        return series.ahead(config.ahead_s)

    tokens_rate = forecast("prompt", seen.prompt_tokens_rate)

    def prefill_share(pool: PoolObservation) -> tuple[float, str]:
        # The tokens already queued must be computed within one interval, beside the new ones.
        backlog = pool.waiting * seen.mean_prompt_tokens / interval
        share = (tokens_rate + backlog) / capacity.prefill_tokens_per_s
        return share, f"{tokens_rate:.0f}+{backlog:.0f} prompt tok/s over {capacity.prefill_tokens_per_s:.0f}"

    def decode_share(name: str, pool: PoolObservation) -> tuple[float, str]:
        rate = decode_tokens_rate(seen, pool, config.itl_target_s)
        if rate is not None:
            rate = forecast(f"decode:{name}", rate)
            per_replica = capacity.decode_sequences / config.itl_target_s
            return rate / per_replica, f"{rate:.0f} gen tok/s over {per_replica:.0f}"
        sequences = forecast(f"sequences:{name}", pool.running + pool.waiting)
        return sequences / capacity.decode_sequences, f"{sequences:.0f} seqs over {capacity.decode_sequences:.1f}"

    for name, pool in seen.pools.items():
        if name == "prefill":
            share, why = prefill_share(pool)
        elif name == "decode":
            share, why = decode_share(name, pool)
        else:
            prefill, why_prefill = prefill_share(pool)
            decode, why_decode = decode_share(name, pool)
            share, why = prefill + decode, f"{why_prefill}; {why_decode}"
        wanted[name] = (math.ceil(share / config.utilization - 1e-9), why)
    return wanted


def decide(config: PlannerConfig, state: PlannerState, seen: Observation, now_s: float) -> Decision:
    """One decision: updates `state` and returns the count each pool should have."""
    state.capacity = corrected_capacity(config, seen)
    wanted = wanted_replicas(config, state, seen, now_s)
    replicas, asked, reasons = {}, {}, {}
    for name, (count, why) in wanted.items():
        bounds = config.bounds.get(name, Bounds(0, max(count, seen.pools[name].replicas)))
        count = bounds.clamp(count)
        asked[name] = count
        history = state.asked.setdefault(name, deque())
        history.append((now_s, count))
        while history and history[0][0] < now_s - config.scale_down_window_s:
            history.popleft()
        current = seen.pools[name].replicas
        # The planner's start counts as a change: one that restarts removes nothing before
        # it has watched the pool for a cooldown.
        state.last_change_s.setdefault(name, now_s)
        target = count
        if count < current:
            # Hysteresis: down only to the highest count asked for over the window, and
            # not within the cooldown of the last change.
            target = min(current, max(c for _, c in history))
            if now_s - state.last_change_s[name] < config.cooldown_s:
                target = current
        target = bounds.clamp(target)
        if target != current:
            state.last_change_s[name] = now_s
        replicas[name] = target
        reasons[name] = f"{why} -> {count} wanted, {current} now, {target} decided"
    return Decision(now_s, replicas, asked, replace(state.capacity), reasons, idle_prefill_for_decode(seen, replicas, asked))


def idle_prefill_for_decode(seen: Observation, replicas: dict[str, int], asked: dict[str, int]) -> int:
    """How many prefill replicas the decode pool should take before adding its own: as
    many as it lacks serving now, of those the prefill pool has beyond what its demand
    asks for. A moved replica serves at once, where a new one loads its model first (a
    pod still loading is then removed before it serves): when the prompts shrink as the
    answers grow (a chat fleet turning to long generations), the prefill pool idles just
    as the decode pool runs short. Never the other way: a decode replica's sequences
    would share their steps with prompts, the stall that disaggregation removes."""
    if "prefill" not in replicas or "decode" not in replicas:
        return 0
    idle = seen.pools["prefill"].replicas - asked["prefill"]
    short = replicas["decode"] - seen.pools["decode"].up
    return max(0, min(idle, short))
