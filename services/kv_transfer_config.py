"""vLLM's --kv-transfer-config for prefill/decode disaggregation (docs/disaggregation.md):
which side of a KV handoff a replica takes, checked before anything loads.

`kv_role`: `kv_producer` replicas compute prompts' KV and hold it for a decode replica
to fetch (the prefill pool), `kv_consumer` replicas fetch it and decode (the decode
pool), `kv_both` replicas do either. `kv_connector` names the transport of a consumer's
fetches, worker to worker: `KvfleetConnector`, the blocks' bytes in kvfleet's gRPC block
stream; vLLM's `NixlConnector`, the consumer reading them over NIXL (the stream only
names them; services/kv_transfer_messages.py). A producer serves either.

kvfleet's `kv_connector_extra_config` key `pool` (`prefill` or `decode`, kv_both only)
puts a replica that can do either in one pool, its pod's Deployment's, until the planner
moves it to the other (docs/planner.md); without it, a kv_both replica is in both.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

from services.json_flag import json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("KvfleetConnector", "NixlConnector")
# vLLM's keys that mean nothing here (one process per rank, one transport): accepted, unused.
_ACCEPTED_KEYS = ("engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_port",
                  "kv_connector_module_path")
_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_connector_extra_config", *_ACCEPTED_KEYS)
_EXTRA_KEYS = ("abort_timeout_s", "fetch_timeout_s", "pool")
POOLS = ("prefill", "decode")
# How long a producer holds a finished prefill's blocks for its consumer (vLLM's
# VLLM_NIXL_ABORT_REQUEST_TIMEOUT is 480 s; a fetch here starts within one gateway round
# trip of the prefill's end, so a minute is ample and frees a lost handoff's blocks sooner).
DEFAULT_ABORT_TIMEOUT_S = 60.0
# How long a consumer's fetch may take before what has not arrived is recomputed.
DEFAULT_FETCH_TIMEOUT_S = 30.0


def nixl_installed() -> bool:
    """Whether NIXL can be imported here (NixlConnector needs it; the worker serves it where it can)."""
    return importlib.util.find_spec("nixl") is not None


class KvTransferConfigError(ValueError):
    """What is wrong with a kv transfer config, in one line (services.config wraps it)."""


@dataclass(frozen=True)
class KvTransferConfig:
    kv_connector: str
    kv_role: str
    kv_ip: str | None = None  # the host other replicas' workers dial to fetch from this one's worker
    abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    pool: str | None = None  # kv_both: the pool it serves in until moved (None: both)

    @property
    def reads_over_nixl(self) -> bool:
        return self.kv_connector == "NixlConnector"

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def to_json(self) -> str:
        extra = {"abort_timeout_s": self.abort_timeout_s, "fetch_timeout_s": self.fetch_timeout_s}
        if self.pool is not None:
            extra["pool"] = self.pool
        value = {"kv_connector": self.kv_connector, "kv_role": self.kv_role, "kv_connector_extra_config": extra}
        if self.kv_ip is not None:
            value["kv_ip"] = self.kv_ip
        return json.dumps(value)


def parse_kv_transfer_config(value: str | dict) -> KvTransferConfig:
    """A JSON object (the flag's text) or a dict (the SDK's) -> a checked KvTransferConfig."""
    value = json_object(value, _KEYS, '{"kv_connector": "KvfleetConnector", "kv_role": "kv_producer"}',
                        KvTransferConfigError)
    connector = value.get("kv_connector")
    if connector not in CONNECTORS:
        raise KvTransferConfigError(f"kv_connector {connector!r}: choose KvfleetConnector (blocks over gRPC) or "
                                    "NixlConnector (blocks over NIXL)")
    if connector == "NixlConnector" and not nixl_installed():
        raise KvTransferConfigError("kv_connector NixlConnector: NIXL is not installed (pip install --no-deps "
                                    "nixl==1.5.1 nixl-cu12==1.5.1, or cu13 for CUDA 13; KvfleetConnector moves "
                                    "the blocks without it)")
    role = value.get("kv_role")
    if role not in KV_ROLES:
        raise KvTransferConfigError(f"kv_role {role!r}: choose one of {', '.join(KV_ROLES)}")
    extra = value.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise KvTransferConfigError("kv_connector_extra_config: give a JSON object")
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        raise KvTransferConfigError(f"kv_connector_extra_config {', '.join(unknown)}: not supported; kvfleet "
                                    f"takes {', '.join(_EXTRA_KEYS)}")
    timeouts = {}
    for key, default in (("abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S), ("fetch_timeout_s", DEFAULT_FETCH_TIMEOUT_S)):
        seconds = extra.get(key, default)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise KvTransferConfigError(f"kv_connector_extra_config {key} {seconds!r}: give a positive number "
                                        "of seconds")
        timeouts[key] = float(seconds)
    kv_ip = value.get("kv_ip")
    if kv_ip is not None and (not isinstance(kv_ip, str) or not kv_ip):
        raise KvTransferConfigError(f"kv_ip {kv_ip!r}: give a host name or address")
    pool = extra.get("pool")
    if pool is not None and (role != "kv_both" or pool not in POOLS):
        raise KvTransferConfigError(f"kv_connector_extra_config pool {pool!r}: give prefill or decode, with kv_role "
                                    "kv_both (a replica that can serve either pool)")
    return KvTransferConfig(connector, role, kv_ip, **timeouts, pool=pool)
