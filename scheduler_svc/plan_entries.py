"""What a step plan says of each request it schedules: its token count (and drafts to
verify), and its data for the worker, in full the first time (NewRequestData), after
that only what changed (CachedRequestData: new blocks, new outputs)."""
from __future__ import annotations

from scheduler_svc.request import Request
from services.messages import CachedRequestData, NewRequestData, StepPlan


def add_to_plan(plan: StepPlan, request: Request, num_tokens: int, new_blocks: list[int],
                drafts: list[int] = ()) -> None:
    """`drafts`: appended to the request's `num_tokens` inputs, to verify."""
    plan.num_scheduled_tokens[request.request_id] = num_tokens + len(drafts)
    if drafts:
        plan.scheduled_spec_decode_tokens[request.request_id] = list(drafts)
    computed = request.num_computed_tokens + request.num_in_flight_tokens  # once the steps in flight are done
    if computed + num_tokens == request.num_tokens + request.num_ahead_samples:
        request.num_ahead_samples += 1  # the step reaches the last token: it samples the next
    request.num_in_flight_tokens += num_tokens + len(drafts)
    outputs = request.output_token_ids
    if request.known_to_worker:
        plan.cached_requests.append(CachedRequestData(request.request_id, new_blocks, computed,
                                                      outputs[request.num_outputs_on_worker :]))
        request.num_outputs_on_worker = len(outputs)
        return
    request.known_to_worker = True
    request.num_outputs_on_worker = len(outputs)
    plan.new_requests.append(
        NewRequestData(
            request_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            block_ids=list(request.block_ids),
            num_computed_tokens=request.num_computed_tokens,
            sampling_params=request.sampling_params,
            lora_request=request.lora_request,
        )
    )
