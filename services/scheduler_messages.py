"""The scheduler role's messages: what gateways send it (Submit, Abort, Stats, the token
stream's subscription and replay, KV snapshots) and what it publishes on NATS (each
step's token deltas per gateway, `kvfleet.out.<gateway_id>`, and its prefix cache's
changes, `kvfleet.kv.<instance_id>`). Each is the one definition of its message, in
process and on the wire (msgpack; services/transport/rpc.py).
"""
from __future__ import annotations

import msgspec

from services.invalid_parameter import InvalidParameter
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import TokenDelta
from services.sampling_params import SamplingParams


def _required(**fields: str) -> None:
    for name, value in fields.items():
        if not value:
            raise InvalidParameter(name, "must not be empty")


class SubmitRequest(msgspec.Struct, omit_defaults=True):
    """A request for the engine, as the step loop takes it too."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    gateway_id: str  # whose token stream gets its deltas
    cache_salt: str | None = None
    # Resumed after its replica died (gateway/migration.py): the tokens it generated there.
    output_token_ids: list[int] = []
    # vLLM's kv_transfer_params: hold the prompt's KV for a consumer, or fetch it from a
    # producer (docs/disaggregation.md).
    kv_transfer_params: KvTransferParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (docs/lora.md)

    def __post_init__(self) -> None:
        _required(request_id=self.request_id, gateway_id=self.gateway_id)


class RemoveLoraRequest(msgspec.Struct):
    lora_int_id: int


class SubmitBatchRequest(msgspec.Struct, omit_defaults=True):
    requests: list[SubmitRequest]
    scheduler_instance_id: str = ""  # the process meant; another one refuses the batch


class SubmitResult(msgspec.Struct, omit_defaults=True):
    code: int = 0  # a grpc.StatusCode's number: each request is answered as Submit would
    message: str = ""


class SubmitBatchResponse(msgspec.Struct):
    results: list[SubmitResult]


class AbortRequest(msgspec.Struct):
    request_id: str  # a request's id aborts it and its children; a child's, that child only


class StatsRequest(msgspec.Struct, omit_defaults=True):
    scheduler_instance_id: str = ""


class StreamOutputsRequest(msgspec.Struct):
    gateway_id: str

    def __post_init__(self) -> None:
        _required(gateway_id=self.gateway_id)


class StepOutputs(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One engine step's deltas for one gateway. On NATS each is numbered (`seq`, from 1
    per gateway, by scheduler_svc/replay_window.py); an `announce` carries no deltas, only
    the last number sent, so a gateway can tell it missed the tail."""

    deltas: list[TokenDelta] = []
    scheduler_instance_id: str = ""
    seq: int = 0
    announce: bool = False


class ReplayOutputsRequest(msgspec.Struct, omit_defaults=True):
    gateway_id: str
    after_seq: int
    scheduler_instance_id: str = ""


class TierEvents(msgspec.Struct, omit_defaults=True):
    """One KV offload tier's changes (medium CPU, DISK or SHARED), applied as the device
    pool's are: clear, remove, store. In a snapshot, `stored` is all it holds."""

    medium: str
    cleared: bool = False
    removed: list[bytes] = []
    stored: list[bytes] = []

    def apply_to(self, hashes: set[bytes]) -> None:
        if self.cleared:
            hashes.clear()
        hashes.difference_update(self.removed)
        hashes.update(self.stored)


class NumberedKvEvents(msgspec.Struct, omit_defaults=True):
    """One step's changes to a scheduler's prefix cache, numbered from 1: clear first if
    `cleared`, then drop `removed`, then add `stored` (block hashes, a parent before its
    child); `tiers`, the offload tiers' changes (docs/kv_connector.md)."""

    scheduler_instance_id: str
    seq: int
    cleared: bool = False
    removed: list[bytes] = []
    stored: list[bytes] = []
    tiers: list[TierEvents] = []


class KvSnapshotRequest(msgspec.Struct, omit_defaults=True):
    scheduler_instance_id: str = ""


class KvSnapshotResponse(msgspec.Struct, omit_defaults=True):
    """The block hashes a scheduler holds as of its KV events numbered up to `seq`."""

    seq: int = 0
    block_hashes: list[bytes] = []
    tiers: list[TierEvents] = []  # what each offload tier holds
