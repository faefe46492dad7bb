"""Lark-style grammars, which vLLM accepts in `structured_outputs.grammar` (and
`guided_grammar`) by converting them to the EBNF xgrammar compiles; so does this.

A grammar is read as Lark when none of its lines defines a rule with `::=` (outside
strings and comments), as vLLM decides. What converts:

- rules `name: expansion`, with more alternatives on the lines that open with `|`; a `?`
  or `!` before the name, a `.priority` after it and `-> alias` after an alternative only
  shape Lark's parse tree, so they are dropped;
- strings in double or single quotes, `"a".."z"` ranges, `[item]` (optional, as in
  Lark), groups, `?` `*` `+`, and `item ~ n` or `item ~ n..m` repetition;
- `//` and `#` comments.

The grammar starts at the rule named `start`, else at its first rule (vLLM's choice).
Directives (`%ignore`, `%import`, ...) are skipped as vLLM skips them, so a rule that an
`%import` would have brought is reported undefined. Regular expressions (`/.../`),
case-insensitive strings, templates and rules used but not defined are a ValueError that
names them.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

_STRINGS = re.compile(r""""(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'""")
_DIRECTIVE = re.compile(r"\s*%")
_HEADER = re.compile(r"\s*[?!]?(?P<name>[A-Za-z_]\w*)(?:\.-?\d+)?\s*:(?P<body>.*)")
_ALTERNATIVE = re.compile(r"\s*\|(?P<body>.*)")
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>(?://|\#).*)
  | (?P<string>(?:"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')i?)
  | (?P<regexp>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<number>\d+)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op>[|()\[\]?*+~])
""", re.VERBOSE)
# A range's ends inside an EBNF character class.
_CLASS_ESCAPES = {"\\": "\\\\", "]": "\\]", "-": "\\-", "^": "\\^", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def as_ebnf(grammar: str) -> str:
    """The grammar as EBNF: converted when it is Lark-style, else as it is."""
    if not is_lark(grammar):
        return grammar
    try:
        return lark_to_ebnf(grammar)
    except ValueError as exc:
        raise ValueError(f"it reads as a Lark grammar (no rule is defined with '::='), which does not "
                         f"convert to EBNF: {exc}") from None


def is_lark(grammar: str) -> bool:
    """No line defines a rule with `::=`, outside strings and comments."""
    for line in grammar.splitlines():
        code = re.split(r"#|//", _STRINGS.sub('""', line), maxsplit=1)[0]
        if "::=" in code:
            return False
    return bool(grammar.strip())


def lark_to_ebnf(grammar: str) -> str:
    """The EBNF of a Lark-style grammar; a ValueError says what does not convert, and where."""
    rules: list[_Rule] = []
    for number, line in enumerate(grammar.splitlines(), 1):
        if _DIRECTIVE.match(line):
            continue
        if header := _HEADER.match(line):
            name = header["name"]
            if any(rule.name == name for rule in rules):
                raise ValueError(f"line {number}: rule {name!r} is defined twice")
            rules.append(_Rule(name))
            rules[-1].add(header["body"], number)
        elif alternative := _ALTERNATIVE.match(line):
            if not rules:
                raise ValueError(f"line {number}: an alternative '|' before any rule")
            rules[-1].add("|" + alternative["body"], number)
        elif _tokens(line, number):
            raise ValueError(f"line {number}: expected 'name: ...', an alternative '| ...' or a %directive")
    if not rules:
        raise ValueError("the grammar defines no rule")
    defined = {rule.name for rule in rules}
    start = "start" if "start" in defined else rules[0].name
    if "root" in defined and start != "root":
        raise ValueError("a rule named 'root' must be the grammar's start")
    lines = [] if start == "root" else [f"root ::= {start}"]
    lines += [f"{rule.name} ::= {rule.ebnf()}" for rule in rules]
    undefined = sorted(set().union(*(rule.references for rule in rules)) - defined)
    if undefined:
        raise ValueError(f"rules used but not defined: {', '.join(undefined)}")
    return "\n".join(lines)


def _tokens(text: str, line: int) -> list[tuple[str, str, int]]:
    """(kind, text, line) of each token, blanks and comments left out."""
    tokens, position = [], 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(f"line {line}: unexpected {text[position:position + 20]!r}")
        position = match.end()
        if match.lastgroup == "comment":
            break
        if match.lastgroup != "space":
            tokens.append((match.lastgroup, match.group(), line))
    return tokens


@dataclass
class _Rule:
    name: str
    tokens: list[tuple[str, str, int]] = field(default_factory=list)
    references: set[str] = field(default_factory=set)

    def add(self, text: str, line: int) -> None:
        self.tokens += _tokens(text, line)

    def ebnf(self) -> str:
        out: list[str] = []
        closers: list[str] = []  # what each open group ends with: ")", or ")?" for Lark's [optional]
        empty = True  # nothing in the current alternative yet: an empty one is ""
        tokens = self.tokens
        index = 0

        def take(kind: str, what: str) -> str:
            nonlocal index
            if index >= len(tokens) or tokens[index][0] != kind:
                raise ValueError(f"{where}: {what}")
            index += 1
            return tokens[index - 1][1]

        while index < len(tokens):
            kind, text, line = tokens[index]
            index += 1
            where = f"line {line}, rule {self.name!r}"
            if kind == "op" and text in "|)]":
                if empty:
                    out.append('""')
                if text == "|":
                    out.append("|")
                    empty = True
                    continue
                if not closers or closers[-1] != (")" if text == ")" else ")?"):
                    raise ValueError(f"{where}: unbalanced {text!r}")
                out.append(closers.pop())
                empty = False
            elif kind == "op" and text in "([":
                out.append("(")
                closers.append(")" if text == "(" else ")?")
                empty = True
            elif kind == "op":  # "?", "*", "+" or "~": they apply to the item before them
                if empty:
                    raise ValueError(f"{where}: {text!r} follows nothing")
                if text == "~":  # "~ n" or "~ n..m"
                    low = take("number", "'~' needs a count after it")
                    high = low
                    if index < len(tokens) and tokens[index][0] == "range":
                        index += 1
                        high = take("number", f"'~ {low}..' needs a count after it")
                    if int(high) < int(low):
                        raise ValueError(f"{where}: '~ {low}..{high}' counts down")
                    text = f"{{{low}}}" if high == low else f"{{{low},{high}}}"
                out[-1] += text
            elif kind == "string":
                out.append(json.dumps(_string(text, where), ensure_ascii=False))
                empty = False
            elif kind == "range":
                if empty or not out[-1].startswith('"'):
                    raise ValueError(f"{where}: '..' needs a string before it")
                high = _string(take("string", "'..' needs a string after it"), where)
                out.append(_char_range(json.loads(out.pop()), high, where))
            elif kind == "name":
                self.references.add(text)
                out.append(text)
                empty = False
            elif kind == "arrow":
                take("name", "'->' needs an alias name after it")
            elif kind == "regexp":
                raise ValueError(f"{where}: regular expressions such as {text} are not supported; "
                                 "use strings, ranges (\"a\"..\"z\") and repetition")
            else:
                raise ValueError(f"{where}: unexpected {text!r}")
        if closers:
            raise ValueError(f"rule {self.name!r}: {len(closers)} group(s) left open")
        if empty:
            out.append('""')
        return " ".join(out)


def _string(literal: str, where: str) -> str:
    if literal.endswith("i"):
        raise ValueError(f"{where}: case-insensitive strings such as {literal} are not supported")
    try:
        return ast.literal_eval(literal)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"{where}: bad string {literal}: {exc}") from None


def _char_range(low: str, high: str, where: str) -> str:
    if len(low) != 1 or len(high) != 1 or low > high:
        raise ValueError(f"{where}: a range runs from one character to a later one, not {low!r}..{high!r}")
    return f"[{_CLASS_ESCAPES.get(low, low)}-{_CLASS_ESCAPES.get(high, high)}]"
