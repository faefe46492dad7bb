"""benchmarks/disaggregated.py's real run: replicas as real `kvfleet worker` and
`kvfleet scheduler` processes on this machine (one thread per worker), real NATS and
Redis, a tokenizer, and the gateway's cluster client placing requests (split or not)."""
from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import aclosing, contextmanager
from functools import partial
from pathlib import Path

from gateway.cluster.client import ClusterEngineClient
from kvfleet.processes import start_listening, start_nats, start_redis, stop_together
from services.registry import Lease, Member, Registry
from services.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
ENGINE = ["--model", "smollm2", "--max-model-len", "2048", "--num-gpu-blocks-override", "512"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextmanager
def cluster(roles: list[str | None], logs: Path):
    """One replica per entry (its kv_role, or None for a combined one), a tokenizer,
    NATS and Redis: yields (nats url, redis url)."""
    env = {**os.environ, "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    processes: list[subprocess.Popen] = []

    def role(name: str, *argv: str) -> None:
        log = open(logs / f"{name}.log", "w")
        processes.append(subprocess.Popen([sys.executable, "-m", "kvfleet.cli", *argv], cwd=REPO, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))

    nats = start_listening(partial(start_nats, HOST), HOST, logs / "nats.log")
    redis = start_listening(partial(start_redis, HOST), HOST, logs / "redis.log")
    processes += [nats.process, redis.process]
    nats_url, redis_url = f"nats://{HOST}:{nats.port}", f"redis://{HOST}:{redis.port}/0"
    try:
        role("tokenizer", "tokenizer", "--host", HOST, "--port", str(free_port()), "--model", "smollm2",
             "--redis-url", redis_url)
        for index, kv_role in enumerate(roles):
            worker = f"{HOST}:{free_port()}"
            role(f"worker{index}", "worker", "--host", HOST, "--port", worker.split(":")[1], "--redis-url", redis_url,
                 *ENGINE)
            transfer = ["--kv-transfer-config", f'{{"kv_connector": "KvfleetConnector", "kv_role": "{kv_role}"}}'
                        ] if kv_role else []
            role(f"scheduler{index}", "scheduler", "--host", HOST, "--port", str(free_port()), "--worker-address",
                 worker, "--nats-url", nats_url, "--redis-url", redis_url, *ENGINE, *transfer)
        yield nats_url, redis_url
    finally:
        stop_together(processes)


def run(roles: list[str | None], streams: int, stream_tokens: int, long_every_s: float, long_len: int,
        duration_s: float, threshold: int) -> dict:
    with tempfile.TemporaryDirectory() as logs, cluster(roles, Path(logs)) as (nats_url, redis_url):
        client = ClusterEngineClient(redis_url, nats_url, poll_interval_s=0.2, pd_min_prefill_tokens=threshold)
        client.start()
        # As `kvfleet gateway` does: schedulers abort the requests of a gateway without a lease.
        lease = Lease(Registry(redis_url), Member("gateway", client.gateway_id, f"{HOST}:0"), 5.0).start()
        deadline = time.monotonic() + 300
        while not (client.is_ready() and len(client._replicas.routable()) == len(roles)):
            assert time.monotonic() < deadline, "the replicas never came up"
            time.sleep(0.5)
        try:
            return asyncio.run(_load(client, streams, stream_tokens, long_every_s, long_len, duration_s))
        finally:
            lease.stop()
            client.shutdown()


async def _load(client: ClusterEngineClient, streams: int, stream_tokens: int, long_every_s: float, long_len: int,
                duration_s: float) -> dict:
    gaps: list[float] = []
    ttfts: list[float] = []
    long_ttfts: list[float] = []
    tokens = 0
    started = time.monotonic()

    async def one(request_id: str, prompt: list[int], max_tokens: int, stream: bool) -> None:
        nonlocal tokens
        arrival = time.monotonic()
        last = None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async with aclosing(client.generate(request_id, prompt, params)) as deltas:
            async for delta in deltas:
                if not delta.new_token_ids:
                    continue
                now = time.monotonic()
                if last is None:
                    (ttfts if stream else long_ttfts).append(now - arrival)
                elif stream:
                    gaps.append(now - last)
                last = now
                tokens += len(delta.new_token_ids)

    async def stream_loop(index: int) -> None:
        turn = 0
        while time.monotonic() - started < duration_s:
            prompt = [1000 + (index * 7919 + turn * 104729 + i) % 40000 for i in range(64)]
            await one(f"s{index}-{turn}", prompt, stream_tokens, True)
            turn += 1

    async def long_loop() -> None:
        turn = 0
        while time.monotonic() - started < duration_s:
            await asyncio.sleep(long_every_s)
            prompt = [2000 + (turn * 15485863 + i) % 40000 for i in range(long_len)]
            asyncio.ensure_future(one(f"long-{turn}", prompt, 16, False))
            turn += 1

    await asyncio.gather(*(stream_loop(i) for i in range(streams)), long_loop())
    gaps.sort()
    return {"decode_p99_itl_s": round(gaps[int(0.99 * (len(gaps) - 1))], 4), "decode_mean_itl_s":
            round(statistics.fmean(gaps), 4), "stream_mean_ttft_s": round(statistics.fmean(ttfts), 4),
            "long_prompt_mean_ttft_s": round(statistics.fmean(long_ttfts), 4) if long_ttfts else None,
            "long_prompts": len(long_ttfts), "tokens_out_per_s": round(tokens / (time.monotonic() - started), 1)}
