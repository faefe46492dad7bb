"""The planner's actions against a fake Kubernetes API server (tests/planner/fake_kube.py),
through the official client, with a real Redis registry: the exact requests it sends.
Scale-up patches the Deployment's scale at once; scale-down first asks the least loaded
replica to drain and patches only once it has left the registry."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from planner.actuator import Actuator
from planner.decision import Capacity, Decision
from planner.fleet import Replica, pool_of
from planner.kube import Deployments
from services.histogram_counts import HistogramCounts
from services.messages import EngineStats
from services.registry import Member, Registry

from fake_kube import SCALE_PATH, Call, FakeKubeApi
from servers import REPO, RoleProcess, redis_url  # noqa: F401  (fixtures)

NAMESPACE = "serving"
MERGE_PATCH = "application/merge-patch+json"


def scale(name: str) -> str:
    return SCALE_PATH.format(namespace=NAMESPACE, name=name)


def stats(running: int) -> EngineStats:
    return EngineStats(running, 0, 0.0, 0, 100, 0, 0, HistogramCounts((0,), 0.0), None)


def decision(**replicas: int) -> Decision:
    return Decision(0.0, replicas, replicas, Capacity(1, 1), {})


@pytest.fixture
def api(tmp_path):
    server = FakeKubeApi({(NAMESPACE, "kvfleet-prefill"): 1, (NAMESPACE, "kvfleet-replica"): 2})
    yield server
    server.close()


@pytest.fixture
def registry(redis_url):
    registry = Registry(redis_url)
    yield registry
    registry._redis.flushdb()
    registry.close()


def test_scale_up_patches_the_deployments_scale(api, registry, tmp_path):
    deployments = Deployments(NAMESPACE, api.kubeconfig(tmp_path))
    actuator = Actuator(registry, deployments, {"prefill": "kvfleet-prefill", "decode": "kvfleet-replica"}, 60.0)
    counts = actuator.counts([])
    actuator.apply(decision(prefill=3, decode=2), [], counts)
    assert api.calls == [
        Call("GET", scale("kvfleet-prefill"), None, None), Call("GET", scale("kvfleet-replica"), None, None),
        Call("GET", scale("kvfleet-prefill"), None, None),
        Call("PATCH", scale("kvfleet-prefill"), MERGE_PATCH, {"spec": {"replicas": 3}}),
    ]
    assert api.replicas[(NAMESPACE, "kvfleet-prefill")] == 3


def test_scale_down_drains_the_least_loaded_replica_before_any_patch(api, registry, tmp_path):
    deployments = Deployments(NAMESPACE, api.kubeconfig(tmp_path))
    actuator = Actuator(registry, deployments, {"decode": "kvfleet-replica"}, 60.0)
    busy, idle = (Member("scheduler", name, f"10.0.0.{i}:50052", {"kv_role": "kv_consumer"})
                  for i, name in enumerate(("busy", "idle")))
    for member in (busy, idle):
        registry.put(member, ttl_s=30)
    replicas = [Replica(busy, "decode", stats(5)), Replica(idle, "decode", stats(1))]
    members = registry.members("scheduler")
    counts = actuator.counts(members)
    assert counts == {"decode": 2}
    actuator.apply(decision(decode=1), replicas, counts)
    # Asked to drain; the Deployment is only read, not patched.
    assert registry.drain_requested(idle) == 60.0 and registry.drain_requested(busy) is None
    assert all(call.method == "GET" for call in api.calls)
    assert actuator.counts(members) == {"decode": 1}  # counted gone already: no second victim
    actuator.settle_drains(registry.members("scheduler"))
    assert all(call.method == "GET" for call in api.calls)  # still draining: still registered
    registry.remove(idle)  # what the drained scheduler does (scheduler_svc/drain_request.py)
    api.calls.clear()
    actuator.settle_drains(registry.members("scheduler"))
    assert api.calls == [Call("GET", scale("kvfleet-replica"), None, None),
                         Call("PATCH", scale("kvfleet-replica"), MERGE_PATCH, {"spec": {"replicas": 1}})]
    assert registry.drain_requested(idle) is None and actuator.draining == {}


def test_a_restarted_planner_resumes_the_drain_it_asked_for(api, registry, tmp_path):
    deployments = Deployments(NAMESPACE, api.kubeconfig(tmp_path))
    names = {"decode": "kvfleet-replica"}
    busy, idle = (Member("scheduler", name, f"10.0.0.{i}:50052", {"kv_role": "kv_consumer"})
                  for i, name in enumerate(("busy", "idle")))
    for member in (busy, idle):
        registry.put(member, ttl_s=30)
    Actuator(registry, deployments, names, 60.0).apply(
        decision(decode=1), [Replica(busy, "decode", stats(5)), Replica(idle, "decode", stats(0))], {"decode": 2})
    # A new planner (the first one restarted mid-drain) finds the drain in Redis, with its pool.
    restarted = Actuator(registry, deployments, names, 60.0)
    restarted.settle_drains(registry.members("scheduler"))
    assert restarted.draining == {"idle": "decode"} and restarted.counts([]) == {"decode": 1}
    registry.remove(idle)
    api.calls.clear()
    restarted.settle_drains(registry.members("scheduler"))
    assert api.calls[-1] == Call("PATCH", scale("kvfleet-replica"), MERGE_PATCH, {"spec": {"replicas": 1}})
    assert registry.drain_requests("scheduler") == {}


def test_the_planner_command_scales_a_pool_of_pods_that_never_registered(api, redis_url, tmp_path):
    # Three combined pods, none of them serving (none in the registry), no load, no
    # cooldown: the command scales the Deployment to its minimum by a patch alone,
    # nothing to drain.
    api.replicas[(NAMESPACE, "kvfleet-replica")] = 3
    planner = RoleProcess("planner", "--redis-url", redis_url, "--kubeconfig", api.kubeconfig(tmp_path),
                          "--namespace", NAMESPACE, "--combined-deployment", "kvfleet-replica",
                          "--combined-min-replicas", "1", "--interval", "1", "--cooldown", "0", "--ttft-target-ms", "500",
                          "--itl-target-ms", "50", "--prefill-tokens-per-s", "4000", "--decode-sequences", "32")
    try:
        deadline = time.monotonic() + 30
        while api.replicas[(NAMESPACE, "kvfleet-replica")] != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert Call("PATCH", scale("kvfleet-replica"), MERGE_PATCH, {"spec": {"replicas": 1}}) in api.calls, \
            planner.log_tail()
        assert [c for c in api.calls if c.method == "PATCH"] == [
            Call("PATCH", scale("kvfleet-replica"), MERGE_PATCH, {"spec": {"replicas": 1}})]
    finally:
        planner.kill()


def test_the_planner_command_rides_out_a_registry_that_is_away(api, tmp_path):
    # Nothing listens on that port: each round fails, says why, and the process goes on.
    planner = RoleProcess("planner", "--redis-url", "redis://127.0.0.1:9/0", "--kubeconfig", api.kubeconfig(tmp_path),
                          "--namespace", NAMESPACE, "--combined-deployment", "kvfleet-replica", "--interval", "1",
                          "--ttft-target-ms", "500", "--itl-target-ms", "50", "--prefill-tokens-per-s", "4000",
                          "--decode-sequences", "32")
    try:
        deadline = time.monotonic() + 30
        while not any("this round failed" in line for line in planner.log) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # a process that the failure ends is gone by now
        assert planner.process.poll() is None, planner.log_tail()
        assert api.calls == []
    finally:
        planner.kill()


@pytest.mark.parametrize("flags, message", [
    ([], "name at least one pool's Deployment"),
    (["--decode-deployment", "d", "--decode-min-replicas", "5", "--decode-max-replicas", "2"],
     "bounds need 0 <= min <= max, got min 5, max 2"),
])
def test_settings_that_cannot_work_are_one_line_and_exit_2(flags, message):
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "planner", "--redis-url", "redis://127.0.0.1:9/0",
                           "--ttft-target-ms", "500", "--itl-target-ms", "50", "--prefill-tokens-per-s", "4000",
                           "--decode-sequences", "32", *flags], cwd=REPO, capture_output=True, text=True, timeout=60)
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and line.startswith(f"kvfleet planner: error: {message}"), done.stderr


def test_idle_prefill_replicas_move_to_the_decode_pool_and_a_moved_one_drains_from_its_own_deployment(
        api, registry, tmp_path):
    """A short decode pool takes idle prefill replicas that can serve either pool (kv_both,
    given a pool) before any pod is added; a moved pod stays in its Deployment, so the
    counts follow the leases, and when it drains, its own Deployment is scaled down."""
    deployments = Deployments(NAMESPACE, api.kubeconfig(tmp_path))
    api.replicas[(NAMESPACE, "kvfleet-prefill")] = 3
    actuator = Actuator(registry, deployments, {"prefill": "kvfleet-prefill", "decode": "kvfleet-replica"}, 60.0)
    movable = {"kv_role": "kv_both", "kv_pool": "prefill", "kv_home_pool": "prefill"}
    prefill = [Member("scheduler", f"p{i}", f"10.0.0.{i}:50052", movable) for i in range(3)]
    decode = [Member("scheduler", f"d{i}", f"10.0.1.{i}:50052", {"kv_role": "kv_consumer"}) for i in range(2)]
    for member in prefill + decode:
        registry.put(member, ttl_s=30)
    loads = {"p0": 3, "p1": 0, "p2": 1, "d0": 9, "d1": 9}
    replicas = [Replica(m, pool_of(m), stats(loads[m.id])) for m in prefill + decode]
    assert actuator.counts(prefill + decode) == {"prefill": 3, "decode": 2}
    actuator.apply(Decision(0.0, {"prefill": 3, "decode": 5}, {"prefill": 1, "decode": 5}, Capacity(1, 1), {},
                            moves=3), replicas, {"prefill": 3, "decode": 2})
    # Two move (one prefill replica stays, the busiest), the least loaded first; one pod is added.
    assert [registry.move_requested(m) for m in prefill] == [None, "decode", "decode"]
    assert [c for c in api.calls if c.method == "PATCH"] == [
        Call("PATCH", scale("kvfleet-replica"), MERGE_PATCH, {"spec": {"replicas": 3}})]
    # What the moved schedulers do (scheduler_svc/pool_move.py): their leases say the new pool.
    moved = [Member(m.role, m.id, m.address, {**movable, "kv_pool": "decode"}) for m in prefill[1:]]
    for member in moved:
        registry.put(member, ttl_s=30)
        registry.clear_move(member)
    members = [prefill[0], *moved, *decode]
    assert actuator.counts(members) == {"prefill": 1, "decode": 5}
    # The decode pool shrinks by two: the pod still loading goes by a patch, and the least
    # loaded decode replica is a moved one, drained; once it has left, its own Deployment,
    # the prefill pool's, is scaled down.
    replicas = [Replica(m, pool_of(m), stats(loads[m.id])) for m in members]
    api.calls.clear()
    actuator.apply(Decision(0.0, {"prefill": 1, "decode": 3}, {"prefill": 1, "decode": 3}, Capacity(1, 1), {}),
                   replicas, actuator.counts(members))
    assert actuator.draining == {"p1": "prefill"} and registry.drain_requests("scheduler") == {"p1": "prefill"}
    assert actuator.counts(members) == {"prefill": 1, "decode": 3}
    registry.remove(moved[0])
    actuator.settle_drains(registry.members("scheduler"))
    assert [c for c in api.calls if c.method == "PATCH"] == [
        Call("PATCH", scale("kvfleet-replica"), MERGE_PATCH, {"spec": {"replicas": 2}}),
        Call("PATCH", scale("kvfleet-prefill"), MERGE_PATCH, {"spec": {"replicas": 2}})]
    assert actuator.counts(registry.members("scheduler")) == {"prefill": 1, "decode": 3}


def test_a_moved_replica_stands_in_for_a_pod_still_loading_which_goes(api, registry, tmp_path):
    deployments = Deployments(NAMESPACE, api.kubeconfig(tmp_path))
    api.replicas[(NAMESPACE, "kvfleet-prefill")] = 2
    api.replicas[(NAMESPACE, "kvfleet-replica")] = 3  # one of them still loading its model
    actuator = Actuator(registry, deployments, {"prefill": "kvfleet-prefill", "decode": "kvfleet-replica"}, 60.0)
    movable = {"kv_role": "kv_both", "kv_pool": "prefill", "kv_home_pool": "prefill"}
    members = [Member("scheduler", f"p{i}", f"10.0.0.{i}:50052", movable) for i in range(2)] + [
        Member("scheduler", f"d{i}", f"10.0.1.{i}:50052", {"kv_role": "kv_consumer"}) for i in range(2)]
    replicas = [Replica(m, pool_of(m), stats(1)) for m in members]
    counts = actuator.counts(members)
    assert counts == {"prefill": 2, "decode": 3}
    actuator.apply(Decision(0.0, {"prefill": 2, "decode": 3}, {"prefill": 1, "decode": 3}, Capacity(1, 1), {},
                            moves=1), replicas, counts)
    assert registry.move_requested(members[0]) == "decode"
    assert [c for c in api.calls if c.method == "PATCH"] == [
        Call("PATCH", scale("kvfleet-replica"), MERGE_PATCH, {"spec": {"replicas": 2}})]


def test_a_dry_run_logs_its_moves_and_asks_for_none(registry, caplog):
    actuator = Actuator(registry, None, {"prefill": "kvfleet-prefill", "decode": "kvfleet-replica"}, 60.0)
    movable = {"kv_role": "kv_both", "kv_pool": "prefill", "kv_home_pool": "prefill"}
    members = [Member("scheduler", f"p{i}", f"10.0.0.{i}:50052", movable) for i in range(2)] + [
        Member("scheduler", "d0", "10.0.1.0:50052", {"kv_role": "kv_consumer"})]
    replicas = [Replica(m, pool_of(m), stats(1)) for m in members]
    with caplog.at_level("INFO", logger="planner.actuator"):
        actuator.apply(Decision(0.0, {"prefill": 2, "decode": 3}, {"prefill": 1, "decode": 3}, Capacity(1, 1), {},
                                moves=1), replicas, actuator.counts(members))
    assert registry.move_requested(members[0]) is None and registry.move_requested(members[1]) is None
    assert "would move prefill replica p0 (load 1) to the decode pool" in caplog.text
    # The rest of the decision as if it had moved: one more decode replica, none less in prefill.
    assert "would scale Deployment kvfleet-replica (2 -> 3)" in caplog.text
    assert "kvfleet-prefill" not in caplog.text
