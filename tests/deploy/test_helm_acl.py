"""The Helm chart's closed internal plane, run for real: the bundled NATS and Redis
started with the configuration the chart renders (nats.conf from its ConfigMap, the
users' names and passwords from its Secret through the environment the server's
container gets; redis-server's configuration from the script its container runs),
only ports and the server binary's path rewritten, then the credentials each role's
container gets tried against them:

- NATS: gateway i may subscribe to its own token streams (kvfleet.out.<its id>, its
  id being `<its --gateway-name>.<random>`) and to the KV events, and is refused
  another gateway's streams, every stream (kvfleet.out.>) and any publish; the
  schedulers' user may publish to every gateway's stream and subscribe to none.
- Redis: the default user is off, so a client without credentials, or with the
  password alone, cannot write a registry lease; the kvfleet ACL user can (through
  services/registry.py, as the roles do), and only under kvfleet's keys.

tests/deploy/test_deploy.py checks the rendered files themselves.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import nats
import pytest
import redis
import yaml
from nats.errors import TimeoutError as NatsTimeout
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.cluster.gateway_id import new_gateway_id
from kvfleet.processes import free_port, redis_server_binary, spawn, start_listening, start_nats, stop
from services.nats_link import kv_subject, subject
from services.registry import REDIS_PASSWORD_ENV, REDIS_USERNAME_ENV, Lease, Member, Registry

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvfleet"
RELEASE, NAMESPACE = "kvfleet", "llm"
HOST = "127.0.0.1"
GATEWAYS = 2


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values=copy.deepcopy({"gateway": {"replicas": GATEWAYS}}), name=RELEASE,
                             namespace=NAMESPACE)
    return [doc for path, text in sorted(files.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def one(manifests: list[dict], kind: str, name: str) -> dict:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def container(manifests: list[dict], deployment: str, name: str) -> dict:
    spec = one(manifests, "Deployment", f"{RELEASE}-{deployment}")["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def environment(manifests: list[dict], c: dict) -> dict[str, str]:
    """The container's variables that are values or come from the release's Secrets,
    as the kubelet sets them."""
    secrets = {m["metadata"]["name"]: m["data"] for m in manifests if m["kind"] == "Secret"}
    env = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif ref := var.get("valueFrom", {}).get("secretKeyRef"):
            env[var["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
    return env


def gateway_name(manifests: list[dict], slot: int) -> str:
    (name,) = [a.removeprefix("--gateway-name=") for a in container(manifests, f"gateway-{slot}", "gateway")["args"]
               if a.startswith("--gateway-name=")]
    return name


# --- NATS ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nats_url(manifests, tmp_path_factory) -> Iterator[str]:
    chart_conf = one(manifests, "ConfigMap", f"{RELEASE}-nats")["data"]["nats.conf"]
    directory = tmp_path_factory.mktemp("nats")
    (server,) = one(manifests, "Deployment", f"{RELEASE}-nats")["spec"]["template"]["spec"]["containers"]
    assert server["args"] == ["--config", "/etc/nats/nats.conf"]
    env = {"PATH": os.environ.get("PATH", ""), **environment(manifests, server)}

    def start(port: int, **output: object) -> subprocess.Popen:
        conf, count = re.subn(r"(?m)^port: 4222$", f"port: {port}", chart_conf)
        conf, monitors = re.subn(r"(?m)^http_port: 8222$", f"http_port: {free_port(HOST)}", conf)
        assert count == monitors == 1, conf
        (directory / "nats.conf").write_text(conf)
        return start_nats(HOST, port, config=directory / "nats.conf", env=env, **output)

    started = start_listening(start, HOST, directory / "nats.log")
    try:
        yield f"nats://{HOST}:{started.port}"
    finally:
        stop(started.process, grace_s=5.0)


def nats_credentials(manifests: list[dict], deployment: str, name: str) -> dict[str, str]:
    env = environment(manifests, container(manifests, deployment, name))
    return {"user": env["KVFLEET_NATS_USER"], "password": env["KVFLEET_NATS_PASSWORD"]}


class Peer:
    """A NATS connection with some role's credentials, and the server's refusals it got."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, url: str, **credentials: str) -> Peer:
        async def on_error(error: Exception) -> None:
            self.errors.append(str(error))

        self.nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5, error_cb=on_error, **credentials)
        return self

    def refused(self, what: str, subject_: str) -> bool:
        refusal = f'permissions violation for {what} to "{subject_}"'.lower()  # as nats-py words it
        return any(refusal in error.lower() for error in self.errors)


async def nothing_arrives(subscription, wait_s: float = 0.3) -> bool:
    try:
        await subscription.next_msg(timeout=wait_s)
    except NatsTimeout:
        return True
    return False


def test_a_gateway_reads_only_its_own_token_streams(manifests, nats_url):
    names = [gateway_name(manifests, slot) for slot in range(GATEWAYS)]
    assert len(set(names)) == GATEWAYS
    a_id, b_id = new_gateway_id(names[0]), new_gateway_id(names[1])
    a_again = new_gateway_id(names[0])  # the same gateway restarted: a new id, still its own
    assert len({a_id, b_id, a_again}) == 3

    async def scenario() -> None:
        a = await Peer().connect(nats_url, **nats_credentials(manifests, "gateway-0", "gateway"))
        b = await Peer().connect(nats_url, **nats_credentials(manifests, "gateway-1", "gateway"))
        scheduler = await Peer().connect(nats_url, **nats_credentials(manifests, "replica", "scheduler"))
        try:
            own = await a.nc.subscribe(subject(a_id))
            own_next = await a.nc.subscribe(subject(a_again))
            kv = await a.nc.subscribe(kv_subject("*"))  # KV events, for prefix routing
            other = await a.nc.subscribe(subject(b_id))
            every = await a.nc.subscribe(subject(">"))
            b_own = await b.nc.subscribe(subject(b_id))
            eavesdrop = await scheduler.nc.subscribe(subject(a_id))
            await a.nc.publish(subject(b_id), b"forged by gateway A")  # a gateway publishes nothing
            for peer in (a, b, scheduler):
                await peer.nc.flush()
            await asyncio.sleep(0.2)  # the server's refusals are asynchronous
            assert a.refused("Subscription", subject(b_id)) and a.refused("Subscription", subject(">")), a.errors
            assert a.refused("Publish", subject(b_id)), a.errors
            assert not any(a.refused("Subscription", s) for s in (subject(a_id), subject(a_again), kv_subject("*")))
            assert not b.errors
            assert scheduler.refused("Subscription", subject(a_id)), scheduler.errors

            # The schedulers' user publishes to every gateway's streams and the KV events.
            for target in (a_id, a_again, b_id):
                await scheduler.nc.publish(subject(target), f"to {target}".encode())
            await scheduler.nc.publish(kv_subject("scheduler-1"), b"kv event")
            await scheduler.nc.flush()
            assert not any("publish" in error.lower() for error in scheduler.errors), scheduler.errors
            assert (await own.next_msg(timeout=5)).data == f"to {a_id}".encode()
            assert (await own_next.next_msg(timeout=5)).data == f"to {a_again}".encode()
            assert (await kv.next_msg(timeout=5)).data == b"kv event"
            assert (await b_own.next_msg(timeout=5)).data == f"to {b_id}".encode()  # not the forged one
            for refused in (other, every, eavesdrop):
                assert await nothing_arrives(refused)
            assert await nothing_arrives(b_own)  # A's forged message never reached B
        finally:
            for peer in (a, b, scheduler):
                await peer.nc.close()

    asyncio.run(scenario())


def test_nats_refuses_wrong_or_missing_credentials(manifests, nats_url):
    a = nats_credentials(manifests, "gateway-0", "gateway")
    b = nats_credentials(manifests, "gateway-1", "gateway")

    async def refused(**credentials: str) -> bool:
        try:
            nc = await nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5,
                                    error_cb=_ignore, **credentials)
        except Exception:
            return True
        await nc.close()
        return False

    async def scenario() -> None:
        assert await refused()
        assert await refused(user=a["user"], password=b["password"])  # another gateway's password
        assert not await refused(**a)

    asyncio.run(scenario())


def test_the_charts_nats_takes_messages_of_64_megabytes(manifests, nats_url):
    """A step's output for one gateway is one message (docs/cluster.md): the chart's server
    takes NATS's most, as `kvfleet cluster up` does, not its default 1 MB."""
    async def max_payload() -> int:
        nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=5, error_cb=_ignore,
                                **nats_credentials(manifests, "replica", "scheduler"))
        try:
            return nc.max_payload
        finally:
            await nc.close()

    assert asyncio.run(max_payload()) == 64 * 1024 * 1024


async def _ignore(error: Exception) -> None:
    pass


class NoReplays:
    def replay(self, instance_id: str, after_seq: int) -> None:
        return None

    def instances(self) -> list[str]:
        return []


def test_the_roles_stream_tokens_with_the_charts_nats_users(manifests, nats_url, monkeypatch):
    """The scheduler's publisher and a named gateway's subscriber (kvfleet's own classes,
    each logging in as its container does) carry a request's tokens."""
    from gateway.cluster.nats_subscriber import OutputSubscriber
    from scheduler_svc.nats_publisher import OutputPublisher
    from services.messages import TokenDelta
    from services.nats_link import NATS_PASSWORD_ENV, NATS_USER_ENV

    def log_in_as(deployment: str, role: str) -> None:
        credentials = nats_credentials(manifests, deployment, role)
        monkeypatch.setenv(NATS_USER_ENV, credentials["user"])
        monkeypatch.setenv(NATS_PASSWORD_ENV, credentials["password"])

    gateway_id = new_gateway_id(gateway_name(manifests, 0))
    log_in_as("replica", "scheduler")
    publisher = OutputPublisher(nats_url, "s1")
    log_in_as("gateway-0", "gateway")
    subscriber = OutputSubscriber(nats_url, gateway_id, NoReplays())

    async def main() -> list[TokenDelta]:
        stream = subscriber.open("r1")
        publisher.publish({gateway_id: [TokenDelta("r1", [1, 2])]})
        publisher.publish({gateway_id: [TokenDelta("r1", [3], "length")]})
        deltas = []
        while not deltas or deltas[-1].finish_reason is None:
            item = await asyncio.wait_for(stream.get(), 10)
            assert not isinstance(item, BaseException), item
            deltas.append(item)
        return deltas

    try:
        deltas = asyncio.run(main())
    finally:
        publisher.close()
        subscriber.close()
    assert [t for d in deltas for t in d.new_token_ids] == [1, 2, 3] and deltas[-1].finish_reason == "length"


# --- Redis ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_port(manifests, tmp_path_factory) -> Iterator[int]:
    (server,) = one(manifests, "Deployment", f"{RELEASE}-redis")["spec"]["template"]["spec"]["containers"]
    assert server["command"][:2] == ["sh", "-c"]
    chart_start = "exec redis-server - "
    script = server["command"][2]
    assert script.startswith(chart_start), script
    env = {"PATH": os.environ.get("PATH", ""), **environment(manifests, server)}

    def start(port: int, **output: object) -> subprocess.Popen:
        # The same script, with this machine's binary, on a free port of loopback.
        ours = f"exec {shlex.quote(redis_server_binary())} - --bind {HOST} --port {port} " + script[len(chart_start):]
        return spawn(["sh", "-c", ours], env=env, **output)

    started = start_listening(start, HOST, tmp_path_factory.mktemp("redis") / "redis.log")
    try:
        yield started.port
    finally:
        stop(started.process, grace_s=5.0)


@pytest.fixture
def lease_member(manifests) -> Member:
    return Member("gateway", new_gateway_id(gateway_name(manifests, 0)), "10.0.0.7:8000", {"model": "smollm2"})


def client(port: int, **credentials: str) -> redis.Redis:
    # No retries: redis-py retries a refused login (a ConnectionError) with backoff.
    return redis.Redis(host=HOST, port=port, socket_timeout=5, retry=Retry(NoBackoff(), 0), **credentials)


def test_redis_refuses_clients_without_the_acl_user(manifests, redis_port, lease_member):
    password = environment(manifests, container(manifests, "gateway-0", "gateway"))[REDIS_PASSWORD_ENV]
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: the default user is off
        client(redis_port).set(lease_member.key, "{}")
    # The password alone logs in as the default user: off.
    with pytest.raises(redis.AuthenticationError):
        client(redis_port, password=password).set(lease_member.key, "{}")
    with pytest.raises(redis.AuthenticationError):
        client(redis_port, username="default", password=password).ping()
    with pytest.raises(redis.AuthenticationError):
        client(redis_port, username="kvfleet", password="not-the-password").ping()
    assert client(redis_port, username="kvfleet", password=password).get(lease_member.key) is None  # nothing written


@pytest.mark.parametrize("deployment, role", [("gateway-0", "gateway"), ("replica", "scheduler"),
                                               ("replica", "worker"), ("tokenizer", "tokenizer")])
def test_each_role_holds_its_lease_as_the_kvfleet_acl_user(manifests, redis_port, lease_member, monkeypatch,
                                                           deployment, role):
    """Through services/registry.py with the environment the role's container gets."""
    env = environment(manifests, container(manifests, deployment, role))
    assert env[REDIS_USERNAME_ENV] == "kvfleet"
    for name in (REDIS_PASSWORD_ENV, REDIS_USERNAME_ENV):
        monkeypatch.setenv(name, env[name])
    registry = Registry(f"redis://{HOST}:{redis_port}/0")
    try:
        member = Member(role, lease_member.id if role == "gateway" else f"{role}-1", "10.0.0.7:50051", {"k": "v"})
        with Lease(registry, member, ttl_s=5.0):
            assert _eventually(lambda: member in registry.members(role)), registry.members(role)
        assert member not in registry.members(role)  # removed on a clean stop
        assert registry.ping()
    finally:
        registry.close()


def test_the_kvfleet_acl_user_reaches_only_kvfleet_keys(manifests, redis_port):
    env = environment(manifests, container(manifests, "gateway-0", "gateway"))
    kvfleet = client(redis_port, username=env[REDIS_USERNAME_ENV], password=env[REDIS_PASSWORD_ENV])
    try:
        kvfleet.set("kvfleet:role:test:x", "1", px=5000)
        for refused in (lambda: kvfleet.set("elsewhere", "1"), lambda: kvfleet.get("elsewhere"),
                        kvfleet.flushall, lambda: kvfleet.config_get("*"), lambda: kvfleet.keys("*"),
                        lambda: kvfleet.publish("kvfleet.out", "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        kvfleet.close()


def _eventually(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
