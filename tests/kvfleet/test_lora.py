"""LoRA adapters in the SDK (docs/lora.md): greedy tokens equal transformers + PEFT with the
adapter merged, for three adapters and the base model in one batch; bad adapters refused
by name before anything loads; adapters' prefix-cache blocks kept apart."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvfleet import LoRARequest, SamplingParams
from worker_svc.formats.peft_adapter import LoraAdapterError

from conftest import DENSE, assert_no_leaks
from lora_adapters import NEW_TOKENS, SPECS

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def make_module_llm():
    from kvfleet import LLM

    built = []

    def build(**engine_args):
        built.append(LLM("smollm2", **engine_args))
        return built[-1]

    yield build
    for llm in built:
        assert_no_leaks(llm)


@pytest.fixture(scope="module")
def lora_llm(make_module_llm):
    return make_module_llm(**DENSE, enable_lora=True, max_loras=len(SPECS), max_lora_rank=16)


def lora_requests(adapter_dirs: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index, str(path)) for index, (name, path) in enumerate(adapter_dirs.items(), 1)}


def test_three_adapters_and_the_base_in_one_batch_match_merged_transformers(lora_llm, lora_adapter_dirs,
                                                                            lora_references):
    prompts, wanted = lora_references
    loras = lora_requests(lora_adapter_dirs)
    names = [None, *loras]
    outputs = lora_llm.generate(prompts * len(names), GREEDY, use_tqdm=False,
                                lora_request=[loras.get(name) for name in names for _ in prompts])
    assert [o.outputs[0].token_ids for o in outputs] == [tokens for name in names for tokens in wanted[name]]


def _write_adapter(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8, **config}))
    save_file(tensors, directory / "adapter_model.safetensors")
    return str(directory)


def _pair(module: str, rank: int, shape_in: int, shape_out: int, block: str = "self_attn") -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.model.layers.0.{block}.{module}"
    return {f"{prefix}.lora_A.weight": torch.zeros(rank, shape_in), f"{prefix}.lora_B.weight": torch.zeros(shape_out, rank)}


def test_bad_adapters_are_refused_by_name_and_disturb_nothing(lora_llm, lora_adapter_dirs, tmp_path):
    hidden = 576  # SmolLM2-135M's
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    cases = {
        str(tmp_path / "absent"): "No adapter found for",
        str(no_weights): "has no adapter_model.safetensors",
        _write_adapter(tmp_path / "rank", {"r": 32}, _pair("q_proj", 32, hidden, hidden)):
            "LoRA rank 32 is greater than max_lora_rank 16",
        _write_adapter(tmp_path / "module", {"r": 4}, _pair("fc1", 4, hidden, hidden, block="mlp")):
            "a module this model lacks",
        _write_adapter(tmp_path / "base", {"r": 4}, _pair("q_proj", 4, 1024, 1024)):
            "has shape [4, 1024], this model's q_proj with r=4 needs [4, 576]",
        _write_adapter(tmp_path / "dora", {"r": 4, "use_dora": True}, _pair("q_proj", 4, hidden, hidden)):
            "use_dora=True is not supported",
    }
    for index, (path, message) in enumerate(cases.items(), 100):
        with pytest.raises(LoraAdapterError, match=message.replace("[", r"\[")):
            lora_llm.generate("Hi", GREEDY, use_tqdm=False, lora_request=LoRARequest(f"bad{index}", index, path))
    assert not lora_llm.engine.scheduler.has_unfinished_requests  # refused before any request was queued
    assert set(lora_llm.engine.worker.list_loras()) <= set(range(1, len(SPECS) + 1))
    witness = LoRARequest("attn8", 1, str(lora_adapter_dirs["attn8"]))
    assert len(lora_llm.generate("Hi", GREEDY, use_tqdm=False, lora_request=witness)[0].outputs[0].token_ids) == 6


def test_adapters_share_prefix_blocks_only_with_themselves(lora_llm, lora_adapter_dirs):
    prompt = list(range(1000, 1050))  # three full blocks of 16; the last token is always computed
    scheduler = lora_llm.engine.scheduler
    loras = lora_requests(lora_adapter_dirs)

    def hits_for(lora: LoRARequest | None) -> int:
        before = scheduler.prefix_cache_hits
        lora_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, lora_request=lora)
        return scheduler.prefix_cache_hits - before

    assert hits_for(loras["attn8"]) == 0
    assert hits_for(loras["mlp4"]) == 0  # the same tokens under another adapter: nothing shared
    assert hits_for(None) == 0
    assert hits_for(loras["attn8"]) == 48
    assert hits_for(loras["mlp4"]) == 48


def test_lora_stats_are_recomputed_only_when_the_queues_change(lora_llm, lora_adapter_dirs):
    engine = lora_llm.engine
    idle = engine.stats().lora
    assert engine.stats().lora is idle  # the engine loop asks every iteration: nothing changed, nothing rebuilt
    engine.add_request("stats-probe", [1000, 1001], SamplingParams(max_tokens=1),
                       lora_request=lora_requests(lora_adapter_dirs)["mlp4"])
    assert engine.stats().lora.waiting == ["mlp4"]
    while engine.has_work:
        engine.step()
    assert engine.stats().lora == idle and engine.stats().lora.running == []


def test_adapters_beyond_max_loras_wait_their_turn_and_the_host_cache_reads_evicted_ones_again(
    make_module_llm, lora_adapter_dirs, lora_references
):
    # One device slot, two adapters in host memory, three adapters asked for at once.
    llm = make_module_llm(**DENSE, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=16)
    prompts, wanted = lora_references
    loras = lora_requests(lora_adapter_dirs)
    outputs = llm.generate(prompts[:1] * len(loras), GREEDY, use_tqdm=False, lora_request=list(loras.values()))
    assert [o.outputs[0].token_ids for o in outputs] == [wanted[name][0] for name in loras]
    assert len(llm.engine.worker.lora._host) == 2
