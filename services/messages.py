"""The engine's messages: what the scheduler and its worker exchange every step, the
token deltas every front end reads, and the engine's stats.

Each is a msgspec Struct, the one definition of the message, in process and on the
wire (msgpack; services/transport/rpc.py). Those sent every step are arrays on the
wire (`array_like`: no field names) and untracked by the garbage collector (`gc=False`:
they hold no cycles); the roles of one cluster run one version of these definitions.

Step plans are deltas: a request new to the worker arrives with all its token ids
and blocks once; after that each step carries only its new block ids and its
computed-token count. The worker keeps the rest between steps.
"""
from __future__ import annotations

import msgspec

from services.histogram_counts import HistogramCounts
from services.kv_transfer_messages import KvTransferParams, RemoteBlocks
from services.lora_request import LoRARequest
from services.pooling_params import PoolerConfig
from services.sampling_params import SamplingParams

# Sent every step: field order is the wire format.
_HOT = {"array_like": True, "gc": False, "omit_defaults": True}


class Empty(msgspec.Struct):
    """A call that takes or answers nothing."""


class NewRequestData(msgspec.Struct, **_HOT):
    request_id: str
    # Prompt plus any tokens already generated (a request resumed after preemption).
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None  # the adapter it runs with (docs/lora.md); None: the base model


class CachedRequestData(msgspec.Struct, **_HOT):
    request_id: str
    new_block_ids: list[int]
    # Tokens whose KV the worker already holds; lets the worker check it is in sync.
    num_computed_tokens: int
    # Tokens sampled since the worker last heard of the request (its next inputs).
    new_token_ids: list[int] = []


class KvLoad(msgspec.Struct, **_HOT):
    """Blocks of one request's prefix to fill from the offload tiers
    (docs/kv_connector.md), in chain order: (device block, block hash, host tier block
    or -1 for the file tiers). The request waits until its StepResult.kv_loads_done
    comes back."""

    request_id: str
    blocks: list[tuple[int, bytes, int]]
    # Set when a producer replica holds the blocks (docs/disaggregation.md): each block's
    # third item is then the producer's block id, fetched from its worker.
    remote: RemoteBlocks | None = None


class StepPlan(msgspec.Struct, **_HOT):
    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    # Tokens to compute this step per request, in batch order.
    num_scheduled_tokens: dict[str, int] = {}
    # Finished, aborted or preempted since the last plan: the worker drops their state.
    finished_request_ids: list[str] = []
    # Copy-on-write of forked parallel samples: (source block, destination block),
    # applied first, before anything else can write to either.
    blocks_to_copy: list[tuple[int, int]] = []
    # Swap preemption, applied before the forward pass: (device block, host block)
    # pairs to copy out, then (host block, device block) pairs to copy back in.
    blocks_to_swap_out: list[tuple[int, int]] = []
    blocks_to_swap_in: list[tuple[int, int]] = []
    # The KV connector (docs/kv_connector.md), applied before the forward pass, in this
    # order: loads (their host tier copies at once, their file reads in the background),
    # then (device block, host tier block) copies into the host tier, then full blocks
    # (device block, hash) copied out for the file tiers to write in the background.
    kv_loads: list[KvLoad] = []
    kv_host_saves: list[tuple[int, int]] = []
    kv_file_saves: list[tuple[int, bytes]] = []
    # The worker instance this plan was made for: a restarted worker holds none of the
    # state the deltas build on, so it must refuse the plan rather than run it.
    worker_instance_id: str = ""
    # The scheduler instance that made it: a worker drops the state of a previous one.
    scheduler_instance_id: str = ""
    # Speculative decoding (vLLM's name): per decoding request, the draft tokens appended
    # to its inputs. Its num_scheduled_tokens counts them; the worker verifies them and
    # returns the accepted ones plus one token in sampled_token_ids.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Speculative decoding by the worker's draft model or EAGLE head: the requests whose
    # drafts the scheduler holds back (scheduler_svc/spec_gate.py), for which the worker
    # drafts one token after this step, the first draft they are judged by, not k.
    draft_probes: list[str] = []
    # Prefill/decode handoffs (docs/disaggregation.md): blocks now held for a consumer, per
    # request, which the worker may serve; and holds that ended (fetched, or timed out),
    # whose blocks it must serve no more (they go back to the pool with this plan).
    kv_holds: dict[str, list[int]] = {}
    kv_hold_ends: list[str] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class KvTierCounts(msgspec.Struct, **_HOT):
    """One offload tier's work over some steps (the worker's side of the KV connector)."""

    medium: str  # CPU (host memory), DISK (--kv-offloading-dir) or SHARED (--kv-shared-dir)
    stored_blocks: int = 0
    stored_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    failed: int = 0  # bad files read and writes that failed: misses, recomputed
    load_seconds: list[float] = []  # one per request's load from this tier
    evicted_hashes: list[bytes] = []  # a file tier's evictions, for the KV events

    def add(self, other: KvTierCounts) -> None:
        for name in self.__struct_fields__[1:]:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class StepResult(msgspec.Struct, **_HOT):
    step_id: int
    # Only the requests that reached the end of their known tokens get a token.
    sampled_token_ids: dict[str, list[int]] = {}
    # For requests that asked for logprobs: per sampled token, {token id: logprob}
    # holding the top-`logprobs` tokens (best first) and the sampled one.
    logprobs: dict[str, list[dict[int, float]]] = {}
    # For requests that asked for prompt_logprobs: entries for the prompt positions
    # computed this step (position p holds the logprob of prompt token p + 1).
    prompt_logprobs: dict[str, list[dict[int, float]]] = {}
    # Loads finished since the last result: per request, how many leading blocks of its
    # KvLoad arrived whole (the rest are recomputed).
    kv_loads_done: dict[str, int] = {}
    # What the offload tiers did since the last result, per medium.
    kv_tiers: list[KvTierCounts] = []
    # Held requests whose blocks a consumer fetched since the last result: their blocks
    # can go (docs/disaggregation.md).
    kv_sent_done: list[str] = []
    # Pooling requests whose prompt this step finished: their pooled vector (docs/pooling.md).
    pooled: dict[str, list[float]] = {}
    # Speculative decoding's draft_model, eagle and eagle3 methods: per request that sampled,
    # the draft model's (or EAGLE head's) tokens to follow them, for the scheduler to verify in the next step.
    draft_token_ids: dict[str, list[int]] = {}


class WorkerDescription(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the scheduler needs to know about the worker group it drives."""

    num_kv_blocks: int
    num_host_blocks: int  # the swap pool
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # New for every worker process: tells a restarted worker (empty KV cache) from the old one.
    instance_id: str
    # Plans the group works on at once (its pipeline stages): the scheduler keeps this many in flight.
    max_plans_in_flight: int = 1
    # The KV connector's tiers (docs/kv_connector.md): host tier blocks, and the key under
    # which the file tiers keep this model's blocks ("" without file tiers).
    num_offload_blocks: int = 0
    kv_layout_key: str = ""
    # One block's KV over every layer, in bytes (what a prefill/decode handoff moves a block).
    kv_block_bytes: int = 0
    # Set when the group pools (docs/pooling.md): how. `generates` False: it pools only (--runner pooling).
    pooler: PoolerConfig | None = None
    generates: bool = True
    # An encoder: every token attends to every other, so a prompt is computed whole in one
    # step (no chunked prefill) and no KV is kept (no prefix cache).
    bidirectional: bool = False


class FirstTokenTimes(msgspec.Struct, frozen=True, **_HOT):
    """How a request reached its first token, measured by the scheduler: durations on its
    own clock, since the front end's may be another host's."""

    queued_s: float  # from arrival at the scheduler to being first scheduled
    prefill_s: float  # from being first scheduled to the first token
    # Prefill/decode disaggregation (docs/disaggregation.md): the part of prefill_s spent
    # fetching the prompt's KV from a producer; and the producer's own queue and prefill
    # times, which the gateway adds from the prefill leg.
    kv_transfer_s: float = 0.0
    remote_queued_s: float = 0.0
    remote_prefill_s: float = 0.0


class TokenDelta(msgspec.Struct, **_HOT):
    """New tokens of one request after a step, as streamed to the request's front end."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # set on the request's last delta
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None  # one entry per new token, when asked for
    # On the first delta, when asked for: one entry per prompt token after the first.
    prompt_logprobs: list[dict[int, float]] | None = None
    first_token_times: FirstTokenTimes | None = None  # on the delta with the first token
    # On the delta with the first token: prompt tokens the prefix cache supplied (vLLM's num_cached_tokens).
    num_cached_tokens: int = 0
    # On a final "abort" delta: the failure that ended the request, if one did; `lost`:
    # a failure of what carried it (a worker or scheduler gone), not of the request.
    error: str = ""
    lost: bool = False
    # On the final delta of a request that asked a producer to hold its KV: where the
    # blocks wait (vLLM's kv_transfer_params in the response).
    kv_transfer_params: KvTransferParams | None = None
    # A pooling request's one delta: its pooled vector (no tokens; finish_reason "stop").
    pooled: list[float] | None = None


class CacheConfigInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """The KV cache's configuration, as the labels of vLLM's vllm:cache_config_info
    (the names of vLLM's CacheConfig fields)."""

    block_size: int
    num_gpu_blocks: int  # the KV blocks of the worker group, on whatever device
    num_cpu_blocks: int  # the host pool that swap preemption copies to
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    swap_space: float  # GiB
    num_gpu_blocks_override: int | None
    cache_dtype: str


class KvTierStats(msgspec.Struct, omit_defaults=True):
    """One offload tier's counters since the scheduler started (KvTierCounts summed)."""

    medium: str
    stored_blocks: int
    stored_bytes: int
    loaded_blocks: int
    loaded_bytes: int
    evicted_blocks: int
    evicted_bytes: int
    failed: int
    load_seconds: HistogramCounts


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Speculative decoding's counters since the scheduler started, as vLLM's: verification
    steps of a request given drafts, draft tokens, accepted drafts (the bonus token is not
    one), and accepted drafts by position in the draft (index 0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []


class LoraStats(msgspec.Struct, omit_defaults=True):
    """Which adapters the scheduler's requests run with: vllm:lora_requests_info's labels."""

    max_lora: int
    running: list[str] = []  # adapter names of the running requests, each once
    waiting: list[str] = []


class EngineStats(msgspec.Struct, omit_defaults=True):
    """A scheduler's gauges, counters and histograms, exported with vLLM's metric names."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float  # used blocks / total blocks
    num_preemptions: int  # counter
    num_kv_blocks: int
    prefix_cache_queries: int  # counter, in tokens
    prefix_cache_hits: int  # counter, in tokens
    # Per engine step that sampled tokens: the prompt tokens of the requests that got their
    # first token, plus the tokens sampled (vllm:iteration_tokens_total, as vLLM counts them).
    iteration_tokens: HistogramCounts
    cache_config: CacheConfigInfo | None  # None: no engine known yet (a cluster still starting)
    # The KV connector's offload tiers: prompt tokens looked up in them and found there
    # (vLLM's external prefix cache), and each tier's counters.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_tiers: list[KvTierStats] = []
    spec_decoding: SpecDecodingStats | None = None  # None: no speculative decoding configured
    # Prompt tokens by where their KV came from, counted at each request's first token
    # (vLLM's vllm:prompt_tokens_by_source: local_compute, local_cache_hit, external_kv_transfer).
    prompt_tokens_by_source: dict[str, int] = {}
    kv_transfer: KvTransferStats | None = None  # None: no --kv-transfer-config
    lora: LoraStats | None = None  # None: LoRA not enabled


class KvTransferStats(msgspec.Struct, omit_defaults=True):
    """A replica's prefill/decode handoffs (docs/disaggregation.md): per fetch, the bytes
    that arrived and the seconds it took (vLLM's nixl_bytes_transferred and
    nixl_xfer_time_seconds); holds no consumer fetched in time, blocks that did not arrive
    (recomputed), and blocks held for consumers now."""

    bytes_transferred: HistogramCounts
    xfer_time_seconds: HistogramCounts
    expired_requests: int = 0
    failed_blocks: int = 0
    held_blocks: int = 0


class EngineInfo(msgspec.Struct, frozen=True):
    """What a front end must know of the engine to validate requests."""

    max_model_len: int
    eos_token_ids: tuple[int, ...]  # what ends a sequence (and a beam in beam search)
    # Set when the engine pools (--runner pooling) rather than generates.
    pooler: PoolerConfig | None = None
