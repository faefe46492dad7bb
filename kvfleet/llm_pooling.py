"""The offline SDK's pooling methods, shaped like vLLM's: `LLM.embed`, `LLM.classify`,
`LLM.score` (docs/pooling.md). Their requests go through the same engine steps as
generate()'s; each ends with one vector."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kvfleet.prompts import as_prompt_list
from services.pooling_outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    fit_pooling_prompt,
)
from services.pooling_params import PoolingParams
from services.sampling_params import SamplingParams
from services.scoring import cosine, pair_lists, pair_prompt

if TYPE_CHECKING:
    from scheduler_svc.engine_core import EngineCore
    from tokenizer_svc.tokenizer import Tokenizer


class PoolingMethods:
    engine: EngineCore
    tokenizer: Tokenizer
    _request_ids: itertools.count

    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """One vector per prompt (text, token ids, or vLLM's dict forms)."""
        lists = self._pooling_prompts(prompts, truncate_prompt_tokens)
        vectors = self._pool(lists, [pooling_params or PoolingParams()] * len(lists), use_tqdm)
        return [PoolingRequestOutput(request_id, ids, EmbeddingOutput(vector)) for request_id, ids, vector in vectors]

    def classify(self, prompts: Any, use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
                 use_activation: bool | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's label scores (a model with a classification head)."""
        if not self._pooler().labels:
            raise ValueError("LLM.classify() needs a model with a classification head")
        lists = self._pooling_prompts(prompts, truncate_prompt_tokens)
        scores = self._pool(lists, [PoolingParams(use_activation=use_activation)] * len(lists), use_tqdm)
        return [PoolingRequestOutput(request_id, ids, ClassificationOutput(probs)) for request_id, ids, probs in scores]

    def score(self, data_1: str | list[str], data_2: str | list[str], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Each pair's score: a cross-encoder's (its one label), or an embedding model's cosine."""
        firsts, seconds = pair_lists(data_1, data_2)
        limit = self.engine.max_model_len
        if self._pooler().labels:
            pairs = [pair_prompt(self.tokenizer.encode(a), self.tokenizer.encode(b)) for a, b in zip(firsts, seconds)]
            lists = [fit_pooling_prompt(ids, truncate_prompt_tokens, limit) for ids, _ in pairs]
            scored = self._pool(lists, [PoolingParams(second_segment_start=start) for _, start in pairs], use_tqdm)
            return [PoolingRequestOutput(rid, ids, ScoringOutput(vector[0])) for rid, ids, vector in scored]
        embedded = self.embed(firsts + seconds, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        pairs_out = zip(embedded[:len(firsts)], embedded[len(firsts):])
        return [PoolingRequestOutput(b.request_id, a.prompt_token_ids + b.prompt_token_ids,
                                     ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding)))
                for a, b in pairs_out]

    def _pooler(self) -> Any:
        pooler = self.engine.description.pooler
        if pooler is None:
            raise ValueError("pooling needs a pooling model: LLM(..., runner=\"pooling\") or convert=\"embed\"")
        return pooler

    def _pooling_prompts(self, prompts: Any, truncate_prompt_tokens: int | None) -> list[list[int]]:
        self._pooler()
        return [fit_pooling_prompt(self._tokenize(p)[1], truncate_prompt_tokens, self.engine.max_model_len)
                for p in as_prompt_list(prompts)]

    def _pool(self, lists: list[list[int]], params: Sequence[PoolingParams],
              use_tqdm: bool) -> list[tuple[str, list[int], list[float]]]:
        """(request id, prompt, vector) per token list, all in the engine at once."""
        order = [str(next(self._request_ids)) for _ in lists]
        try:
            # Shortest first, as sentence-transformers sorts its batches: a step's sequences
            # then have like lengths, and an encoder's attention pads them less.
            for index in sorted(range(len(lists)), key=lambda i: len(lists[i])):
                self.engine.add_request(order[index], lists[index], SamplingParams(pooling=params[index]))
        except Exception:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        vectors: dict[str, list[float]] = {}
        with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm or len(order) < 2) as bar:
            while self.engine.has_work:
                for delta in self.engine.step():
                    if delta.pooled is None:
                        raise RuntimeError(f"request {delta.request_id} ended without a vector: {delta.error}")
                    vectors[delta.request_id] = delta.pooled
                    bar.update(1)
        return [(request_id, ids, vectors[request_id]) for request_id, ids in zip(order, lists)]
