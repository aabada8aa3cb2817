"""The scalar pieces of ``json_schema``'s regular expressions: JSON strings (length bounds,
``pattern`` translated so that it can never produce a character JSON only carries escaped,
``format``), numbers (whole-number bounds exact by digit ranges), and the errors that name a
schema keyword and its JSON path. ``json_schema`` documents the choices.
"""

import math
import re
from typing import List, Optional, Sequence, Tuple

from .errors import GuidedDecodingError

MAX_BOUND = 100_000  # the largest length/count bound (it unrolls into the automaton)
MAX_REGEX_CHARS = 1_000_000

# A string's character: unescaped, a short escape, or \uXXXX outside the surrogates (one code point each)
_CHAR = (r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]'
         r'|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))')
_STRING = f'"{_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+\-]?[0-9]+)?"

_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         rf"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_HM = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = rf"{_HM}:[0-5][0-9](?:\.[0-9]{{1,9}})?(?:Z|[+\-]{_HM})"
_HEX, _ATOM = "[0-9a-fA-F]", r"[A-Za-z0-9_%+\-]"
_FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": rf"{_ATOM}{{1,31}}(?:\.{_ATOM}{{1,32}})?@(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{{0,61}}[A-Za-z0-9])?\.){{1,3}}"
             "[A-Za-z]{2,24}",  # local part <= 64, domain <= 255 characters
}

_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_TYPE_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties", "minProperties", "maxProperties"),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
_UNSUPPORTED = frozenset({
    "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties", "unevaluatedItems", "contains", "minContains", "maxContains", "not",
    "if", "then", "else", "$dynamicRef", "$recursiveRef", "divisibleBy", "disallow", "extends"})
# Keywords that constrain values. JSON Schema ignores the others (title, description, default,
# examples, $id, unknown ones...), and so does this module.
_KNOWN = frozenset({"type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "nullable"}
                   ).union(*_TYPE_KEYWORDS.values(), _UNSUPPORTED)

Path = Tuple[str, ...]
_Range = Tuple[int, int]
_MAX_CP = 0x10FFFF
_FORBIDDEN = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))  # what a JSON string holds only escaped
_SPACES = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
           (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_CLASS_ESCAPES = {"d": ((0x30, 0x39),), "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
                  "s": _SPACES, ".": ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))}  # ".": negated
_ESC = r"\\u[0-9a-fA-F]{4}|\\x[0-9a-fA-F]{2}|\\[\s\S]"
_PATTERN_TOKEN = re.compile(rf"{_ESC}|\[\^?(?:{_ESC}|[^\\\]])*\]|\(\?:?|[*+?]\??|\{{\d+(?:,\d*)?\}}\??|[\s\S]")
_CLASS_ITEM = re.compile(rf"({_ESC}|[^\\])(?:-({_ESC}|[^\\]))?")

def _fmt(path: Path) -> str:
    return "#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)


def _err(keyword: str, path: Path, detail: str) -> GuidedDecodingError:
    return GuidedDecodingError(f"JSON Schema keyword '{keyword}' at {_fmt(path)} {detail}")


def _unsupported(keyword: str, path: Path) -> GuidedDecodingError:
    return _err(keyword, path, "is not supported by guided decoding; remove it or restate the constraint with "
                "type, enum, const, properties, required, items, prefixItems, min/maxItems, min/maxLength, "
                "pattern, format, minimum/maximum, anyOf, oneOf, allOf or $ref")


def _escape(text: str) -> str:
    """Regex literals: metacharacters escaped, controls as \\xNN, the BMP beyond ASCII as \\uNNNN."""
    return "".join("\\" + ch if ch in "\\.*+?()[]{}|^$" else f"\\x{ord(ch):02x}" if ord(ch) < 0x20 or ch == "\x7f"
                   else f"\\u{ord(ch):04x}" if 0x7F < ord(ch) <= 0xFFFF else ch for ch in text)


def _repeat(atom: str, lo: int, hi: Optional[int]) -> str:
    """``atom`` repeated lo..hi times (hi None: unbounded), with no bound above the dialect's 1000."""
    if hi is None and lo <= 1000:
        return atom + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
    if hi is not None and hi <= 1000:
        if hi == 0 or lo == hi == 1:
            return atom if hi else ""
        return atom + ("?" if (lo, hi) == (0, 1) else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}")
    fixed = (f"(?:{atom}{{1000}}){{{lo // 1000}}}" if lo >= 1000 else "") + _repeat(atom, lo % 1000, lo % 1000)
    if hi is None:
        return fixed + atom + "*"
    span = hi - lo
    return fixed + (f"(?:{atom}{{0,1000}}){{{span // 1000}}}" if span >= 1000 else "") + _repeat(atom, 0, span % 1000)


def _count(schema: dict, key: str, path: Path, default: Optional[int]) -> Optional[int]:
    if key not in schema:
        return default
    value = int(schema[key]) if isinstance(schema[key], float) and schema[key].is_integer() else schema[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _err(key, path, f"must be a non-negative integer, got {value!r}")
    if value > MAX_BOUND:
        raise _err(key, path, f"is {value}, above the largest supported bound {MAX_BOUND}")
    return value


# ---- numbers -------------------------------------------------------------------------------------
def _digits(x: str, y: str) -> str:
    """The digit strings of len(x) from x to y (x <= y, same length)."""
    if x == y:
        return x
    if x[0] == y[0]:
        return x[0] + _digits(x[1:], y[1:])
    n, alts, high = len(x) - 1, [], ""
    first, last = x[0], y[0]
    if x[1:] != "0" * n:
        alts.append(x[0] + _digits(x[1:], "9" * n))
        first = chr(ord(first) + 1)
    if y[1:] != "9" * n:
        high, last = y[0] + _digits("0" * n, y[1:]), chr(ord(last) - 1)
    if first <= last:
        alts.append((first if first == last else f"[{first}-{last}]") + _repeat("[0-9]", n, n))
    alts += [high] if high else []
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def _uint_range(lo: int, hi: Optional[int]) -> str:
    """Decimal integers (no leading zeros) from lo >= 0 to hi (None: unbounded)."""
    a, b = str(lo), None if hi is None else str(hi)
    if b is not None and len(a) == len(b):
        return _digits(a, b)
    alts = [_digits(a, "9" * len(a))]
    if b is None:
        alts.append(f"[1-9][0-9]{{{len(a)},}}")
    else:
        alts += ["[1-9]" + _repeat("[0-9]", len(a), len(b) - 2)] if len(b) - len(a) >= 2 else []
        alts.append(_digits("1" + "0" * (len(b) - 1), b))
    return "(?:" + "|".join(alts) + ")"


def _magnitude(a: int, a_excl: bool, b: Optional[int], b_excl: bool, integer: bool) -> Optional[str]:
    """Unsigned decimals m with a <(=) m <(=) b, or None if there is none. A number's integer part
    decides all but the bounds themselves: m > a also takes a.xxx with a non-zero fraction, m <= b
    also takes b.000. Next to an exclusive bound, at most 15 significant digits, so that json.loads'
    float cannot round onto the bound (inclusive bounds are safe: rounding is monotonic)."""
    lo = a + 1 if a_excl else a
    if integer:
        hi = None if b is None else b - 1 if b_excl else b
        return None if hi is not None and hi < lo else _uint_range(lo, hi)
    if b is not None and (b < a or (b == a and (a_excl or b_excl))):
        return None
    digits = lambda n: 15 - len(str(n))  # noqa: E731  (fraction digits left next to integer part n)
    alts = [rf"{a}\.[0-9]{{0,{digits(a) - 1}}}[1-9]0*"] if a_excl and digits(a) > 0 else []
    near = b is not None and b_excl and lo <= b - 1  # integer part b - 1: a limited fraction
    if b is None or lo <= b - 1 - near:
        alts.append(_uint_range(lo, None if b is None else b - 1 - near) + r"(?:\.[0-9]+)?")
    alts += [f"{b - 1}" + (rf"(?:\.[0-9]{{1,{digits(b - 1)}}}0*)?" if digits(b - 1) > 0 else "")] if near else []
    alts += [rf"{b}(?:\.0+)?"] if b is not None and not b_excl and b >= lo else []
    if not alts:
        return None
    exponent = r"(?:[eE][+\-]?[0-9]+)?" if (a, a_excl, b) == (0, False, None) else ""
    return "(?:" + "|".join(alts) + ")" + exponent


def _bound(schema: dict, path: Path, low: bool, integer: bool) -> Optional[Tuple[int, bool]]:
    """The tighter of minimum/exclusiveMinimum (or of the maximums) as (whole number, exclusive)."""
    key, excl_key = ("minimum", "exclusiveMinimum") if low else ("maximum", "exclusiveMaximum")
    found = []
    for k in (key, excl_key):
        value, excl = schema.get(k), k == excl_key or schema.get(excl_key) is True  # draft 4: a boolean
        if value is None or (k == excl_key and isinstance(value, bool)):
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise _err(k, path, f"must be a finite number, got {value!r}")
        if integer:  # the nearest whole number inside the bound, inclusive
            value, excl = (math.floor(value) + 1 if excl else math.ceil(value)) if low else \
                (math.ceil(value) - 1 if excl else math.floor(value)), False
        elif not float(value).is_integer():
            raise _err(k, path, f"is {value}: only whole-number bounds are supported for type number")
        found.append((int(value), excl))
    if not found:
        return None
    return max(found) if low else min(found, key=lambda b: (b[0], not b[1]))


def _numeric(schema: dict, path: Path, integer: bool) -> str:
    """Integers or numbers within minimum/maximum: the non-negative ones, then '-' and magnitudes."""
    mult = schema.get("multipleOf")
    if mult is not None and (mult != 1 or isinstance(mult, bool)):
        raise _err("multipleOf", path, "is supported only as 1: a regex cannot test divisibility by others")
    integer = integer or mult is not None
    low, high = _bound(schema, path, True, integer), _bound(schema, path, False, integer)
    if low is None and high is None:
        return INTEGER if integer else NUMBER
    if not integer and any(b is not None and abs(b[0]) >= 2 ** 53 for b in (low, high)):
        return _numeric(schema, path, True)  # beyond 2^53 floats round between integers: whole numbers only
    alts = []
    if high is None or high[0] > 0 or high == (0, False):
        a, a_excl = low if low is not None and low[0] >= 0 else (0, False)
        alts.append(_magnitude(a, a_excl, high and high[0], high is not None and high[1], integer))
    if low is None or low[0] < 0:
        a, a_excl = (-high[0], high[1]) if high is not None and high[0] < 0 else (0, True)
        m = _magnitude(a, a_excl, None if low is None else -low[0], low is not None and low[1], integer)
        alts.append(m and "-" + m)
    alts = [m for m in alts if m]
    if not alts:
        raise _err("minimum", path, "and the maximum leave no number: no value can satisfy them")
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


# ---- string patterns -----------------------------------------------------------------------------
def _complement(ranges: Sequence[_Range]) -> List[_Range]:
    out, nxt = [], 0
    for lo, hi in sorted(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    return out + ([(nxt, _MAX_CP)] if nxt <= _MAX_CP else [])


def _class_regex(ranges: Sequence[_Range], path: Path) -> str:
    """A class of ``ranges`` less what JSON escapes; written negated if it runs to the last code point."""
    allowed = _complement(_complement(ranges) + list(_FORBIDDEN))
    if not allowed:
        raise _err("pattern", path, "has a class of characters that JSON escapes only: not supported")
    negate = allowed[-1][1] == _MAX_CP
    if not negate and len(allowed) == 1 and allowed[0][0] == allowed[0][1]:
        return _escape(chr(allowed[0][0]))
    char = lambda cp: "\\" + chr(cp) if chr(cp) in "\\]-^[" else _escape(chr(cp))  # noqa: E731
    body = "".join(char(lo) + ("" if lo == hi else "-" + char(hi)) for lo, hi in
                   (_complement(allowed) if negate else allowed))
    return f"[{'^' if negate else ''}{body}]"


def _code_point(token: str, path: Path) -> int:
    """The character of a pattern literal or escape (\\xNN, \\uNNNN, escaped punctuation)."""
    if token[:2] in ("\\x", "\\u") and len(token) > 2:
        return int(token[2:], 16)
    if token[0] == "\\" and (len(token) == 1 or token[1].isalnum() or token[1] == "_"):
        raise _err("pattern", path, f"uses the escape {token}, which is not supported (no anchors, "
                   "backreferences or control characters)")
    return ord(token[-1])


def _pattern_class(token: str, path: Path) -> str:
    """A pattern's ``[...]``: ranges, \\d \\w \\s and their negations, less what JSON escapes."""
    negate, body, ranges = token[1] == "^", token[2 if token[1] == "^" else 1:-1], []
    if not body:
        raise _err("pattern", path, "has an empty class: not supported")
    pos = 0
    while pos < len(body):
        m = _CLASS_ITEM.match(body, pos)
        pos, esc = m.end(), m[1][1:].lower()
        if m[1][0] == "\\" and esc in "dws" and not m[2]:
            ranges += _CLASS_ESCAPES[esc] if m[1][1].islower() else _complement(_CLASS_ESCAPES[esc])
            continue
        lo, hi = _code_point(m[1], path), _code_point(m[2] or m[1], path)
        if hi < lo or (m[2] and m[2][1:].lower() in ("d", "w", "s")):
            raise _err("pattern", path, f"has a bad class range {m[0]!r}")
        ranges.append((lo, hi))
    return _class_regex(_complement(ranges) if negate else ranges, path)


def _pattern(text: str, path: Path) -> str:
    """A ``pattern`` (ECMA-262 subset: literals, classes, ``.``, \\d \\w \\s and their negations,
    groups, ``|``, quantifiers up to 1000) in the engine's dialect, as a full match of the raw text
    between the quotes (a subset of what it searches, so a leading ^ and trailing $ are dropped),
    every class less the characters JSON escapes."""
    text = text[1:] if text.startswith("^") else text
    if text.endswith("$") and (len(text) - 1 - len(text[:-1].rstrip("\\"))) % 2 == 0:
        text = text[:-1]
    out, after_quantifier = [], False
    for tok in _PATTERN_TOKEN.findall(text):
        quantifier = tok[0] in "*+?" or (tok[0] == "{" and len(tok) > 1)
        if tok in ("^", "$", "(?", "[") or (quantifier and after_quantifier):
            raise _err("pattern", path, f"uses {tok!r}, which is not supported (anchors inside the pattern, "
                       "lookarounds, named groups, possessive quantifiers, unterminated classes)")
        if quantifier and max(map(int, re.findall(r"\d+", tok)), default=0) > 1000:
            raise _err("pattern", path, f"has the repetition {tok}, above the supported bound 1000")
        if tok.startswith("[") and len(tok) > 1:
            tok = _pattern_class(tok, path)
        elif tok == "." or (tok[0] == "\\" and tok[1:].lower() in ("d", "w", "s")):
            ranges = _CLASS_ESCAPES[tok[-1].lower()]
            tok = _class_regex(_complement(ranges) if tok == "." or tok[1].isupper() else ranges, path)
        elif quantifier:
            tok = tok[:-1] if len(tok) > 1 and tok.endswith("?") else tok  # lazy: the same full matches
        elif tok not in ("(?:", "(", ")", "|"):
            cp = _code_point(tok, path)
            if any(lo <= cp <= hi for lo, hi in _FORBIDDEN) or 0xD800 <= cp <= 0xDFFF:
                raise _err("pattern", path, f"needs U+{cp:04X}, which JSON escapes: not supported")
            tok = _escape(chr(cp))
        out.append("(?:" if tok == "(" else tok)
        after_quantifier = quantifier
    try:
        return re.compile("".join(out)).pattern
    except re.error as exc:
        raise _err("pattern", path, f"is not a valid regular expression: {exc}") from None
