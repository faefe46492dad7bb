"""The fleet at a scale this machine cannot run for real: 16 replicas, each kvfleet's
real EngineCore and scheduler (block pool, prefix cache, chunked prefill, preemption)
driving a simulated worker whose step takes a modelled time, routed by the gateway's
real code (gateway/cluster/routing.py's pick, gateway/cluster/kv_index.py's index built from the
replicas' real KV events). Time is virtual: a discrete-event loop advances it.

- Step cost model: a + b x (tokens computed) + c x (sequences in the step), fitted by
  least squares to the real worker's steps on this machine (smollm2, float32, 2
  threads): single prefills of 128-1024 tokens and decode steps of 1-32 sequences.
  The fit is written to the JSON. On a GPU the ratio of prefill to per-step cost
  differs; the policies' ranking depends on prefill dominating a cold request.
- Trace: 200 sessions of 5 turns; each session opens with one of 20 shared system
  prompts (1-2k tokens), each turn adds a user message (20-120 tokens) and the
  answer (30-150 tokens) to the history the next turn sends. Sessions start as a
  Poisson process; a turn follows the previous answer after 0-2 s of "reading".
  The same trace (seeded) runs under prefix, least-load and round-robin routing.
  Reported: mean and p99 TTFT, prefix-cache hit rate (hit tokens / prompt tokens).
  Target: prefix routing's mean TTFT at least 3x better than round-robin's.
- Step overhead: the real scheduler's step (schedule, plan, update) with a worker that
  costs nothing, at 64, 256 and 1024 running decode sequences: wall time per step,
  which must grow at most linearly and stay under 1 ms at 256.

Load, in the router's view, is exact here (a real gateway sees it every poll).
JSON goes to benchmarks/results/fleet_sim.json.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
os.environ["KVFLEET_NUM_THREADS"] = "2"

import argparse  # noqa: E402
import heapq  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from gateway.cluster.kv_index import ReplicaBlocks, cached_blocks  # noqa: E402
from gateway.cluster.routing import ROUTING_POLICIES, Candidate, pick  # noqa: E402
from scheduler_svc.block_pool import KvEventLog  # noqa: E402
from scheduler_svc.engine_core import EngineCore  # noqa: E402
from services.block_hash import extend_block_hashes  # noqa: E402
from services.config import EngineConfig  # noqa: E402
from services.messages import StepPlan, StepResult, WorkerDescription  # noqa: E402
from services.sampling_params import SamplingParams  # noqa: E402
from services.scheduler_messages import NumberedKvEvents  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
MAX_MODEL_LEN = 4096
ANSWER_TOKEN = 42  # what the simulated worker samples (requests ignore EOS)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_token_s: float
    per_sequence_s: float

    def __call__(self, tokens: int, sequences: int) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_sequence_s * sequences


class SimWorker:
    """A WorkerHandle that computes nothing: it tracks which requests reach the end of
    their known tokens (those sample one token) and what the step would have cost."""

    def __init__(self, num_blocks: int, cost: StepCost) -> None:
        self._cost = cost
        self._num_blocks = num_blocks
        self._known: dict[str, list[int]] = {}  # request id -> [tokens known, tokens computed]
        self.last_cost_s = 0.0

    def describe(self) -> WorkerDescription:
        return WorkerDescription(self._num_blocks, 0, BLOCK, MAX_MODEL_LEN, 49152, (0,), uuid.uuid4().hex)

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self._known.pop(request_id, None)
        for new in plan.new_requests:
            self._known[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
        result = StepResult(plan.step_id)
        for request_id, count in plan.num_scheduled_tokens.items():
            state = self._known[request_id]
            state[1] += count
            if state[1] >= state[0]:
                result.sampled_token_ids[request_id] = [ANSWER_TOKEN]
                state[0] += 1
        self.last_cost_s = self._cost(plan.total_num_scheduled_tokens, len(plan.num_scheduled_tokens))
        return result

    def compile_grammar(self, params: object) -> None:
        raise NotImplementedError("the simulated worker has no grammars")


def calibrate() -> tuple[StepCost, list[dict]]:
    """Times the real worker's steps and fits the cost model to them."""
    from worker_svc.kernels.cpu.threads import configure_torch_threads
    from worker_svc.runtime.worker import Worker

    configure_torch_threads()
    config = EngineConfig(dtype="float32", max_model_len=2048, max_num_batched_tokens=2048)
    core = EngineCore(config, Worker(config))
    rng = random.Random(0)
    points = []

    def timed_step() -> tuple[float, int, int]:
        plan_tokens = sum(len(r.prompt_token_ids) for r in core.scheduler.waiting)
        began = time.perf_counter()
        core.step()
        return time.perf_counter() - began, plan_tokens, len(core.scheduler.running)

    for length in (128, 512, 1024, 128, 512, 1024):
        core.add_request(uuid.uuid4().hex, [rng.randrange(1000, 40000) for _ in range(length)],
                         SamplingParams(max_tokens=1, ignore_eos=True))
        seconds, tokens, _ = timed_step()
        points.append({"tokens": tokens, "sequences": 1, "seconds": seconds})
        while core.has_work:
            core.step()
    for batch in (1, 8, 32):
        for _ in range(batch):
            core.add_request(uuid.uuid4().hex, [rng.randrange(1000, 40000) for _ in range(64)],
                             SamplingParams(max_tokens=8, ignore_eos=True))
        core.step()  # the prefill
        for _ in range(5):
            began = time.perf_counter()
            core.step()
            points.append({"tokens": batch, "sequences": batch, "seconds": time.perf_counter() - began})
        while core.has_work:
            core.step()
    matrix = np.array([[1.0, p["tokens"], p["sequences"]] for p in points])
    fit, *_ = np.linalg.lstsq(matrix, np.array([p["seconds"] for p in points]), rcond=None)
    return StepCost(*(max(float(v), 0.0) for v in fit)), points


@dataclass
class Session:
    system: list[int]
    turns: list[tuple[list[int], int]]  # (user message, answer length)
    history: list[int] = field(default_factory=list)
    next_turn: int = 0


@dataclass
class Turn:
    session: Session
    prompt: list[int]
    answer_tokens: int
    arrival: float
    first_token: float | None = None


def make_trace(seed: int, sessions: int, turns: int, systems: int) -> list[tuple[float, Session]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(1000, 2000))] for _ in range(systems)]
    trace, at = [], 0.0
    for _ in range(sessions):
        at += rng.expovariate(4.0)  # 4 new sessions a second
        talk = [([rng.randrange(1000, 40000) for _ in range(rng.randint(20, 120))], rng.randint(30, 150))
                for _ in range(turns)]
        trace.append((at, Session(rng.choice(prompts), talk)))
    return trace


class Replica:
    def __init__(self, cost: StepCost, num_blocks: int, max_num_seqs: int = 256) -> None:
        self.worker = SimWorker(num_blocks, cost)
        config = EngineConfig(model="sim", max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs)
        self.core = EngineCore(config, self.worker)
        self.events = self.core.scheduler.block_pool.events = KvEventLog()
        self.seq = 0
        self.busy = False  # a step is under way or due

    @property
    def load(self) -> int:
        return len(self.core.scheduler.running) + len(self.core.scheduler.waiting)


def simulate(policy: str, trace: list[tuple[float, Session]], replicas: int, cost: StepCost, num_blocks: int
             ) -> dict:
    fleet = [Replica(cost, num_blocks) for _ in range(replicas)]
    index = {str(i): ReplicaBlocks() for i in range(replicas)}
    rng = random.Random(1)
    queue: list[tuple[float, int, str, object]] = []  # (time, tie-break, kind, payload)
    order = iter(range(10**9))
    live: dict[str, Turn] = {}
    done: list[Turn] = []
    for at, session in trace:
        heapq.heappush(queue, (at, next(order), "turn", session))
    while queue:
        now, _, kind, payload = heapq.heappop(queue)
        if kind == "turn":
            session = payload
            message, answer = session.turns[session.next_turn]
            if not session.history:
                session.history = list(session.system)
            prompt = session.history + message
            turn = Turn(session, prompt, answer, arrival=now)
            hashes: list[bytes] = []
            extend_block_hashes(hashes, prompt, BLOCK, b"")
            held = cached_blocks(index, hashes)
            candidates = [Candidate(r.load, held[str(i)]) for i, r in enumerate(fleet)]
            chosen = pick(policy, candidates, len(hashes), next(order))
            request_id = uuid.uuid4().hex
            live[request_id] = turn
            fleet[chosen].core.add_request(request_id, prompt, SamplingParams(max_tokens=answer, ignore_eos=True))
            if not fleet[chosen].busy:  # it steps now; a busy one takes the request at its next step
                fleet[chosen].busy = True
                heapq.heappush(queue, (now, next(order), "step", chosen))
        elif kind == "step":
            replica = fleet[payload]
            deltas = replica.core.step()
            events = replica.events.take()
            heapq.heappush(queue, (now + replica.worker.last_cost_s, next(order), "done", (payload, deltas, events)))
        else:
            number, deltas, events = payload
            replica = fleet[number]
            if events is not None:  # the router hears of them when the step is over
                replica.seq += 1
                index[str(number)].receive(
                    NumberedKvEvents(str(number), replica.seq, events.cleared, events.removed, events.stored))
            for delta in deltas:
                turn = live[delta.request_id]
                if turn.first_token is None and delta.new_token_ids:
                    turn.first_token = now
                if delta.finish_reason is not None:
                    del live[delta.request_id]
                    done.append(turn)
                    session = turn.session
                    session.history = turn.prompt + [ANSWER_TOKEN] * turn.answer_tokens
                    session.next_turn += 1
                    if session.next_turn < len(session.turns):
                        heapq.heappush(queue, (now + rng.uniform(0, 2), next(order), "turn", session))
            replica.busy = replica.core.has_work
            if replica.busy:
                heapq.heappush(queue, (now, next(order), "step", number))
    ttfts = sorted(turn.first_token - turn.arrival for turn in done)
    stats = [replica.core.stats() for replica in fleet]
    return {
        "requests": len(done),
        "mean_ttft_s": round(statistics.fmean(ttfts), 4),
        "p99_ttft_s": round(ttfts[int(0.99 * (len(ttfts) - 1))], 4),
        "prefix_cache_hit_rate": round(sum(s.prefix_cache_hits for s in stats)
                                       / max(1, sum(s.prefix_cache_queries for s in stats)), 4),
        "preemptions": sum(s.num_preemptions for s in stats),
        "virtual_duration_s": round(now, 1),
    }


def step_overhead(running: int, steps: int = 50) -> dict[str, float]:
    """Milliseconds per step with `running` decode sequences, the median of 5 runs of
    `steps` steps: the scheduler's part (schedule and plan, then update from the
    result: the issue's "scheduling plus plan building, no model"), and the whole
    EngineCore.step, which adds the simulated worker's own bookkeeping."""
    replica = Replica(StepCost(0.0, 0.0, 0.0), num_blocks=running * 8, max_num_seqs=running)
    scheduler = replica.core.scheduler
    for _ in range(running):
        replica.core.add_request(uuid.uuid4().hex, [7] * 32, SamplingParams(max_tokens=10_000, ignore_eos=True))
    while len(scheduler.running) < running or scheduler.waiting:
        replica.core.step()
    scheduling, whole = [], []
    for _ in range(5):
        spent = 0.0
        began = time.perf_counter()
        for _ in range(steps):
            start = time.perf_counter()
            plan = scheduler.schedule()
            planned = time.perf_counter()
            result = replica.worker.execute(plan)
            executed = time.perf_counter()
            scheduler.update(plan, result)
            spent += (planned - start) + (time.perf_counter() - executed)
        whole.append((time.perf_counter() - began) / steps * 1e3)
        scheduling.append(spent / steps * 1e3)
    return {"scheduler_ms": round(statistics.median(scheduling), 3), "step_ms": round(statistics.median(whole), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 sessions instead of 200 (a sanity run)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/fleet_sim.json")
    args = parser.parse_args()
    log(f"load average {os.getloadavg()}")
    cost, points = calibrate()
    log(f"step cost: {cost.base_s * 1e3:.2f} ms + {cost.per_token_s * 1e3:.4f} ms/token "
        f"+ {cost.per_sequence_s * 1e3:.4f} ms/sequence")
    trace_args = dict(seed=7, sessions=40 if args.quick else 200, turns=5, systems=20)
    results = {}
    for policy in ROUTING_POLICIES:
        began = time.perf_counter()
        results[policy] = simulate(policy, make_trace(**trace_args), replicas=16, cost=cost, num_blocks=2048)
        log(f"{policy}: {results[policy]} ({time.perf_counter() - began:.1f} s of wall time)")
    overhead = {str(n): step_overhead(n) for n in (64, 256, 1024)}
    log(f"step overhead by running sequences: {overhead}")
    report = {
        "step_cost": {"base_s": cost.base_s, "per_token_s": cost.per_token_s, "per_sequence_s": cost.per_sequence_s,
                      "points": points},
        "trace": trace_args, "replicas": 16, "blocks_per_replica": 2048,
        "policies": results,
        "mean_ttft_round_robin_over_prefix": round(results["round-robin"]["mean_ttft_s"]
                                                   / results["prefix"]["mean_ttft_s"], 2),
        "step_overhead_ms": overhead,
        "loadavg_end": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    log(f"round-robin / prefix mean TTFT: {report['mean_ttft_round_robin_over_prefix']}x; wrote {args.out}")


if __name__ == "__main__":
    main()
