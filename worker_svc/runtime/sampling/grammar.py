"""Structured outputs in the worker: constraints compiled by xgrammar, one matcher per
constrained request, and the batch's token bitmask applied to the logits in one op.

With a reasoning parser the grammar starts after the reasoning: a request's
constraint then names the token ids that end it (`reasoning_end_token_ids`, "</think>"),
and its tokens go unconstrained until they have been sampled.

The matchers live here, beside the sampler, not beside the scheduler as in vLLM:
xgrammar loads torch, which the scheduler process must not; and the worker sees every
sampled token first, so advancing a matcher costs no round trip and no [batch,
vocab/32] bitmask crosses the wire each step. A matcher is rebuilt from the request's
tokens whenever the worker is handed a request anew (after a preemption, by recompute
or by swap), so its state is always that of the tokens the request holds. Parallel
samples are separate requests, each with its own matcher; prefix-cache hits and
prefill chunks sample nothing, so they never touch one.

Compiled grammars are cached by xgrammar's compiler, keyed by their text. The
scheduler asks for the compilation when a request arrives (CompileGrammar), on a
thread of its own, so the step that meets the request finds it compiled.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass

import torch
import xgrammar as xgr

from services.invalid_parameter import InvalidParameter
from services.model_source import ModelFormat, ModelSource
from services.structured_outputs import StructuredOutputsParams
from worker_svc.formats.gguf_header import read_gguf_header
from worker_svc.runtime.sampling.lark_grammar import as_ebnf

logger = logging.getLogger(__name__)

# xgrammar's C++ errors open with "[hh:mm:ss] /path/file.cc:line: ": the client needs the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_COMPILER_THREADS = 2
# Whitespace the model may put between JSON tokens, at most: enough for pretty-printing
# five levels deep with four-space indents, and an end to the newline runs a small
# model can fall into until max_tokens.
_MAX_JSON_WHITESPACE = 21


def _tokenizer_info(source: ModelSource, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    if source.format is ModelFormat.GGUF:
        fields = read_gguf_header(source.path, arrays_read=("tokenizer.ggml.tokens",)).fields
        vocab, model = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.model"]
        # "gpt2" vocabularies spell bytes as GPT-2's printable characters; "llama" ones
        # are sentencepiece pieces ("▁the") with <0xNN> tokens for raw bytes.
        sentencepiece = model == "llama"
        vocab_type = xgr.VocabType.BYTE_FALLBACK if sentencepiece else xgr.VocabType.BYTE_LEVEL
        return xgr.TokenizerInfo(vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                 add_prefix_space=sentencepiece)
    from transformers import AutoTokenizer  # only HF directories need it

    tokenizer = AutoTokenizer.from_pretrained(source.path)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


def _choice_grammar(choices: list[str]) -> str:
    # JSON string literals are EBNF string literals: quotes and control characters escaped.
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def _compile_structural_tag(compiler: xgr.GrammarCompiler, spec: str) -> xgr.CompiledGrammar:
    """vLLM's response_format {"structures": [{begin, schema, end}], "triggers": [...]},
    or xgrammar's own structural tag {"type": "structural_tag", "format": ...}."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, tag.get("triggers", []))
    return compiler.compile_structural_tag(spec)


@dataclass
class RequestGrammar:
    """One request's grammar state: its matcher, and the reasoning it waits out first."""

    matcher: xgr.GrammarMatcher
    waiting_for: tuple[int, ...]  # the reasoning's end marker; () once the grammar has started
    recent: list[int]  # the last tokens, to spot the marker

    @property
    def constrains(self) -> bool:
        return not self.waiting_for and not self.matcher.is_terminated()

    def saw(self, token: int) -> None:
        """A token sampled before the grammar started: the marker's last one starts it."""
        self.recent = [*self.recent, token][-len(self.waiting_for):]
        if tuple(self.recent) == self.waiting_for:
            self.waiting_for = ()


class Grammars:
    """The worker's compiler and the batch operations on matchers. Thread-safe: the
    scheduler's CompileGrammar calls run beside the steps."""

    def __init__(self, source: ModelSource, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._source = source
        self._vocab_size = vocab_size
        self._stop_token_ids = list(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use: ~0.1 s and the vocabulary
        self._lock = threading.Lock()
        self._batch = xgr.BatchGrammarMatcher(max_threads=_COMPILER_THREADS)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Raises InvalidParameter naming the field that carried the constraint, with the compiler's message."""
        compiler = self._get_compiler()
        any_whitespace = not params.disable_any_whitespace
        try:
            match params.kind:
                case "json":
                    return compiler.compile_json_schema(
                        params.spec, any_whitespace=any_whitespace, max_whitespace_cnt=_MAX_JSON_WHITESPACE)
                case "json_object":
                    return compiler.compile_builtin_json_grammar()
                case "regex":
                    return compiler.compile_regex(params.spec)
                case "choice":
                    return compiler.compile_grammar(_choice_grammar(json.loads(params.spec)))
                case "grammar":
                    return compiler.compile_grammar(as_ebnf(params.spec))
                case "structural_tag":
                    return _compile_structural_tag(compiler, params.spec)
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            message = _CPP_PREFIX.sub("", str(exc).strip()).splitlines()[0]
            raise InvalidParameter(params.field_name, f"invalid {params.kind} constraint: {message}") from exc
        raise InvalidParameter(params.field_name, f"unknown constraint kind {params.kind!r}")

    def request_grammar(self, params: StructuredOutputsParams, output_token_ids: list[int]) -> RequestGrammar:
        """The state of a request whose output so far is `output_token_ids` (none, unless it resumes)."""
        grammar = RequestGrammar(xgr.GrammarMatcher(self.compile(params)),
                                 tuple(params.reasoning_end_token_ids), [])
        for position, token in enumerate(output_token_ids):
            if grammar.waiting_for:
                grammar.saw(token)
            elif not grammar.matcher.accept_token(token):
                logger.warning("a resumed request's output left its grammar at token %d (position %d)",
                               token, position)
                break
        return grammar

    def mask(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
        """Sets to -inf, in place, each constrained row's logits of tokens its grammar forbids."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None and grammar.constrains]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(grammars), self._vocab_size)
        matchers = [grammars[row].matcher for row in rows]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self._vocab_size, indices=rows)

    def accept(self, grammars: list[RequestGrammar | None], tokens: list[int]) -> None:
        """Advances each row's grammar past its sampled token."""
        live = []
        for grammar, token in zip(grammars, tokens):
            if grammar is None:
                continue
            if grammar.waiting_for:
                grammar.saw(token)
            elif not grammar.matcher.is_terminated():
                live.append((grammar.matcher, token))
        if not live:
            return
        accepted = self._batch.batch_accept_token([m for m, _ in live], [token for _, token in live])
        if not all(accepted):  # the mask allowed it, so the grammar and the mask disagree: say so
            logger.warning("%d sampled tokens were refused by their grammars", accepted.count(False))

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = _tokenizer_info(self._source, self._vocab_size, self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILER_THREADS)
            return self._compiler
