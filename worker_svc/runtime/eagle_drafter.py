"""Speculative decoding's eagle and eagle3 methods: an EAGLE head (worker_svc/model/eagle.py)
drafts from the target's hidden states, in the same worker and the same step.

The head's KV cache has its own tensors over the target's block ids, as the draft
model's does (worker_svc/runtime/draft_model.py), so the scheduler's block tables,
lookahead slots, preemption and prefix cache serve it unchanged. Its KV at position p
holds the head's input there: the target's hidden state at p (EAGLE: the last one, after
the final norm; EAGLE-3: three layers' inputs, combined by fc) with the embedding of the
token at p + 1. So the head runs after the target has sampled, when that token is known
at every row: over all the step's rows (prompt chunks, last tokens, verified drafts; a
rejected draft's row gets its own token and is written again next step), and the row
before a request's newest token gives its first draft. Each further draft is one batched
forward of the head alone, from its own previous hidden state, at the next position.
Greedy requests take the argmax; sampled ones draw from q and keep it for the rejection
sampler, as the draft model's do.

On a TP x PP worker group the head drafts on the rank that samples, alone, as a draft
model does: the last stage's first TP rank, whose hidden states are whole (TP's
all-reduces) and where EAGLE-3's layer inputs arrive from earlier stages with each
stage's output (worker_svc/model/llama.py). Its embedding and LM head, where it shares
the target's, are whole copies there: the target's hold a slice of the vocabulary.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from services.config import EngineConfig
from services.messages import StepPlan
from services.model_source import ModelSource
from worker_svc.attention.backend import BatchLayout
from worker_svc.formats.eagle_head import EagleHead
from worker_svc.group.rank_group import RankGroup
from worker_svc.model.eagle import EagleHeadModel
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.weights import load_vocab_weights
from worker_svc.runtime import kernel_choice
from worker_svc.runtime.batch import InputBatch, RequestState, StepInputs
from worker_svc.runtime.cuda_graphs import DecodeGraphs, forward_rows
from worker_svc.runtime.draft_model import decode_layout, draft_count, draw_drafts, keep_drafts
from worker_svc.runtime.kv_cache import allocate_kv_cache, bytes_per_block

Vocabulary = Callable[[torch.Tensor], torch.Tensor] | None  # an embedding lookup, or an LM head


class EagleDrafter:
    def __init__(self, config: EngineConfig, head: EagleHead, target: LlamaForCausalLM, source: ModelSource,
                 device: torch.device, dtype: torch.dtype, max_model_len: int) -> None:
        self.config, self.k = config, config.speculative.num_speculative_tokens
        self.head = head
        self.target, self.device, self.dtype = target, device, dtype
        self.embed, self.target_lm_head = self._vocabulary(source, dtype)
        self.backend = kernel_choice.attention_backend(config, device, self.head.config, dtype)
        self.model = EagleHeadModel(self.head, self.backend, target.ops, max_model_len, device)
        weights = {}
        for file in self.head.files:
            weights.update({name: t.to(device, dtype if t.is_floating_point() else t.dtype)
                            for name, t in load_file(file).items()})
        self.model.load_weights(weights)
        self.model.eval()
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        self._step: tuple[StepPlan, StepInputs, torch.Tensor] | None = None

    def _vocabulary(self, source: ModelSource, dtype: torch.dtype) -> tuple[Vocabulary, Vocabulary]:
        """The embedding and LM head the head shares with the target, as vLLM shares them. On
        one rank of a worker group the target's hold a slice of the vocabulary (or live on
        another stage), so the head reads whole copies of those it lacks of its own."""
        target = self.target
        if not target.group.distributed:
            return target.embed_tokens, target.lm_head
        if self.head.has_embedding and self.head.has_lm_head:
            return None, None
        weights = {name: tensor.to(self.device) for name, tensor in load_vocab_weights(source, dtype).items()}
        embedding = weights["model.embed_tokens.weight"]
        lm_head = weights.get("lm_head.weight", embedding)  # tied: the embedding
        return (partial(F.embedding, weight=embedding) if not self.head.has_embedding else None,
                partial(F.linear, weight=lm_head) if not self.head.has_lm_head else None)

    def capture_graphs(self, batch: InputBatch) -> None:
        """CUDA graphs of the head's own, as the target's (a GPU, the Triton kernels, not
        --enforce-eager): its forward over a step of decodes with their drafts, and each
        further draft's (one row a request)."""
        row = (self.dtype, (self.head.config.hidden_size,))
        self.graphs = kernel_choice.decode_graphs(self.config, self.device, RankGroup(), self.model, self.backend,
                                                  self.kv_caches, batch, inputs=(row, row))

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return bytes_per_block(self.head.config, block_size, kv_dtype)

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.kv_caches = allocate_kv_cache(self.head.config, num_blocks, block_size, kv_dtype, self.device)

    @torch.inference_mode()
    def run(self, plan: StepPlan, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """Keeps the step's target hidden states: the head runs over them once the step has sampled."""
        if self.head.method == "eagle3":
            features = self.model.combine(self.target.aux_hidden_states)
        else:
            features = self.target.ops.norm(self.target.norm, hidden)
        self._step = (plan, inputs, features)

    @torch.inference_mode()
    def propose(self, emitted: dict[str, list[int]], requests: dict[str, RequestState], batch: InputBatch,
                probes: set[str]) -> dict[str, list[int]]:
        """The head over the step's rows, then per request that emitted tokens and may
        speculate, up to k drafts to follow them (as far as its blocks reach); one for the
        `probes` (StepPlan.draft_probes)."""
        plan, inputs, features = self._step
        self._step = None
        next_ids: list[int] = []  # per row: the token after its position
        step_ids = inputs.input_ids.tolist()
        ids, first_rows, rows, positions, counts = [], [], [], [], []
        for (request_id, count), start in zip(plan.num_scheduled_tokens.items(), inputs.row_starts):
            state = requests[request_id]
            sampled, tokens = emitted.get(request_id, []), state.token_ids
            computed, end = state.num_computed_tokens, state.num_computed_tokens + 1 + count
            following = tokens[computed + 1 : end]
            if end > len(tokens):  # the tokens this step emitted follow the ones the worker holds
                following += sampled[max(0, computed + 1 - len(tokens)) : end - len(tokens)]
            # Rows past the newest token (rejected drafts) take their own token: written again next step.
            next_ids += following + step_ids[start + len(following) : start + count]
            state.draft_token_ids = state.draft_probs = None
            if not sampled:
                continue
            newest = len(tokens) + len(sampled) - 1
            if (drafts := draft_count(1 if request_id in probes else self.k, state, newest, batch)) > 0:
                ids.append(request_id)
                first_rows.append(start + newest - 1 - computed)
                rows.append(state.row)
                positions.append(newest)
                counts.append(drafts)
        prenorm, out = self._forward(self._embed(torch.tensor(next_ids, device=self.device)), features,
                                     inputs.positions, inputs.layout, inputs.row_starts)
        drafts: dict[str, list[int]] = {request_id: [] for request_id in ids}
        proposals: dict[str, list[torch.Tensor]] = {request_id: [] for request_id in ids}
        live = list(range(len(ids)))
        index = torch.tensor(first_rows, dtype=torch.long, device=self.device)
        hidden, out = prenorm[index], out[index]
        for step in range(max(counts, default=0)):
            states = [requests[ids[i]] for i in live]
            new, probs = draw_drafts(self._logits(out), states, [rows[i] for i in live], batch)
            for j, (i, token) in enumerate(zip(live, new)):
                drafts[ids[i]].append(token)
                if probs[j] is not None:
                    proposals[ids[i]].append(probs[j])
            keep = [j for j, i in enumerate(live) if counts[i] > step + 1]
            if not keep:
                break
            live = [live[j] for j in keep]
            tokens = torch.tensor([new[j] for j in keep], device=self.device)
            position, layout = decode_layout([rows[i] for i in live], [positions[i] + step for i in live], batch)
            hidden, out = self._forward(self._embed(tokens), hidden[keep], position, layout, list(range(len(live))))
        keep_drafts(requests, drafts, proposals)
        return drafts

    def _forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, layout: BatchLayout,
                 row_starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the rows (`row_starts`: each request's first)."""
        return forward_rows(self.graphs, self.model, self.backend, self.kv_caches, (embeds, hidden), positions, layout,
                            row_starts)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The head's own embedding (some EAGLE-3 heads), else the target's, shared as vLLM does."""
        return (self.model.embed_tokens if self.head.has_embedding else self.embed)(token_ids)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary: EAGLE through the target's LM head;
        EAGLE-3 through its own, over its draft vocabulary, mapped by d2t (the others -inf)."""
        vocab = self.head.config.vocab_size
        if not self.head.has_lm_head:
            return self.target_lm_head(out)[:, :vocab].float()
        logits = self.model.lm_head(out).float()
        if self.head.draft_vocab_size == vocab:
            return logits
        full = logits.new_full((len(logits), vocab), float("-inf"))
        full[:, torch.arange(self.head.draft_vocab_size, device=logits.device) + self.model.d2t] = logits
        return full
