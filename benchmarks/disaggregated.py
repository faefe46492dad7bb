"""Prefill/decode disaggregation (docs/disaggregation.md) against combined replicas, on
a decode-heavy load with long prompts arriving among the streams.

- Simulator (`--sim`, the default): benchmarks/fleet_sim.py's fleet, extended with pools
  and a transfer cost: each replica is kvfleet's real EngineCore and scheduler (with its
  real KV handoff: holds, LOADING_KV, fetched blocks indexed) driving a simulated worker
  whose step costs the model fitted to this machine's real worker; the gateway's real
  routing picks the decode replica, then (past the threshold) the prefill replica. A
  fetch of n blocks takes n x the per-block transfer time measured here over loopback
  gRPC (`--transfer-ms-per-block`), beside the steps. 8 prefill + 8 decode replicas
  against 16 combined ones, on the same trace.
- Real (`--real`): the same comparison on this machine's processes, small: 2 combined
  replicas against 1 prefill + 1 decode, each a `kvfleet worker` (one thread) and
  `kvfleet scheduler` process, real NATS and Redis, the gateway's cluster client.

Trace: decode streams (64-token prompts, 256 tokens out) arriving as a Poisson process,
and long prompts (2048 tokens, 16 out) arriving among them. Reported: p99 and mean
inter-token latency of the decode streams, mean TTFT (all requests, and the long ones),
and throughput (tokens out per second). Target (simulator): decode p99 ITL at least 2x
better with P/D at equal throughput.

At that load neither fleet keeps up with the arrivals, so their throughputs differ (the
whole run's tokens over its length, drain included). Beside it, each fleet's tokens/s
while requests arrive, and `--sweep`: the same trace shape with both rates scaled, where
the fleets that sustain the same tokens/s compare at equal throughput. The simulated
handoff moves the blocks after the prefill (no `remote_streamed`): at 2.9 ms a block
the overlap would change no inter-token gap.

JSON goes to benchmarks/results/disaggregated.json.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import heapq  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

from fleet_sim import BLOCK, MAX_MODEL_LEN, SimWorker, StepCost, calibrate, log  # noqa: E402

from gateway.cluster.routing import NOT_CACHED, Candidate, pick  # noqa: E402
from scheduler_svc.engine_core import EngineCore  # noqa: E402
from services.config import EngineConfig  # noqa: E402
from services.kv_transfer_messages import KvTransferParams  # noqa: E402
from services.messages import StepPlan, StepResult, WorkerDescription  # noqa: E402
from services.sampling_params import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# A 16-token block of the default model in float32 (737,280 bytes) over loopback gRPC,
# measured with tests/system/test_disaggregation.py's pair: 9 blocks in 26 ms.
TRANSFER_MS_PER_BLOCK = 2.9
GATEWAY_HOP_S = 0.002  # the prefill's output over NATS and the decode's submit


@dataclass
class Request:
    prompt_len: int
    max_tokens: int
    arrival: float
    stream: bool  # a decode stream (ITL measured), or a long prompt
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    emitted: list[float] = field(default_factory=list)  # each token's time: the windowed throughput
    gap_ends: list[float] = field(default_factory=list)  # when each of `gaps` ended


def make_trace(seed: int, duration_s: float, streams_per_s: float, long_per_s: float) -> list[Request]:
    rng = random.Random(seed)
    trace = []
    for rate, prompt, out, stream in ((streams_per_s, 64, 256, True), (long_per_s, 2048, 16, False)):
        at = 0.0
        while (at := at + rng.expovariate(rate)) < duration_s:
            trace.append(Request(prompt, out, at, stream))
    return sorted(trace, key=lambda r: r.arrival)


class PdSimWorker(SimWorker):
    """The simulated worker, with the KV connector's remote loads: a fetch of n blocks
    ends n x the per-block time after its plan, beside the steps; the producer hears of
    it (kv_sent_done) at its next step."""

    def __init__(self, num_blocks: int, cost: StepCost, transfer_s_per_block: float) -> None:
        super().__init__(num_blocks, cost)
        self.now = 0.0
        self.transfer_s_per_block = transfer_s_per_block
        self.loads: list[tuple[float, str, int, str, PdSimWorker]] = []  # (ready, request, blocks, producer's id, producer)
        self.sent: list[str] = []

    def describe(self) -> WorkerDescription:
        return WorkerDescription(self._num_blocks, 0, BLOCK, MAX_MODEL_LEN, 49152, (0,), uuid.uuid4().hex,
                                 kv_block_bytes=737280)

    def execute(self, plan: StepPlan) -> StepResult:
        for load in plan.kv_loads:
            ready = self.now + len(load.blocks) * self.transfer_s_per_block
            self.loads.append((ready, load.request_id, len(load.blocks), load.remote.request_id,
                               PRODUCERS[load.remote.address]))
        result = super().execute(plan)
        for ready, request_id, blocks, remote_id, producer in [entry for entry in self.loads if entry[0] <= self.now]:
            self.loads.remove((ready, request_id, blocks, remote_id, producer))
            result.kv_loads_done[request_id] = blocks
            producer.sent.append(remote_id)
        result.kv_sent_done, self.sent = self.sent, []
        if not plan.num_scheduled_tokens:  # nothing to compute: the next event is a fetch's end
            pending = [entry[0] for entry in self.loads]
            self.last_cost_s = max(self.last_cost_s, (min(pending) - self.now) if pending else 0.005)
        return result


PRODUCERS: dict[str, PdSimWorker] = {}


class SimReplica:
    def __init__(self, name: str, role: str | None, cost: StepCost, num_blocks: int, transfer_s: float) -> None:
        self.worker = PdSimWorker(num_blocks, cost, transfer_s)
        transfer = {"kv_connector": "KvfleetConnector", "kv_role": role} if role else None
        # Chunked prefill in 512-token steps: it bounds a long prompt's stall of the decodes
        # sharing its steps, but spreads it over four of them.
        config = EngineConfig(model="sim", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512,
                              kv_transfer_config=transfer)
        address = f"{name}:1"
        self.core = EngineCore(config, self.worker, address)
        PRODUCERS[address] = self.worker
        self.busy = False

    @property
    def load(self) -> int:
        return len(self.core.scheduler.running) + len(self.core.scheduler.waiting)


def simulate(trace: list[Request], prefill: int, decode: int, combined: int, cost: StepCost, num_blocks: int,
             transfer_s: float, threshold: int) -> dict:
    fleet = ([SimReplica(f"p{i}", "kv_producer", cost, num_blocks, transfer_s) for i in range(prefill)]
             + [SimReplica(f"d{i}", "kv_consumer", cost, num_blocks, transfer_s) for i in range(decode)]
             + [SimReplica(f"c{i}", None, cost, num_blocks, transfer_s) for i in range(combined)])
    producers = list(range(prefill))
    decoders = list(range(prefill, len(fleet)))
    queue: list[tuple[float, int, str, object]] = []
    order = iter(range(10**9))
    live: dict[str, Request] = {}
    splits: dict[str, Request] = {}  # prefill request id -> the request it prefills
    for request in trace:
        heapq.heappush(queue, (request.arrival, next(order), "arrive", request))

    def submit(number: int, request_id: str, request: Request, params: SamplingParams,
               handoff: KvTransferParams | None, now: float) -> None:
        replica = fleet[number]
        replica.core.add_request(request_id, [7] * request.prompt_len, params, kv_transfer_params=handoff)
        if not replica.busy:
            replica.busy = True
            heapq.heappush(queue, (now, next(order), "step", number))

    def choose(pool: list[int]) -> int:
        candidates = [Candidate(fleet[i].load, NOT_CACHED) for i in pool]
        return pool[pick("prefix", candidates, 0, 0)]

    now = 0.0
    while queue:
        now, _, kind, payload = heapq.heappop(queue)
        if kind == "arrive":
            request = payload
            params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
            request_id = uuid.uuid4().hex
            live[request_id] = request
            decoder = choose(decoders)
            if producers and request.prompt_len > threshold:
                prefill_id = f"{request_id}-prefill"
                splits[prefill_id] = request
                request.decoder, request.request_id = decoder, request_id
                submit(choose(producers), prefill_id, request, SamplingParams(max_tokens=1, ignore_eos=True),
                       KvTransferParams(do_remote_decode=True), now)
            else:
                submit(decoder, request_id, request, params, None, now)
        elif kind == "handoff":
            request, handoff = payload
            submit(request.decoder, request.request_id, request,
                   SamplingParams(max_tokens=request.max_tokens, ignore_eos=True), handoff, now)
        elif kind == "step":
            replica = fleet[payload]
            replica.worker.now = now
            deltas = replica.core.step()
            heapq.heappush(queue, (now + replica.worker.last_cost_s, next(order), "done", (payload, deltas)))
        else:
            number, deltas = payload
            replica = fleet[number]
            for delta in deltas:
                if delta.request_id in splits:
                    if delta.finish_reason is not None:
                        request = splits.pop(delta.request_id)
                        heapq.heappush(queue, (now + GATEWAY_HOP_S, next(order), "handoff",
                                               (request, delta.kv_transfer_params)))
                    continue
                request = live[delta.request_id]
                if delta.new_token_ids:
                    if request.first_token is None:
                        request.first_token = now
                    else:
                        request.gaps.append(now - request.last_token)
                        request.gap_ends.append(now)
                    request.last_token = now
                    request.tokens += len(delta.new_token_ids)
                    request.emitted += [now] * len(delta.new_token_ids)
                if delta.finish_reason is not None:
                    del live[delta.request_id]
            replica.busy = replica.core.has_work
            if replica.busy:
                heapq.heappush(queue, (now, next(order), "step", number))
    return summarize(trace, now, [replica.core.stats() for replica in fleet])


def windowed(trace: list[Request], start_s: float, end_s: float) -> dict:
    """What a fleet sustains while requests arrive: tokens out per second within the
    window (none of the drain after the last arrival, whose length the total throughput
    counts), and the decode streams' gaps ending within it."""
    tokens = sum(start_s <= t < end_s for r in trace for t in r.emitted)
    gaps = sorted(gap for r in trace if r.stream for t, gap in zip(r.gap_ends, r.gaps) if start_s <= t < end_s)
    return {"tokens_out_per_s": round(tokens / (end_s - start_s), 1),
            "decode_p99_itl_s": round(gaps[int(0.99 * (len(gaps) - 1))], 4) if gaps else None}


def summarize(trace: list[Request], duration_s: float, stats: list) -> dict:
    gaps = sorted(gap for r in trace if r.stream for gap in r.gaps)
    ttfts = [r.first_token - r.arrival for r in trace if r.first_token is not None]
    long = [r.first_token - r.arrival for r in trace if not r.stream and r.first_token is not None]
    last_arrival = max(r.arrival for r in trace)
    return {
        "requests": len(trace),
        "decode_p99_itl_s": round(gaps[int(0.99 * (len(gaps) - 1))], 4),
        # A long prompt's chunks stall the streams sharing its replica: few gaps, but long ones.
        "decode_p999_itl_s": round(gaps[int(0.999 * (len(gaps) - 1))], 4),
        "decode_max_itl_s": round(gaps[-1], 4),
        "decode_mean_itl_s": round(statistics.fmean(gaps), 4),
        "mean_ttft_s": round(statistics.fmean(ttfts), 4),
        "long_prompt_mean_ttft_s": round(statistics.fmean(long), 4) if long else None,
        "tokens_out_per_s": round(sum(r.tokens for r in trace) / duration_s, 1),
        "preemptions": sum(s.num_preemptions for s in stats),
        "blocks_moved": sum(sum(s.kv_transfer.bytes_transferred.counts) and
                            int(s.kv_transfer.bytes_transferred.sum // 737280) for s in stats if s.kv_transfer),
        # Throughput above divides by the whole run, drain included; this is what was
        # sustained while requests arrived (the first sixth left out: the fleet starts empty).
        "while_arriving": windowed(trace, last_arrival / 6, last_arrival),
        "drain_s": round(duration_s - last_arrival, 2),  # after the last arrival: how far behind it fell
    }


def run_sim(args: argparse.Namespace) -> dict:
    if args.step_cost:
        cost = StepCost(*args.step_cost)
    else:
        os.environ["KVFLEET_NUM_THREADS"] = "2"
        cost, _ = calibrate()
    log(f"step cost: {cost.base_s * 1e3:.2f} ms + {cost.per_token_s * 1e3:.4f} ms/token "
        f"+ {cost.per_sequence_s * 1e3:.4f} ms/sequence; transfer {args.transfer_ms_per_block} ms/block")
    trace_args = dict(seed=3, duration_s=args.duration, streams_per_s=args.streams_per_s, long_per_s=args.long_per_s)
    results = {}
    for name, pools in (("combined", dict(prefill=0, decode=0, combined=16)),
                        ("disaggregated", dict(prefill=8, decode=8, combined=0))):
        began = time.perf_counter()
        results[name] = simulate(make_trace(**trace_args), cost=cost, num_blocks=4096,
                                 transfer_s=args.transfer_ms_per_block / 1e3, threshold=args.threshold, **pools)
        log(f"{name}: {results[name]} ({time.perf_counter() - began:.1f} s of wall time)")
    return {
        "step_cost": {"base_s": cost.base_s, "per_token_s": cost.per_token_s, "per_sequence_s": cost.per_sequence_s},
        "transfer_ms_per_block": args.transfer_ms_per_block, "threshold": args.threshold, "trace": trace_args,
        "replicas": {"combined": 16, "disaggregated": "8 prefill + 8 decode"},
        "results": results,
        "decode_p99_itl_combined_over_disaggregated": round(
            results["combined"]["decode_p99_itl_s"] / results["disaggregated"]["decode_p99_itl_s"], 2),
    }


def run_sweep(args: argparse.Namespace, cost: StepCost) -> list[dict]:
    """The equal-throughput comparison the default load cannot give (there the prefill
    pool falls behind, so the two fleets' throughputs differ): the same trace shape with
    both arrival rates scaled, P/D against combined at each scale. Where both fleets
    sustain the same tokens/s while requests arrive, their decode p99 ITLs compare at
    equal throughput."""
    rows = []
    for scale in args.sweep:
        trace_args = dict(seed=3, duration_s=args.duration, streams_per_s=args.streams_per_s * scale,
                          long_per_s=args.long_per_s * scale)
        row: dict = {"scale": scale, "trace": trace_args}
        for name, pools in (("combined", dict(prefill=0, decode=0, combined=16)),
                            ("disaggregated", dict(prefill=8, decode=8, combined=0))):
            row[name] = simulate(make_trace(**trace_args), cost=cost, num_blocks=4096,
                                 transfer_s=args.transfer_ms_per_block / 1e3, threshold=args.threshold, **pools)
        combined, split = row["combined"], row["disaggregated"]
        row["equal_throughput"] = abs(split["while_arriving"]["tokens_out_per_s"]
                                      - combined["while_arriving"]["tokens_out_per_s"]) <= 0.02 * max(
            combined["while_arriving"]["tokens_out_per_s"], 1e-9)
        row["decode_p99_itl_combined_over_disaggregated"] = round(
            combined["decode_p99_itl_s"] / split["decode_p99_itl_s"], 2)
        log(f"x{scale}: p99 ITL {combined['decode_p99_itl_s']} s combined, {split['decode_p99_itl_s']} s P/D "
            f"({row['decode_p99_itl_combined_over_disaggregated']}x); tokens/s while arriving "
            f"{combined['while_arriving']['tokens_out_per_s']} / {split['while_arriving']['tokens_out_per_s']}; "
            f"drain {combined['drain_s']} / {split['drain_s']} s")
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-cost", type=float, nargs=3, metavar=("BASE_S", "PER_TOKEN_S", "PER_SEQUENCE_S"),
                        help="the step cost model (default: fitted now to this machine's worker, as fleet_sim does)")
    parser.add_argument("--transfer-ms-per-block", type=float, default=TRANSFER_MS_PER_BLOCK)
    parser.add_argument("--threshold", type=int, default=256, help="--pd-min-prefill-tokens")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--streams-per-s", type=float, default=2.0)
    parser.add_argument("--long-per-s", type=float, default=0.5)
    parser.add_argument("--real", action="store_true", help="also the real run (processes; a few minutes)")
    parser.add_argument("--sweep", type=float, nargs="*", default=[0.25, 0.5, 0.75, 1.0],
                        help="the arrival rates' scales of the equal-throughput comparison (none: skip it)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/disaggregated.json")
    args = parser.parse_args()
    log(f"load average {os.getloadavg()}")
    report = {"simulator": run_sim(args)}
    if args.sweep:
        report["simulator_sweep"] = run_sweep(args, StepCost(**report["simulator"]["step_cost"]))
    if args.real:
        from disaggregated_real import run

        real = dict(streams=4, stream_tokens=64, long_every_s=4.0, long_len=1024, duration_s=40.0, threshold=256)
        report["real"] = {"load": real, "results": {}}
        for name, roles in (("combined", [None, None]), ("disaggregated", ["kv_producer", "kv_consumer"])):
            report["real"]["results"][name] = run(roles, **real)
            log(f"real {name}: {report['real']['results'][name]} (load average {os.getloadavg()})")
    report["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    log(f"decode p99 ITL, combined / disaggregated: {report['simulator']['decode_p99_itl_combined_over_disaggregated']}x;"
        f" wrote {args.out}")


if __name__ == "__main__":
    main()
