"""`kvfleet cluster up` as a real process tree: nats-server, Redis and the four roles
come up on free ports, the official openai client gets completions (streamed too)
through the gateway with its API key, and SIGTERM takes every process down with exit 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from services.cluster import free_port

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["--dtype", "float32", "--num-gpu-blocks-override", "16", "--max-model-len", "128", "--lease-ttl", "3"]
# Runs the launcher the way the console script will: its argparse set-up, then run_cluster_up.
_LAUNCH = (
    "import argparse, sys\n"
    "from services.cluster import add_cluster_up_args, run_cluster_up\n"
    "parser = argparse.ArgumentParser()\n"
    "add_cluster_up_args(parser)\n"
    "sys.exit(run_cluster_up(parser.parse_args(sys.argv[1:])))\n"
)


def descendants(pid: int) -> set[int]:
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


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the process tree")
def test_cluster_up_serves_the_openai_client_and_stops_on_sigterm() -> None:
    port = free_port()
    env = {**os.environ, "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with tempfile.TemporaryFile("w+") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, *FLAGS, "--port", str(port), "--api-key", "sesame"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )

        def output() -> str:
            log.seek(0)
            return log.read()[-6000:]

        try:
            deadline = time.monotonic() + 150
            while not healthy(f"http://127.0.0.1:{port}/health"):
                assert launcher.poll() is None and time.monotonic() < deadline, output()
                time.sleep(0.5)
            processes = descendants(launcher.pid)
            assert len(processes) >= 6, output()  # nats, redis, tokenizer, worker, scheduler, gateway

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sesame", max_retries=0)
            completion = client.completions.create(
                model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert completion.usage.completion_tokens == 8 and completion.choices[0].text.strip(), completion
            stream = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=6,
                temperature=0, stream=True,
            )
            chunks = list(stream)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()

            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(timeout=90) == 0, output()
            assert "cluster stopped" in output()
            assert not [pid for pid in processes if alive(pid)], output()
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
