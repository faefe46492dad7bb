"""kvfleet's public face and the only place that composes several roles: the offline
SDK (`from kvfleet import LLM, SamplingParams`), embedded `kvfleet serve`,
`kvfleet cluster up` and the `kvfleet` console script. It may import every role;
nothing imports it but tests and benchmarks.

`LLM` loads on first use, so that `kvfleet <role>` processes (and `--help`) never
import the worker's torch code through this package.
"""
from importlib.metadata import version
from typing import Any

from services.beam_search import BeamSearchParams
from services.lora_request import LoRARequest
from services.outputs import CompletionOutput, RequestOutput
from services.pooling_outputs import ClassificationOutput, EmbeddingOutput, PoolingRequestOutput, ScoringOutput
from services.pooling_params import PoolingParams
from services.sampling_params import SamplingParams
from services.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

__version__ = version("kvfleet")  # what GET /version answers, as vllm.__version__ is vLLM's

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "StructuredOutputsParams", "GuidedDecodingParams", "PoolingParams", "PoolingRequestOutput",
           "EmbeddingOutput", "ClassificationOutput", "ScoringOutput", "LoRARequest"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvfleet.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvfleet' has no attribute {name!r}")
