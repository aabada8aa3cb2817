"""GBNF grammars (llama.cpp's EBNF, the form vLLM's ``guided_grammar`` takes): the reader, and the
choice of recognizer.

A grammar whose rules never refer back to themselves describes a regular language: its rules are
inlined into one regular expression from ``root`` and run on ``regex_dfa`` (whose masks come from
a transition table, the fastest path). A recursive grammar (nested brackets, arithmetic, JSON) runs
on ``grammar_automaton``'s pushdown recognizer instead; ``grammar_automaton.grammar_recognizer()``
picks.

Syntax read: ``name ::= ...`` rules (names of letters, digits, ``-`` and ``_``; a rule runs until
the next ``name ::=``), ``"literals"`` (escapes ``\\n \\r \\t \\\\ \\" \\xNN \\uNNNN
\\UNNNNNNNN``), character classes ``[a-z_]`` and ``[^"\\\\]`` (the same escapes, ``\\]`` and
``\\-``; a ``-`` first or last is itself), rule references, ``( ... )``, ``|``, the repeats
``* + ?`` and ``{n}`` ``{n,}`` ``{n,m}``, and ``#`` comments to the end of the line.
"""

import re
from collections import namedtuple
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple, Union

from .errors import GuidedDecodingError
from .regex_parser import MAX_NESTING, Ranges, negate_ranges, normalize_ranges

MAX_REPEAT = 1000  # the largest n or m of {n,m}, as for regular expressions

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
_SIMPLE_REPEATS = {"*": (0, None), "+": (1, None), "?": (0, 1)}
MAX_CODE_POINT = 0x10FFFF
Token = Tuple[str, str, int]  # (kind, text, position)

# The parse tree: a literal, a character class (its code point ranges, after any negation), a rule
# reference, a sequence, alternatives, a repeat (high None: unbounded)
Literal = namedtuple("Literal", "text")
CharClass = namedtuple("CharClass", "ranges")
RuleRef = namedtuple("RuleRef", "name")
Sequence = namedtuple("Sequence", "items")
Alternatives = namedtuple("Alternatives", "options")
Repeat = namedtuple("Repeat", "item low high")
Node = Union[Literal, CharClass, RuleRef, Sequence, Alternatives, Repeat]


def parse_grammar(grammar: str) -> Dict[str, Node]:
    """The grammar's rules by name (``GuidedDecodingError`` naming the problem when it cannot be
    read, has no ``root`` or refers to a rule it does not define)."""
    rules = _Parser(_tokens(grammar)).rules()
    if "root" not in rules:
        raise GuidedDecodingError(f"the grammar has no 'root' rule (it has {sorted(rules)}); the output matches root")
    for name, node in rules.items():
        for ref in _references(node):
            if ref not in rules:
                raise GuidedDecodingError(f"rule '{name}' refers to rule '{ref}', which the grammar does not define")
    return rules


def recursion(rules: Dict[str, Node]) -> Optional[List[str]]:
    """A cycle of rules reachable from ``root`` (``[a, b, a]``: a refers to b, b back to a), or None
    when the grammar is not recursive."""
    done: Dict[str, bool] = {}

    def visit(name: str, path: List[str]) -> Optional[List[str]]:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for ref in _references(rules[name]):
            cycle = visit(ref, path + [name])
            if cycle:
                return cycle
        done[name] = True
        return None

    return visit("root", [])


def grammar_to_regex(grammar: str) -> str:
    """The regular expression of a non-recursive grammar's ``root`` rule (``GuidedDecodingError``
    naming the cycle for a recursive one)."""
    with too_deep_is_an_error():
        return rules_to_regex(parse_grammar(grammar))


@contextmanager
def too_deep_is_an_error() -> Iterator[None]:
    """A grammar's rules are walked recursively, one Python frame per rule a chain of references
    goes through: a chain of about a thousand rules is a ``GuidedDecodingError`` (a request error),
    not Python's ``RecursionError``."""
    try:
        yield
    except RecursionError:
        raise GuidedDecodingError("the grammar's rules refer to each other in a chain too long to follow (about a "
                                  "thousand rules or more); shorten it") from None


def rules_to_regex(rules: Dict[str, Node]) -> str:
    """``grammar_to_regex`` for rules already read."""
    cycle = recursion(rules)
    if cycle:
        raise GuidedDecodingError(f"the grammar is recursive ({' -> '.join(cycle)}): no regular expression describes "
                                  "it")
    return _Regex(rules).of(RuleRef("root"))


def _references(node: Node) -> List[str]:
    """The rule names ``node`` refers to, in order."""
    if isinstance(node, RuleRef):
        return [node.name]
    if isinstance(node, Repeat):
        return _references(node.item)
    if isinstance(node, (Sequence, Alternatives)):
        children = node.items if isinstance(node, Sequence) else node.options
        return [name for child in children for name in _references(child)]
    return []


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
            if int(digits, 16) > MAX_CODE_POINT:
                raise GuidedDecodingError(f"escape \\{e}{digits} in the grammar at position {pos} is past U+10FFFF")
            out.append((chr(int(digits, 16)), True))
            i += 2 + len(digits)
        else:
            raise GuidedDecodingError(f"unknown escape \\{e} in the grammar at position {pos}")
    return out


def _class_ranges(text: str, pos: int) -> Ranges:
    """The code points a class ``[...]`` / ``[^...]`` matches, as sorted disjoint ranges."""
    negated = text.startswith("[^")
    chars = _unescape(text[2 if negated else 1:-1], pos)
    if not chars:
        raise GuidedDecodingError(f"an empty character class in the grammar at position {pos}")
    spans: List[Tuple[int, int]] = []
    i = 0
    while i < len(chars):
        lo = ord(chars[i][0])
        if i + 2 < len(chars) and chars[i + 1] == ("-", False):  # a range; a '-' first or last is itself
            hi = ord(chars[i + 2][0])
            if hi < lo:
                raise GuidedDecodingError(f"a reversed range {chars[i][0]!r}-{chars[i + 2][0]!r} in the grammar's "
                                          f"class at position {pos}")
            spans.append((lo, hi))
            i += 3
        else:
            spans.append((lo, lo))
            i += 1
    merged = normalize_ranges(spans)
    return negate_ranges(merged) if negated else merged


def _repeat(text: str, pos: int) -> Tuple[int, Optional[int]]:
    if text in _SIMPLE_REPEATS:
        return _SIMPLE_REPEATS[text]
    body = text[1:-1].replace(" ", "")
    low_text, _, high_text = body.partition(",")
    low = int(low_text)
    high = low if "," not in body else (int(high_text) if high_text else None)
    if low > MAX_REPEAT or (high is not None and high > MAX_REPEAT):
        raise GuidedDecodingError(f"repeat {text} in the grammar at position {pos}: counts above {MAX_REPEAT} are "
                                  "not supported")
    if high is not None and high < low:
        raise GuidedDecodingError(f"repeat {text} in the grammar at position {pos}: the maximum is below the minimum")
    return low, high


class _Parser:
    def __init__(self, tokens: List[Token]):
        self.tokens, self.i = tokens, 0
        self.depth = 0  # groups open: the parser recurses once per level

    def _peek(self, offset: int = 0) -> Optional[Token]:
        j = self.i + offset
        return self.tokens[j] if j < len(self.tokens) else None

    def _rule_starts(self) -> bool:
        first, second = self._peek(), self._peek(1)
        return first is not None and first[0] == "name" and second is not None and second[0] == "define"

    def rules(self) -> Dict[str, Node]:
        rules: Dict[str, Node] = {}
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

    def _alternatives(self, top: bool) -> Node:
        options = [self._sequence()]
        while self._peek() is not None and self._peek()[1] == "|":  # type: ignore[index]
            self.i += 1
            options.append(self._sequence())
        if not top:
            tok = self._peek()
            if tok is None or tok[1] != ")":
                raise GuidedDecodingError("a '(' of the grammar is never closed")
            self.i += 1
        return options[0] if len(options) == 1 else Alternatives(tuple(options))

    def _sequence(self) -> Node:
        items: List[Node] = []
        while True:
            tok = self._peek()
            if tok is None or tok[1] in ("|", ")") or self._rule_starts():
                return items[0] if len(items) == 1 else Sequence(tuple(items))
            kind, text, pos = tok
            self.i += 1
            item: Node
            if kind == "string":
                item = Literal("".join(c for c, _ in _unescape(text[1:-1], pos)))
            elif kind == "cls":
                item = CharClass(_class_ranges(text, pos))
            elif kind == "name":
                item = RuleRef(text)
            elif text == "(":
                self.depth += 1
                if self.depth > MAX_NESTING:
                    raise GuidedDecodingError(f"groups nested deeper than {MAX_NESTING} in the grammar at position "
                                              f"{pos}; flatten them")
                item = self._alternatives(top=False)
                self.depth -= 1
            else:
                raise GuidedDecodingError(f"unexpected {text!r} in the grammar at position {pos}")
            while self._peek() is not None and (self._peek()[0] == "repeat"  # type: ignore[index]
                                                or self._peek()[1] in _SIMPLE_REPEATS):  # type: ignore[index]
                _, suffix, suffix_pos = self.tokens[self.i]
                self.i += 1
                item = Repeat(item, *_repeat(suffix, suffix_pos))
            items.append(item)


def _regex_char(cp: int) -> str:
    """One code point as the regular expression syntax writes it (inside or outside a class)."""
    c = chr(cp)
    if c in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c]
    if c in '\\.^$*+?{}[]|()-/"':
        return "\\" + c
    return c if c.isprintable() else f"\\U{cp:08x}"


class _Regex:
    """A non-recursive grammar's rules written out as one regular expression (each rule once)."""

    def __init__(self, rules: Dict[str, Node]):
        self.rules = rules
        self.done: Dict[str, str] = {}

    def of(self, node: Node) -> str:
        if isinstance(node, Literal):
            text = "".join(_regex_char(ord(c)) for c in node.text)
            return f"(?:{text})" if len(node.text) != 1 else text
        if isinstance(node, CharClass):
            if not node.ranges:
                return "[^\\s\\S]"  # matches nothing: regex_dfa names the problem
            body = "".join(_regex_char(lo) if lo == hi else f"{_regex_char(lo)}-{_regex_char(hi)}"
                           for lo, hi in node.ranges)
            return f"[{body}]"
        if isinstance(node, RuleRef):
            if node.name not in self.done:
                self.done[node.name] = f"(?:{self.of(self.rules[node.name])})"
            return self.done[node.name]
        if isinstance(node, Sequence):
            return "".join(self.of(item) for item in node.items)
        if isinstance(node, Alternatives):
            return "(?:" + "|".join(self.of(option) for option in node.options) + ")"
        high = "" if node.high is None else str(node.high)
        return f"(?:{self.of(node.item)}){{{node.low},{high}}}"
