"""vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine) on the scheduler role, over
real gRPC on 127.0.0.1 with the real smollm2 in float32, driven by a client made of
nothing but grpc and smg-grpc-proto's generated stubs: greedy tokens equal kvfleet's
offline LLM, text prompts and stop strings, n, logprobs, abort, a vanishing client,
loads, KV events (resumable), the tokenizer's files, and reflection."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as smg
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from kvfleet import LLM
from kvfleet.processes import free_port
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.engine_protocol.convert import sampling_params_from_engine_protocol
from scheduler_svc.engine_protocol.kv_events import KvEventStream, block_hash_int64
from scheduler_svc.engine_protocol.server import SERVICE_NAME, VllmEngineServicer, start_vllm_engine_server
from scheduler_svc.engine_protocol.text import EngineText
from scheduler_svc.output_hub import OutputHub
from scheduler_svc.server import start_scheduler_server
from scheduler_svc.step_loop import StepLoop
from scheduler_svc.worker_client import RemoteWorker
from services.block_hash import extend_block_hashes
from services.config import EngineConfig
from services.model_source import resolve_model
from services.role_process import grpc_serving
from services.sampling_params import SamplingParams
from services.structured_outputs import StructuredOutputsParams
from services.tokenizer_archive import unpack
from tokenizer_svc.tokenizer import Tokenizer
from worker_svc.runtime.worker import Worker
from worker_svc.server import start_worker_server

from corpus import TEXT
from servers import RoleProcess

# 8 blocks of 16 tokens: a long request evicts what short ones left cached.
# It pools as well as it generates (a --pooler-config), for Embed.
ENGINE = dict(dtype="float32", num_gpu_blocks_override=8, max_model_len=128, pooler_config='{"pooling_type": "LAST"}')
NEW_TOKENS = 8
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    # The last two: a prompt no other test runs (its block is stored fresh), and one long
    # enough to evict it.
    return [ids[0:5], ids[40:60], ids[100:133], ids[300:320], ids[340:450]]


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    """kvfleet's own offline path on the same token ids."""
    llm = LLM("smollm2", **ENGINE)
    try:
        outputs = llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.engine.worker.close()
    return [list(output.outputs[0].token_ids) for output in outputs]


class Replica:
    """A worker server, a scheduler over it, and the engine protocol on its own port."""

    def __init__(self) -> None:
        self.worker = Worker(EngineConfig(**ENGINE))
        self.worker_server = start_worker_server(self.worker, "127.0.0.1:0")
        self.remote = RemoteWorker(self.worker_server.address)
        hub = OutputHub()
        self.kv_events = hub.kv_events = KvEventStream(None)
        self.loop = StepLoop(EngineCore(EngineConfig(**ENGINE), self.remote), hub)
        self.scheduler_server = start_scheduler_server(self.loop, hub, "127.0.0.1:0")
        servicer = VllmEngineServicer(self.loop, hub, self.kv_events, EngineText.for_engine(EngineConfig(**ENGINE)),
                                      grpc_serving(self.worker_server.address, 3.0), "smollm2", "smollm2")
        self.server = start_vllm_engine_server(servicer, "127.0.0.1:0")
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.VllmEngineStub(self.channel)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (stats := self.loop.stats()).num_requests_running or stats.num_requests_waiting \
                or self.loop.core.has_work:
            assert time.monotonic() < deadline, f"not idle: {stats}"
            time.sleep(0.01)
        pool = self.loop.core.scheduler.block_pool
        assert pool.num_free_blocks == pool.num_blocks, f"{pool.num_used_blocks} blocks leaked"

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)
        self.scheduler_server.stop(0)
        self.remote.close()
        self.worker_server.stop(0)


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    running = Replica()
    yield running
    running.close()


def generate(request_id: str, prompt: list[int], stream: bool = False, **params) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(**{"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True, **params})
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt),
                              sampling_params=sampling, stream=stream)


def test_greedy_generate_equals_the_offline_llm(replica, prompts, reference) -> None:
    [response] = replica.stub.Generate(generate("plain", prompts[0]))
    complete = response.complete
    assert list(complete.output_ids) == reference[0]
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", 5, NEW_TOKENS)

    responses = list(replica.stub.Generate(generate("streamed", prompts[1], stream=True)))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    assert [token for chunk in chunks for token in chunk.token_ids] == reference[1]
    assert len(chunks) > 1 and chunks[-1].completion_tokens == NEW_TOKENS
    last = responses[-1]
    assert last.HasField("complete") and last.complete.finish_reason == "length"
    replica.wait_idle()


def test_n_logprobs_and_prompt_logprobs(replica, prompts, reference) -> None:
    responses = list(replica.stub.Generate(generate("n3", prompts[2], n=3, logprobs=2, prompt_logprobs=1)))
    completes = sorted((r.complete for r in responses), key=lambda c: c.index)
    assert [c.index for c in completes] == [0, 1, 2]
    for complete in completes:  # greedy: every child is the same
        assert list(complete.output_ids) == reference[2]
        logprobs = complete.output_logprobs
        assert list(logprobs.token_ids) == reference[2]
        assert all(len(top.token_ids) == 2 and top.values[0] >= top.values[1] for top in logprobs.top_logprobs)
        # Greedy: the chosen token is the most likely one.
        assert [top.token_ids[0] for top in logprobs.top_logprobs] == reference[2]
        assert all(lp <= 0 for lp in logprobs.token_logprobs)
        prompt_logprobs = complete.input_logprobs
        assert list(prompt_logprobs.token_ids) == prompts[2]
        assert not prompt_logprobs.token_logprobs[0].HasField("value")
        assert all(entry.HasField("value") for entry in prompt_logprobs.token_logprobs[1:])
    replica.wait_idle()


@pytest.mark.parametrize(("request_", "field"), [
    (pb.GenerateRequest(request_id="t"), "input"),
    (pb.GenerateRequest(request_id="t", text=""), "text"),
    (pb.GenerateRequest(request_id="t", tokenized=pb.TokenizedInput(input_ids=[])), "tokenized"),
    (generate("s", [1, 2, 3], stop=["x" * 1025]), "stop"),
    (generate("t", [1, 2, 3], temperature=-1.0), "temperature"),
    (generate("l", [1, 2, 3], logprobs=-1), "logprobs"),
    # The bounds every front door shares (SamplingParams'):
    (generate("l", [1, 2, 3], logprobs=21), "logprobs"),
    (generate("i", [1, 2, 3], stop_token_ids=list(range(257))), "stop_token_ids"),
    (generate("b", [1, 2, 3], logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
])
def test_what_it_cannot_honour_is_invalid_argument_naming_the_field(replica, request_, field) -> None:
    with pytest.raises(grpc.RpcError) as error:
        list(replica.stub.Generate(request_))
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field), error.value.details()


def test_abort_ends_the_stream_and_a_vanished_client_aborts_its_request(replica, prompts) -> None:
    long = dict(max_tokens=100)
    stream = replica.stub.Generate(generate("to-abort", prompts[0], stream=True, **long))
    assert next(stream).chunk.token_ids
    replica.stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]))
    assert [r.complete.finish_reason for r in stream if r.HasField("complete")] == ["abort"]
    replica.wait_idle()

    stream = replica.stub.Generate(generate("to-cancel", prompts[0], stream=True, **long))
    assert next(stream).chunk.token_ids
    stream.cancel()
    replica.wait_idle()


def test_model_info_loads_health_and_reflection(replica) -> None:
    info = replica.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.max_context_length, info.vocab_size, info.is_generation) == (128, 49152, True)
    assert list(info.eos_token_ids) == list(replica.loop.core.eos_token_ids)
    [load] = replica.stub.GetLoads(pb.GetLoadsRequest()).loads
    assert (load.num_running_reqs, load.num_waiting_reqs, load.max_total_num_tokens) == (0, 0, 8 * BLOCK_SIZE)
    assert replica.stub.HealthCheck(pb.HealthCheckRequest()).healthy

    reflection = reflection_pb2_grpc.ServerReflectionStub(replica.channel)
    [answer] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    assert SERVICE_NAME in {service.name for service in answer.list_services_response.service}


def test_kv_events_show_stores_and_evictions_and_resume_without_a_gap(replica, prompts) -> None:
    seen: list[smg.KvEventBatch] = []
    # From batch 1: whatever ran before is replayed, so no race with the subscription's start.
    subscription = replica.stub.SubscribeKvEvents(smg.SubscribeKvEventsRequest(start_sequence_number=1))

    def read() -> None:
        try:
            seen.extend(subscription)
        except grpc.RpcError as error:  # the cancel below ends it
            assert error.code() is grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    list(replica.stub.Generate(generate("kv", prompts[3])))  # 20 tokens: one full block
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompts[3], BLOCK_SIZE, b"")
    expected = block_hash_int64(hashes[0])
    # 110 prompt tokens take 7 of the 8 blocks and then more: the cached block goes.
    list(replica.stub.Generate(generate("evict", prompts[4], max_tokens=NEW_TOKENS)))
    replica.wait_idle()
    time.sleep(0.2)
    subscription.cancel()
    reader.join(5)

    events = [event for batch in seen for event in batch.events]
    stored = [block.block_hash for e in events if e.HasField("stored") for block in e.stored.blocks]
    removed = [h for e in events if e.HasField("removed") for h in e.removed.block_hashes]
    assert expected in stored and expected in removed
    assert stored.index(expected) < len(stored)
    numbers = [batch.sequence_number for batch in seen]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))

    assert numbers[0] == 1
    # A subscriber resuming midway gets every batch from there, in order, then live ones.
    middle = len(seen) // 2
    resumed = replica.stub.SubscribeKvEvents(
        smg.SubscribeKvEventsRequest(start_sequence_number=seen[middle].sequence_number))
    again = [next(resumed) for _ in seen[middle:]]
    list(replica.stub.Generate(generate("after", prompts[3])))  # its block is cached again: a live batch
    live = next(resumed)
    resumed.cancel()
    assert again == seen[middle:]
    assert live.sequence_number == numbers[-1] + 1


def _received_tokenizer(stub: pb_grpc.VllmEngineStub, directory) -> set[str]:
    received = list(stub.GetTokenizer(smg.GetTokenizerRequest()))
    assert received[-1].sha256 and not any(chunk.sha256 for chunk in received[:-1])
    directory.mkdir()
    unpack(((chunk.data, chunk.sha256) for chunk in received), directory)
    return {path.name for path in directory.iterdir()}


def test_get_tokenizer_streams_the_tokenizer_files(replica, tokenizer, tmp_path) -> None:
    # A GGUF keeps its tokenizer inside the weights: it is sent as HF files, chat template included.
    sent = _received_tokenizer(replica.stub, tmp_path / "from-gguf")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= sent
    received = Tokenizer.from_files(tmp_path / "from-gguf", "smollm2")
    assert received.encode(TEXT[:2000]) == tokenizer.encode(TEXT[:2000])
    chat = [{"role": "user", "content": "Hi"}]
    assert received.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)

    # --tokenizer names a HF directory: its tokenizer is sent, never the weights beside it.
    source = tmp_path / "tokenizer"
    source.mkdir()
    tokenizer.save_pretrained(source)
    (source / "model.safetensors").write_bytes(b"weights")
    config = EngineConfig(**ENGINE, tokenizer=str(source))
    loop = SimpleNamespace(core=SimpleNamespace(config=config))  # GetTokenizer reads no engine state
    server = start_vllm_engine_server(
        VllmEngineServicer(loop, OutputHub(), None, EngineText.for_engine(config), lambda: True, "smollm2",
                           "smollm2"), "127.0.0.1:0")
    try:
        with grpc.insecure_channel(server.address) as channel:
            sent = _received_tokenizer(pb_grpc.VllmEngineStub(channel), tmp_path / "unpacked")
    finally:
        server.stop(0)
    assert "tokenizer.json" in sent and "model.safetensors" not in sent
    assert Tokenizer.from_files(tmp_path / "unpacked", "x").encode(TEXT[:2000]) == tokenizer.encode(TEXT[:2000])


def test_a_text_prompt_is_tokenized_as_a_completion_prompt(replica, tokenizer, prompts) -> None:
    text = tokenizer.decode(prompts[1])
    request = generate("text", [])
    request.text = text  # the input oneof: text instead of tokenized
    [by_text] = replica.stub.Generate(request)
    [by_ids] = replica.stub.Generate(generate("ids", tokenizer.encode(text)))
    assert list(by_text.complete.output_ids) == list(by_ids.complete.output_ids)
    assert by_text.complete.prompt_tokens == len(tokenizer.encode(text))
    replica.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_output_and_frees_the_request(replica, tokenizer, prompts, stream) -> None:
    """The stop string is chosen from what greedy decoding says after a few tokens; the
    output ends at the token that completes it, and the engine stops running it."""
    [full] = replica.stub.Generate(generate("full", prompts[3], max_tokens=24))
    full_ids = list(full.complete.output_ids)
    text = tokenizer.decode(full_ids)
    stop = text[len(tokenizer.decode(full_ids[:6])):][:3]
    assert stop.strip(), text
    ends = next(i for i in range(1, len(full_ids) + 1) if stop in tokenizer.decode(full_ids[:i]))
    responses = list(replica.stub.Generate(generate(f"stop-{stream}", prompts[3], stream=stream, max_tokens=24,
                                                    n=2, stop=["never said", stop])))
    completes = sorted((r.complete for r in responses if r.HasField("complete")), key=lambda c: c.index)
    assert len(completes) == 2
    for complete in completes:
        assert (complete.finish_reason, complete.matched_stop_str) == ("stop", stop)
        assert complete.completion_tokens == ends
        if not stream:
            assert list(complete.output_ids) == full_ids[:ends]
    if stream:
        for index in (0, 1):
            streamed = [t for r in responses if r.HasField("chunk") and r.chunk.index == index
                        for t in r.chunk.token_ids]
            assert streamed == full_ids[:ends]
    replica.wait_idle()  # aborted at the stop string, not run to max_tokens


def test_scheduler_role_serves_the_engine_protocol_on_its_engine_port(prompts, reference) -> None:
    """`kvfleet scheduler --engine-port` as a process, over a worker role process."""
    flags = ["--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks-override", "8"]
    worker_port, engine_port = free_port(), free_port()
    worker = RoleProcess("worker", *flags, "--port", str(worker_port))
    scheduler = RoleProcess("scheduler", *flags, "--port", "0", "--worker-address", f"127.0.0.1:{worker_port}",
                            "--engine-port", str(engine_port))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{engine_port}") as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            grpc.channel_ready_future(channel).result(timeout=120)
            assert stub.HealthCheck(pb.HealthCheckRequest()).healthy, scheduler.log_tail()
            [response] = stub.Generate(generate("process", prompts[0]))
            assert list(response.complete.output_ids) == reference[0]
        assert scheduler.stop() == 0, scheduler.log_tail()
        assert not scheduler.imported_torch()  # the protocol's stubs are protobuf alone
    finally:
        scheduler.kill()
        worker.kill()


def test_every_sampling_field_maps_to_kvfleets_and_proto_zeros_mean_unset() -> None:
    message = pb.SamplingParams(
        temperature=0.5, top_p=0.75, top_k=40, min_p=0.0625, frequency_penalty=0.125, presence_penalty=0.25,
        repetition_penalty=1.25, max_tokens=20, min_tokens=2, stop_token_ids=[7], ignore_eos=True, n=2, logprobs=3,
        prompt_logprobs=1, seed=11, include_stop_str_in_output=True, logit_bias={5: -1.5}, truncate_prompt_tokens=9,
        skip_special_tokens=True, spaces_between_special_tokens=True, regex="[0-9]+")
    assert sampling_params_from_engine_protocol(message) == SamplingParams(
        # Each float is exact in the protocol's float32.
        temperature=0.5, top_p=0.75, top_k=40, min_p=0.0625, frequency_penalty=0.125, presence_penalty=0.25,
        repetition_penalty=1.25, max_tokens=20, min_tokens=2, stop_token_ids=[7], ignore_eos=True, n=2,
        logprobs=3, prompt_logprobs=1, seed=11, include_stop_str_in_output=True, logit_bias={5: -1.5},
        truncate_prompt_tokens=9, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    defaults = sampling_params_from_engine_protocol(pb.SamplingParams())
    assert (defaults.n, defaults.temperature, defaults.top_p, defaults.repetition_penalty, defaults.max_tokens,
            defaults.logprobs, defaults.seed) == (1, 1.0, 1.0, 1.0, None, None, None)
    choice = sampling_params_from_engine_protocol(pb.SamplingParams(choice=pb.ChoiceConstraint(choices=["yes", "no"])))
    assert choice.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])


def test_a_regex_constraint_shapes_the_output(replica, prompts) -> None:
    [response] = replica.stub.Generate(generate("regex", prompts[0], ignore_eos=False, regex="[0-9]{3}"))
    text = Tokenizer.load(resolve_model("smollm2")).decode(list(response.complete.output_ids))
    assert len(text) == 3 and text.isdigit(), text
    replica.wait_idle()


def test_flush_cache_empties_the_prefix_cache_only_when_idle(replica, prompts) -> None:
    list(replica.stub.Generate(generate("cached", prompts[3])))  # a full block enters the prefix cache
    replica.wait_idle()
    pool = replica.loop.core.scheduler.block_pool
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompts[3], BLOCK_SIZE, b"")
    assert pool.lookup(hashes[:1])
    busy = replica.stub.Generate(generate("busy", prompts[0], stream=True, max_tokens=60))
    next(busy)  # running now
    refused = replica.stub.FlushCache(smg.FlushCacheRequest(timeout_s=0))
    assert not refused.success and "in flight" in refused.message
    waited = replica.stub.FlushCache(smg.FlushCacheRequest(timeout_s=30))  # once "busy" is done
    assert waited.success
    list(busy)
    assert pool.lookup(hashes[:1]) == []


def test_cached_tokens_count_the_prefix_cache_hit(replica, prompts) -> None:
    assert replica.stub.FlushCache(smg.FlushCacheRequest(timeout_s=30)).success
    prompt = prompts[4][:40]  # two full blocks, then the 8 tokens the cache cannot hold yet
    [cold] = replica.stub.Generate(generate("cold", prompt))
    warm = list(replica.stub.Generate(generate("warm", prompt, stream=True)))
    assert cold.complete.cached_tokens == 0
    assert warm[0].chunk.cached_tokens == 2 * BLOCK_SIZE and warm[-1].complete.cached_tokens == 2 * BLOCK_SIZE
    replica.wait_idle()


def test_embed_pools_the_token_ids_through_the_worker_and_refuses_bad_input(replica, prompts) -> None:
    import math

    def embed(request_id: str, ids: list[int]) -> pb.EmbedResponse:
        return replica.stub.Embed(pb.EmbedRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids)))

    first, again, other = embed("e1", prompts[1]), embed("e2", prompts[1]), embed("e3", prompts[2])
    assert (first.embedding_dim, first.prompt_tokens) == (576, len(prompts[1]))
    assert math.isclose(math.fsum(x * x for x in first.embedding), 1.0, abs_tol=1e-4)
    assert list(again.embedding) == pytest.approx(list(first.embedding), abs=1e-5)
    assert math.fsum(a * b for a, b in zip(first.embedding, other.embedding)) < 0.999
    for ids, field in (([], "tokenized"), ([1] * 129, "maximum context length")):
        with pytest.raises(grpc.RpcError) as error:
            embed("bad", ids)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.value.details()
    replica.wait_idle()
