"""A worker group: TP x PP ranks, one process and device each, that its scheduler sees
as one worker.

The process that starts the group is rank 0, the leader. It holds a shard like every
rank, and it alone takes plans (over gRPC, or in-process calls), which it broadcasts to
the others (worker_svc/group/rank_group.py): the scheduler sends each plan once. The other
ranks are processes it spawns on this machine; they follow the plans until it closes.

A rank that dies takes the group down, never leaving it hung: the leader watches its
followers' processes and hands the loss to `on_lost` (the worker role exits, so its
scheduler sees one lost worker; embedded, every later step fails saying why), and a
follower whose leader is gone exits within a second.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable

from services.config import EngineConfig
from worker_svc.group.rank_group import RankGroup
from worker_svc.group.shard import Shard
from worker_svc.kernels.cpu.threads import configure_torch_threads
from worker_svc.runtime.device import torch_device
from worker_svc.runtime.worker import Worker

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"  # the ranks of a group share one machine
_CLOSE_TIMEOUT_S = 10.0


def start_worker(config: EngineConfig, on_lost: Callable[[str], None] | None = None) -> Worker:
    """The worker `config` asks for: a single one, or the leader of a group whose other
    ranks run in spawned processes. `on_lost(reason)` is called once if a rank dies;
    by default the leader's later steps fail with that reason. Every caller has checked
    the model against the flags already (worker_svc.runtime.preflight), so no rank starts for a
    split the model cannot take."""
    world_size = config.tensor_parallel_size * config.pipeline_parallel_size
    if world_size == 1:
        return Worker(config)
    if torch_device(config).type == "cpu":
        configure_torch_threads(world_size)  # the ranks share this machine's cores
    store = RankGroup.open_store(_HOST, 0, world_size, leader=True)
    context = multiprocessing.get_context("spawn")  # a forked rank would inherit this process's threads
    followers = [
        context.Process(target=_follow, args=(config, rank, store.port, os.getpid()), name=f"kvfleet-rank-{rank}",
                        daemon=True)
        for rank in range(1, world_size)
    ]
    for process in followers:
        process.start()
    watch = _RankWatch(followers)
    watch.start()
    shard = Shard.of_rank(0, config.tensor_parallel_size, config.pipeline_parallel_size)
    worker = Worker(config, RankGroup.join(shard, store, torch_device(config, 0)))
    watch.worker, watch.on_lost = worker, on_lost or worker.lose_group

    def end_group(reason: str) -> None:
        """The followers killed: the watch then reports the group lost."""
        logger.error("ending the worker group: %s", reason)
        for process in followers:
            process.kill()

    worker.end_group = end_group
    atexit.register(_close, worker, followers)
    return worker


class _RankWatch(threading.Thread):
    """Waits on the followers' processes; the first that exits, unless the group is closing, is the group's end."""

    def __init__(self, followers: list[multiprocessing.Process]) -> None:
        super().__init__(name="kvfleet-rank-watch", daemon=True)
        self.followers = followers
        # None while the group forms: a rank that dies then ends this process (nothing to fail over yet).
        self.worker: Worker | None = None
        self.on_lost: Callable[[str], None] | None = None

    def run(self) -> None:
        by_sentinel = {process.sentinel: process for process in self.followers}
        ended = by_sentinel[multiprocessing.connection.wait(list(by_sentinel))[0]]
        if self.worker is not None and self.worker.closed:
            return
        ended.join(1.0)  # reaps it, so its exit code is known
        reason = f"rank {ended.name.rsplit('-', 1)[-1]} of the worker group exited (code {ended.exitcode})"
        logger.error("%s: the worker group is down", reason)
        for process in self.followers:
            process.kill()
        if self.on_lost is None:
            logger.error("a rank failed while the group was forming: exiting")
            os._exit(1)
        self.on_lost(reason)


def _close(worker: Worker, followers: list[multiprocessing.Process]) -> None:
    """At exit: the followers leave their loop and exit; any still there after the timeout are killed."""
    worker.close()
    deadline = time.monotonic() + _CLOSE_TIMEOUT_S
    for process in followers:
        process.join(max(0.0, deadline - time.monotonic()))
        process.kill()


def _follow(config: EngineConfig, rank: int, port: int, leader_pid: int) -> None:
    """A follower rank's process."""
    from services.telemetry import configure_logging

    configure_logging()
    if torch_device(config, rank).type == "cpu":
        configure_torch_threads(config.tensor_parallel_size * config.pipeline_parallel_size)
    # Ctrl-C reaches the terminal's whole process group, and some supervisors signal a
    # group too: the leader decides when the group stops (it drains first), not the signal.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    threading.Thread(target=_exit_without, args=(leader_pid,), name="kvfleet-leader-watch", daemon=True).start()
    shard = Shard.of_rank(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    group = RankGroup.join(shard, RankGroup.open_store(_HOST, port, shard.world_size, leader=False),
                           torch_device(config, rank))
    worker = Worker(config, group)
    try:
        worker.follow()
    except Exception:
        logger.exception("rank %d: the worker group failed", rank)
        os._exit(1)
    group.close()


def _exit_without(leader_pid: int) -> None:
    """Ends this follower once its leader is gone (its parent changes), wherever it waits."""
    while os.getppid() == leader_pid:
        time.sleep(0.5)
    logger.error("the worker group's leader (pid %d) is gone: exiting", leader_pid)
    os._exit(1)
