"""Prefix-cache mechanics: reproducible hashes, LRU eviction, tenant isolation, usage."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from kvfleet import SamplingParams
from scheduler_svc.block_pool import BlockPool
from services.block_hash import (
    ROOT_PARENT,
    extend_block_hashes,
    extra_keys_bytes,
    hash_block,
)
from worker_svc.runtime.kv_sizing import profile_run

from conftest import assert_no_leaks


def test_hash_follows_the_documented_formula():
    tokens = [5, 70000, 3, 9]
    extra = extra_keys_bytes(cache_salt="tenant-a")
    assert extra == json.dumps({"cache_salt": "tenant-a"}).replace(" ", "").encode()
    expected = hashlib.sha256(bytes(32) + struct.pack("<5I", 4, *tokens) + extra).digest()
    assert hash_block(ROOT_PARENT, tokens, extra) == expected
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens + [1, 2, 3], block_size=4, extra=extra)
    assert hashes == [expected]  # only full blocks are hashed
    extend_block_hashes(hashes, tokens + [1, 2, 3, 4], block_size=4, extra=extra)
    assert hashes[1] == hash_block(expected, [1, 2, 3, 4], extra)


def test_hashes_are_the_same_in_another_process():
    code = (
        "from services.block_hash import extend_block_hashes, extra_keys_bytes\n"
        "h = []\nextend_block_hashes(h, list(range(64)), 16, extra_keys_bytes(cache_salt='s'))\n"
        "print(','.join(x.hex() for x in h))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    here: list[bytes] = []
    extend_block_hashes(here, list(range(64)), 16, extra_keys_bytes(cache_salt="s"))
    assert out.stdout.strip() == ",".join(x.hex() for x in here)


def test_freed_cached_blocks_stay_evictable_tail_first():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for block, name in zip(blocks, (b"head", b"middle", b"tail")):
        pool.cache(block, name)
    pool.free(blocks)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 3
    assert pool.lookup([b"head", b"middle", b"tail"]) == blocks
    # The never-used block goes first, then the request's tail, its head last.
    pool.allocate(2)
    assert pool.lookup([b"head", b"middle", b"tail"]) == blocks[:2]
    pool.share(blocks[:1])  # a hit revives an evictable block: it leaves the free queue
    assert pool.num_free_blocks == 1
    pool.allocate(1)
    assert pool.lookup([b"head"]) == blocks[:1] and pool.lookup([b"middle"]) == []


def test_cache_salt_isolates_tenants(llm):
    prompt = list(range(1000, 1100))
    params = SamplingParams(temperature=0, max_tokens=2)
    scheduler = llm.engine.scheduler

    def hits_for(salt: str | None) -> int:
        before = scheduler.prefix_cache_hits
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}], params, use_tqdm=False)
        return scheduler.prefix_cache_hits - before

    assert hits_for("tenant-a") == 0
    assert hits_for("tenant-b") == 0  # same tokens, other tenant: nothing shared
    assert hits_for(None) == 0
    assert hits_for("tenant-a") == 96  # 6 full blocks of 16; the last token is always computed
    assert hits_for(None) == 96


def test_kv_usage_and_prefix_metrics(llm):
    before = llm.engine.stats()
    llm.generate([list(range(2000, 2040))], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    after = llm.engine.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 40
    assert after.kv_cache_usage == 0.0  # cached blocks are evictable, not used
    engine = llm.engine
    engine.add_request("held", list(range(3000, 3033)), SamplingParams(max_tokens=4))
    engine.step()
    stats = engine.stats()
    assert stats.num_requests_running == 1
    assert stats.kv_cache_usage == pytest.approx(3 / stats.num_kv_blocks)
    engine.abort_request("held")
    engine.step()
    assert_no_leaks(llm)


def test_a_request_that_ends_in_its_first_step_leaves_its_prompt_cached(llm):
    """One token asked for: the request ends in the step that computed its prompt, whose
    full blocks go back to the pool cached, as vLLM's do, for the next to hit."""
    prompt = list(range(4000, 4040))  # two full blocks, and the last token's
    one_token = SamplingParams(temperature=0, max_tokens=1)
    first, again = (llm.generate([{"prompt_token_ids": prompt}], one_token, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)


def test_profile_run_leaves_no_state(llm):
    worker = llm.engine.worker
    requests = dict(worker.requests)
    profile_run(worker)
    assert worker.requests == requests  # the worker's own, untouched
    assert len(worker.batch.free_rows) == len(worker.batch.num_blocks) - len(requests)  # the rest free again
