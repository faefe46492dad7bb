"""Every kvfleet command-line flag, defined once with vLLM's names, and the groups each
command takes: `serve` and `cluster up` take the engine and HTTP groups, the roles
take the engine, listen and cluster groups they need. Building a parser imports no
role, so `kvfleet <command> --help` answers at once."""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

from services.config import EngineConfig, flag
from services.lora_modules import LoRAModulePath, parse_lora_module
from services.registry import DEFAULT_TTL_S
from services.sampling_params import MAX_LOGPROBS

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

_ENGINE_HELP = {
    "model": "alias (smollm2), a .gguf file, a HuggingFace model directory, or a repo id in the local HF cache",
    "revision": "the branch, tag or commit of a repo id --model names",
    "tokenizer": "where the tokenizer comes from, in --model's forms or a directory of tokenizer files "
                 "(default: the model's)",
    "tokenizer_revision": "the branch, tag or commit of a repo id --tokenizer names",
    "generation_config": "auto: the model's generation_config.json sets the sampling defaults; vllm: it does "
                         "not; or a directory holding one",
    "dtype": "auto (float32 on CPU, bfloat16 on GPU), half/float16, bfloat16 or float/float32",
    "device": "auto, cpu or cuda[:N]",
    "quantization": "gguf (the default for GGUF files): run their 4-bit (Q4_0/Q4_1) projections and 8-bit (Q8_0) "
                    "embedding as stored, on CPU, computing in float32 over exactly the file's weights (less memory, "
                    "faster decode); none: dequantize them to --dtype (exactly transformers' tokens)",
    "kv_cache_dtype": "auto: float16 for GGUF weights run as stored (llama.cpp's default), the model's dtype "
                      "otherwise; bfloat16 or float16: in 16 bits, which for a float32 model holds twice the tokens "
                      "and halves what decode attention reads",
    "block_size": "tokens per KV block",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step (the per-step token budget)",
    "max_model_len": "context length; defaults to the model's",
    "num_gpu_blocks_override": "KV blocks to allocate, ignoring the memory budget",
    "kv_cache_memory": "bytes of KV cache on CPU",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "enable_prefix_caching": "reuse the KV of cached prompt prefixes",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes",
    "preemption_mode": "recompute or swap, when KV blocks run out",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "kv_offloading_size": "GiB of host memory holding KV blocks evicted from the device pool, found again by "
                          "prefix (the first offload tier)",
    "kv_offloading_backend": "native: kvfleet's own offload tiers (vLLM's name; lmcache is not supported)",
    "kv_offloading_dir": "a local directory holding KV blocks the device pool (and host tier) evicted, one file "
                         "per block (the disk tier)",
    "kv_offloading_dir_size": "GiB the --kv-offloading-dir tier may hold; the least recently used blocks go first",
    "kv_shared_dir": "a directory several replicas mount (a PersistentVolume, a bind mount): KV blocks any of them "
                     "computed, for all of them (the shared tier)",
    "kv_shared_dir_size": "GiB the --kv-shared-dir tier may hold; the least recently used blocks go first",
    "seed": "seeds the sampling of requests that bring no seed of their own",
    "tensor_parallel_size": "ranks each layer is split over (one process and device each; gloo on CPU, NCCL on GPU)",
    "pipeline_parallel_size": "pipeline stages the layers are split into (one process and device each)",
    "attention_backend": "auto (triton on CUDA, torch on CPU), triton (paged Triton kernels; interpreted on CPU, "
                         "for tests) or torch",
    "enforce_eager": "run every step eagerly: capture no CUDA graphs for decode (CPU steps always run eagerly)",
    "async_scheduling": "plan each step while the one before runs (vLLM's async scheduling): hides the "
                        "scheduler's time behind the GPU's; a request that stops computes one token in vain",
    "cuda_graph_sizes": "decode batch sizes captured as CUDA graphs; a batch runs in the smallest that holds it "
                        "(default: 1 2 4 8 16 24 32 48 64 ... up to --max-num-seqs)",
    "trust_remote_code": "accepted for vLLM's sake: kvfleet never runs a model repository's code",
    "speculative_config": "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4} drafts tokens from the request's own "
                          "prompt and output, {\"method\": \"suffix\"} from suffix trees over it and past "
                          "outputs, {\"method\": \"draft_model\", \"model\": ...} from a smaller model, "
                          "{\"method\": \"eagle\" or \"eagle3\", \"model\": ...} from an EAGLE head fed by the "
                          "model's hidden states; the model verifies them in one step",
    "kv_transfer_config": "prefill/decode disaggregation, vLLM's JSON: {\"kv_connector\": \"KvfleetConnector\", "
                          "\"kv_role\": \"kv_producer\"} (a prefill replica), kv_consumer (a decode replica) or "
                          "kv_both; optional kv_ip (the host other workers dial for this worker's blocks) and "
                          "kv_connector_extra_config {\"abort_timeout_s\", \"fetch_timeout_s\", \"pool\"} (pool: "
                          "prefill or decode, the one pool a kv_both replica serves in until the planner moves it) "
                          "(docs/disaggregation.md)",
    "runner": "auto: generate with a decoder model, pool with an encoder (BERT); pooling: serve embeddings "
              "(/v1/embeddings, /pooling) rather than text; generate: serve text",
    "convert": "embed: serve a decoder model as an embedder (its last token's normalized hidden state by default; "
               "implies --runner pooling); classify: as a classifier, its sequence-classification head (a "
               "...ForSequenceClassification checkpoint's score weights) over its last token; auto/none: the model "
               "as it is (a ...ForSequenceClassification checkpoint classifies)",
    "pooler_config": "how a pooling model pools, vLLM's JSON: {\"pooling_type\": \"LAST\"|\"MEAN\"|\"CLS\", "
                     "\"normalize\": true, \"dimensions\": N} (default: the model's own, else LAST and normalize)",
    "enable_lora": "serve LoRA adapters (PEFT's adapter_config.json + adapter_model.safetensors) beside the "
                   "base model: a request names one in `model` (docs/lora.md)",
    "max_loras": "adapters one step may run, each in a device slot",
    "max_lora_rank": "the largest adapter rank accepted (device slots are sized for it)",
    "max_cpu_loras": "adapters kept in host memory, least recently used evicted (default: --max-loras)",
}
# vLLM's short spellings.
_ENGINE_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "quantization": ["-q"],
                   "speculative_config": ["-sc"]}
# What the tokenizer role needs of the engine flags: the text side of the model.
TOKENIZER_FIELDS = ("model", "revision", "tokenizer", "tokenizer_revision", "generation_config")

# vLLM flags for what kvfleet does not do (yet): refused by name, saying what to do instead.
_TLS = "kvfleet serves plain HTTP; terminate TLS in front of it (a reverse proxy, an ingress)"
VLLM_FLAGS_NOT_SUPPORTED = {
    "--cpu-offload-gb": "weights offloaded to host memory are not supported; use a device that holds the model",
    "--limit-mm-per-prompt": "kvfleet serves text-only models; drop the flag",
    "--enable-expert-parallel": "kvfleet implements no mixture-of-experts model; drop the flag",
    "--ssl-keyfile": _TLS,
    "--ssl-certfile": _TLS,
}

# The gateway's parsers by name (gateway/tool_parsers; tests/gateway checks the lists agree).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")

def add_engine_args(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """EngineConfig's fields as flags; `only` those named, for a role that needs a few."""
    for f in fields(EngineConfig):
        if only is not None and f.name not in only:
            continue
        names, help_text = [flag(f.name), *_ENGINE_ALIASES.get(f.name, [])], f"{_ENGINE_HELP[f.name]} (default: %(default)s)"
        kind = str(f.type).split(" ")[0]
        if kind == "bool":  # --enable-x / --no-enable-x, as in vLLM
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif kind == "tuple[int,":  # a list of ints, space separated, as in vLLM
            parser.add_argument(*names, type=int, nargs="+", default=f.default, help=help_text)
        else:
            parser.add_argument(*names, type={"int": int, "float": float, "str": str}[kind], default=f.default,
                                help=help_text)


def engine_args(namespace: argparse.Namespace) -> dict:
    """The EngineConfig fields `namespace` has flags for."""
    return {f.name: getattr(namespace, f.name) for f in fields(EngineConfig) if hasattr(namespace, f.name)}


def engine_argv(namespace: argparse.Namespace, only: Sequence[str] | None = None) -> list[str]:
    """The engine flags of `namespace` as a command line, for the roles `cluster up` starts."""
    argv = []
    for f in fields(EngineConfig):
        if only is not None and f.name not in only:
            continue
        name, value = flag(f.name), getattr(namespace, f.name)
        if isinstance(value, bool):
            argv.append(name if value else f"--no-{name[2:]}")
        elif isinstance(value, (tuple, list)):
            argv += [name, *map(str, value)]
        elif value is not None:
            argv += [name, str(value)]
    return argv


def add_shutdown_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="seconds in-flight work gets to finish after SIGTERM (default: %(default)s)")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int no smaller than `minimum`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value

    return parse


def add_http_args(parser: argparse.ArgumentParser, port: int = 8000) -> None:
    """The OpenAI server's flags: `serve`, `cluster up` and `gateway`."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=port, help="port to listen on (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 routes (default: $KVFLEET_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the names clients may ask for; responses carry the first (default: the --model value)")
    parser.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                        help="uvicorn's log level (default: %(default)s)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="accepted for vLLM's sake: kvfleet never logs request contents")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="accepted for vLLM's sake: kvfleet logs no periodic stats (they are on /metrics)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 before they are read (default: %(default)s)")
    parser.add_argument("--max-sequences-per-request", type=int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                        help="most sequences one request may fan out to: prompts x n (or best_of) "
                        "(default: %(default)s)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage tells prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache "
                        "supplied")
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="every stream tells its usage, in each chunk and a last chunk of its own, as if it "
                        "asked for stream_options include_usage and continuous_usage_stats")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help='logprobs name each token "token_id:N" instead of its text (a request\'s '
                        "return_tokens_as_token_ids decides for itself)")
    parser.add_argument("--max-logprobs", type=at_least(-1), default=MAX_LOGPROBS,
                        help="the most logprobs, prompt_logprobs or top_logprobs a request may ask for; -1: the "
                        "whole vocabulary (default: %(default)s)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                        help="how the model writes tool calls, to turn its text into tool_calls")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="split <think>...</think> reasoning into reasoning (and reasoning_content)")
    parser.add_argument("--lora-modules", nargs="+", type=_lora_module, metavar="NAME=PATH",
                        help="LoRA adapters to serve from the start (needs --enable-lora): name=path, or JSON "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request names one in `model`')
    add_server_args(parser)
    add_shutdown_arg(parser)


def _lora_module(text: str) -> LoRAModulePath:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for where the HTTP server listens and which of its own routes it serves."""
    parser.add_argument("--uds", metavar="PATH",
                        help="listen on this Unix domain socket instead of --host and --port")
    parser.add_argument("--root-path",
                        help="the path prefix a path-rewriting proxy serves this server under, e.g. /llm: "
                        "routes answer with and without it, and --api-key guards /v1 under it too")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's configuration, chat template included")
    parser.add_argument("--enable-server-load-tracking", action="store_true",
                        help="GET /load counts the completion and chat requests being answered (else it says 0)")
    parser.add_argument("--show-hidden-metrics-for-version", metavar="VERSION",
                        help="accepted for vLLM's sake: kvfleet hides no metric, every one it has is on /metrics")


def add_api_server_count_arg(parser: argparse.ArgumentParser, help_text: str) -> None:
    """`serve` and `cluster up`: how many HTTP server processes share the port."""
    parser.add_argument("--api-server-count", "-asc", type=at_least(1), default=1, metavar="N",
                        help=f"{help_text} (default: %(default)s)")


def http_ignored(namespace: argparse.Namespace) -> list[str]:
    """A line for each HTTP flag accepted for vLLM's sake that changes nothing here."""
    notes = []
    if namespace.disable_log_requests:
        notes.append("--disable-log-requests has no effect: kvfleet never logs request contents")
    if namespace.disable_log_stats:
        notes.append("--disable-log-stats has no effect: kvfleet logs no periodic stats (see /metrics)")
    if namespace.show_hidden_metrics_for_version:
        notes.append("--show-hidden-metrics-for-version has no effect: kvfleet hides no metric (see /metrics)")
    return notes


def gateway_argv(namespace: argparse.Namespace) -> list[str]:
    """The HTTP flags of `namespace` but the address, as a command line for the gateway `cluster up` starts."""
    argv = [f"--max-request-body-bytes={namespace.max_request_body_bytes}",
            f"--max-sequences-per-request={namespace.max_sequences_per_request}",
            f"--max-logprobs={namespace.max_logprobs}",
            f"--uvicorn-log-level={namespace.uvicorn_log_level}"]
    for name in ("enable_auto_tool_choice", "enable_prompt_tokens_details", "enable_force_include_usage",
                 "return_tokens_as_token_ids", "disable_uvicorn_access_log", "disable_log_requests",
                 "disable_log_stats"):
        if getattr(namespace, name):
            argv.append(flag(name))
    for name in ("tool_call_parser", "reasoning_parser"):
        if getattr(namespace, name):
            argv.append(f"{flag(name)}={getattr(namespace, name)}")
    if namespace.served_model_name:
        argv += ["--served-model-name", *namespace.served_model_name]
    if namespace.lora_modules:
        argv += ["--lora-modules", *(json.dumps({"name": m.name, "path": m.path, "base_model_name": m.base_model_name})
                                     for m in namespace.lora_modules)]
    return argv + server_argv(namespace)


def server_argv(namespace: argparse.Namespace) -> list[str]:
    """add_server_args' flags but --uds (where to listen is the launcher's to give), as a command line."""
    argv = [flag(name) for name in ("enable_tokenizer_info_endpoint", "enable_server_load_tracking")
            if getattr(namespace, name)]
    for name in ("root_path", "show_hidden_metrics_for_version"):
        if getattr(namespace, name) is not None:
            argv.append(f"{flag(name)}={getattr(namespace, name)}")
    return argv


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    """For whoever renders chats: `serve`, `cluster up` and the tokenizer role."""
    parser.add_argument("--chat-template", type=chat_template,
                        help="a Jinja chat template, or a file holding one, instead of the model's")


def chat_template(value: str) -> str:
    """vLLM's rule: an existing file is read; text with template syntax is the template itself."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as file:
            return file.read()
    if "{" in value or "\n" in value:
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a template")


def add_listen_args(parser: argparse.ArgumentParser, port: int) -> None:
    """A gRPC role's address, metrics port and drain time."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=port,
                        help="port to listen on; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port; 0 turns it off (default: %(default)s)")
    add_shutdown_arg(parser)
    add_tls_args(parser)


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert-file", type=Path, help="PEM certificate this process serves gRPC with, and "
                        "presents to servers that ask for a client certificate (default: plain gRPC)")
    parser.add_argument("--tls-key-file", type=Path, help="PEM private key of --tls-cert-file")
    parser.add_argument("--tls-ca-file", type=Path, help="PEM CA bundle the other roles' certificates chain to: "
                        "this process dials them over TLS verified by it (default: plain gRPC)")
    parser.add_argument("--tls-require-client-cert", action="store_true",
                        help="serve only callers whose certificate chains to --tls-ca-file (mutual TLS)")


def add_migration_wait_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--migration-wait", type=non_negative_seconds, default=0.0, metavar="SECONDS",
                        help="how long a request whose replica died waits for a replica to take it when no other "
                        "can, its own included once restarted (0: the client gets the error at once) "
                        "(default: %(default)s)")


def non_negative_seconds(text: str) -> float:
    """An argparse type: seconds, 0 or more."""
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def add_lease_ttl_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_TTL_S,
                        help="seconds a dead process stays listed in the registry (default: %(default)s)")


def add_registry_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--redis-url", required=required, help="the registry, e.g. redis://127.0.0.1:6379/0")
    add_lease_ttl_arg(parser)
    parser.add_argument("--advertise-address", help="host:port other roles dial (default: --host:--port)")


def add_nats_arg(parser: argparse.ArgumentParser, required: bool, help_text: str) -> None:
    parser.add_argument("--nats-url", required=required, help=help_text)
