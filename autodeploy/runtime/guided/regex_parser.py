"""The parser of ``regex_dfa``'s regular expressions: a pattern becomes a tree of code point sets,
concatenations, alternations and repeats, and a code point set the UTF-8 byte sequences of its
code points. The subset it reads (and what it refuses, each error naming the problem and its
position in the pattern) is described in ``regex_dfa``.
"""

from collections import namedtuple
from functools import lru_cache
from typing import Dict, List, Optional, Tuple, Union

from .errors import GuidedDecodingError

MAX_REPEAT = 1000  # the largest n or m of {n,m}: repeats are unrolled into copies in the NFA
MAX_NESTING = 100  # group depth: the parser and NFA builder recurse once (or so) per level

Ranges = Tuple[Tuple[int, int], ...]  # sorted, disjoint, non-adjacent inclusive code point ranges
ByteSeq = Tuple[Tuple[int, int], ...]  # one inclusive byte range per position of a UTF-8 encoding

_MAX_CP = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_UTF8_LENGTH_ENDS = (0x7F, 0x7FF, 0xFFFF, _MAX_CP)


# The parse tree: a code point set, a concatenation, an alternation, a repeat (high None: unbounded)
_Chars = namedtuple("_Chars", "ranges")
_Concat = namedtuple("_Concat", "items")
_Alt = namedtuple("_Alt", "options")
_Repeat = namedtuple("_Repeat", "item low high")
_Node = Union[_Chars, _Concat, _Alt, _Repeat]


def _shown(pattern: str) -> str:
    """The pattern as error messages quote it: long ones cut, so that a message stays readable."""
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


def normalize_ranges(ranges: List[Tuple[int, int]]) -> Ranges:
    """Sorted, merged ranges, so that equal sets compare (and cache) equal."""
    merged: List[Tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def negate_ranges(ranges: Ranges) -> Ranges:
    """All code points not in ``ranges``: what ``[^...]`` and ``\\D \\W \\S`` match."""
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX_CP:
        out.append((nxt, _MAX_CP))
    return tuple(out)


_DIGIT = ((0x30, 0x39),)
_WORD = normalize_ranges([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
_SPACE = ((0x09, 0x0D), (0x20, 0x20))
_CLASS_ESCAPES: Dict[str, Ranges] = {
    "d": _DIGIT, "D": negate_ranges(_DIGIT), "w": _WORD, "W": negate_ranges(_WORD),
    "s": _SPACE, "S": negate_ranges(_SPACE),
}
_DOT = negate_ranges(((0x0A, 0x0A),))
_SIMPLE_QUANTIFIERS = {"*": (0, None), "+": (1, None), "?": (0, 1)}
_CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07}
_ANCHOR_ESCAPES = {"b": "word boundary", "B": "non-word boundary", "A": "start-of-text anchor",
                   "Z": "end-of-text anchor", "z": "end-of-text anchor", "G": "match-start anchor"}
_EXTENSIONS = {"=": "lookahead '(?=...)'", "!": "negative lookahead '(?!...)'",
               "<=": "lookbehind '(?<=...)'", "<!": "negative lookbehind '(?<!...)'",
               "P=": "backreference '(?P=name)'", "#": "comment '(?#...)'",
               ">": "atomic group '(?>...)'", "(": "conditional group '(?(...)...)'"}


@lru_cache(maxsize=1024)
def _utf8_sequences(ranges: Ranges) -> Tuple[ByteSeq, ...]:
    """The UTF-8 encodings of the code points in ``ranges`` as byte-range sequences: a byte string
    encodes one of them iff it matches one sequence (byte i in range i). Surrogates are left out:
    they have no UTF-8 encoding, and so cannot occur in an encoded text."""
    out: List[ByteSeq] = []
    for lo, hi in ranges:
        pieces = [(lo, min(hi, _SURROGATES[0] - 1)), (max(lo, _SURROGATES[1] + 1), hi)]
        for start, end in pieces:
            for length_end in _UTF8_LENGTH_ENDS:  # split where the encoded length changes
                if start <= min(end, length_end):
                    _aligned_sequences(start, min(end, length_end), out)
                    start = length_end + 1
    return tuple(out)


def _aligned_sequences(lo: int, hi: int, out: List[ByteSeq]) -> None:
    """``lo..hi`` (same encoded length) split until it is a product of per-byte ranges: where lo and
    hi differ above a 6-bit continuation group, lo's lower groups must be all 0s and hi's all 1s."""
    for groups in range(1, len(chr(lo).encode())):
        mask = (1 << (6 * groups)) - 1
        if lo & ~mask == hi & ~mask:
            continue
        if lo & mask:
            _aligned_sequences(lo, lo | mask, out)
            _aligned_sequences((lo | mask) + 1, hi, out)
            return
        if hi & mask != mask:
            _aligned_sequences(lo, (hi & ~mask) - 1, out)
            _aligned_sequences(hi & ~mask, hi, out)
            return
    out.append(tuple(zip(chr(lo).encode(), chr(hi).encode())))


def _repeat_count(digits: str) -> int:
    """A count of ``{n,m}``; a long one is just "too many", without reading thousands of digits."""
    return int(digits) if len(digits.lstrip("0")) <= 4 else MAX_REPEAT + 1


class _Parser:
    """Recursive descent over the pattern into a tree; ``end`` excludes an ignored final ``$``."""

    def __init__(self, pattern: str, placeholders: bool = False) -> None:
        self.pattern = pattern
        # a lone surrogate written as itself is a placeholder (a rule reference of json_schema's
        # grammars, which no user text can produce), else an error
        self.placeholders = placeholders
        self.pos = 1 if pattern.startswith("^") else 0
        slashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
        dollar = pattern.endswith("$") and slashes % 2 == 0 and len(pattern) > self.pos
        self.end = len(pattern) - 1 if dollar else len(pattern)
        self.depth = 0

    def error(self, problem: str, pos: int, hint: str = "") -> GuidedDecodingError:
        message = f"regex {_shown(self.pattern)}: {problem} at position {pos}"
        return GuidedDecodingError(message + (f"; {hint}" if hint else ""))

    def peek(self, offset: int = 0) -> str:
        return self.pattern[self.pos + offset] if self.pos + offset < self.end else ""

    def parse(self) -> _Node:
        node = self.alternation()
        if self.pos < self.end:  # only a ')' without its '(' stops the top level early
            raise self.error("unbalanced ')'", self.pos, "remove it or escape it as '\\)'")
        return node

    def alternation(self) -> _Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else _Alt(tuple(options))

    def sequence(self) -> _Node:
        items: List[_Node] = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else _Concat(tuple(items))

    def atom(self) -> _Node:
        c, pos = self.peek(), self.pos
        if c == "(":
            return self.group()
        if c == "[":
            return _Chars(self.char_class())
        if c == "\\":
            return _Chars(self.escape(in_class=False)[0])
        if c in "*+?" or (c == "{" and self.quantifier_at(pos) is not None):
            raise self.error(f"nothing to repeat before {c!r}", pos, f"escape it as '\\{c}'")
        if c in "^$":
            where = "first" if c == "^" else "last"
            raise self.error(f"anchor {c!r} is only supported as the {where} character", pos,
                             f"remove it (matches are full anyway) or escape it as '\\{c}'")
        self.pos += 1
        if self.placeholders and _SURROGATES[0] <= ord(c) <= _SURROGATES[1]:
            return _Chars(((ord(c), ord(c)),))
        return _Chars(_DOT if c == "." else self.literal(ord(c), pos))

    def literal(self, cp: int, pos: int) -> Ranges:
        if _SURROGATES[0] <= cp <= _SURROGATES[1]:
            raise self.error(f"surrogate code point U+{cp:04X}", pos, "it has no UTF-8 encoding")
        return ((cp, cp),)

    def quantifier_at(self, pos: int) -> Optional[Tuple[int, Optional[int], int]]:
        """``{n}``, ``{n,}``, ``{,m}``, ``{n,m}`` at ``pos`` as (low, high, end), else None (then
        the ``{`` is a literal, as in Python)."""
        close = self.pattern.find("}", pos, self.end)
        if close < 0:
            return None
        low, comma, high = self.pattern[pos + 1:close].partition(",")
        numbers = (low or "0", high or "0")
        if not (low or comma) or not all(n.isascii() and n.isdigit() for n in numbers):
            return None
        high_value = _repeat_count(high) if high else (None if comma else _repeat_count(low))
        return _repeat_count(low or "0"), high_value, close + 1

    def quantifier(self) -> Optional[Tuple[int, Optional[int]]]:
        c, pos = self.peek(), self.pos
        if c in _SIMPLE_QUANTIFIERS:
            self.pos += 1
            return _SIMPLE_QUANTIFIERS[c]
        found = self.quantifier_at(pos) if c == "{" else None
        if found is None:
            return None
        low, high, self.pos = found
        shown = self.pattern[pos:self.pos]
        shown = shown if len(shown) <= 20 else shown[:17] + "..."
        if max(low, high or 0) > MAX_REPEAT:
            raise self.error(f"repeat count over {MAX_REPEAT} in {shown}", pos,
                             "use '*' or '+' for long repeats, or a smaller bound")
        if high is not None and low > high:
            raise self.error(f"min repeat greater than max repeat in {shown}", pos)
        return low, high

    def quantified(self, item: _Node) -> _Node:
        found = self.quantifier()
        if found is None:
            return item
        if self.peek() == "+":
            raise self.error("possessive quantifier", self.pos, "remove the '+' after it")
        if self.peek() == "?":  # lazy: the same set of full matches as greedy
            self.pos += 1
        c = self.peek()
        if c in ("*", "+", "?") or (c == "{" and self.quantifier_at(self.pos) is not None):
            raise self.error("multiple repeat", self.pos, "wrap the repeated part in (?:...) first")
        return _Repeat(item, found[0], found[1])

    def group(self) -> _Node:
        start = self.pos
        self.pos += 1
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"groups nested deeper than {MAX_NESTING}", start, "flatten them")
        if self.peek() == "?":
            self.group_extension(start)
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("unbalanced '('", start, "add the missing ')' or escape it as '\\('")
        self.pos += 1
        self.depth -= 1
        return node

    def group_extension(self, start: int) -> None:
        """Skips ``?:`` or ``?P<name>``; rejects every other ``(?...)`` by name."""
        rest = self.pattern[self.pos + 1:self.end]
        if rest.startswith(":"):
            self.pos += 2
            return
        if rest.startswith("P<"):
            close = rest.find(">")
            if close < 0 or not rest[2:close].isidentifier():
                raise self.error("bad group name in '(?P<...>'", start, "use (?P<name>...)")
            self.pos += 1 + close + 1
            return
        for prefix, name in _EXTENSIONS.items():
            if rest.startswith(prefix):
                raise self.error(f"unsupported {name}", start, "rewrite it without that construct")
        if rest[:1].isalpha() or rest[:1] == "-":
            raise self.error("unsupported inline flags '(?...)'", start, "remove the flags")
        raise self.error(f"unknown group extension '(?{rest[:1]}'", start)

    def escape(self, in_class: bool) -> Tuple[Ranges, Optional[int]]:
        """The escape at ``pos`` as (ranges, its code point when it is one character)."""
        pos = self.pos
        c = self.peek(1)
        if not c:
            raise self.error("trailing backslash", pos, "escape it as '\\\\'")
        self.pos += 2
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c], None
        if c in _CHAR_ESCAPES or (in_class and c == "b"):
            cp = _CHAR_ESCAPES.get(c, 0x08)
        elif c in "xuU":
            cp = self.hex_escape(pos, {"x": 2, "u": 4, "U": 8}[c])
        elif c.isdigit():
            raise self.error(f"unsupported backreference or octal escape '\\{c}'", pos,
                             "use \\xNN for a character code")
        elif c in _ANCHOR_ESCAPES:
            raise self.error(f"unsupported {_ANCHOR_ESCAPES[c]} '\\{c}'", pos, "remove it")
        elif c.isascii() and c.isalpha():
            raise self.error(f"unsupported escape '\\{c}'", pos,
                             "escape only punctuation; write letters unescaped")
        else:
            cp = ord(c)
        return self.literal(cp, pos), cp

    def hex_escape(self, pos: int, digits: int) -> int:
        kind = self.pattern[pos:pos + 2]
        text = self.pattern[pos + 2:min(pos + 2 + digits, self.end)]
        if len(text) < digits or any(ch not in "0123456789abcdefABCDEF" for ch in text):
            raise self.error(f"bad escape '{kind}': needs {digits} hex digits", pos)
        self.pos = pos + 2 + digits
        value = int(text, 16)
        if kind == "\\x" and value > 0x7F:
            raise self.error(f"'\\x{text}' above \\x7F", pos,
                             f"write the character itself or \\u{value:04X} (a code point)")
        if value > _MAX_CP:
            raise self.error(f"code point '\\U{text}' above U+10FFFF", pos)
        return value

    def char_class(self) -> Ranges:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        ranges: List[Tuple[int, int]] = []
        first = True
        while first or self.peek() != "]":
            if not self.peek():
                raise self.error("unterminated character set '['", start,
                                 "close it with ']' or escape it as '\\['")
            first = False
            item_pos = self.pos
            item, lo = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("", "]"):
                self.pos += 1
                hi = self.class_item()[1]
                if lo is None or hi is None or hi < lo:
                    raise self.error(f"bad character range {self.pattern[item_pos:self.pos]}",
                                     item_pos, "ranges need single characters, low to high")
                item = ((lo, hi),)
            ranges.extend(item)
        self.pos += 1
        result = normalize_ranges(ranges)
        return negate_ranges(result) if negated else result

    def class_item(self) -> Tuple[Ranges, Optional[int]]:
        if self.peek() == "\\":
            return self.escape(in_class=True)
        cp, pos = ord(self.peek()), self.pos
        self.pos += 1
        return self.literal(cp, pos), cp
