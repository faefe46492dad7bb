"""StructuredOutputsParams: constrain a request's output to a JSON schema, any JSON,
a regex, a choice of strings, an EBNF grammar or a structural tag, with vLLM's names.

Exactly one constraint is set. The worker's grammar compiler reads it as text (`kind`,
`spec`), and its cache is keyed by that text, so one schema sent by many requests
compiles once (a schema as a dict equals the same schema as text). Whether the text is
a valid schema, regex or grammar is the compiler's to say (the worker's,
worker_svc/runtime/sampling/grammar.py), with its own message, as a 400 on the field
that carried it.
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

from services.invalid_parameter import InvalidParameter

# The constraint kinds, as the worker compiles them.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, frozen=True, omit_defaults=True):
    json: str | dict[str, Any] | None = None  # a JSON schema, as text or as a dict
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar reads it), or Lark-style as vLLM takes it
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # vLLM's structural tag, as JSON text
    # JSON output on one line, without free whitespace between tokens.
    disable_any_whitespace: bool = False
    # Which request field carried the constraint, named in errors (e.g. "response_format");
    # not part of equality.
    field_name: str = "structured_outputs"
    # With a reasoning parser: the tokens that end the reasoning ("</think>"); the
    # constraint applies from the token after them. Empty: from the first token.
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter(
                self.field_name, f"set exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice)):
            raise InvalidParameter(self.field_name, "choice must be a non-empty list of strings")

    def __eq__(self, other: object) -> bool:
        # A schema given as a dict equals the same schema as text: what the compiler reads.
        if not isinstance(other, StructuredOutputsParams):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[str, str, bool, tuple[int, ...]]:
        return self.kind, self.spec, self.disable_any_whitespace, tuple(self.reasoning_end_token_ids)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: a schema's JSON, the regex, the grammar, the choices as a JSON list."""
        value = getattr(self, self.kind)
        if self.kind == "json_object":
            return ""
        if isinstance(value, str):
            return value
        return json.dumps(value, ensure_ascii=False)


# vLLM's older name for the same parameters.
GuidedDecodingParams = StructuredOutputsParams
