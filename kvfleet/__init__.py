"""kvfleet's public facade: `from kvfleet import LLM, SamplingParams`."""
import os

# Before torch loads OpenMP: idle threads sleep instead of spinning (see services/threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from services.beam_search import BeamSearchParams  # noqa: E402
from services.llm import LLM  # noqa: E402
from services.outputs import CompletionOutput, RequestOutput  # noqa: E402
from services.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
