"""LoRA adapters through `kvfleet serve` (docs/lora.md), as a client sees them: adapters
from --lora-modules and from vLLM's runtime load route, listed in /v1/models; greedy
completions naming each, sent together, equal transformers + PEFT with the adapter
merged; bad loads and unknown names answered by name while a witness finishes intact."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai_servers import API_KEY, SERVED, Server, running_server

from lora_adapters import NEW_TOKENS

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, lora_adapter_dirs) -> Server:
    dirs = lora_adapter_dirs
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        with running_server("serve", tmp_path_factory, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "16",
                            "--lora-modules", f"attn8={dirs['attn8']}",
                            json.dumps({"name": "mlp4", "path": str(dirs["mlp4"])})) as server:
            yield server


def complete(client: httpx.Client, model: str, prompt: list[int], max_tokens: int = NEW_TOKENS) -> httpx.Response:
    return client.post("/v1/completions", headers=HEADERS, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def test_adapters_are_listed_and_named_completions_match_merged_transformers(lora_server, lora_adapter_dirs,
                                                                             lora_references):
    prompts, wanted = lora_references
    with lora_server.http() as client:
        loaded = client.post("/v1/load_lora_adapter", headers=HEADERS,
                             json={"lora_name": "all16", "lora_path": str(lora_adapter_dirs["all16"])})
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'all16' added successfully.")
        cards = {card["id"]: card for card in client.get("/v1/models", headers=HEADERS).json()["data"]}
        assert cards[SERVED]["parent"] is None
        for name, path in lora_adapter_dirs.items():
            assert (cards[name]["root"], cards[name]["parent"]) == (str(path), SERVED)
        jobs = [(name, prompt) for name in (None, *lora_adapter_dirs) for prompt in prompts]
        with ThreadPoolExecutor(len(jobs)) as pool:  # sent together: the steps mix every adapter and the base
            responses = list(pool.map(lambda job: complete(client, job[0] or SERVED, job[1]), jobs))
    assert [r.status_code for r in responses] == [200] * len(jobs), responses[0].text
    assert [r.json()["model"] for r in responses] == [name or SERVED for name, _ in jobs]
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == [
        tokens for name in (None, *lora_adapter_dirs) for tokens in wanted[name]]
    lora_server.wait_idle()


def test_lora_requests_info_names_the_running_adapters(lora_server, lora_references):
    prompts, _ = lora_references
    body = {"model": "attn8", "prompt": prompts[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with lora_server.http() as client, client.stream("POST", "/v1/completions", headers=HEADERS, json=body) as stream:
        # Its first token (the head chunk has no choice): it runs until this stream closes.
        next(line for line in stream.iter_lines() if line.startswith("data: {") and json.loads(line[6:])["choices"])
        wanted = "vllm:lora_requests_info{max_lora=3,running_lora_adapters=attn8,waiting_lora_adapters=}"
        deadline = time.monotonic() + 5  # a scrape may come before the engine's next iteration
        while wanted not in (running := lora_server.metrics()):
            assert time.monotonic() < deadline, (  # what the scrape and the stream said
                [name for name in running if name.startswith("vllm:lora")], [next(stream.iter_lines()) for _ in range(4)])
            time.sleep(0.05)
    idle = [name for name in lora_server.wait_idle() if name.startswith("vllm:lora_requests_info")]
    assert idle == ["vllm:lora_requests_info{max_lora=3,running_lora_adapters=,waiting_lora_adapters=}"]


def test_bad_loads_and_unknown_names_are_answered_by_name_and_a_witness_finishes(lora_server, lora_references,
                                                                                 tmp_path: Path):
    prompts, wanted = lora_references
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 8}))
    (tmp_path / "big" / "adapter_model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with lora_server.http() as client, ThreadPoolExecutor(1) as pool:
        witness = pool.submit(complete, client, "attn8", prompts[0], 64)
        cases = [
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "absent")}, 404,
             "No adapter found for"),
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "big")}, 400,
             "LoRA rank 64 is greater than max_lora_rank 16"),
            ("/v1/load_lora_adapter", {"lora_name": "attn8", "lora_path": str(tmp_path)}, 400,
             "The lora adapter 'attn8' has already been loaded."),
            ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "The lora adapter 'nope' cannot be found."),
        ]
        for path, body, status, message in cases:
            response = client.post(path, headers=HEADERS, json=body)
            assert (response.status_code, response.json()["error"]["message"].startswith(message)) == (status, True), \
                response.text
        unknown = complete(client, "nope", prompts[0])
        assert (unknown.status_code, unknown.json()["error"]["message"]) == (404, "The model `nope` does not exist.")
        # Unloaded, an adapter's name is unknown again.
        unloaded = client.post("/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "mlp4"})
        assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'mlp4' removed successfully.")
        assert complete(client, "mlp4", prompts[0]).status_code == 404
        result = witness.result()
    assert result.status_code == 200
    assert result.json()["choices"][0]["token_ids"][:NEW_TOKENS] == wanted["attn8"][0]
    lora_server.wait_idle()
