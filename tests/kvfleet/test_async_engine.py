"""AsyncEngine, the embedded engine client, without HTTP: delivery across event loops,
batched wake-ups, rejected input, parallel samples routed to one stream, cache salts,
shutdown with live requests. Each test runs its own engine thread over one module
EngineCore, and checks the pool is whole afterwards."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kvfleet.async_engine import AsyncEngine
from scheduler_svc.engine_core import EngineCore
from services.config import EngineConfig
from services.engine_client import EngineUnavailable, RequestFailed
from services.invalid_parameter import InvalidParameter
from services.messages import TokenDelta
from services.model_source import resolve_model
from services.parallel_sampling import child_request_id
from services.sampling_params import SamplingParams
from tokenizer_svc.tokenizer import Tokenizer
from worker_svc.runtime.worker import Worker

from conftest import assert_no_leaks

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 504, 3458, 282], [19556, 28, 957, 1462, 314], [504, 2030, 282, 5140, 314], [2, 3, 4]]


@pytest.fixture(scope="module")
def core() -> EngineCore:
    Tokenizer.load(resolve_model("smollm2"))
    config = EngineConfig(model="smollm2", max_model_len=256, kv_cache_memory=64 * 2**20)
    return EngineCore(config, Worker(config))


@pytest.fixture(scope="module")
def reference(core: EngineCore) -> list[list[int]]:
    """Greedy tokens of PROMPTS from the core stepped directly, before any engine thread."""
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"ref-{i}", prompt, GREEDY)
    tokens: dict[str, list[int]] = {f"ref-{i}": [] for i in range(len(PROMPTS))}
    while core.has_work:
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
    return list(tokens.values())


@pytest.fixture
def engine(core: EngineCore, reference: list[list[int]]) -> Iterator[AsyncEngine]:
    running = AsyncEngine(core)
    running.start()
    yield running
    running.shutdown()
    assert_no_leaks(SimpleNamespace(engine=core))


async def _tokens(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    deltas = [delta async for delta in engine.generate(request_id, prompt, GREEDY)]
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    return [token for delta in deltas for token in delta.new_token_ids]


def test_streams_on_two_event_loops_get_their_own_tokens(engine: AsyncEngine, reference: list[list[int]]) -> None:
    results: dict[int, list[list[int]]] = {}

    def serve(loop_id: int) -> None:
        async def both() -> list[list[int]]:
            return await asyncio.gather(
                *(_tokens(engine, f"{loop_id}-{i}", PROMPTS[i]) for i in (2 * loop_id, 2 * loop_id + 1))
            )

        results[loop_id] = asyncio.run(both())

    threads = [threading.Thread(target=serve, args=(loop_id,)) for loop_id in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results[0] + results[1] == reference


def test_one_wakeup_per_step_not_per_token(engine: AsyncEngine, reference: list[list[int]]) -> None:
    async def run() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        tokens = await asyncio.gather(*(_tokens(engine, f"w-{i}", p) for i, p in enumerate(PROMPTS)))
        return tokens, calls

    tokens, calls = asyncio.run(run())
    assert tokens == reference
    # 4 requests x 8 tokens in about 8 steps: one hand-off per step carries every request's delta.
    assert calls <= GREEDY.max_tokens + 2 < sum(map(len, tokens))


def test_rejected_input_raises_to_the_caller_and_the_loop_goes_on(
    engine: AsyncEngine, reference: list[list[int]]
) -> None:
    async def run() -> list[int]:
        with pytest.raises(InvalidParameter) as caught:
            [delta async for delta in engine.generate("bad", [], GREEDY)]
        assert caught.value.param == "prompt"
        with pytest.raises(InvalidParameter, match="maximum model length of 256"):
            [delta async for delta in engine.generate("long", [1] * 257, GREEDY)]
        with pytest.raises(InvalidParameter) as caught:  # every child is checked before any runs
            [delta async for delta in engine.generate("many", [10**9], SamplingParams(n=3))]
        assert caught.value.param == "prompt"
        return await _tokens(engine, "good", PROMPTS[0])

    assert asyncio.run(run()) == reference[0]
    assert engine.is_ready()


def test_parallel_samples_share_the_parent_stream(engine: AsyncEngine, reference: list[list[int]]) -> None:
    async def run() -> list[TokenDelta]:
        params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
        return [delta async for delta in engine.generate("par", PROMPTS[2], params)]

    deltas = asyncio.run(run())
    children = [child_request_id("par", i) for i in range(3)]
    assert {d.request_id for d in deltas} == set(children)
    for child in children:
        mine = [d for d in deltas if d.request_id == child]
        assert [t for d in mine for t in d.new_token_ids] == reference[2]  # greedy children agree
        assert [d.finish_reason for d in mine][-1] == "length" and all(d.finish_reason is None for d in mine[:-1])
    # The stream ends with the last child's end, not the first.
    assert deltas[-1].finish_reason == "length"


def test_aborting_one_child_leaves_its_siblings_running(engine: AsyncEngine) -> None:
    async def run() -> dict[str, list[TokenDelta]]:
        params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
        by_child: dict[str, list[TokenDelta]] = {child_request_id("two", i): [] for i in range(2)}
        async for delta in engine.generate("two", PROMPTS[0], params):
            by_child[delta.request_id].append(delta)
            if delta.request_id == child_request_id("two", 0) and delta.finish_reason is None:
                await engine.abort(delta.request_id)
        return by_child

    first, second = asyncio.run(run()).values()
    assert first[-1].finish_reason == "abort" and sum(len(d.new_token_ids) for d in first) < 12
    assert second[-1].finish_reason == "length" and sum(len(d.new_token_ids) for d in second) == 12


def test_a_failed_step_fails_a_parallel_request_whole(
    engine: AsyncEngine, core: EngineCore, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    execute = core.worker.execute
    calls = 0

    def fail_third_step(plan):  # by then every child runs
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected worker failure")
        return execute(plan)

    monkeypatch.setattr(core.worker, "execute", fail_third_step)

    async def run() -> list[int]:
        params = SamplingParams(n=3, temperature=0, max_tokens=50, ignore_eos=True)
        with pytest.raises(RequestFailed, match="injected worker failure"):
            [delta async for delta in engine.generate("doomed", PROMPTS[0], params)]
        return await _tokens(engine, "after", PROMPTS[0])

    assert asyncio.run(run()) == reference[0]  # the fixture then checks no child kept a block


def test_cache_salt_keeps_prefix_caches_apart(engine: AsyncEngine) -> None:
    prompt = list(range(1000, 1040))  # two full blocks to share

    async def hits(request_id: str, salt: str | None) -> int:
        # Hits are counted when the prompt is admitted, steps before the stream ends.
        before = engine.stats().prefix_cache_hits
        [delta async for delta in engine.generate(request_id, prompt, GREEDY, salt)]
        return engine.stats().prefix_cache_hits - before

    async def run() -> list[int]:
        return [await hits(f"salt-{i}", salt) for i, salt in enumerate(("a", "a", "b", None, None))]

    first_a, again_a, first_b, first_none, again_none = asyncio.run(run())
    assert first_a == first_b == first_none == 0
    assert again_a == again_none == 32


def test_closing_a_stream_early_aborts_its_request(engine: AsyncEngine) -> None:
    async def run() -> None:
        # Seconds of decoding, in three children: closing the stream must abort them all.
        params = SamplingParams(n=3, temperature=0, max_tokens=240, ignore_eos=True)
        stream = engine.generate("early", PROMPTS[1], params)
        first = await anext(stream)
        assert first.new_token_ids and first.finish_reason is None
        await stream.aclose()
        # Checked while this loop still runs: a closed loop would also end its streams.
        deadline = time.monotonic() + 1.0
        while (stats := engine.stats()).num_requests_running or stats.kv_cache_usage:
            assert time.monotonic() < deadline, f"the request still runs: {stats}"
            await asyncio.sleep(0.01)

    asyncio.run(run())


def test_shutdown_ends_live_requests_explicitly(engine: AsyncEngine) -> None:
    async def run() -> list[TokenDelta]:
        received: list[TokenDelta] = []
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        with pytest.raises(EngineUnavailable):
            async for delta in engine.generate("live", PROMPTS[0], params):
                received.append(delta)
                if len(received) == 2:
                    await asyncio.to_thread(engine.shutdown)
        return received

    received = asyncio.run(run())
    assert len(received) >= 2 and all(delta.finish_reason is None for delta in received)
    assert not engine.is_ready()

    async def after() -> None:
        [delta async for delta in engine.generate("late", PROMPTS[0], GREEDY)]

    with pytest.raises(EngineUnavailable):
        asyncio.run(after())
