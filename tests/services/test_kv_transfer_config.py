"""vLLM's --kv-transfer-config: each replica's side of prefill/decode disaggregation,
checked before anything loads (docs/disaggregation.md)."""
from __future__ import annotations

import importlib.util

import pytest

from services.config import ConfigError, EngineConfig


def config(value: object, **engine: object) -> EngineConfig:
    return EngineConfig(kv_transfer_config=value, **engine)


def test_vllm_configs_are_taken_and_kept_as_canonical_json() -> None:
    producer = config('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda"}')
    assert producer.kv_transfer.is_producer and not producer.kv_transfer.is_consumer
    both = config({"kv_connector": "KvfleetConnector", "kv_role": "kv_both", "kv_ip": "10.0.0.7",
                   "kv_connector_extra_config": {"abort_timeout_s": 5}})
    assert both.kv_transfer.is_producer and both.kv_transfer.is_consumer
    assert (both.kv_transfer.kv_ip, both.kv_transfer.abort_timeout_s) == ("10.0.0.7", 5.0)
    assert config(both.kv_transfer_config).kv_transfer == both.kv_transfer  # what the roles' argv carries
    assert config(None).kv_transfer is None and not config(None).has_kv_connector
    # kvfleet's pool for a kv_both replica the planner may move (docs/planner.md)
    pooled = config({"kv_connector": "KvfleetConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"pool": "prefill"}})
    assert pooled.kv_transfer.pool == "prefill" and both.kv_transfer.pool is None
    assert config(pooled.kv_transfer_config).kv_transfer == pooled.kv_transfer


@pytest.mark.parametrize(("value", "engine", "message"), [
    ("{", {}, "not JSON"),
    ('{"kv_connector": "KvfleetConnector", "kv_role": "kv_decoder"}', {},
     "kv_role 'kv_decoder': choose one of kv_producer, kv_consumer, kv_both"),
    ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', {},
     "choose KvfleetConnector (blocks over gRPC) or NixlConnector"),
    ('{"kv_connector": "KvfleetConnector", "kv_role": "kv_both", "kv_lookup": 1}', {}, "kv_lookup: not supported"),
    ('{"kv_connector": "KvfleetConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"abort_timeout_s": 0}}',
     {}, "abort_timeout_s 0: give a positive number of seconds"),
    ('{"kv_connector": "KvfleetConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"pool": "prefill"}}',
     {}, "pool 'prefill': give prefill or decode, with kv_role kv_both"),
    ('{"kv_connector": "KvfleetConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"pool": "both"}}',
     {}, "pool 'both': give prefill or decode"),
    ('{"kv_connector": "KvfleetConnector", "kv_role": "kv_both"}', {"tensor_parallel_size": 2}, "one-rank workers"),
    ('{"kv_connector": "KvfleetConnector", "kv_role": "kv_both"}', {"async_scheduling": True},
     "with --async-scheduling is not supported yet"),
])
def test_a_config_that_cannot_work_is_refused_naming_the_flag(value, engine, message) -> None:
    with pytest.raises(ConfigError, match="--kv-transfer-config") as refused:
        config(value, **engine)
    assert message in str(refused.value)


def test_nixl_is_named_by_vllms_connector_and_refused_where_it_is_not_installed(monkeypatch) -> None:
    reads = config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}').kv_transfer
    assert reads.reads_over_nixl and not config('{"kv_connector": "KvfleetConnector", "kv_role": "kv_consumer"}'
                                                ).kv_transfer.reads_over_nixl
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="NixlConnector: NIXL is not installed"):
        config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}')
