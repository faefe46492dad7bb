"""SamplingParams with vLLM's field names, defaults and validation.

Validation raises `ValueError` whose message starts with the offending field name,
so every front end (SDK, REST, gRPC) can report which parameter was wrong. The class
is also what crosses processes (msgpack, services/transport/rpc.py): decoding runs the
same validation, so a role never holds parameters that the SDK would have refused.
"""
from __future__ import annotations

import msgspec

from services.invalid_parameter import InvalidParameter
from services.pooling_params import PoolingParams
from services.structured_outputs import StructuredOutputsParams

MAX_PARALLEL_SAMPLES = 128
# Bounds on the work one request may ask for, checked by every front door (HTTP, both
# gRPC services, the SDK) through this class: they keep a request's per-step cost
# (masks, string matching) small next to its forward pass, far above what real clients
# send. MAX_LOGPROBS, vLLM's max_logprobs, is the public doors' own (VllmEngine's, and
# the HTTP gateway's default for --max-logprobs): beam search asks the scheduler for
# 2 x beam_width per step.
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 262_144
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 256


class SamplingParams(msgspec.Struct, omit_defaults=True, repr_omit_defaults=True):
    n: int = 1
    best_of: int | None = None  # sample this many, return the n with the best cumulative logprob
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables it, as in vLLM
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k per prompt token (computing them bypasses the prefix cache)
    # Keep only the last k prompt tokens; -1 keeps max_model_len of them.
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Filled by the front end that owns the tokenizer: each bad word as token ids,
    # with and without a leading space, as vLLM does.
    bad_words_token_ids: list[list[int]] = []
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name for structured_outputs: moved there on construction, so always None after.
    guided_decoding: StructuredOutputsParams | None = None
    # Set for a pooling request (an embedding): prefill only, its result a vector, no token.
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidParameter("guided_decoding", "set structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("n", 1 <= self.n <= MAX_PARALLEL_SAMPLES, f"must be in [1, {MAX_PARALLEL_SAMPLES}], got {self.n}"),
            ("best_of", self.best_of is None or self.n <= self.best_of <= MAX_PARALLEL_SAMPLES,
             f"must be in [n, {MAX_PARALLEL_SAMPLES}], got {self.best_of} with n={self.n}"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
             f"must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             f"must be in [-2, 2], got {self.frequency_penalty}"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0,
             f"must be in (0, 2], got {self.repetition_penalty}"),
            ("logit_bias", all(-100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()),
             "biases must be in [-100, 100]"),
            ("logit_bias", len(self.logit_bias or {}) <= MAX_LOGIT_BIAS_ENTRIES,
             f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias or {})}"),
            ("allowed_token_ids", self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "must not be empty"),
            ("allowed_token_ids", len(self.allowed_token_ids or []) <= MAX_ALLOWED_TOKEN_IDS,
             f"at most {MAX_ALLOWED_TOKEN_IDS} tokens, got {len(self.allowed_token_ids or [])}"),
            ("bad_words", len(self.bad_words or []) <= MAX_BAD_WORDS,
             f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words or [])}"),
            ("bad_words", all(len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words or []),
             f"each at most {MAX_BAD_WORD_CHARS} characters"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"),
            ("stop", all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
             f"each at most {MAX_STOP_STRING_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}"),
            ("temperature", self.temperature >= 0.0, f"must be >= 0, got {self.temperature}"),
            ("top_p", 0.0 < self.top_p <= 1.0, f"must be in (0, 1], got {self.top_p}"),
            ("top_k", 0 <= self.top_k <= 2**63 - 1, f"must be -1 (disable) or >= 1, got {self.top_k}"),
            # Children of a parallel request use seed + index; torch takes seeds in [-2**63, 2**64).
            ("seed", self.seed is None or -(2**63) <= self.seed <= 2**64 - 1 - MAX_PARALLEL_SAMPLES,
             f"must fit in 64 bits, got {self.seed}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"must be in [0, 1], got {self.min_p}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             f"must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0, f"must be >= 0, got {self.min_tokens}"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, f"must be >= 0, got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"must be >= 0, got {self.prompt_logprobs}"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
             or self.truncate_prompt_tokens >= 1, f"must be -1 or >= 1, got {self.truncate_prompt_tokens}"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "token ids must be >= 0"),
            ("stop", all(s for s in self.stop), "stop strings must not be empty"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidParameter(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling the next token reads the ones generated so far (penalties, bad
        words, min_tokens' count, a grammar's state): such a request never runs a step ahead."""
        return bool(self.repetition_penalty != 1 or self.frequency_penalty or self.presence_penalty
                    or self.bad_words_token_ids or self.min_tokens or self.structured_outputs)
