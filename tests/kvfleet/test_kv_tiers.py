"""The KV offload tiers through the engine (docs/kv_connector.md), on real files: a block
another engine wrote to the shared directory is loaded, never one of another layout;
and every fault (a damaged file, a directory gone mid-read, a full disk, a request
aborted while its blocks load) is a miss: the same tokens, recomputed, no error.
(Greedy parity with blocks loaded from every tier is in test_parity.py.)"""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfleet import LLM, SamplingParams
from scheduler_svc.kv_connector import KvConnector
from scheduler_svc.request import RequestStatus
from services.block_hash import extend_block_hashes
from services.kv_block_files import HEADER, BlockFiles

from conftest import assert_no_leaks
from corpus import TEXT

BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SMALL_POOL = {"num_gpu_blocks_override": 64, "max_model_len": 512}


@pytest.fixture(scope="module")
def tokens(llm: LLM) -> list[int]:
    return llm.get_tokenizer().encode(TEXT)


def prompt(tokens: list[int], index: int, length: int = 100) -> list[int]:
    """Prompts that share no block (each starts elsewhere): 6 full blocks and a partial one."""
    return tokens[index * 37:index * 37 + length]


def run(llm: LLM, prompt_ids: list[int]) -> tuple[list[int], int]:
    [output] = llm.generate([prompt_ids], PARAMS, use_tqdm=False)
    return output.outputs[0].token_ids, output.num_cached_tokens


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kvblock"))


def wait_for_files(directory: Path, count: int) -> None:
    """Saves are written in the background: wait until they are there."""
    deadline = time.monotonic() + 10
    while len(block_files(directory)) < count:
        assert time.monotonic() < deadline, f"{len(block_files(directory))} of {count} blocks were written"
        time.sleep(0.01)


def forget_device_blocks(llm: LLM) -> None:
    """The device pool moves on (as vLLM's reset_prefix_cache): only the tiers still hold the prefix."""
    llm.engine.scheduler.block_pool.reset_prefix_cache()


def test_the_shared_directory_serves_blocks_another_engine_computed_and_no_other_layout(
        llm: LLM, tokens: list[int], make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    first = make_llm(dtype="float32", kv_shared_dir=str(tmp_path), **SMALL_POOL)
    expected = run(llm, prompt(tokens, 0))[0]
    assert run(first, prompt(tokens, 0)) == (expected, 0)
    wait_for_files(tmp_path, 6)
    second = make_llm(dtype="float32", kv_shared_dir=str(tmp_path), **SMALL_POOL)
    assert run(second, prompt(tokens, 0)) == (expected, 6 * BLOCK)
    [shared] = second.engine.stats().kv_tiers
    assert (shared.medium, shared.loaded_blocks) == ("SHARED", 6)
    # Blocks of 32 tokens lay KV out otherwise: none of the 16-token blocks' files is theirs.
    other = make_llm(dtype="float32", kv_shared_dir=str(tmp_path), block_size=32, **SMALL_POOL)
    assert run(other, prompt(tokens, 0)) == (expected, 0)
    assert other.engine.stats().external_prefix_cache_hits == 0


@pytest.fixture
def disk_tier(make_llm: Callable[..., LLM], tmp_path: Path) -> tuple[LLM, Path]:
    return make_llm(dtype="float32", kv_offloading_dir=str(tmp_path), **SMALL_POOL), tmp_path


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "foreign"])
def test_a_damaged_block_is_a_miss_from_there_on(llm: LLM, tokens: list[int], disk_tier, damage: str,
                                                  caplog) -> None:
    tiered, directory = disk_tier
    expected = run(llm, prompt(tokens, 1))[0]
    assert run(tiered, prompt(tokens, 1)) == (expected, 0)
    wait_for_files(directory, 6)
    forget_device_blocks(tiered)
    third = _file_of_block(prompt(tokens, 1), 2, directory)  # the chain's third block goes bad
    data = bytearray(third.read_bytes())
    if damage == "truncated":
        data = data[:HEADER.size + 10]
    elif damage == "corrupted":
        data[-1] ^= 0x01
    else:  # the right name, another writer's bytes
        data = bytearray(b"\0" * len(data))
    third.write_bytes(data)
    assert run(tiered, prompt(tokens, 1)) == (expected, 2 * BLOCK)  # the two blocks before it, loaded
    [disk] = tiered.engine.stats().kv_tiers
    assert disk.failed == 1 and "counts as a miss" in caplog.text


def test_a_directory_gone_mid_read_is_a_miss(llm: LLM, tokens: list[int], disk_tier,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    tiered, directory = disk_tier
    expected = run(llm, prompt(tokens, 2))[0]
    run(tiered, prompt(tokens, 2))
    wait_for_files(directory, 6)
    forget_device_blocks(tiered)
    find = KvConnector.find

    def find_then_vanish(self: KvConnector, *args) -> list[int]:
        found = find(self, *args)
        shutil.rmtree(directory)  # after the scheduler found the files, before the worker reads them
        return found

    monkeypatch.setattr(KvConnector, "find", find_then_vanish)
    assert run(tiered, prompt(tokens, 2)) == (expected, 0)
    monkeypatch.undo()
    assert run(tiered, prompt(tokens, 3))[0] == run(llm, prompt(tokens, 3))[0]  # and it writes again
    wait_for_files(directory, 6)


def test_a_full_disk_costs_hits_never_tokens(llm: LLM, tokens: list[int], make_llm: Callable[..., LLM],
                                             small_tmpfs: Path) -> None:
    tiered = make_llm(dtype="float32", kv_offloading_dir=str(small_tmpfs), **SMALL_POOL)  # 1 MiB: one block fits
    for index in range(4, 7):
        assert run(tiered, prompt(tokens, index))[0] == run(llm, prompt(tokens, index))[0]
    deadline = time.monotonic() + 10
    while not (failed := sum(tier.failed for tier in tiered.engine.stats().kv_tiers)):
        assert time.monotonic() < deadline, "no write failed on a full disk"
        time.sleep(0.05)
        run(tiered, prompt(tokens, 7, 20))  # a step, to bring the worker's counts back
    assert failed > 0


def test_a_request_aborted_while_its_blocks_load_frees_them_when_the_load_ends(
        tokens: list[int], disk_tier, monkeypatch: pytest.MonkeyPatch) -> None:
    tiered, directory = disk_tier
    run(tiered, prompt(tokens, 8))
    wait_for_files(directory, 6)
    forget_device_blocks(tiered)
    read = BlockFiles.read

    def slow_read(self: BlockFiles, *args) -> memoryview | None:  # a slow disk: the load outlasts a step
        time.sleep(0.1)
        return read(self, *args)

    monkeypatch.setattr(BlockFiles, "read", slow_read)
    engine = tiered.engine
    engine.add_request("loading", prompt(tokens, 8), PARAMS)
    engine.step()
    assert engine.scheduler.requests["loading"].status is RequestStatus.LOADING_KV
    engine.abort_request("loading")
    while engine.has_work:
        engine.step()
    assert_no_leaks(tiered)


def _file_of_block(prompt_ids: list[int], index: int, directory: Path) -> Path:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt_ids, BLOCK, b"")
    [path] = [path for path in block_files(directory) if path.stem == hashes[index].hex()]
    return path
