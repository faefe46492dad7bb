"""Engine configuration, with vLLM's names and defaults where vLLM has them.

Every value is checked here, before anything loads: a setting that cannot work is a
ConfigError naming its flag, which the CLI prints as one line (exit 2) and the SDK
raises. Settings kvfleet accepts for vLLM's sake but does not act on are listed by
`ignored()`, for one log line each at start-up.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from services.kv_transfer_config import KvTransferConfig, KvTransferConfigError, parse_kv_transfer_config
from services.pooling_params import parse_pooler_config
from services.speculative_config import SpeculativeConfig, SpeculativeConfigError, parse_speculative_config


class ConfigError(ValueError):
    """A setting that cannot work, found before any loading."""


# vLLM's --dtype spellings -> the torch dtype computed in ("auto" is decided per device).
DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
          "float32": "float32"}
# GGUF files are quantized (Q4_1, Q8_0, ...) and read as such; other formats are not implemented.
QUANTIZATIONS = ("gguf", "none")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")  # vLLM's names; auto: the model's dtype
GENERATION_CONFIGS = ("auto", "vllm")  # or a directory holding generation_config.json
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner (draft models are not supported)
CONVERTS = ("auto", "none", "embed", "classify")  # vLLM's --convert
# Decode batch sizes captured as CUDA graphs when --cuda-graph-sizes is not given (cut at --max-num-seqs).
DEFAULT_CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class EngineConfig:
    model: str = "smollm2"
    revision: str = "main"  # of a repo id in the local HF cache: a branch, tag or commit
    tokenizer: str | None = None  # None: the model's own
    tokenizer_revision: str = "main"
    # "auto" applies the model's generation_config.json sampling defaults, as vLLM does;
    # "vllm" ignores them; or a directory with its own generation_config.json.
    generation_config: str = "auto"
    # "auto" is float32 on CPU (this CPU's bf16 matmuls gain little and lose parity) and bfloat16 on GPU.
    dtype: str = "auto"
    device: str = "auto"
    # gguf (a GGUF file's default, as in vLLM): its 4- and 8-bit weights run as stored on CPU; none: dequantized
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # float16 for GGUF run as stored, else the model's dtype; or bfloat16/float16
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int = 4 * 2**30  # bytes of KV on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE default)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    # The KV connector's offload tiers (docs/kv_connector.md): host memory beside the
    # device pool (GiB), a local directory and a directory replicas share, each with a
    # byte bound (GiB). A block evicted from the device pool is found in them again.
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"  # vLLM's name; kvfleet's tiers are its own
    kv_offloading_dir: str | None = None
    kv_offloading_dir_size: float = 16.0
    kv_shared_dir: str | None = None
    kv_shared_dir_size: float = 64.0
    seed: int = 0  # seeds the sampling of requests that bring no seed of their own
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # auto: Triton kernels on CUDA, torch (with the C decode kernel) on CPU; triton on CPU runs interpreted (tests)
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = False  # plan step N+1 while step N runs (one rank only, for now)
    cuda_graph_sizes: tuple[int, ...] | None = None  # None: DEFAULT_CUDA_GRAPH_SIZES up to max_num_seqs
    trust_remote_code: bool = False
    # vLLM's JSON (a dict from the SDK); kept as canonical JSON, parsed into `speculative`.
    speculative_config: str | None = None
    # vLLM's JSON (a dict from the SDK): this replica's side of prefill/decode
    # disaggregation (docs/disaggregation.md); kept as canonical JSON, parsed into `kv_transfer`.
    kv_transfer_config: str | None = None
    # Pooling (docs/pooling.md), vLLM's flags: auto generates with a decoder and pools with an
    # encoder; --convert embed makes a decoder an embedder (it implies --runner pooling).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | None = None  # vLLM's JSON: pooling_type, normalize, dimensions
    # LoRA adapters (docs/lora.md), vLLM's names and defaults: device slots, the largest rank,
    # and adapters kept in host memory (None: as many as the slots).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[self.dtype]
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"--device {self.device}: choose auto, cpu or cuda (cuda:N for one GPU)")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"--block-size {self.block_size}: choose one of 8, 16, 32, 64, 128")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(f"--preemption-mode {self.preemption_mode}: choose recompute or swap")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_gpu_blocks_override",
                     "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{flag(name)} {value}: must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: must be in (0, 1]")
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space {self.swap_space}: must not be negative")
        self._check_kv_tiers()
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} {getattr(self, name)}: must be positive")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"--quantization {self.quantization}: kvfleet cannot run these weights yet; it runs GGUF files "
                "(--quantization gguf runs their 4-bit weights as stored, none dequantizes them) and unquantized "
                "safetensors"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"--attention-backend {self.attention_backend}: choose one of "
                              f"{', '.join(ATTENTION_BACKENDS)}")
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = tuple(sorted(set(self.cuda_graph_sizes)))
            if not self.cuda_graph_sizes or self.cuda_graph_sizes[0] < 1:
                raise ConfigError(f"--cuda-graph-sizes {' '.join(map(str, self.cuda_graph_sizes))}: give positive "
                                  "batch sizes")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype}: choose one of {', '.join(KV_CACHE_DTYPES)} "
                              "(fp8 caches are not supported)")
        self._check_speculative()
        self._check_kv_transfer()
        self._check_pooling()
        self._check_lora()

    def _check_pooling(self) -> None:
        if self.runner not in RUNNERS:
            raise ConfigError(f"--runner {self.runner}: choose one of {', '.join(RUNNERS)}")
        if self.convert not in CONVERTS:
            raise ConfigError(f"--convert {self.convert}: choose one of {', '.join(CONVERTS)}")
        if self.convert in ("embed", "classify"):
            if self.runner == "generate":
                raise ConfigError(f"--convert {self.convert} makes a pooling model: use --runner pooling (or auto)")
            self.runner = "pooling"
        self.pooler_overrides: dict = {}
        if self.pooler_config is not None:
            try:
                self.pooler_overrides = parse_pooler_config(self.pooler_config)
            except ValueError as exc:
                raise ConfigError(f"--pooler-config: {exc}") from exc
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ConfigError("--speculative-config drafts tokens: a pooling model generates none; drop it")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{flag(name)} {value}: must be positive")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:  # as vLLM: the host cache feeds the slots
            raise ConfigError(f"--max-cpu-loras {self.max_cpu_loras}: must be at least --max-loras {self.max_loras}")
        if self.enable_lora and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("--enable-lora serves one-rank workers for now: drop --tensor-parallel-size and "
                              "--pipeline-parallel-size")

    def _check_speculative(self) -> None:
        self.speculative: SpeculativeConfig | None = None
        if self.speculative_config is None:
            return
        try:
            self.speculative = parse_speculative_config(self.speculative_config)
        except SpeculativeConfigError as exc:
            raise ConfigError(f"--speculative-config: {exc}") from exc
        self.speculative_config = self.speculative.to_json()

    def _check_kv_transfer(self) -> None:
        self.kv_transfer: KvTransferConfig | None = None
        if self.kv_transfer_config is None:
            return
        try:
            self.kv_transfer = parse_kv_transfer_config(self.kv_transfer_config)
        except KvTransferConfigError as exc:
            raise ConfigError(f"--kv-transfer-config: {exc}") from exc
        self.kv_transfer_config = self.kv_transfer.to_json()
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("--kv-transfer-config serves one-rank workers for now: drop --tensor-parallel-size and "
                              "--pipeline-parallel-size, or the kv transfer config")
        # Holds end through empty steps' results, which a plan kept ahead never leaves room for.
        if self.async_scheduling:
            raise ConfigError("--kv-transfer-config with --async-scheduling is not supported yet: drop one of them")

    @property
    def has_kv_connector(self) -> bool:
        """Whether the KV connector runs: for offload tiers, or for a prefill/decode handoff."""
        return self.has_kv_tiers or self.kv_transfer is not None

    @property
    def has_kv_tiers(self) -> bool:
        return bool(self.kv_offloading_size or self.kv_offloading_dir or self.kv_shared_dir)

    def _check_kv_tiers(self) -> None:
        if self.kv_offloading_backend != "native":
            raise ConfigError(f"--kv-offloading-backend {self.kv_offloading_backend}: kvfleet offloads KV with its "
                              "own tiers (native); LMCache is not supported")
        for name in ("kv_offloading_size", "kv_offloading_dir_size", "kv_shared_dir_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} {getattr(self, name)}: must not be negative")
        if not self.has_kv_tiers:
            return
        if not self.enable_prefix_caching:
            raise ConfigError("the KV offload tiers find blocks by their prefix hashes: drop --no-enable-prefix-caching")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("the KV offload tiers serve one-rank workers for now: drop --tensor-parallel-size and "
                              "--pipeline-parallel-size, or the --kv-offloading-*/--kv-shared-* flags")
        for name in ("kv_offloading_dir", "kv_shared_dir"):
            directory = getattr(self, name)
            if directory is None:
                continue
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"{flag(name)} {directory}: cannot create it ({exc.strerror})") from exc
            if not os.access(directory, os.W_OK | os.X_OK):
                raise ConfigError(f"{flag(name)} {directory}: not writable by this process")

    def graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture as CUDA graphs (none with --enforce-eager)."""
        if self.enforce_eager:
            return ()
        if self.cuda_graph_sizes is not None:
            return self.cuda_graph_sizes
        sizes = tuple(size for size in DEFAULT_CUDA_GRAPH_SIZES if size < self.max_num_seqs)
        return (*sizes, self.max_num_seqs)

    def ignored(self) -> list[str]:
        """A line for each setting accepted for vLLM's sake that changes nothing here."""
        notes = []
        if self.async_scheduling and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            notes.append("--async-scheduling has no effect on a worker group yet: its followers would need the "
                         "leader's sampled tokens; a pipeline keeps its stages busy with micro-batches instead")
        if self.trust_remote_code:
            notes.append("--trust-remote-code has no effect: kvfleet implements each architecture itself and "
                         "never runs a model repository's code")
        return notes
