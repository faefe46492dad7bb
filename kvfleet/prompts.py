"""The prompt forms the SDK takes, shared by generate() and the pooling methods."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# A prompt is text, token ids, or vLLM's dict form {"prompt": ...} / {"prompt_token_ids": ...},
# where the dict may carry a "cache_salt" that keeps its prefix cache apart from other tenants'.
Prompt = str | Sequence[int] | dict[str, Any]


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)
