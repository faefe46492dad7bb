"""The tokenizer role doing the gateway's text work in a cluster of real processes
(tokenizer, worker, scheduler, gateway; real nats-server and Redis):

- the gateway is given no model files (its --model names a path that does not exist,
  and its cache is empty), yet it serves chat completions whose greedy text equals the
  embedded engine's: it tokenizes through the tokenizer role and detokenizes with the
  files it fetched from it;
- a request that comes while the tokenizer restarts waits for it and is served;
  one that finds no tokenizer for a lease TTL gets an explicit 503, and a tokenizer
  restarted on its address is used again without restarting the gateway;
- the gateway, scheduler and tokenizer processes never import torch.
"""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kvfleet import LLM, SamplingParams
from kvfleet.processes import free_port

from corpus import CHAT
from servers import RoleProcess, nats, redis_url  # noqa: F401  (fixtures)
from test_worker_failover import ENGINE_FLAGS, health, roles, wait_for  # noqa: F401  (fixture)

LEASE_TTL_S = 5.0  # long enough for a tokenizer to restart on a busy machine
MAX_TOKENS = 24


def test_a_gateway_without_model_files_serves_through_the_tokenizer_role(
    nats, redis_url, roles, tmp_path: Path
) -> None:
    registry = ["--redis-url", redis_url, "--lease-ttl", str(LEASE_TTL_S)]
    tokenizer_port, gateway_port = free_port(), free_port()
    worker_address = f"127.0.0.1:{free_port()}"
    url = f"http://127.0.0.1:{gateway_port}"

    def start_tokenizer() -> RoleProcess:
        role = RoleProcess("tokenizer", "--port", str(tokenizer_port), *registry)
        roles.append(role)
        return role

    tokenizer = start_tokenizer()
    roles.append(RoleProcess("worker", *ENGINE_FLAGS, "--port", worker_address.rsplit(":", 1)[1], *registry))
    scheduler = RoleProcess("scheduler", *ENGINE_FLAGS, "--port", "0", "--worker-address", worker_address,
                            "--nats-url", nats.url, *registry)
    roles.append(scheduler)
    no_files = {"KVFLEET_CACHE_DIR": str(tmp_path / "empty-cache"), "HF_HOME": str(tmp_path / "empty-hf")}
    gateway = RoleProcess("gateway", "--model", str(tmp_path / "no-such-model"), "--served-model-name", "smollm2",
                          "--port", str(gateway_port), "--nats-url", nats.url, *registry, env=no_files)
    roles.append(gateway)
    wait_for(lambda: health(url) == 200, 180, "the cluster is not healthy", roles)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    def chat() -> str:
        reply = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
        return reply.choices[0].message.content

    served = chat()
    embedded = LLM("smollm2", dtype="float32", max_model_len=256, num_gpu_blocks_override=16)
    [expected] = embedded.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    assert served == expected.outputs[0].text

    def kill_tokenizer() -> None:
        tokenizer.process.send_signal(signal.SIGKILL)
        tokenizer.process.wait()

    kill_tokenizer()
    with ThreadPoolExecutor(1) as meanwhile:
        during_restart = meanwhile.submit(chat)
        tokenizer = start_tokenizer()
        assert during_restart.result() == served

    kill_tokenizer()
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        chat()
    assert refused.value.status_code == 503 and "tokenizer" in str(refused.value)
    assert time.monotonic() - began >= LEASE_TTL_S - 0.5, "the request did not wait for the tokenizer"
    wait_for(lambda: health(url) == 503, LEASE_TTL_S + 3.0, "/health is not 503 without a tokenizer", roles)

    start_tokenizer()
    wait_for(lambda: health(url) == 200, 60, "/health is not 200 after the tokenizer's restart", roles)
    assert chat() == served

    for role in (gateway, scheduler, roles[-1]):
        assert role.stop() == 0, role.log_tail()
        assert not role.imported_torch(), f"the {role.role} process imported torch"
