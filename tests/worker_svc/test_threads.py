"""A CPU step's thread count (worker_svc/kernels/cpu/threads.py): small steps on the calling thread
alone under OMP_WAIT_POLICY=PASSIVE, the configured count back after them, and bigger
steps, other devices and a spinning policy untouched; in any step whose pool helpers poll,
the int16 GEMMs take every thread, however small the call."""
from __future__ import annotations

import pytest
import torch

from worker_svc.kernels.cpu.library import thread_pool
from worker_svc.kernels.cpu.q4_gemm import PASSIVE_PARALLEL_MIN_MACS, call_threads
from worker_svc.kernels.cpu.threads import SINGLE_THREAD_MAX_TOKENS, decode_threads, even_shares, step_threads

CPU = torch.device("cpu")


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def threads_during(device: torch.device, num_tokens: int) -> int:
    with step_threads(device, num_tokens):
        return torch.get_num_threads()


def test_a_small_step_runs_on_one_thread_and_the_count_comes_back(two_threads) -> None:
    assert threads_during(CPU, 1) == 1
    assert threads_during(CPU, SINGLE_THREAD_MAX_TOKENS) == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), step_threads(CPU, 1):
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == 2


def test_bigger_steps_other_devices_and_spinning_threads_keep_the_count(two_threads, monkeypatch) -> None:
    assert threads_during(CPU, SINGLE_THREAD_MAX_TOKENS + 1) == 2
    assert threads_during(torch.device("meta"), 1) == 2
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert threads_during(CPU, 1) == 2


@pytest.mark.skipif(thread_pool() is None, reason="kvfleet's thread pool did not build")
def test_decode_gemms_take_every_thread_in_any_step_whose_helpers_poll(two_threads) -> None:
    # 12 rows of a 576 x 576 projection: 4M multiply-adds, under the size that pays for waking a
    # sleeping thread, but nothing sleeps here (it had run on one thread, 1.7x slower).
    small_call = 12 * 576 * 576
    assert small_call < PASSIVE_PARALLEL_MIN_MACS
    for tokens in (1, SINGLE_THREAD_MAX_TOKENS + 4):
        with step_threads(CPU, tokens, decode_gemms=True):
            assert decode_threads() == 2 and call_threads(small_call, PASSIVE_PARALLEL_MIN_MACS, decode_gemm=True) == 2
    assert decode_threads() == 0 and call_threads(small_call, PASSIVE_PARALLEL_MIN_MACS, decode_gemm=True) == 1


def test_even_shares_cut_contiguous_runs_of_about_equal_cost() -> None:
    assert even_shares([1] * 10, 2) == [0, 5, 10]
    assert even_shares([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1, 10]  # a heavy first item is a share alone
    assert even_shares([3, 3, 3], 3) == [0, 1, 2, 3]
    assert even_shares([5, 5], 4) == [0, 1, 2]  # no more shares than items
    assert even_shares([7], 2) == [0, 1]
    assert even_shares([], 2) == [0, 0]
