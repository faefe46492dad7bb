"""The worker and scheduler roles over real gRPC on 127.0.0.1, with the real smollm2 in
float32: greedy tokens equal the in-process engine's (preemption included), a client
with nothing but grpc and the service's description streams a completion, bad input is
INVALID_ARGUMENT naming the parameter, failures end requests explicitly, and no block
leaks. The servers run in this process, on threads, over one module Worker."""
from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc import server as scheduler_server
from scheduler_svc.engine_core import EngineCore, WorkerLost
from scheduler_svc.output_hub import OutputHub
from scheduler_svc.server import start_scheduler_server
from scheduler_svc.step_loop import StepLoop
from scheduler_svc.worker_client import RemoteWorker
from services.config import EngineConfig
from services.messages import TokenDelta
from services.model_source import resolve_model
from services.sampling_params import SamplingParams
from services.scheduler_messages import AbortRequest, StatsRequest, StepOutputs, StreamOutputsRequest, SubmitRequest
from services.transport.role_services import SCHEDULER
from services.transport.server import RoleServer
from tokenizer_svc.tokenizer import Tokenizer
from worker_svc import server as worker_server
from worker_svc.runtime.worker import Worker
from worker_svc.server import start_worker_server

from corpus import TEXT

# 8 blocks of 16 tokens hold 128; the six prompts below need 168 with their outputs,
# so a request is preempted (and recomputed).
ENGINE = dict(dtype="float32", num_gpu_blocks_override=8, max_model_len=128)
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ids = Tokenizer.load(resolve_model("smollm2")).encode(TEXT)
    return [ids[start:start + length] for start, length in [(0, 5), (40, 10), (90, 15), (7, 20), (150, 30), (60, 40)]]


@pytest.fixture(scope="module")
def worker() -> Worker:
    return Worker(EngineConfig(**ENGINE))


@pytest.fixture(scope="module")
def worker_srv(worker: Worker) -> Iterator[RoleServer]:
    server = start_worker_server(worker, "127.0.0.1:0")
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def reference(worker: Worker, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the in-process engine over the same Worker object."""
    return run_engine(EngineCore(EngineConfig(**ENGINE), worker=worker), prompts)


class Cluster:
    """A scheduler server driving the module worker through its gRPC server."""

    def __init__(self, worker_address: str) -> None:
        self.hub = OutputHub()
        self.remote = RemoteWorker(worker_address)
        self.loop = StepLoop(EngineCore(EngineConfig(**ENGINE), self.remote), self.hub)
        self.server = start_scheduler_server(self.loop, self.hub, "127.0.0.1:0")
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = SCHEDULER.stub(self.channel)

    def open_stream(self, gateway_id: str) -> grpc.Future:
        outputs = self.stub.StreamOutputs(StreamOutputsRequest(gateway_id))
        assert not next(outputs).deltas  # the subscription is live
        return outputs

    def submit(self, request_id: str, prompt: list[int], gateway_id: str = "g", resumed: list[int] = (),
               **params) -> None:
        sampling = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "max_tokens": None, **params})
        self.stub.Submit(SubmitRequest(request_id, prompt, sampling, gateway_id, output_token_ids=list(resumed)))

    def submit_payload(self, fields: dict) -> None:
        """Submits a payload built by hand: values SubmitRequest would refuse to build."""
        self.channel.unary_unary(f"/{SCHEDULER.name}/Submit")(msgspec.msgpack.encode(fields))

    def settle(self, worker: Worker) -> None:
        """Idle, and the step that told the worker to drop the last requests has returned:
        the loop takes a command only between steps, so its answer comes after that step's."""
        wait_idle(self.loop.core, worker)
        assert self.loop.check_worker().result(timeout=10)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)
        self.remote.close()


@pytest.fixture(scope="module")
def cluster(worker_srv: RoleServer) -> Iterator[Cluster]:
    running = Cluster(worker_srv.address)
    yield running
    running.close()


@pytest.fixture
def idle_after(cluster: Cluster, worker: Worker) -> Iterator[None]:
    yield
    wait_idle(cluster.loop.core, worker)


def run_engine(core: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), prompt, GREEDY)
    tokens: dict[str, list[int]] = {str(index): [] for index in range(len(prompts))}
    while core.has_work:
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
    return list(tokens.values())


def wait_idle(core: EngineCore, worker: Worker, timeout_s: float = 10.0) -> None:
    """Once the engine has nothing left to do, every block is free and the worker holds nothing."""
    deadline = time.monotonic() + timeout_s
    while core.has_work or worker.requests:
        assert time.monotonic() < deadline, f"not idle: {list(core.scheduler.requests)}, {list(worker.requests)}"
        time.sleep(0.01)
    pool = core.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks, f"{pool.num_used_blocks} blocks leaked"


def read_until_finished(
    outputs, request_ids: set[str], messages: list[StepOutputs] | None = None
) -> dict[str, list[TokenDelta]]:
    """Each request's deltas, read from the stream until all have finished; the
    messages read are appended to `messages` when given."""
    deltas: dict[str, list[TokenDelta]] = {request_id: [] for request_id in request_ids}
    pending = set(request_ids)
    while pending:
        message = next(outputs)
        if messages is not None:
            messages.append(message)
        for delta in message.deltas:
            deltas[delta.request_id].append(delta)
            if delta.finish_reason is not None:
                pending.remove(delta.request_id)
    return deltas


def tokens_of(deltas: list[TokenDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.new_token_ids]


# -- the worker role ---------------------------------------------------------------------


def test_remote_worker_matches_the_in_process_llm(make_llm, worker, worker_srv, prompts) -> None:
    llm = make_llm(**ENGINE)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = [output.outputs[0].token_ids for output in outputs]
    assert llm.engine.scheduler.num_preemptions > 0

    remote = RemoteWorker(worker_srv.address)
    core = EngineCore(EngineConfig(**ENGINE), worker=remote)
    try:
        assert run_engine(core, prompts) == expected
    finally:
        remote.close()
    assert core.scheduler.num_preemptions == llm.engine.scheduler.num_preemptions
    wait_idle(core, worker)


# -- the scheduler role ------------------------------------------------------------------


def stub_generate(address: str, prompt_token_ids: list[int]) -> list[int]:
    """A client built of nothing but grpc and the service's description, as docs/cluster.md's
    example is (tests/system/test_readme.py runs that one as written, against `cluster up`)."""
    import grpc

    from services.sampling_params import SamplingParams
    from services.scheduler_messages import StreamOutputsRequest, SubmitRequest
    from services.transport.role_services import SCHEDULER

    with grpc.insecure_channel(address) as channel:
        scheduler = SCHEDULER.stub(channel)
        outputs = scheduler.StreamOutputs(StreamOutputsRequest(gateway_id="stub"))
        next(outputs)  # the stream is live: Submits for this gateway are accepted from now on
        scheduler.Submit(SubmitRequest(
            request_id="stub-1",
            prompt_token_ids=prompt_token_ids,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            gateway_id="stub",
        ))
        tokens = []
        for message in outputs:
            for delta in message.deltas:
                tokens.extend(delta.new_token_ids)
                if delta.finish_reason is not None:
                    outputs.cancel()  # reading on after cancel() would raise CANCELLED
                    return tokens
        raise AssertionError("the stream ended before the request finished")


def test_plain_stub_client_streams_a_completion(cluster, prompts, reference, idle_after) -> None:
    assert stub_generate(cluster.server.address, prompts[2]) == reference[2]


def test_a_batch_streams_one_message_per_step(cluster, prompts, reference, idle_after) -> None:
    outputs = cluster.open_stream("g")
    for index, prompt in enumerate(prompts):
        cluster.submit(str(index), prompt, max_tokens=NEW_TOKENS)
    messages: list[StepOutputs] = []
    deltas = read_until_finished(outputs, {str(index) for index in range(len(prompts))}, messages)
    outputs.cancel()
    assert [tokens_of(deltas[str(index)]) for index in range(len(prompts))] == reference
    # A message carries a whole step's deltas: several requests' tokens at once.
    assert max(len({delta.request_id for delta in message.deltas}) for message in messages) > 1
    assert len(messages) < sum(map(len, reference)) / 2
    assert all(d[-1].finish_reason == "length" and not d[-1].error for d in deltas.values())
    assert cluster.loop.stats().num_preemptions > 0


def test_a_resumed_request_continues_as_if_uninterrupted(cluster, prompts, reference, idle_after) -> None:
    """What a gateway sends when it migrates a request: the tokens generated so far, as
    output. Greedy and seeded sampling both go on with the tokens an uninterrupted run
    gives (a seeded row's noise depends on its seed and output position alone)."""
    outputs = cluster.open_stream("resume")
    cluster.submit("whole", prompts[1], "resume", max_tokens=NEW_TOKENS, temperature=0.9, seed=11)
    sampled = tokens_of(read_until_finished(outputs, {"whole"})["whole"])
    cluster.submit("greedy", prompts[0], "resume", resumed=reference[0][:3], max_tokens=NEW_TOKENS)
    cluster.submit("seeded", prompts[1], "resume", resumed=sampled[:3], max_tokens=NEW_TOKENS, temperature=0.9, seed=11)
    resumed = read_until_finished(outputs, {"greedy", "seeded"})
    assert tokens_of(resumed["greedy"]) == reference[0][3:]
    assert tokens_of(resumed["seeded"]) == sampled[3:]
    assert resumed["greedy"][-1].finish_reason == "length"
    for bad, params in ((list(range(NEW_TOKENS)), {}), ([1], {"n": 2})):  # nothing left to do; not one sequence
        with pytest.raises(grpc.RpcError) as refused:
            cluster.submit("bad", prompts[0], "resume", resumed=bad, max_tokens=NEW_TOKENS, **params)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("output_token_ids")
    outputs.cancel()


def test_health_reports_serving(cluster, worker_srv) -> None:
    for server, service in [(worker_srv, worker_server.SERVICE_NAME), (cluster.server, scheduler_server.SERVICE_NAME)]:
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
                assert status == health_pb2.HealthCheckResponse.SERVING, (server.address, name)


@pytest.mark.parametrize(
    ("request_fields", "code", "param"),
    [
        ({"prompt_token_ids": [5] * 129}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),  # max_model_len is 128
        ({"prompt_token_ids": [5, 49152]}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),  # outside the vocabulary
        ({"sampling_params": {"temperature": -1.0}}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"sampling_params": {"max_tokens": 0}}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ({"sampling_params": {"n": 3, "best_of": 2}}, grpc.StatusCode.INVALID_ARGUMENT, "best_of"),
        ({"sampling_params": {"top_p": "high"}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p"),
        ({"request_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        ({"gateway_id": "nobody-listens"}, grpc.StatusCode.FAILED_PRECONDITION, "gateway_id"),
    ],
)
def test_bad_input_is_rejected_by_name_and_serving_goes_on(
    cluster, prompts, reference, idle_after, request_fields, code, param
) -> None:
    outputs = cluster.open_stream("g")
    fields = {"request_id": "bad", "prompt_token_ids": prompts[0], "gateway_id": "g", "sampling_params": {},
              **request_fields}
    with pytest.raises(grpc.RpcError) as caught:
        cluster.submit_payload(fields)
    assert caught.value.code() == code and caught.value.details().startswith(f"{param}: "), caught.value.details()
    cluster.submit("good", prompts[0], max_tokens=NEW_TOKENS)
    assert tokens_of(read_until_finished(outputs, {"good"})["good"]) == reference[0]
    outputs.cancel()


def test_a_live_request_id_cannot_be_reused(cluster, prompts, idle_after) -> None:
    outputs = cluster.open_stream("g")
    cluster.submit("twice", prompts[0], max_tokens=50)
    with pytest.raises(grpc.RpcError) as caught:
        cluster.submit("twice", prompts[1])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("request_id: ")
    cluster.stub.Abort(AbortRequest("twice"))
    assert read_until_finished(outputs, {"twice"})["twice"][-1].finish_reason == "abort"
    outputs.cancel()


def test_parallel_samples_stream_under_child_ids_and_abort_together(cluster, prompts, reference, idle_after) -> None:
    outputs = cluster.open_stream("g")
    cluster.submit("par", prompts[2], max_tokens=NEW_TOKENS, n=3)
    children = {f"par#{index}" for index in range(3)}
    deltas = read_until_finished(outputs, children)
    assert [tokens_of(deltas[child]) for child in sorted(children)] == [reference[2]] * 3  # greedy: alike
    cluster.submit("par-long", prompts[3], max_tokens=100, n=2, best_of=3)
    while not any(delta.new_token_ids for delta in next(outputs).deltas):
        pass
    cluster.stub.Abort(AbortRequest("par-long"))  # the parent's id: every child
    ended = read_until_finished(outputs, {f"par-long#{index}" for index in range(3)})
    assert {d[-1].finish_reason for d in ended.values()} == {"abort"}
    outputs.cancel()


def test_abort_ends_a_request_on_its_stream(cluster, prompts, idle_after) -> None:
    outputs = cluster.open_stream("g")
    cluster.submit("long", prompts[1], max_tokens=100)
    while not any(delta.new_token_ids for delta in next(outputs).deltas):
        pass
    cluster.stub.Abort(AbortRequest("long"))
    cluster.stub.Abort(AbortRequest("never-submitted"))  # a no-op
    [last] = read_until_finished(outputs, {"long"})["long"][-1:]
    assert last.finish_reason == "abort" and not last.error
    outputs.cancel()


def test_a_gateway_that_leaves_has_its_requests_aborted(cluster, worker, prompts) -> None:
    outputs = cluster.open_stream("leaver")
    cluster.submit("orphan", prompts[1], gateway_id="leaver", max_tokens=100)
    while not any(delta.new_token_ids for delta in next(outputs).deltas):
        pass
    outputs.cancel()
    wait_idle(cluster.loop.core, worker)  # long before its 100 tokens
    # The engine thread publishes its stats just after the abort: give it that moment.
    deadline = time.monotonic() + 5
    while (stats := cluster.stub.Stats(StatsRequest())).num_requests_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (stats.num_requests_running, stats.num_requests_waiting, stats.num_kv_blocks) == (0, 0, 8)


def test_a_lost_worker_ends_requests_with_an_error_and_the_loop_goes_on(worker, prompts, reference) -> None:
    lost = start_worker_server(worker, "127.0.0.1:0")
    cluster = Cluster(lost.address)
    restarted = None
    try:
        outputs = cluster.open_stream("g")
        for index in range(2):
            cluster.submit(f"long-{index}", prompts[index], max_tokens=100)
        while not any(delta.new_token_ids for delta in next(outputs).deltas):
            pass
        lost.stop(0)
        for deltas in read_until_finished(outputs, {"long-0", "long-1"}).values():
            assert deltas[-1].finish_reason == "abort"
            assert "unreachable" in deltas[-1].error and deltas[-1].lost, deltas[-1]  # a 503: nothing was wrong with it
        # With no worker to run them, new requests are refused at once, explicitly.
        with pytest.raises(grpc.RpcError) as caught:
            cluster.submit("refused", prompts[0])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "unavailable" in caught.value.details()
        restarted = start_worker_server(worker, f"127.0.0.1:{lost.port}")
        submit_until_accepted(cluster, "after", prompts[0])
        assert tokens_of(read_until_finished(outputs, {"after"})["after"]) == reference[0]
        outputs.cancel()
        wait_idle(cluster.loop.core, worker)
    finally:
        cluster.close()
        if restarted is not None:
            restarted.stop(0)


def submit_until_accepted(cluster: Cluster, request_id: str, prompt: list[int], timeout_s: float = 15.0) -> None:
    """Until the scheduler sees the worker again, Submit is UNAVAILABLE."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return cluster.submit(request_id, prompt, max_tokens=NEW_TOKENS)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc.details()
            time.sleep(0.1)


def reachable(remote: RemoteWorker) -> bool:
    try:
        remote.describe()
    except WorkerLost:
        return False
    return True


def test_a_restarted_worker_is_taken_up_with_an_empty_cache(worker, prompts, reference) -> None:
    """A worker that restarts between steps holds no KV: the scheduler must notice
    before reusing its cached prefixes, fail what ran there, and start over clean."""
    first = start_worker_server(worker, "127.0.0.1:0")
    cluster = Cluster(first.address)
    restarted = fresh = None
    try:
        outputs = cluster.open_stream("g")
        cluster.submit("before", prompts[5], max_tokens=NEW_TOKENS)  # 40 tokens: two full blocks enter the prefix cache
        assert tokens_of(read_until_finished(outputs, {"before"})["before"]) == reference[5]
        cluster.settle(worker)  # stopping the server mid-step would lose the worker before it restarts
        first.stop(0)
        fresh = Worker(EngineConfig(**ENGINE))
        restarted = start_worker_server(fresh, f"127.0.0.1:{first.port}")
        # Once the channel is back the scheduler's next plan reaches the new worker, which refuses it.
        deadline = time.monotonic() + 15
        while not reachable(cluster.remote):
            assert time.monotonic() < deadline, "the restarted worker is not reachable"
            time.sleep(0.1)
        cluster.submit("stale", prompts[5], max_tokens=NEW_TOKENS)
        [last] = read_until_finished(outputs, {"stale"})["stale"][-1:]
        assert last.finish_reason == "abort" and "restarted" in last.error, last.error
        cluster.submit("after", prompts[5], max_tokens=NEW_TOKENS)
        assert tokens_of(read_until_finished(outputs, {"after"})["after"]) == reference[5]
        outputs.cancel()
        wait_idle(cluster.loop.core, fresh)
    finally:
        cluster.close()
        for server in (first, restarted):
            if server is not None:
                server.stop(0)
