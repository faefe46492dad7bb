"""Lark-style grammars to EBNF (worker_svc/runtime/sampling/lark_grammar.py): each
converted grammar compiles with xgrammar and accepts exactly its Lark language; EBNF
passes through untouched; what does not convert is a ValueError naming it."""
from __future__ import annotations

import pytest
import xgrammar as xgr
from structured_schemas import SQL_GRAMMAR

from worker_svc.runtime.sampling.lark_grammar import as_ebnf, is_lark

# (Lark grammar, strings it accepts, strings it refuses)
CASES = [
    (SQL_GRAMMAR, ["SELECT col_1 from table_2 where col_2=1"], ["SELECT col_3 from table_1 where col_1=1", "SELECT col_1"]),
    ("rule: 'hello'", ["hello"], ["hell", "Hello"]),  # the first rule starts; single quotes, as vLLM takes them
    ("""
// alternatives on the lines after, modifiers, priorities and aliases
?value: dict
      | "null" -> none
dict: "{" [pair ("," pair)*] "}"   # [..] is optional, as in Lark
pair.2: key ":" value
!key: "a".."c" ~ 1..2
""", ["null", "{}", "{a:null}", "{ab:{},c:null}"], ["{d:null}", "{abc:null}", "{,}", "{a:null,}"]),
    ('start: "x" ~ 3 "y"?', ["xxx", "xxxy"], ["xx", "xxxx"]),
    ('start: "a" | \n  | "b"', ["a", "", "b"], ["ab"]),  # an empty alternative
    ('start: "\\n" "\\"" "é" "::=" "#"', ['\n"é::=#'], ["\n"]),  # escapes, and "::=" and "#" inside strings
]


@pytest.mark.parametrize(("lark", "accepted", "refused"), CASES)
def test_lark_converts_to_ebnf_that_accepts_its_language(lark: str, accepted: list[str], refused: list[str]) -> None:
    assert is_lark(lark)
    ebnf = as_ebnf(lark)
    xgr.Grammar.from_ebnf(ebnf)  # compiles
    for text in accepted:
        assert xgr.testing._is_grammar_accept_string(ebnf, text), (text, ebnf)
    for text in refused:
        assert not xgr.testing._is_grammar_accept_string(ebnf, text), (text, ebnf)


@pytest.mark.parametrize("ebnf", ['root ::= "a" # a comment: x', 'root ::= item\nitem ::= [a-z]+ // ok: y'])
def test_ebnf_passes_through(ebnf: str) -> None:
    assert not is_lark(ebnf) and as_ebnf(ebnf) == ebnf


@pytest.mark.parametrize(("lark", "named"), [
    ("start: a b", "rules used but not defined: a, b"),
    ("%import common.NUMBER\nstart: NUMBER", "rules used but not defined: NUMBER"),
    ("start: NUMBER\nNUMBER: /[0-9]+/", "/[0-9]+/"),
    ('start: "a"i', '"a"i'),
    ('start: ("a"', "left open"),
    ('start: "a" ]', "unbalanced ']'"),
    ('start: "ab".."c"', "'ab'..'c'"),
    ('start: "a"\nstart: "b"', "rule 'start' is defined twice"),
    ('| "a"', "line 1: an alternative"),
    ('start: "a"\nwhat is this', "line 2"),
    ('x: root\nroot: "a"', "'root'"),
])
def test_what_does_not_convert_is_named(lark: str, named: str) -> None:
    with pytest.raises(ValueError, match="reads as a Lark grammar") as caught:
        as_ebnf(lark)
    assert named in str(caught.value)
