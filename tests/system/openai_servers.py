"""The OpenAI servers the system tests drive: `kvfleet serve` (embedded: one process)
and `kvfleet cluster up` (nats-server, Redis and every role as its own process), each
on a free port (or a Unix socket) with an API key, started healthy and stopped with SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.processes import free_port

REPO = Path(__file__).resolve().parents[2]
MODES = ("serve", "cluster")
MODEL = "smollm2"
SERVED = "smol"  # --served-model-name: what clients must send
API_KEY = "sesame"
MAX_MODEL_LEN = 512
# 32 streams of a short prompt and 12 tokens hold 2 blocks each; a long request 32.
NUM_BLOCKS = 128
ENGINE_FLAGS = [
    "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", str(NUM_BLOCKS),
]
START_TIMEOUT_S = 180.0
PROC = sys.platform.startswith("linux")  # the process tree is read from /proc
IDLE_WITHIN_S = 2.0

# -- the servers -------------------------------------------------------------------------


@dataclass
class Server:
    mode: str
    url: str
    process: subprocess.Popen
    log_path: Path
    uds: Path | None = None  # --uds: `url` is then http://localhost, over this socket

    def http(self, timeout: float = 60) -> httpx.Client:
        """A client of this server, over its Unix socket where it has one."""
        return httpx.Client(base_url=self.url, transport=_transport(self.uds), timeout=timeout)

    def log_tail(self, chars: int = 8000) -> str:
        """What conftest's report hook shows under a failed test."""
        text = self.log_path.read_text(errors="replace")
        return f"[kvfleet {self.mode}, exit code {self.process.poll()}] ...\n{text[-chars:]}"

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics (open without the key), keyed `name{label=value,...}` without model_name."""
        samples = {}
        with self.http(timeout=10) as client:
            text = client.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def wait_idle(self, since: float | None = None, timeout: float = IDLE_WITHIN_S) -> dict[str, float]:
        """/metrics once no request runs or waits and no KV block is held, within `timeout`
        of `since` (a time.monotonic(); default now). Every scrape shows the engine as it
        is (in a cluster too): this waits only for what happens after a response, such as
        the abort of a request whose client left."""
        start = time.monotonic() if since is None else since
        while True:
            now = time.monotonic()
            metrics = self.metrics()
            busy = {name: metrics[name] for name in
                    ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
            if not any(busy.values()):
                return metrics
            assert now < start + timeout, f"{self.mode}: still busy {now - start:.2f} s later: {busy}"
            time.sleep(0.05)


def _command(mode: str, port: int) -> list[str]:
    common = [*ENGINE_FLAGS, "--port", str(port), "--api-key", API_KEY, "--served-model-name", SERVED]
    if mode == "serve":  # vLLM's form: the model positional
        return [sys.executable, "-m", "kvfleet.cli", "serve", MODEL, *common]
    return [sys.executable, "-m", "kvfleet.cli", "cluster", "up", "--model", MODEL, *common, "--lease-ttl", "3"]


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _transport(uds: Path | None) -> httpx.HTTPTransport | None:
    return httpx.HTTPTransport(uds=str(uds)) if uds is not None else None


def healthy(url: str, uds: Path | None = None) -> bool:
    try:
        with httpx.Client(transport=_transport(uds), timeout=2) as client:
            return client.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def running_server(mode: str, tmp_path_factory: pytest.TempPathFactory, *flags: str,
                   uds: Path | None = None) -> Iterator[Server]:
    """`kvfleet serve` or `cluster up` with the engine flags above and `flags` (and
    listening on `uds` if given), healthy; stopped after with SIGTERM, which must end
    the whole process tree with exit code 0."""
    port = free_port()
    log_path = tmp_path_factory.mktemp(f"kvfleet-{mode}") / "server.log"
    if uds is not None:
        flags = (*flags, "--uds", str(uds))
    env = {key: value for key, value in os.environ.items() if key != "KVFLEET_API_KEY"}
    env.update(KVFLEET_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as log:  # O_APPEND: the children write, the tests read
        process = subprocess.Popen([*_command(mode, port), *flags], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    running = Server(mode, "http://localhost" if uds else f"http://127.0.0.1:{port}", process, log_path, uds)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(running.url, uds):
            assert process.poll() is None, f"kvfleet {mode} exited while starting\n{running.log_tail()}"
            assert time.monotonic() < deadline, (
                f"kvfleet {mode} not healthy in {START_TIMEOUT_S} s\n{running.log_tail()}")
            time.sleep(0.25)
        children = descendants(process.pid) if PROC else set()
        if mode == "cluster" and PROC:  # nats, redis, tokenizer, worker, scheduler, gateway
            assert len(children) >= 6, f"{children}\n{running.log_tail()}"
        yield running
        # SIGTERM stops both cleanly; the cluster launcher stops its roles, then NATS and Redis.
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=90)
        assert code == 0, f"kvfleet {mode} exited with {code} on SIGTERM\n{running.log_tail()}"
        assert not [pid for pid in children if alive(pid)], f"left running\n{running.log_tail()}"
        if mode == "cluster":
            assert "cluster stopped" in running.log_tail()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


