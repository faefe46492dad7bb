"""A cluster of real role processes (tokenizer, worker, scheduler, gateway, with real
nats-server and Redis) losing its worker to SIGKILL: a stream in flight ends with an
explicit error at once, the gateway's /health turns 503 within a second,
and once a worker is back on its address the gateway serves again, with the same
greedy output as before (the old worker's cached prefixes are not reused). Through a
gateway started with --migration-wait, a stream in flight outlasts the worker's kill and
immediate restart (as a supervisor does it) and ends with the uninterrupted text."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from kvfleet.processes import free_port

from servers import RoleProcess, nats, redis_url  # noqa: F401  (fixtures)

# Latency bounds under a second: run alone (see pyproject's markers).
pytestmark = pytest.mark.serial

LEASE_TTL_S = 2.0
MIGRATION_WAIT_S = 20.0  # a worker restarts within it, even on a busy machine
ENGINE_FLAGS = ["--dtype", "float32", "--num-gpu-blocks-override", "16", "--max-model-len", "256"]
PROMPT = "The history of the printing press begins in"
GREEDY = dict(model="smollm2", temperature=0, extra_body={"ignore_eos": True})


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, processes: list[RoleProcess]) -> float:
    """Seconds until `condition` held; fails with the roles' logs after `timeout_s`."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout_s, f"{what} after {timeout_s} s\n" + "\n".join(
            p.log_tail() for p in processes
        )
        time.sleep(0.1)
    return time.monotonic() - began


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code
    except httpx.HTTPError:
        return 0


@pytest.fixture
def roles() -> Iterator[list[RoleProcess]]:
    started: list[RoleProcess] = []
    yield started
    for role in started:
        role.kill()


def test_a_killed_worker_fails_its_requests_and_a_restarted_one_serves(nats, redis_url, roles) -> None:
    registry = ["--redis-url", redis_url, "--lease-ttl", str(LEASE_TTL_S)]
    worker_address, gateway_port = f"127.0.0.1:{free_port()}", free_port()
    url = f"http://127.0.0.1:{gateway_port}"

    def start_worker() -> RoleProcess:
        worker = RoleProcess("worker", *ENGINE_FLAGS, "--port", worker_address.rsplit(":", 1)[1], *registry)
        roles.append(worker)
        return worker

    roles.append(RoleProcess("tokenizer", "--port", "0", *registry))
    worker = start_worker()
    roles.append(RoleProcess("scheduler", *ENGINE_FLAGS, "--port", "0", "--worker-address", worker_address,
                             "--nats-url", nats.url, *registry))
    roles.append(RoleProcess("gateway", "--port", str(gateway_port), "--nats-url", nats.url, *registry))
    waiting_port = free_port()
    roles.append(RoleProcess("gateway", "--port", str(waiting_port), "--nats-url", nats.url, *registry,
                             "--migration-wait", str(MIGRATION_WAIT_S)))
    waiting_url = f"http://127.0.0.1:{waiting_port}"
    wait_for(lambda: health(url) == 200 and health(waiting_url) == 200, 180, "the cluster is not healthy", roles)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    expected = client.completions.create(prompt=PROMPT, max_tokens=8, **GREEDY).choices[0].text

    stream = client.completions.create(prompt=PROMPT, max_tokens=200, stream=True, **GREEDY)
    first = next(iter(stream))
    assert first.choices[0].text
    worker.kill()
    killed = time.monotonic()
    with pytest.raises(openai.APIError) as failure:
        for _ in stream:
            pass
    assert time.monotonic() - killed < 5.0
    assert "unreachable" in str(failure.value), failure.value

    # The scheduler sees its worker link break at once and says it is not ready; the
    # gateway polls twice a second: no waiting for the worker's lease to lapse.
    wait_for(lambda: health(url) == 503, LEASE_TTL_S + 2.0, "/health is not 503", roles)
    assert time.monotonic() - killed <= 1.0
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(prompt=PROMPT, max_tokens=8, **GREEDY)
    assert refused.value.status_code == 503

    worker = start_worker()
    wait_for(lambda: health(url) == 200, 120, "/health is not 200 after the restart", roles)
    again = client.completions.create(prompt=PROMPT, max_tokens=8, **GREEDY)
    assert again.choices[0].text == expected

    wait_for(lambda: health(waiting_url) == 200, 10, "/health is not 200 after the restart", roles)
    waiting = openai.OpenAI(base_url=f"{waiting_url}/v1", api_key="unused", max_retries=0, timeout=60)
    uninterrupted = waiting.completions.create(prompt=PROMPT, max_tokens=64, **GREEDY).choices[0].text
    stream = iter(waiting.completions.create(prompt=PROMPT, max_tokens=64, stream=True, **GREEDY))
    text = next(stream).choices[0].text
    worker.kill()
    start_worker()
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == uninterrupted
