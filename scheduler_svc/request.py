"""The scheduler's view of one request: its tokens, blocks and progress."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # KV dropped; recomputed when resumed
    SWAPPED = "swapped"  # KV copied to the host pool; copied back when resumed
    LOADING_KV = "loading_kv"  # its prefix's blocks are being loaded from the offload tiers
    AWAITING_FORK = "awaiting_fork"  # a parallel sample waiting for its leader's prompt KV
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Set when the worker has this request's state: later steps send only deltas.
    known_to_worker: bool = False
    num_outputs_on_worker: int = 0  # output tokens the worker has been sent
    # In plans whose results have not come back: their tokens, and the tokens they will sample.
    num_in_flight_tokens: int = 0
    num_ahead_samples: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # its adapter; None: the base model
    # Prefix caching: hashes of the full blocks of all_token_ids, and how many of
    # this request's blocks are indexed in the pool already.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache supplied when first scheduled
    host_block_ids: list[int] = field(default_factory=list)  # while SWAPPED
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # when asked for
    # The draft model's tokens to follow the last step's (speculative decoding's draft_model method).
    draft_token_ids: list[int] = field(default_factory=list)
    # Parallel samples forked from this request once its prompt is computed.
    followers: list[Request] = field(default_factory=list)
    # time.monotonic() at arrival in the scheduler and when first scheduled: the queue
    # and prefill times its first token reports.
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    # vLLM's kv_transfer_params (docs/disaggregation.md): as the request came (cleared once
    # a consumer has started its fetch), and, on a producer, what its final delta tells.
    kv_transfer_params: KvTransferParams | None = None
    kv_transfer_params_out: KvTransferParams | None = None
    num_external_tokens: int = 0  # prompt tokens whose KV was loaded (offload tiers, a producer)
    kv_transfer_s: float = 0.0  # seconds its KV load from a producer took

    @property
    def lora_int_id(self) -> int | None:
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def in_flight(self) -> bool:
        return self.num_in_flight_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
