"""Prefill/decode disaggregation (docs/disaggregation.md) on real replicas: a prefill
replica (kv_producer) and a decode replica (kv_consumer), each a worker and a scheduler
over gRPC in this process, real NATS and Redis, and the gateway's cluster client. The
decode replica's own run of each prompt (no split, another cache salt) is the combined
replica's answer. Blocks move worker to worker; the tests count what moved and what the
decode replica computed, and break the handoff: blocks that never arrive, a prefill
replica that died, holds nobody fetches. Each test's prompts start at offsets of the text
no other test's do, so no block is cached from another test (block hashes chain from a
prompt's first token)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import Iterator
from contextlib import aclosing

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.app import build_app
from gateway.cluster.client import ClusterEngineClient
from gateway.cluster.disaggregation import Disaggregation, decodes, prefills
from gateway.cluster.replica import Replica as Placed
from gateway.metrics import GatewayMetrics
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import TokenDelta
from services.model_source import resolve_model
from services.pooling_params import PoolingParams
from services.registry import Member, Registry
from services.sampling_params import SamplingParams
from services.telemetry import EngineStatsCollector
from tokenizer_svc.in_process import InProcessEncoder
from tokenizer_svc.tokenizer import Tokenizer

from corpus import TEXT, parity_prompts
from in_process_replica import InProcessReplica, serving_tokenizer
from servers import nats, redis_url  # noqa: F401  (fixtures)

BLOCK = 16
THRESHOLD = 32  # --pd-min-prefill-tokens: the parity prompts longer than this are split
FETCH_TIMEOUT_S = 2.0  # how long a fetch waits for its producer
HOLD_S = 30.0  # how long a hold waits for its consumer (the test of holds nobody fetches shortens it)
# Chunked prefill on both sides (64-token steps); a small pool on the decode side, which
# preempts when long prompts decode together.
# LoRA enabled (one slot) for the adapter's split request; the others run as without it.
ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64, enable_lora=True, max_loras=1)
POOLS = {"kv_producer": 128, "kv_consumer": 20}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TTL_S = 2.0


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def start_replica(role: str, nats_url: str, registry: Registry, name: str | None = None) -> InProcessReplica:
    config = dict(ENGINE, num_gpu_blocks_override=POOLS[role], kv_transfer_config={
        "kv_connector": "KvfleetConnector", "kv_role": role,
        "kv_connector_extra_config": {"abort_timeout_s": HOLD_S, "fetch_timeout_s": FETCH_TIMEOUT_S}})
    # The prefill replica's worker without the config: a one-rank worker serves what its
    # scheduler holds whatever its flags (the decode side's has it, for its fetch timeout).
    worker_config = dict(config, kv_transfer_config=None) if role == "kv_producer" else config
    return InProcessReplica(name or role, nats_url, registry, config, TTL_S, worker_config)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def pair(nats, redis_url, tokenizer) -> Iterator[dict[str, InProcessReplica]]:
    registry = Registry(redis_url)
    with serving_tokenizer(registry, tokenizer, TTL_S):
        replicas = {"prefill": start_replica("kv_producer", nats.url, registry),
                    "decode": start_replica("kv_consumer", nats.url, registry)}
        yield replicas
        for replica in replicas.values():
            replica.close()
    registry.close()


@pytest.fixture(scope="module")
def client(pair, nats, redis_url) -> Iterator[ClusterEngineClient]:
    client = ClusterEngineClient(redis_url, nats.url, poll_interval_s=0.2, pd_min_prefill_tokens=THRESHOLD)
    client.start()
    wait_until(lambda: client.is_ready() and len(client._replicas.routable()) == 2, "the client never saw the pair")
    yield client
    client.shutdown()


def generate(client: ClusterEngineClient, prompts: list[list[int]], tag: str, salt: str | None = None,
             kv_transfer_params: KvTransferParams | None = None, params: SamplingParams = GREEDY,
             lora_request: LoRARequest | None = None) -> list[list[TokenDelta]]:
    async def one(index: int, prompt: list[int]) -> list[TokenDelta]:
        async with aclosing(client.generate(f"{tag}-{index}", prompt, params, salt, kv_transfer_params,
                                            lora_request)) as deltas:
            return [delta async for delta in deltas]

    async def main() -> list[list[TokenDelta]]:
        return await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(prompts)))

    return asyncio.run(main())


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.new_token_ids]


def combined(client: ClusterEngineClient, prompts: list[list[int]], tag: str, params: SamplingParams = GREEDY,
             lora_request: LoRARequest | None = None) -> list[list[int]]:
    """The decode replica's own answers, computed there (a salt no block of the split runs shares)."""
    hold_back = client._streams._pd.min_prefill_tokens
    client._streams._pd.min_prefill_tokens = 10**6
    try:
        return [tokens(d) for d in generate(client, prompts, tag, salt=f"combined-{tag}", params=params,
                                            lora_request=lora_request)]
    finally:
        client._streams._pd.min_prefill_tokens = hold_back


def moved(replica: InProcessReplica) -> tuple[int, float, int]:
    transfer = replica.stats().kv_transfer
    return sum(transfer.bytes_transferred.counts), transfer.bytes_transferred.sum, transfer.failed_blocks


def _scrape(replica: InProcessReplica) -> str:
    """The replica's scheduler /metrics, as its role serves them."""
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(replica.loop, "smollm2"))
    return generate_latest(registry).decode()


def block_bytes(replica: InProcessReplica) -> int:
    """Block size x layers x 2 (K and V) x KV heads x head size x element size, from the model's config;
    float16 elements: --kv-cache-dtype auto keeps a float16 cache for GGUF weights run as stored."""
    model = replica.worker_process.model_config
    return BLOCK * model.num_hidden_layers * 2 * model.num_key_value_heads * model.head_dim * 2


def test_split_requests_decode_the_combined_replicas_tokens_moving_only_full_blocks(pair, client, tokenizer) -> None:
    prompts = parity_prompts(tokenizer.encode(TEXT))[:9]  # up to 200 tokens: the longer three cost seconds more
    decode, prefill = pair["decode"], pair["prefill"]
    fetches, bytes_before, _ = moved(decode)
    sources_before = decode.stats().prompt_tokens_by_source
    split = generate(client, prompts, "parity")
    long = [p for p in prompts if len(p) > THRESHOLD]
    full_blocks = sum((len(p) - 1) // BLOCK for p in long)  # all but the last token's block, none cached yet
    count, bytes_after, failed = moved(decode)
    assert count - fetches == len(long) and failed == 0
    assert bytes_after - bytes_before == full_blocks * block_bytes(decode) == full_blocks * 368640
    # What the decode replica computed of the split prompts: at most one partial block each.
    sources = decode.stats().prompt_tokens_by_source
    computed = sources["local_compute"] - sources_before.get("local_compute", 0)
    short = sum(len(p) for p in prompts if len(p) <= THRESHOLD)
    assert computed == short + sum(len(p) - (len(p) - 1) // BLOCK * BLOCK for p in long) <= short + BLOCK * len(long)
    assert sources["external_kv_transfer"] - sources_before.get("external_kv_transfer", 0) == full_blocks * BLOCK
    # The decode replica's /metrics says so under vLLM's name.
    scraped = _scrape(decode)
    assert f'vllm:prompt_tokens_by_source_total{{model_name="smollm2",source="local_compute"}} ' \
           f'{float(sources["local_compute"])}' in scraped
    # A split request's first token says how long its prefill and its transfer took; the
    # gateway's histograms split its TTFT by them.
    metrics = GatewayMetrics(client, "smollm2")
    for prompt, deltas in zip(prompts, split):
        times = next(d.first_token_times for d in deltas if d.new_token_ids)
        assert (times.remote_prefill_s > 0 and times.kv_transfer_s > 0) == (len(prompt) > THRESHOLD)
        meter = metrics.request(len(prompt), GREEDY.max_tokens)
        meter.tokens(1, times)
        meter.finished("length")
    rendered = metrics.render().decode()
    for name in ("pd_queue_time", "pd_prefill_time", "pd_kv_transfer_time", "pd_first_decode_step"):
        assert f'kvfleet:{name}_seconds_count{{model_name="smollm2"}} {float(len(long))}' in rendered
    assert [tokens(d) for d in split] == combined(client, prompts, "parity")
    wait_until(lambda: prefill.stats().kv_transfer.held_blocks == 0, "the prefill replica kept blocks")


def first_token(client: ClusterEngineClient, prompt: list[int], tag: str, salt: str) -> tuple[float, TokenDelta]:
    """Seconds from the request to its first token, and that token's delta."""
    async def main() -> tuple[float, TokenDelta]:
        started = time.monotonic()
        async with aclosing(client.generate(tag, prompt, GREEDY, salt)) as deltas:
            async for delta in deltas:
                if delta.new_token_ids:
                    return time.monotonic() - started, delta
        raise AssertionError(f"{tag}: no token")

    return asyncio.run(main())


def test_blocks_move_while_the_prompt_is_computed(pair, client, tokenizer) -> None:
    """A 200-token prompt, prefilled in 64-token chunks: the decode replica fetches each block
    as the prefill publishes it, so the phases overlap, and the prefill's time plus the
    transfer's is more than the whole time to the first token (one after the other, as when
    the blocks move after the prefill, it could not be)."""
    prompt = tokenizer.encode(TEXT)[200:400]
    _, before, _ = moved(pair["decode"])
    ttft, delta = first_token(client, prompt, "overlap", "overlap")
    times = delta.first_token_times
    _, after, failed = moved(pair["decode"])
    assert after - before == (len(prompt) - 1) // BLOCK * block_bytes(pair["decode"]) and failed == 0
    assert times.remote_queued_s + times.remote_prefill_s + times.kv_transfer_s > ttft, (ttft, times)


def test_a_decode_replica_that_preempts_split_requests_decodes_the_same_tokens(pair, client, tokenizer) -> None:
    """Three prompts of 7 blocks whose outputs need 3 blocks more each, in a 20-block pool.
    Their prefills end first (as vLLM's proxy has them held), so the three decode requests
    come at once: their 18 blocks arrive, then decoding preempts (and recomputes) one."""
    ids = tokenizer.encode(TEXT)
    prompts = [ids[101 * i + 101:101 * i + 201] for i in range(3)]
    decode = pair["decode"]
    preemptions = decode.stats().num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    held = [next(d.kv_transfer_params for d in deltas if d.kv_transfer_params) for deltas in generate(
        client, prompts, "preempted-held", kv_transfer_params=KvTransferParams(do_remote_decode=True),
        params=SamplingParams(temperature=0.0, max_tokens=1))]

    async def main() -> list[list[TokenDelta]]:
        async def one(index: int) -> list[TokenDelta]:
            async with aclosing(client.generate(f"preempted-{index}", prompts[index], params, None,
                                                held[index])) as deltas:
                return [delta async for delta in deltas]
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    split = [tokens(d) for d in asyncio.run(main())]
    assert decode.stats().num_preemptions > preemptions
    hold_back = client._streams._pd.min_prefill_tokens
    client._streams._pd.min_prefill_tokens = 10**6
    try:
        assert split == [tokens(d) for d in generate(client, prompts, "preempted-combined", "combined", params=params)]
    finally:
        client._streams._pd.min_prefill_tokens = hold_back


def test_a_prefix_the_decode_replica_holds_is_not_moved(pair, client, tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    first, second = ids[310:390], ids[310:374] + ids[420:480]  # the second shares 4 full blocks with the first
    decode = pair["decode"]
    fetches, before, _ = moved(decode)
    split = [tokens(generate(client, [prompt], f"prefix-{i}")[0]) for i, prompt in enumerate((first, second))]
    count, after, _ = moved(decode)
    assert count - fetches == 2
    assert after - before == ((80 - 1) // BLOCK + (124 - 1) // BLOCK - 4) * block_bytes(decode)
    assert split == combined(client, [first, second], "prefix")


def test_blocks_that_never_arrive_are_recomputed(pair, client, tokenizer) -> None:
    """The prefill replica serves a fetch up to the first block it does not hold for the
    request: those after it are recomputed, and the text is the same."""
    prompt = tokenizer.encode(TEXT)[333:433]
    decode = pair["decode"]
    [[held]] = [[d for d in deltas if d.kv_transfer_params] for deltas in generate(
        client, [prompt], "held", kv_transfer_params=KvTransferParams(do_remote_decode=True))]
    handoff = held.kv_transfer_params
    assert handoff.do_remote_prefill and handoff.remote_port == int(pair["prefill"].worker.address.split(":")[1])
    handoff.remote_block_ids[3:] = [POOLS["kv_producer"] - 1] * (len(handoff.remote_block_ids) - 3)  # not its own
    _, before, failed = moved(decode)
    [out] = generate(client, [prompt], "partial", kv_transfer_params=handoff)
    _, after, failed_after = moved(decode)
    assert after - before == 3 * block_bytes(decode) and failed_after - failed == (100 - 1) // BLOCK - 3
    assert tokens(out) == combined(client, [prompt], "partial")[0]
    # The fetch ended (refused midway): the prefill replica let the request's blocks go.
    wait_until(lambda: pair["prefill"].stats().kv_transfer.held_blocks == 0, "the refused fetch's hold stayed")


def test_vllms_proxy_drives_the_pair_with_kv_transfer_params_over_rest(pair, client, tokenizer) -> None:
    """As vLLM's disaggregation proxy does: the prompt with do_remote_decode and one token
    asked; the response's kv_transfer_params with the request for the text."""
    prompt = tokenizer.encode(TEXT)[360:440]
    app = build_app(client, InProcessEncoder(tokenizer), "smollm2")
    decode = pair["decode"]

    async def proxy() -> tuple[dict, dict, dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                     timeout=60) as http:
            body = {"model": "smollm2", "prompt": prompt, "temperature": 0, "ignore_eos": True}
            held = (await http.post("/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False}})).json()
            fetched, before, _ = moved(decode)
            out = (await http.post("/v1/completions", json={**body, "max_tokens": GREEDY.max_tokens,
                                                             "kv_transfer_params": held["kv_transfer_params"]})).json()
            refused = await http.post("/v1/completions", json={**body, "kv_transfer_params": {"remote_port": "x"}})
            return held, out, {"fetched": fetched, "before": before, "refused": refused}

    held, out, seen = asyncio.run(proxy())
    handoff = held["kv_transfer_params"]
    assert handoff["do_remote_prefill"] and handoff["remote_request_id"] and len(handoff["remote_block_ids"]) == 5
    count, after, _ = moved(decode)
    assert count == seen["fetched"] + 1 and after - seen["before"] == (80 - 1) // BLOCK * block_bytes(decode)
    assert out["kv_transfer_params"] is None
    assert out["choices"][0]["text"] == tokenizer.decode(combined(client, [prompt], "proxy")[0])
    assert seen["refused"].status_code == 400 and "kv_transfer_params" in seen["refused"].text


def test_an_adapters_request_is_split_with_its_adapter_on_both_sides(pair, client, tokenizer,
                                                                     lora_adapter_dirs) -> None:
    """Its prefill leg runs the adapter, and the adapter is part of the blocks' hashes on both
    sides: the same prompt without it is computed again on the prefill replica and moved
    again, not taken from the adapter's cached blocks. The text is the decode replica's own
    run with the adapter, which differs from the base model's."""
    prompt = tokenizer.encode(TEXT)[390:470]
    lora = LoRARequest("attn8", 9, str(lora_adapter_dirs["attn8"]))
    prefill, decode = pair["prefill"], pair["decode"]
    asyncio.run(client.add_lora(lora))
    try:
        blocks = (len(prompt) - 1) // BLOCK
        computed = prefill.stats().prompt_tokens_by_source.get("local_compute", 0)
        _, before, _ = moved(decode)
        [adapted] = [tokens(d) for d in generate(client, [prompt], "lora", lora_request=lora)]
        _, between, _ = moved(decode)
        [base] = [tokens(d) for d in generate(client, [prompt], "lora-base")]
        _, after, _ = moved(decode)
        assert between - before == after - between == blocks * block_bytes(decode)
        assert prefill.stats().prompt_tokens_by_source["local_compute"] - computed == 2 * len(prompt)
        assert adapted == combined(client, [prompt], "lora", lora_request=lora)[0] != base
    finally:
        asyncio.run(client.remove_lora(lora.lora_int_id))


def _chunks(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_streamed_responses_carry_kv_transfer_params_and_llm_ds_sidecar_drives_the_pair(
        pair, client, tokenizer) -> None:
    """A streamed do_remote_decode request's kv_transfer_params come on its last chunk (only
    there), and a streamed request carrying them decodes the text of a run that was not
    split. Then chat as llm-d's routing sidecar drives it: the prefill leg non-streamed with
    every remote_* key null, the decode leg streamed."""
    prompt = tokenizer.encode(TEXT)[380:460]
    app = build_app(client, InProcessEncoder(tokenizer), "smollm2")
    decode = pair["decode"]
    body = {"model": "smollm2", "prompt": prompt, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_salt": "streamed"}  # the first test's blocks of this prompt are not the decode replica's
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": tokenizer.decode(prompt)}],
            "temperature": 0, "ignore_eos": True, "max_tokens": GREEDY.max_tokens}
    sidecar = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}

    async def proxy() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                     timeout=60) as http:
            held = _chunks(await http.post("/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True}}))
            fetched = moved(decode)[0]
            out = _chunks(await http.post("/v1/completions", json={
                **body, "max_tokens": GREEDY.max_tokens, "kv_transfer_params": held[-1]["kv_transfer_params"]}))
            chat_held = (await http.post("/v1/chat/completions", json={
                **chat, "max_tokens": 1, "stream": False, "kv_transfer_params": sidecar})).json()
            chat_out = _chunks(await http.post("/v1/chat/completions", json={
                **chat, "stream": True, "kv_transfer_params": chat_held["kv_transfer_params"]}))
            client._streams._pd.min_prefill_tokens = 10**6  # the chat answer of a replica that computes it all
            try:
                chat_combined = (await http.post("/v1/chat/completions", json={**chat, "cache_salt": "c"})).json()
            finally:
                client._streams._pd.min_prefill_tokens = THRESHOLD
            return {"held": held, "fetched": fetched, "out": out, "chat_held": chat_held, "chat_out": chat_out,
                    "chat_combined": chat_combined}

    seen = asyncio.run(proxy())
    held = seen["held"]
    assert [c["choices"][0]["finish_reason"] for c in held] == ["length"]
    handoff = held[-1]["kv_transfer_params"]
    assert handoff["do_remote_prefill"] and len(handoff["remote_block_ids"]) == 5 and handoff["remote_request_id"]
    assert all("kv_transfer_params" not in c for c in seen["out"] + seen["chat_out"])
    assert moved(decode)[0] >= seen["fetched"] + 2  # the completion's fetch and the chat's
    text = "".join(c["choices"][0]["text"] for c in seen["out"])
    assert text == tokenizer.decode(combined(client, [prompt], "streamed")[0])
    assert seen["chat_held"]["kv_transfer_params"]["do_remote_prefill"]
    chat_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in seen["chat_out"] if c["choices"])
    assert chat_text == seen["chat_combined"]["choices"][0]["message"]["content"]


def test_a_hold_nobody_fetches_and_a_fetch_nobody_answers_free_their_blocks(pair, client, tokenizer) -> None:
    prompt = tokenizer.encode(TEXT)[350:430]
    prefill, decode = pair["prefill"], pair["decode"]
    expired, held = prefill.stats().kv_transfer.expired_requests, prefill.stats().kv_transfer.held_blocks
    handoff = prefill.core.scheduler.handoff
    handoff.config = dataclasses.replace(handoff.config, abort_timeout_s=1.0)  # the flag's value, shorter
    try:
        generate(client, [prompt], "orphan", kv_transfer_params=KvTransferParams(do_remote_decode=True))
    finally:
        handoff.config = dataclasses.replace(handoff.config, abort_timeout_s=HOLD_S)
    assert prefill.stats().kv_transfer.held_blocks == held + (80 + BLOCK) // BLOCK  # the prompt and its token
    wait_until(lambda: prefill.stats().kv_transfer.held_blocks == held, "the hold outlived its timeout", 3.0)
    assert prefill.stats().kv_transfer.expired_requests == expired + 1
    with socket.socket() as silent:  # accepts connections, never answers: the fetch times out
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        handoff = KvTransferParams(do_remote_prefill=True, remote_block_ids=list(range(5)), remote_host="127.0.0.1",
                                   remote_port=silent.getsockname()[1], remote_request_id="gone")
        started = time.monotonic()
        [out] = generate(client, [prompt], "silent", kv_transfer_params=handoff)
    assert time.monotonic() - started < 3 * FETCH_TIMEOUT_S
    assert tokens(out) == combined(client, [prompt], "silent")[0]
    assert decode.stats().kv_cache_usage == 0  # every block it took for the fetch went back


def test_a_decode_replica_that_dies_mid_stream_loses_no_request(pair, client, tokenizer, nats, redis_url) -> None:
    """A second decode replica joins; split streams run on both decode replicas; the second's
    worker dies (its gRPC server stopped: what a kill -9 leaves its scheduler) while they
    decode. Its streams migrate to the first decode replica and finish with the text of an
    undisturbed run, no error; the first's streams (the witnesses) finish intact. The second
    replica is then gone for good, and the pair is as before."""
    ids = tokenizer.encode(TEXT)
    prompts = [ids[20 * i + 5:20 * i + 45] for i in range(3)]  # 2 full blocks each move
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    registry = Registry(redis_url)
    dying = start_replica("kv_consumer", nats.url, registry, "second-decode")
    try:
        wait_until(lambda: len(client._replicas.routable()) == 3, "the client never saw the second decode replica")
        received: list[list[int]] = [[] for _ in prompts]
        placed: dict[int, str] = {}

        async def one(index: int) -> None:
            async with aclosing(client.generate(f"dies-{index}", prompts[index], params)) as deltas:
                async for delta in deltas:
                    received[index].extend(delta.new_token_ids)

        async def main() -> list[BaseException | None]:
            streams = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
            deadline = time.monotonic() + 30

            def on_dying() -> list[int]:
                return [i for i, instance in placed.items() if instance == dying.core.instance_id]

            # Until each stream placed on the dying replica is decoding there, its first tokens out.
            while (len(placed) < len(prompts) or not all(len(received[i]) >= 2 for i in on_dying())) \
                    and time.monotonic() < deadline:
                for i in range(len(prompts)):
                    if i not in placed and (replica := client._streams._placed.get(f"dies-{i}")) is not None:
                        placed[i] = replica.instance_id
                await asyncio.sleep(0.01)
            dying.worker.stop(0)
            return await asyncio.gather(*streams, return_exceptions=True)

        errors = asyncio.run(main())
        assert errors == [None] * len(prompts)  # nothing lost: no error, each ran to its length
        on_dying = {i for i, instance in placed.items() if instance == dying.core.instance_id}
        assert on_dying and len(on_dying) < len(prompts), placed  # migrated streams, and witnesses
    finally:
        dying.close()
        registry.close()
    wait_until(lambda: len(client._replicas.routable()) == 2, "the dead replica stayed routable")
    assert received == combined(client, prompts, "dies", params)
    wait_until(lambda: pair["prefill"].stats().kv_transfer.held_blocks == 0, "the prefill replica kept blocks")


def test_a_pooling_request_is_never_split() -> None:
    """It pools every prompt position's hidden state where it runs: a decode replica given the
    prompt's KV would compute only the last block's (docs/pooling.md)."""
    prefill, decode = (Placed(Member("scheduler", role, "127.0.0.1:1", {"kv_role": role}), None, None, None)
                       for role in ("kv_producer", "kv_consumer"))
    split = Disaggregation(BLOCK)
    assert split.wants_prefill(decode, 8 * BLOCK, [prefill], SamplingParams(max_tokens=1))
    assert not split.wants_prefill(decode, 8 * BLOCK, [prefill], SamplingParams(pooling=PoolingParams()))


def test_past_the_prefill_queue_bound_the_decode_replica_computes_the_prompt() -> None:
    """--pd-max-prefill-queue (Dynamo's conditional disaggregation): split only while some
    prefill replica has fewer requests waiting than the bound."""
    busy, idle, decode = (Placed(Member("scheduler", name, "127.0.0.1:1", {"kv_role": role}), None, None, None)
                          for name, role in (("busy", "kv_producer"), ("idle", "kv_producer"), ("d", "kv_consumer")))
    busy.waiting, idle.waiting = 3, 2
    params = SamplingParams(max_tokens=1)
    bounded = Disaggregation(BLOCK, max_prefill_queue=3)
    assert bounded.wants_prefill(decode, 8 * BLOCK, [busy, idle], params)
    assert not bounded.wants_prefill(decode, 8 * BLOCK, [busy], params)
    assert Disaggregation(BLOCK).wants_prefill(decode, 8 * BLOCK, [busy], params)  # no bound


def test_a_kv_both_replica_given_a_pool_is_in_that_one_only() -> None:
    def replica(**metadata: str) -> Placed:
        return Placed(Member("scheduler", "r", "127.0.0.1:1", metadata), None, None, None)

    pools = [(prefills(r), decodes(r)) for r in (
        replica(kv_role="kv_both"), replica(kv_role="kv_both", kv_pool="prefill"),
        replica(kv_role="kv_both", kv_pool="decode"), replica(kv_role="kv_producer"), replica(kv_role="kv_consumer"),
        replica())]
    assert pools == [(True, True), (True, False), (False, True), (True, False), (False, True), (False, True)]


def test_a_prefill_replica_that_died_is_recomputed_on_the_decode_side(pair, client, tokenizer) -> None:
    """Last: the prefill replica's worker stops between its prefill and the fetch."""
    prompt = tokenizer.encode(TEXT)[370:470]
    prefill, decode = pair["prefill"], pair["decode"]
    [[held]] = [[d for d in deltas if d.kv_transfer_params] for deltas in generate(
        client, [prompt], "dying", kv_transfer_params=KvTransferParams(do_remote_decode=True))]
    prefill.worker.stop(0)
    _, before, failed = moved(decode)
    [out] = generate(client, [prompt], "after-death", kv_transfer_params=held.kv_transfer_params)
    _, after, failed_after = moved(decode)
    assert after == before and failed_after - failed == (100 - 1) // BLOCK
    assert tokens(out) == combined(client, [prompt], "after-death")[0]
