"""Which replicas serve which model, for a gateway fronting several (`--extra-model`).

Every scheduler and tokenizer lease names its model (its `--model`). A gateway's extra
model is served by the leases naming it; its main model (`--model`) by every other
lease, so a gateway fronting one model takes every replica whatever its lease says, as
before there were several.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from services.registry import Member


def serving(model: str | None, extra_models: Sequence[str]) -> Callable[[Member], bool]:
    """The leases of `model` (one of `extra_models`), or of the main model (None)."""
    if model is None:
        others = frozenset(extra_models)
        return lambda member: member.metadata.get("model") not in others
    return lambda member: member.metadata.get("model") == model
