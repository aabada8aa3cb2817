"""A GBNF grammar (llama.cpp's, the EBNF form vLLM's ``guided_grammar`` takes) as a regular
expression for ``regex_dfa``, when the grammar is regular.

Guided decoding here runs on finite automata, so a grammar is accepted when no rule refers back to
itself, directly or through others: its rules are then inlined into one regular expression, from
``root``. A recursive grammar (nested brackets, arithmetic) is refused with an error naming the
rule, never approximated.

Syntax read: ``name ::= ...`` rules (names of letters, digits, ``-`` and ``_``; a rule runs until
the next ``name ::=``), ``"literals"`` (escapes ``\\n \\r \\t \\\\ \\" \\xNN \\uNNNN
\\UNNNNNNNN``), character classes ``[a-z_]`` and ``[^"\\\\]`` (the same escapes, ``\\]`` and
``\\-``), rule references, ``( ... )``, ``|``, the repeats ``* + ?`` and ``{n}`` ``{n,}``
``{n,m}``, and ``#`` comments to the end of the line.
"""

import re
from typing import Dict, List, Optional, Tuple

from .errors import GuidedDecodingError

_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z][A-Za-z0-9_-]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<cls>\[\^?(?:[^\]\\\n]|\\.)*\])
  | (?P<repeat>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[()|*+?])
""", re.VERBOSE)
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "]": "]", "[": "[", "-": "-"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
Token = Tuple[str, str, int]  # (kind, text, position)


def grammar_to_regex(grammar: str) -> str:
    """The regular expression of ``grammar``'s ``root`` rule (``GuidedDecodingError`` naming the
    problem otherwise)."""
    rules = _Parser(_tokens(grammar)).rules()
    if "root" not in rules:
        raise GuidedDecodingError(f"the grammar has no 'root' rule (it has {sorted(rules)}); the output matches root")
    return _Inliner(rules).regex("root", [])


def _tokens(grammar: str) -> List[Token]:
    out: List[Token] = []
    pos = 0
    while pos < len(grammar):
        m = _TOKEN.match(grammar, pos)
        if m is None:
            raise GuidedDecodingError(f"the grammar cannot be read at position {pos}: {grammar[pos:pos + 20]!r}")
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group(), pos))  # type: ignore[arg-type]
        pos = m.end()
    return out


def _unescape(body: str, pos: int) -> List[Tuple[str, bool]]:
    """The characters of a literal's or class's body, each with whether it was escaped."""
    out: List[Tuple[str, bool]] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append((c, False))
            i += 1
            continue
        e = body[i + 1]
        if e in _SIMPLE_ESCAPES:
            out.append((_SIMPLE_ESCAPES[e], True))
            i += 2
        elif e in _HEX_ESCAPES:
            digits = body[i + 2:i + 2 + _HEX_ESCAPES[e]]
            if len(digits) != _HEX_ESCAPES[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise GuidedDecodingError(f"bad escape \\{e}{digits} in the grammar at position {pos}")
            out.append((chr(int(digits, 16)), True))
            i += 2 + len(digits)
        else:
            raise GuidedDecodingError(f"unknown escape \\{e} in the grammar at position {pos}")
    return out


def _regex_char(c: str) -> str:
    """One character as the regular expression syntax writes it (inside or outside a class)."""
    if c == "\n":
        return "\\n"
    if c in "\r\t":
        return {"\r": "\\r", "\t": "\\t"}[c]
    if c in '\\.^$*+?{}[]|()-/"':
        return "\\" + c
    return c if c.isprintable() else f"\\U{ord(c):08x}"


class _Parser:
    def __init__(self, tokens: List[Token]):
        self.tokens, self.i = tokens, 0

    def _peek(self, offset: int = 0) -> Optional[Token]:
        j = self.i + offset
        return self.tokens[j] if j < len(self.tokens) else None

    def _rule_starts(self) -> bool:
        first, second = self._peek(), self._peek(1)
        return first is not None and first[0] == "name" and second is not None and second[0] == "define"

    def rules(self) -> Dict[str, str]:
        rules: Dict[str, str] = {}
        while self._peek() is not None:
            if not self._rule_starts():
                _, text, pos = self.tokens[self.i]
                raise GuidedDecodingError(f"expected a rule ('name ::= ...') at position {pos}, got {text!r}")
            name = self.tokens[self.i][1]
            if name in rules:
                raise GuidedDecodingError(f"the grammar defines rule '{name}' twice")
            self.i += 2
            rules[name] = self._alternatives(top=True)
        return rules

    def _alternatives(self, top: bool) -> str:
        options = [self._sequence()]
        while self._peek() is not None and self._peek()[1] == "|":  # type: ignore[index]
            self.i += 1
            options.append(self._sequence())
        if not top:
            tok = self._peek()
            if tok is None or tok[1] != ")":
                raise GuidedDecodingError("a '(' of the grammar is never closed")
            self.i += 1
        return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"

    def _sequence(self) -> str:
        items: List[str] = []
        while True:
            tok = self._peek()
            if tok is None or tok[1] in ("|", ")") or self._rule_starts():
                return "".join(items)
            kind, text, pos = tok
            self.i += 1
            if kind == "string":
                item = "".join(_regex_char(c) for c, _ in _unescape(text[1:-1], pos))
                item = f"(?:{item})" if len(text) > 3 else item
            elif kind == "cls":
                item = self._class(text, pos)
            elif kind == "name":
                item = "\x00" + text + "\x00"  # a reference, inlined later
            elif text == "(":
                item = "(?:" + self._alternatives(top=False) + ")"
            else:
                raise GuidedDecodingError(f"unexpected {text!r} in the grammar at position {pos}")
            while self._peek() is not None and (self._peek()[0] == "repeat"  # type: ignore[index]
                                                or self._peek()[1] in ("*", "+", "?")):  # type: ignore[index]
                suffix = self._peek()[1].replace(" ", "")  # type: ignore[index]
                self.i += 1
                item = f"(?:{item}){suffix}"
            items.append(item)

    @staticmethod
    def _class(text: str, pos: int) -> str:
        negated = text.startswith("[^")
        chars = _unescape(text[2 if negated else 1:-1], pos)
        if not chars:
            raise GuidedDecodingError(f"an empty character class in the grammar at position {pos}")
        body = []
        for c, escaped in chars:
            body.append("-" if c == "-" and not escaped else _regex_char(c))
        return "[" + ("^" if negated else "") + "".join(body) + "]"


class _Inliner:
    def __init__(self, rules: Dict[str, str]):
        self.rules = rules
        self.done: Dict[str, str] = {}

    def regex(self, name: str, path: List[str]) -> str:
        if name in self.done:
            return self.done[name]
        if name in path:
            cycle = " -> ".join(path[path.index(name):] + [name])
            raise GuidedDecodingError(
                f"the grammar is recursive ({cycle}): only grammars whose rules never refer back to themselves "
                "are supported (guided decoding runs on finite automata); unroll the recursion to a bounded depth, or "
                "use a JSON Schema or a regex")
        if name not in self.rules:
            raise GuidedDecodingError(f"the grammar refers to rule '{name}', which it does not define")
        parts = self.rules[name].split("\x00")
        out = "".join(self.regex(p, path + [name]) if k % 2 else p for k, p in enumerate(parts))
        self.done[name] = f"(?:{out})"
        return self.done[name]

