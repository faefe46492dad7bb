"""`kvfleet planner`: every --interval, reads the fleet (planner/fleet.py), decides each
pool's replicas (planner/decision.py) and acts on the pools' Deployments
(planner/actuator.py); between decisions, it watches the replicas it asked to drain."""
from __future__ import annotations

import argparse
import logging
import signal
import threading
import time

from services.config import ConfigError

logger = logging.getLogger(__name__)

# How often the drains under way are looked at between decisions: a drained replica's
# pod should go soon after (it fails its probes meanwhile).
DRAIN_POLL_S = 2.0
POOL_DEFAULTS = {"prefill": (1, 4), "decode": (1, 4), "combined": (1, 4)}


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", required=True, help="the registry, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--prometheus-url", default=None,
                        help="read latencies and rates from this Prometheus (e.g. http://prometheus:9090) instead of "
                        "scraping the gateways' /metrics (queues always come from the replicas' Stats)")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between decisions (default: %(default)s)")
    parser.add_argument("--ttft-target-ms", type=float, required=True, help="time to first token to hold, at p90")
    parser.add_argument("--itl-target-ms", type=float, required=True, help="inter-token latency to hold, at p90")
    parser.add_argument("--prefill-tokens-per-s", type=float, required=True,
                        help="measured capacity: prompt tokens one replica computes per second within the TTFT target")
    parser.add_argument("--decode-sequences", type=float, required=True,
                        help="measured capacity: sequences one replica decodes at once within the ITL target")
    parser.add_argument("--utilization", type=float, default=0.8,
                        help="the share of each replica's capacity to plan for (default: %(default)s)")
    parser.add_argument("--cooldown", type=float, default=120.0,
                        help="seconds after a pool's change before it may scale down (default: %(default)s)")
    parser.add_argument("--scale-down-window", type=float, default=300.0,
                        help="a pool scales down only to the most replicas asked for over these seconds "
                        "(default: %(default)s)")
    parser.add_argument("--startup", type=float, default=120.0,
                        help="seconds from a scale-up to the new replica serving (its pod scheduled, its model "
                        "loaded): the rule provisions for the load this far ahead, plus one interval "
                        "(default: %(default)s)")
    parser.add_argument("--forecast-window", type=float, default=None,
                        help="seconds of history each demand's trend line is fit through (default: --startup plus "
                        "one --interval, as far back as the forecast looks ahead)")
    parser.add_argument("--season", type=float, default=0.0,
                        help="seconds after which the load repeats (86400: daily): each demand's forecast is then at "
                        "least what it was over the coming --startup plus --interval one season ago (default: "
                        "%(default)s, none)")
    for pool, (low, high) in POOL_DEFAULTS.items():
        parser.add_argument(f"--{pool}-deployment", default=None,
                            help=f"the Deployment of the {pool} pool (unset: the planner leaves that pool alone)")
        parser.add_argument(f"--{pool}-min-replicas", type=int, default=low, help="(default: %(default)s)")
        parser.add_argument(f"--{pool}-max-replicas", type=int, default=high, help="(default: %(default)s)")
    parser.add_argument("--namespace", default=None,
                        help="the Deployments' namespace (default: the planner's own, from its ServiceAccount)")
    parser.add_argument("--kubeconfig", default=None,
                        help="a kubeconfig file, to run outside the cluster (default: the pod's in-cluster credentials)")
    parser.add_argument("--drain-timeout", type=float, default=600.0,
                        help="seconds a replica asked to drain gives its requests to finish (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true",
                        help="log each decision and what it would do; touch neither the registry nor Kubernetes")


def planner_config(args: argparse.Namespace):
    from planner.decision import Bounds, Capacity, PlannerConfig

    names = {pool: getattr(args, f"{pool}_deployment") for pool in POOL_DEFAULTS}
    names = {pool: name for pool, name in names.items() if name}
    if not names:
        raise ConfigError("name at least one pool's Deployment: --prefill-deployment and --decode-deployment for "
                          "prefill/decode disaggregation, --combined-deployment otherwise")
    try:
        return PlannerConfig(
            ttft_target_s=args.ttft_target_ms / 1000, itl_target_s=args.itl_target_ms / 1000,
            capacity=Capacity(args.prefill_tokens_per_s, args.decode_sequences),
            bounds={pool: Bounds(getattr(args, f"{pool}_min_replicas"), getattr(args, f"{pool}_max_replicas"))
                    for pool in names},
            interval_s=args.interval, utilization=args.utilization, cooldown_s=args.cooldown,
            scale_down_window_s=args.scale_down_window, startup_s=args.startup,
            forecast_window_s=args.forecast_window, season_s=args.season), names
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def run_planner(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException
    from redis import RedisError

    from planner.actuator import Actuator
    from planner.decision import PlannerState, decide
    from planner.fleet import FleetReader
    from planner.kube import Deployments
    from services.registry import Registry
    from services.telemetry import configure_logging

    config, names = planner_config(args)
    configure_logging()
    registry = Registry(args.redis_url)
    reader = FleetReader(registry, args.prometheus_url)
    deployments = None if args.dry_run else Deployments(args.namespace, args.kubeconfig)
    actuator = Actuator(registry, deployments, names, args.drain_timeout)
    state = PlannerState(config.capacity)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    logger.info("planning %s every %g s%s", ", ".join(f"{p} ({n})" for p, n in names.items()), config.interval_s,
                " (dry run)" if args.dry_run else "")
    next_decision = time.monotonic()
    while not stop.is_set():
        try:
            members = registry.members("scheduler")
            actuator.settle_drains(members)
            now = time.monotonic()
            if now >= next_decision:
                next_decision = now + config.interval_s
                replicas = reader.replicas()
                counts = actuator.counts([r.member for r in replicas])
                seen = reader.observe(replicas, counts, now, config.interval_s)
                decision = decide(config, state, seen, now)
                for pool, reason in decision.reasons.items():
                    logger.info("%s pool: %s (TTFT p90 %s, ITL p90 %s)", pool, reason, _ms(seen.ttft_p90_s),
                                _ms(seen.itl_p90_s))
                actuator.apply(decision, replicas, counts)
        except (RedisError, ApiException) as exc:
            # Redis or the API server away, or a Role that lacks a permission: nothing is
            # changed half-way that the next round would not see, so say so and go on.
            logger.warning("this round failed, trying again in %g s: %s", DRAIN_POLL_S, _short(exc))
        stop.wait(min(DRAIN_POLL_S, max(0.0, next_decision - time.monotonic())))
    reader.close()
    return 0


def _short(exc: Exception) -> str:
    # The client's ApiException carries the response's headers and body: the first line says it.
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
