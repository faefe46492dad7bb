"""Why kvfleet lacks a vLLM flag or request field, and what to use instead: the words
docs/vllm_differences.md gives them (kvfleet/vllm_differences.py decides which are
lacking, from the code). A flag the CLI refuses by name gives the CLI's own reason
(services/cli_args.py's VLLM_FLAGS_NOT_SUPPORTED); the rest are here, per flag, else per
vLLM argument group, else FALLBACK. An entry for a flag or field kvfleet now has is
stale, and the test of the document says so.
"""
from __future__ import annotations

from services.cli_args import REASONING_PARSERS, TOOL_CALL_PARSERS

FALLBACK = "not implemented in kvfleet yet; drop it"

_TEXT_ONLY = "kvfleet serves text-only models; drop the flag"
_NO_MOE = "kvfleet implements no mixture-of-experts model; drop the flag"
_NO_PLUGINS = "kvfleet loads no plugins: its parsers, samplers and routes are built in"
_NO_CODE = "kvfleet never runs a model repository's code; drop the flag"
_NEVER_LOGS = "kvfleet never logs request contents or outputs; drop the flag"
_LOADER = ("kvfleet loads a GGUF file or a safetensors directory, from a local path or the local HF cache, as the "
           "files say: it has no loader options and downloads nothing; drop the flag")
_ONE_MACHINE = ("a kvfleet worker group (--tensor-parallel-size x --pipeline-parallel-size ranks) runs on one machine, "
                "its ranks started by kvfleet; drop the flag")
_DATA_PARALLEL = ("kvfleet's data parallelism is more model replicas, each a `kvfleet scheduler` with its worker, which "
                  "the gateways route among (docs/cluster.md; `kvfleet cluster up --data-parallel-size N` starts N); "
                  "drop the flag")
_CONTEXT_PARALLEL = "kvfleet has no context parallelism; use --tensor-parallel-size or --pipeline-parallel-size"
_FP8_KV = "kvfleet has no fp8 KV cache (--kv-cache-dtype auto, bfloat16 or float16); drop the flag"
_MAMBA = "kvfleet implements no Mamba (state-space) model; drop the flag"
_PARTIAL_PREFILLS = ("kvfleet's chunked prefill shares each step's --max-num-batched-tokens among prompts with no "
                     "per-prompt limits; drop the flag")
_CORS = "kvfleet sends no CORS headers; add them in the proxy in front of it"
_TLS = "kvfleet serves plain HTTP; terminate TLS in front of it (a reverse proxy, an ingress)"
_DOCS = "kvfleet's app serves FastAPI's /docs and /openapi.json as they come; hide them at the proxy in front of it"
_METRICS = "kvfleet's /metrics carries vLLM's V1 metrics as they are; it has no tracing or extra metric switches"

# Per vLLM argument group (the group titles of `vllm serve --help`).
GROUP_REASONS: dict[str, str] = {
    "LoadConfig": _LOADER,
    "MultiModalConfig": _TEXT_ONLY,
    "LoRAConfig": "kvfleet's LoRA (docs/lora.md) takes --enable-lora, --max-loras, --max-lora-rank and "
                  "--max-cpu-loras, adapters of the decoder's projections computed in the model's dtype; drop the flag",
    "OffloadConfig": "weights offloaded to host memory are not supported; use a device that holds the model",
    "ObservabilityConfig": f"{_METRICS}; drop the flag",
    "ParallelConfig": _ONE_MACHINE,
}

FLAG_REASONS: dict[str, str] = {
    # `vllm serve`'s own
    "--headless": "a kvfleet engine without an HTTP server is a `kvfleet scheduler` with its `kvfleet worker`, in a "
                  "cluster whose gateways route among the replicas (docs/cluster.md)",
    "--config": "kvfleet reads no YAML config file; pass the flags",
    "--grpc": "kvfleet's schedulers serve vLLM's gRPC engine protocol beside the HTTP gateway: "
              "`kvfleet cluster up --engine-port PORT` (or `kvfleet scheduler --engine-port`)",
    # frontend
    "--chat-template-content-format": "kvfleet hands the chat template each message's text as a string (text parts "
                                      "joined), vLLM's \"string\" format; drop the flag",
    "--trust-request-chat-template": "kvfleet takes no chat template in a request; set one with --chat-template",
    "--default-chat-template-kwargs": "kvfleet passes no extra variables to the chat template; give a template that "
                                      "sets them with --chat-template",
    "--response-role": "kvfleet's answers always have the role assistant; drop the flag",
    "--exclude-tools-when-tool-choice-none": "kvfleet renders the request's tools into the prompt whatever its "
                                             "tool_choice; leave tools out of a request that must not use them",
    "--tool-parser-plugin": f"{_NO_PLUGINS}; use --tool-call-parser, one of {', '.join(TOOL_CALL_PARSERS)}",
    "--tool-server": "kvfleet has no built-in tools or MCP tool servers (vLLM's Responses API); drop the flag",
    "--log-config-file": "kvfleet logs to stderr in one format for every role; set uvicorn's level with "
                         "--uvicorn-log-level",
    "--max-log-len": _NEVER_LOGS,
    "--enable-log-outputs": _NEVER_LOGS,
    "--enable-log-deltas": _NEVER_LOGS,
    "--log-error-stack": "kvfleet always logs an unexpected error with its stack; drop the flag",
    "--tokens-only": "kvfleet has no tokens-only server; send token ids as the prompt of /v1/completions",
    "--disable-access-log-for-endpoints": "use --disable-uvicorn-access-log, for every endpoint",
    "--allow-credentials": _CORS,
    "--allowed-origins": _CORS,
    "--allowed-methods": _CORS,
    "--allowed-headers": _CORS,
    "--ssl-ca-certs": _TLS,
    "--enable-ssl-refresh": _TLS,
    "--ssl-cert-reqs": _TLS,
    "--ssl-ciphers": _TLS,
    "--middleware": "kvfleet loads no ASGI middleware from the command line; put it in a proxy in front of kvfleet",
    "--enable-request-id-headers": "kvfleet sends no X-Request-Id header; a response's id names the request",
    "--disable-fastapi-docs": _DOCS,
    "--enable-offline-docs": _DOCS,
    "--h11-max-incomplete-event-size": "kvfleet keeps uvicorn's h11 limits; --max-request-body-bytes bounds bodies",
    "--h11-max-header-count": "kvfleet keeps uvicorn's h11 limits; --max-request-body-bytes bounds bodies",
    # ModelConfig
    "--tokenizer-mode": "kvfleet uses the model's fast tokenizer (tokenizer.json) or a GGUF file's own; drop the flag",
    "--hf-config-path": "kvfleet reads the model's configuration from --model's files; drop the flag",
    "--allowed-local-media-path": _TEXT_ONLY,
    "--allowed-media-domains": _TEXT_ONLY,
    "--code-revision": _NO_CODE,
    "--allow-deprecated-quantization": "kvfleet runs GGUF's 4- and 8-bit formats and unquantized weights only; "
                                       "drop the flag",
    "--enable-return-routed-experts": _NO_MOE,
    "--logprobs-mode": "kvfleet's logprobs are always of the raw logits (vLLM's default, raw_logprobs); drop the flag",
    "--disable-sliding-window": "kvfleet's attention has no sliding window to disable; drop the flag",
    "--disable-cascade-attn": "kvfleet has no cascade attention; drop the flag",
    "--skip-tokenizer-init": "kvfleet always loads the tokenizer (the gateway detokenizes and matches stop strings); "
                             "drop the flag",
    "--enable-prompt-embeds": "kvfleet takes prompts as text or token ids, not embeddings; drop the flag",
    "--config-format": "kvfleet reads config.json or a GGUF file's metadata, as the files say; drop the flag",
    "--hf-token": "kvfleet downloads nothing: models come from local paths or the local HF cache; drop the flag",
    "--hf-overrides": "kvfleet applies no overrides to the model's configuration; edit config.json in a local copy",
    "--override-generation-config": "write the settings in a generation_config.json and pass its directory with "
                                    "--generation-config",
    "--enable-sleep-mode": "kvfleet has no sleep mode; stop the server, or drain a replica, to free its device",
    "--model-impl": "kvfleet runs its own implementation of each architecture; drop the flag",
    "--override-attention-dtype": "kvfleet computes attention in --dtype, over a KV cache in --kv-cache-dtype",
    "--logits-processors": f"{_NO_PLUGINS}; use the request fields logit_bias, allowed_token_ids, bad_words and "
                           "the penalties",
    "--io-processor-plugin": f"{_NO_PLUGINS}; drop the flag",
    "--renderer-num-workers": "kvfleet renders and tokenizes prompts on a thread of their own; in a cluster, run more "
                              "tokenizer replicas",
    # StructuredOutputsConfig
    "--reasoning-parser-plugin": f"{_NO_PLUGINS}; use --reasoning-parser, one of {', '.join(REASONING_PARSERS)}",
    # ParallelConfig, besides one machine's group
    "--decode-context-parallel-size": _CONTEXT_PARALLEL,
    "--dcp-comm-backend": _CONTEXT_PARALLEL,
    "--dcp-kv-cache-interleave-size": _CONTEXT_PARALLEL,
    "--cp-kv-cache-interleave-size": _CONTEXT_PARALLEL,
    "--prefill-context-parallel-size": _CONTEXT_PARALLEL,
    "--data-parallel-size": _DATA_PARALLEL,
    "--data-parallel-rank": _DATA_PARALLEL,
    "--data-parallel-start-rank": _DATA_PARALLEL,
    "--data-parallel-size-local": _DATA_PARALLEL,
    "--data-parallel-address": _DATA_PARALLEL,
    "--data-parallel-rpc-port": _DATA_PARALLEL,
    "--data-parallel-backend": _DATA_PARALLEL,
    "--data-parallel-hybrid-lb": _DATA_PARALLEL,
    "--data-parallel-external-lb": _DATA_PARALLEL,
    "--disable-nccl-for-dp-synchronization": _DATA_PARALLEL,
    "--enable-ep-weight-filter": _NO_MOE,
    "--all2all-backend": _NO_MOE,
    "--enable-elastic-ep": _NO_MOE,
    "--enable-eplb": _NO_MOE,
    "--eplb-config": _NO_MOE,
    "--expert-placement-strategy": _NO_MOE,
    "--enable-dbo": "kvfleet has no dual-batch overlap; drop the flag",
    "--ubatch-size": "kvfleet has no dual-batch overlap; drop the flag",
    "--dbo-decode-token-threshold": "kvfleet has no dual-batch overlap; drop the flag",
    "--dbo-prefill-token-threshold": "kvfleet has no dual-batch overlap; drop the flag",
    "--worker-cls": f"{_NO_PLUGINS}; drop the flag",
    "--worker-extension-cls": f"{_NO_PLUGINS}; drop the flag",
    # CacheConfig
    "--kv-cache-memory-bytes": "kvfleet's --kv-cache-memory is the KV cache's bytes on CPU; on a GPU, use "
                               "--gpu-memory-utilization or --num-gpu-blocks-override",
    "--prefix-caching-hash-algo": "kvfleet always hashes blocks with sha256, reproducible across processes; drop the "
                                  "flag",
    "--calculate-kv-scales": _FP8_KV,
    "--kv-cache-dtype-skip-layers": _FP8_KV,
    "--kv-sharing-fast-prefill": "kvfleet shares no KV across layers; drop the flag",
    "--mamba-cache-dtype": _MAMBA,
    "--mamba-ssm-cache-dtype": _MAMBA,
    "--mamba-block-size": _MAMBA,
    "--mamba-cache-mode": _MAMBA,
    # SchedulerConfig
    "--max-num-partial-prefills": _PARTIAL_PREFILLS,
    "--max-long-partial-prefills": _PARTIAL_PREFILLS,
    "--long-prefill-token-threshold": _PARTIAL_PREFILLS,
    "--scheduling-policy": "kvfleet schedules first come, first served (vLLM's fcfs); drop the flag",
    "--disable-chunked-mm-input": _TEXT_ONLY,
    "--scheduler-cls": f"{_NO_PLUGINS}; drop the flag",
    "--scheduler-reserve-full-isl": "kvfleet's scheduler has no such admission setting; drop the flag",
    "--disable-hybrid-kv-cache-manager": "kvfleet has one KV cache manager for every layer; drop the flag",
    "--stream-interval": "kvfleet streams each step's tokens as the step ends; drop the flag",
    # CompilationConfig, KernelConfig
    "--cudagraph-capture-sizes": "kvfleet takes these as --cuda-graph-sizes (vLLM's earlier name)",
    "--max-cudagraph-capture-size": "kvfleet's --cuda-graph-sizes lists the sizes; by default they go up to "
                                    "--max-num-seqs",
    "--enable-flashinfer-autotune": "kvfleet has no FlashInfer kernels (--attention-backend triton or torch); drop the "
                                    "flag",
    "--moe-backend": _NO_MOE,
    # VllmConfig
    "--kv-events-config": "kvfleet's schedulers publish KV events on NATS in a cluster (kvfleet.kv.*) and over vLLM's "
                          "gRPC engine protocol (--engine-port), not over ZMQ; drop the flag",
    "--ec-transfer-config": _TEXT_ONLY,
    "--compilation-config": "kvfleet uses no torch.compile; CUDA graphs are set by --cuda-graph-sizes and "
                            "--enforce-eager",
    "--attention-config": "use --attention-backend",
    "--reasoning-config": "use --reasoning-parser",
    "--kernel-config": "kvfleet has no kernel settings beyond --attention-backend; drop the flag",
    "--additional-config": "kvfleet takes no platform-specific configuration; drop the flag",
    "--structured-outputs-config": "kvfleet compiles output constraints with xgrammar, always; the reasoning parser is "
                                   "--reasoning-parser",
    "--profiler-config": "kvfleet has no built-in profiler; drop the flag",
    "--optimization-level": "kvfleet has no optimization levels: --enforce-eager turns CUDA graphs off; drop the flag",
    "--performance-mode": "kvfleet has no performance modes; drop the flag",
    "--weight-transfer-config": "kvfleet does not update weights while serving; restart with the new weights",
    # AsyncEngineArgs
    "--aggregate-engine-logging": "kvfleet logs no periodic engine stats (they are on /metrics); drop the flag",
    "--fail-on-environ-validation": "kvfleet reads no VLLM_* environment variables but VLLM_ALLOW_LONG_MAX_MODEL_LEN; "
                                    "drop the flag",
    "--gdn-prefill-backend": "kvfleet implements no gated delta-net model; drop the flag",
    "--enable-log-requests": _NEVER_LOGS,
}

FIELD_REASONS: dict[str, str] = {
    "suffix": "kvfleet inserts no suffix (fill-in-the-middle); write the prompt in the model's own FIM format",
    "prompt_embeds": "kvfleet takes prompts as text or token ids, not embeddings",
    "add_special_tokens": "kvfleet adds the tokenizer's special tokens to a text prompt, and a chat template writes "
                          "its own; send token ids to choose them exactly",
    "response_format": "on completions, use structured_outputs (json, regex, choice, grammar) to constrain the output",
    "priority": "kvfleet schedules first come, first served; drop it",
    "request_id": "kvfleet names each request itself: the response's id",
    "vllm_xargs": "kvfleet loads no logits-processor plugins to pass arguments to; drop it",
    "repetition_detection": "use repetition_penalty, frequency_penalty or stop strings against repetition",
    "reasoning_effort": "kvfleet passes no reasoning_effort to the chat template; say it in the messages",
    "thinking_token_budget": "kvfleet puts no bound on reasoning tokens apart from max_tokens",
    "include_reasoning": "with --reasoning-parser the reasoning always comes in its own field; leave it unread",
    "documents": "kvfleet passes no documents to the chat template; put them in the messages",
    "chat_template": "kvfleet takes no chat template in a request; set one with --chat-template",
    "chat_template_kwargs": "kvfleet passes no extra variables to the chat template; give a template that sets them "
                            "with --chat-template",
    "media_io_kwargs": "kvfleet serves text-only models",
    "mm_processor_kwargs": "kvfleet serves text-only models",
}
