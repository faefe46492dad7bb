"""A vLLM user's command lines against the real `kvfleet` console script: a launch
line written for `vllm serve` starts and serves; a setting kvfleet cannot honour ends
the command within seconds with exit code 2 and one line naming it, before any loading;
the SDK takes the same names and shows the same start-up summary."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvfleet.processes import free_port
from tests.system.openai_servers import healthy

REPO = Path(__file__).resolve().parents[2]
KVFLEET = [sys.executable, "-m", "kvfleet.cli"]
ENV = {**{k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_LONG_MAX_MODEL_LEN"},
       "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
# The launch line, as a vLLM user's script carries it.
VLLM_LAUNCH = ["--tensor-parallel-size", "1", "--dtype", "half", "--max-model-len", "1024",
               "--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--disable-log-requests",
               "--uvicorn-log-level", "warning", "--served-model-name", "a", "b", "--generation-config", "auto",
               "--trust-remote-code"]
# A vLLM user's speculative decoding flag, on the same line.
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
ERROR_WITHIN_S = 3.0
# What a person needs to see once the server is up (worker_svc/runtime/worker.py, gateway/drain.py).
SUMMARY_FIELDS = ("model smollm2:", "(llama, 30 layers)",
                  "weights: GGUF Q4_1+Q8_0, its 4-bit projections and 8-bit embedding run as stored",
                  "the rest in float32 on cpu", "GB, loaded in", "KV cache:", "blocks of 16 tokens",
                  "maximum concurrency at max_model_len")


def test_a_vllm_launch_line_serves(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([*KVFLEET, "serve", "smollm2", "--port", str(port), *VLLM_LAUNCH,
                                    "--speculative-config", json.dumps(SPECULATIVE)], cwd=REPO,
                                   env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        while not healthy(url):
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() - started < 120, log_path.read_text()
            time.sleep(0.2)
        print(f"healthy after {time.monotonic() - started:.1f} s")
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("a", 1024), ("b", 1024)]
        body = {"model": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "a"  # the first served name, as vLLM answers
        assert httpx.post(f"{url}/v1/chat/completions", json={**body, "model": "c"}).status_code == 404
        # The speculative config reached the engine: vLLM's counters are exported (and counted).
        metrics = httpx.get(f"{url}/metrics").text
        assert 'vllm:spec_decode_num_drafts_total{model_name="a"}' in metrics, metrics
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    log = log_path.read_text()
    for field in (*SUMMARY_FIELDS, "max_model_len 1024", "routes: GET /v1/models", "POST /v1/chat/completions",
                  f"serving a, b on http://127.0.0.1:{port} (OpenAI API: http://127.0.0.1:{port}/v1)",
                  "--trust-remote-code has no effect", "--disable-log-requests has no effect",
                  "--dtype float16 on CPU: computing in float32"):
        assert field in log, f"{field!r} not in:\n{log}"
    assert "Uvicorn running" not in log  # --uvicorn-log-level warning holds


def _hf_dir(tmp_path: Path, model_type: str, tokenizer: bool) -> Path:
    directory = tmp_path / f"{model_type}-model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    if tokenizer:
        (directory / "tokenizer.json").write_text("{}")
        (directory / "tokenizer_config.json").write_text("{}")
    return directory


# argv after `kvfleet serve` -> what the one line must say
REFUSED = {
    "tensor-parallel": (["--tensor-parallel-size", "4"], "--tensor-parallel-size 4: with fewer KV heads (3) than "
                        "ranks"),
    "pipeline-parallel": (["-pp", "31"], "--pipeline-parallel-size 31: the model has only 30 layers"),
    "dtype": (["--dtype", "int8"], "--dtype int8: choose one of auto, half, float16, bfloat16, float, float32"),
    "block-size": (["--block-size", "7"], "--block-size 7: choose one of 8, 16, 32, 64, 128"),
    "quantization": (["--quantization", "awq"], "--quantization awq: kvfleet cannot run these weights yet"),
    "kv-cache-dtype": (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: choose one of auto, bfloat16, float16 "
                       "(fp8 caches are not supported)"),
    "max-model-len": (["--max-model-len", "20000"], "--max-model-len 20000: SmolLM2-135M-Instruct.Q4_1 has 8192 "
                      "positions; use at most 8192, or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"),
    "device-name": (["--device", "tpu"], "--device tpu: choose auto, cpu or cuda"),
    "lora": (["--lora-modules", "a=/no/such/adapter"], "--lora-modules needs --enable-lora"),
    "tls": (["--ssl-keyfile=key.pem"], "--ssl-keyfile: kvfleet serves plain HTTP; terminate TLS in front of it"),
    "unknown-flag": (["--no-such-flag"], "kvfleet serve: error: unrecognized arguments: --no-such-flag"),
    "api-server-count": (["--api-server-count", "2"], "--api-server-count 2: `kvfleet serve` answers HTTP in the "
                         "one process its engine runs in; for several HTTP processes on one port, run `kvfleet "
                         "cluster up --api-server-count 2`"),
    "uds": (["--uds", "/no/such/dir/kvfleet.sock"], "--uds /no/such/dir/kvfleet.sock: cannot listen there"),
    "tool-choice": (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    "chat-template": (["--chat-template", "no-such-file"], "'no-such-file' is neither a file nor a template"),
    "generation-config": (["--generation-config", "/no/such/dir"], "--generation-config /no/such/dir: no "
                          "generation_config.json there"),
    "speculative-method": (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
                           "--speculative-config: method 'mtp' drafts with the target's own multi-token-prediction "
                           "layers"),
    "kv-transfer-serve": (["--kv-transfer-config", '{"kv_connector": "KvfleetConnector", "kv_role": "kv_both"}'],
                          "--kv-transfer-config: prefill/decode disaggregation needs replicas of the cluster's roles"),
    "missing-model": (["--model", "/no/such/model"], "'/no/such/model'"),
    "missing-tokenizer": (["--tokenizer", "/no/such/tokenizer"], "'/no/such/tokenizer'"),
}


@pytest.mark.serial  # times each refusal
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_setting_that_cannot_work_is_one_line_and_exit_2(case: str) -> None:
    argv, message = REFUSED[case]
    _assert_refused(["serve", "--port", str(free_port()), *argv], message)


@pytest.mark.serial
def test_refused_before_loading_model_and_machine_facts(tmp_path: Path) -> None:
    import torch

    unknown_arch = _hf_dir(tmp_path, "gpt2", tokenizer=True)
    _assert_refused(["serve", "--model", str(unknown_arch)],
                    "model_type 'gpt2' is not supported; supported: llama, mistral, qwen2")
    if not torch.cuda.is_available():
        _assert_refused(["serve", "--device", "cuda"], "--device cuda: this machine has no CUDA device")
        _assert_refused(["cluster", "up", "--device", "cuda:1"], "--device cuda:1: this machine has no CUDA device")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _assert_refused(["serve", "--port", str(port)], f"--host 127.0.0.1 --port {port}: cannot listen there")
        # cluster up checks it too, before starting anything
        _assert_refused(["cluster", "up", "--port", str(port)], f"--port {port}: cannot listen there")
    _assert_refused(["cluster", "up", "--max-model-len", "9000"], "--max-model-len 9000")
    _assert_refused(["worker", "--tensor-parallel-size", "4"], "kvfleet worker: error: --tensor-parallel-size 4")


def _assert_refused(argv: list[str], message: str) -> None:
    started = time.monotonic()
    done = subprocess.run([*KVFLEET, *argv], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0] and not done.stdout, done.stderr
    assert elapsed < ERROR_WITHIN_S, f"{argv}: {elapsed:.2f} s"


def test_help_loads_no_engine() -> None:
    """`kvfleet serve --help` answers without torch or transformers (0.3 s here)."""
    probe = ("import sys, runpy\nsys.argv = ['kvfleet', 'serve', '--help']\ntry:\n"
             "    runpy.run_module('kvfleet.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print([m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules], file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert done.stderr.strip() == "[]", done.stderr
    for flag in ("--tensor-parallel-size", "-tp", "--served-model-name NAME [NAME ...]", "--generation-config",
                 "--chat-template", "--uvicorn-log-level", "--trust-remote-code", "--quantization"):
        assert flag in done.stdout


def test_the_sdk_takes_vllm_names_and_shows_the_summary() -> None:
    """LLM(...) in a script that configured no logging: the load and its summary are
    shown; and --seed seeds the requests that bring none, whatever ran before."""
    script = """
import torch
from kvfleet import LLM, SamplingParams
def sample(seed):
    llm = LLM("smollm2", tensor_parallel_size=1, enforce_eager=True, trust_remote_code=True, dtype="float",
              max_model_len=512, seed=seed)
    return llm.generate("Hello", SamplingParams(max_tokens=8, temperature=1.0), use_tqdm=False)[0].outputs[0].text
first = sample(7)
torch.rand(100)  # draws from the global generator in between: unseeded, the next sample would differ
print(repr([first, sample(7)]))
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    for field in (*SUMMARY_FIELDS, "max_model_len 512", "--trust-remote-code has no effect",
                  "--enforce-eager has no effect"):
        assert field in run.stderr, f"{field!r} not in:\n{run.stderr}"
    first, again = eval(run.stdout)
    assert first == again


def test_the_response_flags_reach_serve_s_app_and_cluster_up_s_gateway() -> None:
    """vLLM's flags that shape responses: `serve` builds its app from them, and `cluster
    up` hands them to the gateway role it starts (what they do: tests/gateway/test_gateway.py,
    tests/system/test_openai_modes.py)."""
    from gateway.limits import RequestLimits
    from gateway.response_options import ResponseOptions
    from kvfleet.cli import build_parser
    from services.cli_args import gateway_argv

    flags = ["--enable-force-include-usage", "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
             "--max-logprobs", "-1"]
    serve = build_parser().parse_args(["serve", "smollm2", *flags])
    up = build_parser().parse_args(["cluster", "up", *flags])
    gateway = build_parser().parse_args(["gateway", "--nats-url", "nats://n", "--redis-url", "redis://r", *gateway_argv(up)])
    for args in (serve, gateway):
        assert ResponseOptions.from_args(args) == ResponseOptions(True, True, True)
        assert RequestLimits.from_args(args).max_logprobs == -1
    default = build_parser().parse_args(["serve", "smollm2"])
    assert (ResponseOptions.from_args(default), RequestLimits.from_args(default).max_logprobs) == (ResponseOptions(), 20)
