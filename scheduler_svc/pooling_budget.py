"""How many pooling tokens a step may take beside generation (docs/pooling.md).

A replica that serves embeddings beside chat (a generating decoder with --pooler-config)
shares each step between the two. A pooling request is all prefill: given the step's
whole token budget, it would make every step of the chat streams beside it many times
longer (a 512-token step of the default model costs 15 decode steps on a 2-core CPU).
So while generation requests run, their mean turn (from one step's outputs to the next's,
what a stream waits for a token) may be POOLING_STEP_RISE longer than without pooling
work, kept as a credit of seconds: each turn of generation earns (1 + rise) times a turn
without pooling work and spends what it took, the work of taking pooling requests in
and of planning around them included. Pooling tokens go only into steps planned out of
debt, as many as the credit buys at the measured cost per prompt token. An account
rather than a per-step cap, because a step's cost is not a decode step plus a cost per
token: on an AVX2 CPU a decode row runs the int16 kernel
alone and the float32 kernels beside any 3 more rows, so a mixed step costs twice a
decode-only one before its first pooling token; an account pays that jump rarely, for
big chunks, where a per-step cap paid it every step. Pooling requests are chunked to fit
(a decoder's pooling runs across chunks), and take the whole budget again once no
generation request runs. The costs come from the replica's own steps (EngineCore records
them), so the rule follows the hardware: a GPU, whose step costs little more for hundreds
of tokens, gets hundreds a step; this CPU a chunk every few steps.

vLLM serves one kind of request per server, so it has no such rule; kvfleet's mixed
replicas need one.
"""
from __future__ import annotations

from scheduler_svc.request import Request

# The issue's bound on the chat streams' inter-token latency beside embeddings is +25%.
# The account aims 10 points under it: aimed at +20%, runs on one quiet machine landed
# anywhere from +18.6% to +23.4% (benchmarks/pooling.py --itl), as step times vary.
POOLING_STEP_RISE = 0.15
# Until both costs have been measured: one block's worth.
INITIAL_CAP = 16
# A step with fewer prompt tokens tells too little of their cost over the step's noise.
MIN_MEASURED_TOKENS = 32
# Weight of each new measurement in the running averages.
SMOOTHING = 0.2
# The most credit kept, in decode-only steps' allowances: a burst after a quiet spell
# stays one ordinary chunk.
MAX_CREDIT_STEPS = 8


class PoolingBudget:
    def __init__(self, max_rise: float = POOLING_STEP_RISE) -> None:
        self.max_rise = max_rise
        self._alone_s: float | None = None  # a turn of decode rows only, no pooling work anywhere
        self._step_s: float | None = None  # a turn of decode rows only, whatever else waits
        self._token_s: float | None = None  # each prompt token on top of it
        self._credit = 0.0  # seconds the streams may still lose to pooling
        self._left: int | None = None  # of the step being planned; None when uncapped

    def record(self, prompt_tokens: int, decode_rows: int, seconds: float, pooling: bool) -> None:
        """One turn: its step's prompt tokens (prefill and pooling) and one-token rows, how
        long the streams waited for it, and whether pooling requests were waiting or running."""
        if prompt_tokens == 0 and decode_rows:
            self._step_s = _averaged(self._step_s, seconds)
            if not pooling:
                self._alone_s = _averaged(self._alone_s, seconds)
        elif prompt_tokens >= MIN_MEASURED_TOKENS and self._step_s is not None:
            self._token_s = _averaged(self._token_s, max(seconds - self._step_s, 0.0) / prompt_tokens)
        if decode_rows and self._step_s is not None:
            # Earned only while pooling waits: a quiet spell's credit spent at once would be
            # a burst the streams' mean over a short answer does not absorb.
            most = MAX_CREDIT_STEPS * self.max_rise * self._baseline_s if pooling else 0.0
            self._credit = min(self._credit + self._allowed_turn_s - seconds, most)

    def cap(self) -> int:
        """Pooling tokens the next step beside generation may take: none while the streams
        are in debt, else what the credit and this turn's allowance buy beyond its decode rows."""
        if self._step_s is None or not self._token_s:
            return INITIAL_CAP
        if self._credit < 0:
            return 0
        return max(1, int((self._credit + self._allowed_turn_s - self._step_s) / self._token_s))

    @property
    def _baseline_s(self) -> float:
        """A turn without pooling work; any decode-only turn until one is measured (callers
        check that _step_s is)."""
        return self._alone_s or self._step_s

    @property
    def _allowed_turn_s(self) -> float:
        """The turn the streams may take on average beside pooling."""
        return (1 + self.max_rise) * self._baseline_s

    def start_step(self, capped: bool) -> None:
        """A step is planned: its pooling tokens are capped (while generation requests
        run or wait, and prompts can be chunked), else they may take the whole budget."""
        self._left = self.cap() if capped else None

    def room(self, request: Request, budget: int) -> int:
        """The step's tokens this request may take: a pooling request's are capped too."""
        if self._left is None or request.sampling_params.pooling is None:
            return budget
        return min(budget, self._left)

    def take(self, request: Request, num_tokens: int) -> None:
        if self._left is not None and request.sampling_params.pooling is not None:
            self._left -= num_tokens


def _averaged(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - SMOOTHING) * average + SMOOTHING * sample
