"""Worker groups as the worker role (gloo, 2 processes) driven over gRPC. A PP=2 group
takes plans in flight, two at a time, and gives the tokens of one rank. A TP=2 group
losing a rank to SIGKILL goes down as one worker within seconds (the leader's process
exits, so its scheduler's steps fail explicitly and the worker can be restarted), and
no rank is left behind."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.processes import free_port
from scheduler_svc.engine_core import EngineCore, StepFailed
from scheduler_svc.worker_client import RemoteWorker
from services.config import EngineConfig
from services.sampling_params import SamplingParams

from servers import RoleProcess

ENGINE = dict(dtype="float32", tensor_parallel_size=2, max_model_len=512, num_gpu_blocks_override=64)
FLAGS = ["--dtype", "float32", "--tensor-parallel-size", "2", "--max-model-len", "512",
         "--num-gpu-blocks-override", "64"]
DOWN_WITHIN_S = 5.0


def _followers(leader_pid: int) -> list[int]:
    """The leader's spawned ranks (not multiprocessing's resource tracker)."""
    pids = []
    for children in Path(f"/proc/{leader_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                pids.append(int(pid))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def group() -> Iterator[tuple[RoleProcess, EngineCore, list[int]]]:
    port = free_port()
    worker = RoleProcess("worker", *FLAGS, "--port", str(port))
    try:
        core = EngineCore(EngineConfig(**ENGINE), RemoteWorker(f"127.0.0.1:{port}", ready_timeout_s=120))
        followers = _followers(worker.process.pid)
        assert len(followers) == 1, worker.log_tail()
        core.add_request("long", [1, 504, 3458, 314, 260, 2379, 30], SamplingParams(temperature=0, max_tokens=400,
                                                                                      ignore_eos=True))
        for _ in range(3):
            core.step()
        yield worker, core, followers
    finally:
        worker.kill()
        for pid in _followers(worker.process.pid) if worker.process.poll() is None else []:
            os.kill(pid, signal.SIGKILL)


def test_a_pipelined_worker_role_runs_two_plans_at_once_with_the_tokens_of_one_rank(make_llm) -> None:
    prompts = [[1, 504, 3458, 314, 260, 2379, 30 + i, 17 * i] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    single = make_llm("smollm2", dtype="float32", max_model_len=512)
    expected = [output.outputs[0].token_ids for output in single.generate(prompts, greedy, use_tqdm=False)]
    port = free_port()
    worker = RoleProcess("worker", "--dtype", "float32", "--pipeline-parallel-size", "2", "--max-model-len", "512",
                         "--port", str(port))
    try:
        config = EngineConfig(dtype="float32", pipeline_parallel_size=2, max_model_len=512)
        core = EngineCore(config, RemoteWorker(f"127.0.0.1:{port}", ready_timeout_s=120))
        assert core.description.max_plans_in_flight == 2
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, greedy)
        outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        most_in_flight = 0
        while core.has_work:
            for delta in core.step():
                outputs[delta.request_id] += delta.new_token_ids
            most_in_flight = max(most_in_flight, core.num_plans_in_flight)
        assert [outputs[str(i)] for i in range(len(prompts))] == expected
        # A step waits for its oldest plan with the pipeline full: one plan is still in flight after it.
        assert most_in_flight == 1
    finally:
        worker.kill()


def _steps_until_failed(core: EngineCore) -> float:
    began = time.monotonic()
    with pytest.raises(StepFailed) as failed:
        while time.monotonic() - began < DOWN_WITHIN_S:
            core.step()
    assert failed.value.request_ids == ["long"]
    return time.monotonic() - began


def test_a_killed_follower_takes_the_group_down(group) -> None:
    worker, core, (follower,) = group
    os.kill(follower, signal.SIGKILL)
    assert _steps_until_failed(core) < DOWN_WITHIN_S
    assert worker.process.wait(DOWN_WITHIN_S) == 1, worker.log_tail()
    assert "rank 1 of the worker group exited (code -9)" in "".join(worker.log)


def test_a_killed_leader_takes_its_followers_along(group) -> None:
    worker, core, (follower,) = group
    worker.kill()
    assert _steps_until_failed(core) < DOWN_WITHIN_S
    deadline = time.monotonic() + DOWN_WITHIN_S
    while _alive(follower):
        assert time.monotonic() < deadline, "the follower outlived its leader"
        time.sleep(0.1)
