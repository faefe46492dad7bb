"""The role entry points (<role>/main.py) as real processes: worker, scheduler and
tokenizer started at once (the scheduler waits for its worker) serve a completion
end to end; SIGTERM or SIGINT stops each gracefully, and a request still running in
the scheduler past its --shutdown-timeout ends with an explicit error rather than a
broken stream (tests/system/test_drain.py has requests finish within it)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvfleet.processes import free_port
from services.messages import TokenDelta
from services.sampling_params import SamplingParams
from services.scheduler_messages import StreamOutputsRequest, SubmitRequest
from services.tokenizer_messages import DetokenizeRequest, TokenizeRequest
from services.transport.role_services import SCHEDULER, TOKENIZER

REPO = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--dtype", "float32", "--num-gpu-blocks-override", "8", "--max-model-len", "128"]
# Runs one role the way the console script does: `kvfleet <role> <flags>`.
_LAUNCH = "import sys\nfrom kvfleet.cli import main\nsys.exit(main(sys.argv[1:]))\n"


class Role:
    def __init__(self, role: str, *flags: str, port: int = 0) -> None:
        env = {**os.environ, "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, role, "--host", "127.0.0.1", "--port", str(port), *flags],
            cwd=REPO, env=env, stderr=subprocess.PIPE, text=True,
        )
        self.log: list[str] = []
        # Drains stderr (the role's log) so the process never blocks on a full pipe.
        self._reader = threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True)
        self._reader.start()

    def address(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.log):
                if match := re.search(r"serving on (\S+)", line):
                    return match.group(1)
            assert self.process.poll() is None, "".join(self.log)
            time.sleep(0.05)
        raise AssertionError(f"not serving after {timeout_s} s:\n{''.join(self.log)}")

    def stop(self, signum: int) -> int:
        self.process.send_signal(signum)
        code = self.process.wait(timeout=30)
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def roles():
    started: list[Role] = []

    def start(role: str, *flags: str, port: int = 0) -> Role:
        started.append(Role(role, *flags, port=port))
        return started[-1]

    yield start
    for role in started:
        role.kill()


def test_cluster_of_role_processes_serves_and_stops_gracefully(roles) -> None:
    # All at once, as a compose file starts them: the scheduler waits for its worker,
    # which listens only once its weights are loaded.
    worker_port = free_port()
    worker = roles("worker", *ENGINE_FLAGS, port=worker_port)
    scheduler = roles(
        "scheduler", *ENGINE_FLAGS, "--worker-address", f"127.0.0.1:{worker_port}", "--shutdown-timeout", "0"
    )
    tokenizer = roles("tokenizer")

    with grpc.insecure_channel(tokenizer.address()) as channel:
        tokenize = TOKENIZER.stub(channel)
        prompt = tokenize.Tokenize(TokenizeRequest("The capital of France is")).token_ids
        with grpc.insecure_channel(scheduler.address()) as scheduler_channel:
            stub = SCHEDULER.stub(scheduler_channel)
            outputs = stub.StreamOutputs(StreamOutputsRequest("g"))
            next(outputs)
            for request_id, max_tokens in [("short", 8), ("long", 100)]:
                stub.Submit(SubmitRequest(
                    request_id=request_id, prompt_token_ids=prompt, gateway_id="g",
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                ))
            deltas: dict[str, list[TokenDelta]] = {"short": [], "long": []}
            while not deltas["short"] or deltas["short"][-1].finish_reason is None:
                for delta in next(outputs).deltas:
                    deltas[delta.request_id].append(delta)
            short = [token for delta in deltas["short"] for token in delta.new_token_ids]
            assert len(short) == 8 and deltas["short"][-1].finish_reason == "length"
            text = tokenize.Detokenize(DetokenizeRequest(short)).text
            assert text.strip()

            # "long" is still running, with no time to finish: stopping the scheduler ends it
            # explicitly, then the stream.
            assert scheduler.stop(signal.SIGTERM) == 0, "".join(scheduler.log)
            deltas["long"].extend(delta for message in outputs for delta in message.deltas)
            last = deltas["long"][-1]
            assert last.finish_reason == "abort" and "shut down" in last.error
            assert len([token for delta in deltas["long"] for token in delta.new_token_ids]) < 100

    assert worker.stop(signal.SIGTERM) == 0, "".join(worker.log)
    assert tokenizer.stop(signal.SIGINT) == 0, "".join(tokenizer.log)
    for role in (worker, scheduler, tokenizer):
        assert any(re.search(r" stopped$", line.rstrip()) for line in role.log), "".join(role.log)
