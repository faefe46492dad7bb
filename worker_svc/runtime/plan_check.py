"""What a worker checks in a step plan before it touches any state.

A plan names raw block ids and request state the worker must already hold; run blindly,
one out-of-range id writes into another request's KV (or past the pool), and a plan for
another worker instance builds on state this one never had. Every plan is checked
whole first, so a refused plan changes nothing.
"""
from __future__ import annotations

from collections.abc import Container, Iterable

from services.messages import StepPlan


class InvalidPlan(ValueError):
    """A plan this worker cannot run as it stands; nothing of it was applied."""


class WrongWorkerInstance(InvalidPlan):
    """A step plan made for another worker instance: this one holds none of its state."""


def check_plan(plan: StepPlan, instance_id: str, num_blocks: int, num_host_blocks: int,
               known_requests: Container[str]) -> None:
    """Raises InvalidPlan (WrongWorkerInstance for a plan made for another instance)."""
    if plan.worker_instance_id != instance_id:
        raise WrongWorkerInstance(
            f"step {plan.step_id} was planned for worker instance {plan.worker_instance_id or '(none)'}, this is "
            f"{instance_id} (restarted?): it holds none of that plan's state"
        )
    _in_range("a block id", (b for new in plan.new_requests for b in new.block_ids), num_blocks)
    _in_range("a block id", (b for cached in plan.cached_requests for b in cached.new_block_ids), num_blocks)
    _in_range("a copied block", (b for pair in plan.blocks_to_copy for b in pair), num_blocks)
    _in_range("a swapped-out device block", (device for device, _ in plan.blocks_to_swap_out), num_blocks)
    _in_range("a swapped-in device block", (device for _, device in plan.blocks_to_swap_in), num_blocks)
    _in_range("a host block", (host for _, host in plan.blocks_to_swap_out), num_host_blocks)
    _in_range("a host block", (host for host, _ in plan.blocks_to_swap_in), num_host_blocks)
    arriving = {new.request_id for new in plan.new_requests}
    for cached in plan.cached_requests:
        if cached.request_id not in known_requests:
            raise InvalidPlan(f"step {plan.step_id}: request {cached.request_id!r} is not held here")
    for request_id, count in plan.num_scheduled_tokens.items():
        if count < 1:
            raise InvalidPlan(f"step {plan.step_id}: {count} tokens scheduled for {request_id!r}")
        if request_id not in arriving and request_id not in known_requests:
            raise InvalidPlan(f"step {plan.step_id}: request {request_id!r} is scheduled but not held here")
    for request_id, drafts in plan.scheduled_spec_decode_tokens.items():
        if not 0 < len(drafts) < plan.num_scheduled_tokens.get(request_id, 0):
            raise InvalidPlan(f"step {plan.step_id}: {len(drafts)} drafts for {request_id!r}, which is scheduled "
                              f"{plan.num_scheduled_tokens.get(request_id, 0)} tokens")


def _in_range(what: str, ids: Iterable[int], size: int) -> None:
    for block_id in ids:
        if not 0 <= block_id < size:
            raise InvalidPlan(f"{what} {block_id} is outside this worker's pool of {size}")
