"""JSON Schema -> regular expression, for guided decoding (OpenAI's ``response_format`` json_schema,
vLLM's ``guided_json``).

The regex full-matches only JSON texts that parse, validate against the schema and have whitespace
only between tokens. Where a regex cannot express the schema it matches a subset of the valid texts,
never more; a constraint it cannot keep raises ``GuidedDecodingError`` naming keyword and JSON path.
Deliberate restrictions:

* Whitespace: ``WHITESPACE``, at most 8 spaces/newlines per gap between tokens (none at the ends),
  so a model cannot loop on whitespace; 8 fits ``json.dumps(indent=2)`` to nesting depth 3.
* Objects: properties in ``properties`` order; ``required`` ones present, the others optional; no
  other property, whatever ``additionalProperties`` says (a required name missing from
  ``properties`` is generated with the additionalProperties schema).
* Any value (``{}``, ``true``, a schema with neither type nor a type-specific keyword): containers
  nest at most ``ANY_DEPTH`` levels; its objects may repeat a key (json.loads keeps the last).
  Without ``type``, keywords such as ``properties`` or ``minLength`` select the types they constrain.
* enum/const: compact ``json.dumps`` texts, those the sibling keywords accept.
* anyOf: alternation. oneOf: alternation where the branches provably exclude each other (types,
  const/enum values, required properties, a discriminator property), else an error: a regex
  cannot enforce "exactly one". allOf: merged where the subschemas' keywords do not interact.
* $ref: local JSON pointers (``#/$defs/Name``); recursion is an error (a regex cannot nest without
  bound, and a cut-off depth would silently reject valid data).
* Strings: ``\\uXXXX`` escapes exclude surrogates (astral characters come as themselves), so
  minLength/maxLength count code points. ``pattern`` full-matches the raw text between the quotes,
  restricted to characters JSON carries unescaped (so raw text == value).
* Numbers: whole-number bounds by digit ranges, exact as decimals and safe for json.loads' floats
  (15 significant digits next to an exclusive bound, whole numbers beyond 2^53); bounded numbers
  take no exponent unless the only bound is ``minimum: 0``; ``-0`` is never generated. Other
  bounds, and multipleOf other than 1, raise.
"""

import json
import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .errors import GuidedDecodingError

WHITESPACE = r"[ \n]{0,8}"  # one gap between tokens: bounded, so that a model cannot loop on whitespace
# Container levels of a value the schema leaves unconstrained. Each level multiplies the regex ~4x
# and the engine's NFA ~8x: level 3 would be ~80k NFA states per occurrence (the engine takes 250k).
ANY_DEPTH = 2
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


def schema_to_regex(schema: Union[dict, bool, str], whitespace: str = WHITESPACE) -> str:
    """The regex of the JSON texts valid against ``schema`` (a dict, a boolean or the schema's JSON
    text). ``whitespace`` is the regex of one gap between tokens: it must match only JSON whitespace."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GuidedDecodingError(f"The JSON Schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise GuidedDecodingError(f"A JSON Schema must be an object or a boolean, got {type(schema).__name__}")
    try:
        re.compile(whitespace)
    except (re.error, TypeError) as exc:
        raise GuidedDecodingError(f"whitespace must be a regex string: {exc}") from None
    simple = re.fullmatch(r"(?:\[[^\]]*\](?:[*+?]|\{\d+(?:,\d*)?\})?)?", whitespace)
    return _Compiler(schema, whitespace if simple else f"(?:{whitespace})").compile(schema, ())


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


def _dump(value: Any, keyword: str, path: Path) -> str:
    """Compact JSON text; non-ASCII characters as themselves unless there is a lone surrogate."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _err(keyword, path, f"holds a value that is not JSON: {exc}") from None
    return json.dumps(value, separators=(",", ":")) if re.search("[\ud800-\udfff]", text) else text


def _norm(value: Any) -> Any:
    """Makes JSON equality Python's (1 == 1.0 but true != 1) for ``_same``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_norm(v) for v in value] if isinstance(value, list) else \
        {k: _norm(v) for k, v in value.items()} if isinstance(value, dict) else value


def _same(a: Any, b: Any) -> bool:
    return json.dumps(_norm(a), sort_keys=True) == json.dumps(_norm(b), sort_keys=True)


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


# ---- schemas -------------------------------------------------------------------------------------
def _without(schema: dict, *keys: str) -> dict:
    return {k: v for k, v in schema.items() if k not in keys}


def _values(schema: Any) -> Optional[list]:
    if not isinstance(schema, dict):
        return None
    return [schema["const"]] if "const" in schema else schema["enum"] if isinstance(schema.get("enum"), list) else None


def _type_set(schema: Any) -> set:
    """The JSON types a schema's instances may have, conservatively (number includes integer)."""
    if not isinstance(schema, dict) or any(k in schema for k in ("allOf", "anyOf", "oneOf", "$ref")):
        return set(_TYPES)
    values, named = _values(schema), schema.get("type")
    if values is not None:
        names = {"boolean" if isinstance(v, bool) else "null" if v is None else "integer" if isinstance(v, int)
                 else "number" if isinstance(v, float) else "string" if isinstance(v, str)
                 else "array" if isinstance(v, list) else "object" for v in values}
    elif isinstance(named, (str, list)):
        names = set([named] if isinstance(named, str) else named)
    else:
        names = {t for t, kws in _TYPE_KEYWORDS.items() if any(k in schema for k in kws)} or set(_TYPES)
    return names | ({"integer"} if "number" in names else set()) | ({"null"} if schema.get("nullable") else set())


def _merge(a: Any, b: Any, path: Path) -> Any:
    """One schema for "a and b", where their keywords do not interact (else an error)."""
    if a is True or b is False or b is True or a is False:
        return b if a is True or b is False else a
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise GuidedDecodingError(f"The schema at {_fmt(path)} must be an object or a boolean")
    a, b = ({k: v for k, v in s.items() if k in _KNOWN} for s in (a, b))
    for dependent, on in (("additionalProperties", "properties"), ("items", "prefixItems"),
                          ("additionalItems", "items")):
        for x, y in ((a, b), (b, a)):  # x's `dependent` covers what x's own `on` leaves out: keep that
            mine, theirs = x.get(on), y.get(on)
            if x.get(dependent, True) is not True and theirs is not None and (mine is None or (
                    isinstance(mine, dict) and isinstance(theirs, dict) and not set(theirs) <= set(mine))):
                raise _err(dependent, path, f"would apply to '{on}' of another subschema; merge them into one")
    merged = dict(a)
    for key, value in b.items():
        if key == "properties" and isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = {**merged[key], **{n: _merge(merged[key][n], s, path + ("properties", n))
                                             if n in merged[key] else s for n, s in value.items()}}
        elif key == "type" and "type" in merged and all(isinstance(t, (str, list)) for t in (value, merged[key])):
            ta, tb = ([t] if isinstance(t, str) else t for t in (merged["type"], value))
            merged["type"] = [t for t in ta if t in tb or (t == "integer" and "number" in tb)] + \
                             [t for t in tb if t == "integer" and "number" in ta and t not in ta]
        elif key == "required" and isinstance(merged.get(key), list) and isinstance(value, list):
            merged["required"] = list(dict.fromkeys(merged["required"] + value))
        elif key in merged and not _same(merged[key], value):
            raise _err(key, path, "appears in two subschemas with different values; combine them by hand")
        else:
            merged[key] = value
    return merged


class _Compiler:
    """Compiles the schema nodes of one root document (which $refs resolve against)."""

    def __init__(self, root: Any, ws: str):
        self.root, self.ws, self.sep = root, ws, f"{ws},{ws}"
        self.origins: List[Path] = []  # where the $refs being expanded were taken
        self.cache: Dict[Any, str] = {}

    def compile(self, schema: Any, path: Path) -> str:
        if schema is True:
            return self.any(ANY_DEPTH)
        if not isinstance(schema, dict):
            what = "false: no value can satisfy it" if schema is False else "not an object or a boolean"
            raise GuidedDecodingError(f"The schema at {_fmt(path)} is {what}")
        for key in schema:
            if key in _UNSUPPORTED:
                raise _unsupported(key, path)
        if schema.get("nullable") is True:
            regex = f"(?:{self.compile(_without(schema, 'nullable'), path)}|null)"
        elif "$ref" in schema:
            regex = self._ref(schema, path)
        elif "allOf" in schema:
            regex = self._all_of(schema, path)
        elif "anyOf" in schema or "oneOf" in schema:
            regex = self._union(schema, path)
        elif "enum" in schema or "const" in schema:
            regex = self._enum(schema, path)
        else:
            regex = self._typed(schema, path)
        if len(regex) > MAX_REGEX_CHARS:
            raise GuidedDecodingError(f"The schema at {_fmt(path)} needs a regex over {MAX_REGEX_CHARS} "
                                      "characters; simplify it (fewer nested $refs or alternatives)")
        return regex

    def any(self, depth: int) -> str:
        """Any JSON value whose containers nest at most ``depth`` levels."""
        if depth not in self.cache:
            alts = [_STRING, NUMBER, "(?:true|false|null)"]
            if depth > 0:
                inner, ws, sep = self.any(depth - 1), self.ws, self.sep
                member = f"{_STRING}{ws}:{ws}{inner}"
                alts.append(self._brackets(f"{inner}(?:{sep}{inner})*", True))
                alts.append(rf"\{{{ws}(?:{member}(?:{sep}{member})*{ws})?\}}")
            self.cache[depth] = "(?:" + "|".join(alts) + ")"
        return self.cache[depth]

    def _resolve(self, ref: Any, path: Path) -> Tuple[Any, Path]:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise _err("$ref", path, f"is {ref!r}: only local references (#/$defs/Name) are supported")
        node, target = self.root, []
        for raw in ref[2:].split("/") if ref != "#" else []:
            part = re.sub("%([0-9a-fA-F]{2})", lambda m: chr(int(m[1], 16)), raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _err("$ref", path, f"is {ref!r}, which does not resolve in this schema")
            target.append(part)
        return node, tuple(target)

    def _target(self, schema: dict, path: Path) -> Tuple[Any, Path]:
        """A $ref's target and its path. Recursion: the target holds a place being expanded."""
        target, where = self._resolve(schema["$ref"], path)
        if any(p[:len(where)] == where for p in self.origins + [path]):
            raise _err("$ref", path, f"is {schema['$ref']!r}, a recursive reference: a regex cannot nest without "
                       "bound; unroll the recursion to a fixed depth in the schema")
        return target, where

    def _ref(self, schema: dict, path: Path) -> str:
        """The target merged with the sibling keywords. A target without siblings is compiled once
        (if it cannot recurse here, it cannot anywhere)."""
        target, where = self._target(schema, path)
        siblings = {k: v for k, v in schema.items() if k in _KNOWN and k != "$ref"}
        if not siblings and where in self.cache:
            return self.cache[where]
        self.origins.append(path)
        try:
            regex = self.compile(_merge(target, siblings, path), where)
        finally:
            self.origins.pop()
        self.cache.update({where: regex} if not siblings else {})
        return regex

    def _inline(self, schema: Any, path: Path, expanding: bool = False) -> Any:
        """``schema`` with its top-level $ref chain merged in (for allOf and the oneOf checks); when
        ``expanding`` (allOf), the targets count as places being expanded until the caller drops them."""
        for _ in range(64):
            if not isinstance(schema, dict) or "$ref" not in schema:
                return schema
            target, where = self._target(schema, path) if expanding else self._resolve(schema["$ref"], path)
            self.origins += [where] if expanding else []
            schema = _merge(target, _without(schema, "$ref"), path)
        raise _err("$ref", path, "forms a cycle of references")

    def _all_of(self, schema: dict, path: Path) -> str:
        subs, merged, mark = schema["allOf"], _without(schema, "allOf"), len(self.origins)
        if not isinstance(subs, list) or not subs:
            raise _err("allOf", path, "must be a non-empty array of schemas")
        try:
            for i, sub in enumerate(subs):
                merged = _merge(merged, self._inline(sub, path + ("allOf", str(i)), True), path + ("allOf", str(i)))
            return self.compile(merged, path)
        finally:
            del self.origins[mark:]

    def _union(self, schema: dict, path: Path) -> str:
        kw = "anyOf" if "anyOf" in schema else "oneOf"
        subs, rest = schema[kw], _without(schema, kw)
        if not isinstance(subs, list) or not subs:
            raise _err(kw, path, "must be a non-empty array of schemas")
        branches = [(path + (kw, str(i)), _merge(rest, sub, path + (kw, str(i)))) for i, sub in enumerate(subs)]
        branches = [(p, b) for p, b in branches if b is not False and not (isinstance(b, dict) and b.get("type") == [])]
        if not branches:
            raise _err(kw, path, "has no branch compatible with its sibling keywords")
        for i, (pa, a) in enumerate(branches if kw == "oneOf" else []):
            for pb, b in branches[i + 1:]:
                if not self._disjoint(self._inline(a, pa), self._inline(b, pb)):
                    raise _err("oneOf", path, f"has branches {_fmt(pa)} and {_fmt(pb)} that a value may both match; "
                               "a regex cannot enforce 'exactly one' (use anyOf if overlap is fine)")
        alts = list(dict.fromkeys(self.compile(b, p) for p, b in branches))
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    def _disjoint(self, a: Any, b: Any, depth: int = 0) -> bool:
        """Whether no value generated for one branch validates against the other: their types or
        const/enum values differ, each requires a property the other never generates, or a property
        both require is itself disjoint (a discriminator)."""
        common, va, vb = _type_set(a) & _type_set(b), _values(a), _values(b)
        if not common or (va is not None and vb is not None and not any(_same(x, y) for x in va for y in vb)):
            return True
        if common != {"object"} or not isinstance(a, dict) or not isinstance(b, dict) or depth > 8:
            return False
        props = [s["properties"] if isinstance(s.get("properties"), dict) else {} for s in (a, b)]
        req = [set(s["required"]) if isinstance(s.get("required"), list) else set() for s in (a, b)]
        keys = [{k for k, v in p.items() if v is not False} | r for p, r in zip(props, req)]
        if req[1] - keys[0] and req[0] - keys[1]:
            return True
        return any(self._disjoint(self._inline(props[0].get(k, True), ()), self._inline(props[1].get(k, True), ()),
                                  depth + 1) for k in req[0] & req[1])

    def _enum(self, schema: dict, path: Path) -> str:
        key = "const" if "const" in schema else "enum"
        values = [schema["const"]] if key == "const" else schema["enum"]
        if not isinstance(values, list) or not values:
            raise _err("enum", path, "must be a non-empty array")
        if key == "const" and "enum" in schema and not any(_same(v, values[0]) for v in list(schema["enum"] or [])):
            raise _err("const", path, "is not in the enum: no value can satisfy both")
        rest = {k: v for k, v in schema.items() if k in _KNOWN and k not in ("enum", "const", "nullable")}
        check = re.compile(self.compile(rest, path)) if rest else None
        texts = [t for t in dict.fromkeys(_dump(v, key, path) for v in values) if check is None or check.fullmatch(t)]
        if not texts:
            raise _err(key, path, "has no value that the sibling keywords accept (objects must list their "
                       "properties in the order of 'properties')")
        return "(?:" + "|".join(_escape(t) for t in texts) + ")"

    def _typed(self, schema: dict, path: Path) -> str:
        named = schema.get("type")
        types = [t for t, kws in _TYPE_KEYWORDS.items() if any(k in schema for k in kws)] if named is None else \
            [named] if isinstance(named, str) else named
        if named is None and not types:
            return self.any(ANY_DEPTH)
        if not isinstance(types, list) or not types or any(t not in _TYPES for t in types):
            raise _err("type", path, f"is {named!r}: use one of {', '.join(_TYPES)}, or a non-empty list of them")
        alts = []
        for t in dict.fromkeys(t for t in types if t != "integer" or "number" not in types):
            if t in ("integer", "number"):
                alts.append(_numeric(schema, path, t == "integer"))
            elif t in ("string", "object", "array"):
                alts.append(getattr(self, "_" + t)(schema, path))
            else:
                alts.append("(?:true|false)" if t == "boolean" else "null")
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    def _string(self, schema: dict, path: Path) -> str:
        lo, hi = _count(schema, "minLength", path, 0), _count(schema, "maxLength", path, None)
        if hi is not None and hi < lo:
            raise _err("minLength", path, "exceeds maxLength: no string can satisfy both")
        fmt, pattern = schema.get("format"), schema.get("pattern")
        if fmt is None and pattern is None:
            return f'"{_repeat(_CHAR, lo, hi)}"'
        key = "format" if fmt is not None else "pattern"
        if (fmt is not None and pattern is not None) or lo > 0 or hi is not None:
            raise _err(key, path, "cannot be combined with pattern/format/minLength/maxLength by guided "
                       "decoding (a regex cannot intersect them); keep one")
        if fmt is not None and fmt not in _FORMATS:
            raise _err("format", path, f"is {fmt!r}: the supported formats are {', '.join(_FORMATS)}")
        if pattern is not None and not isinstance(pattern, str):
            raise _err("pattern", path, "must be a string")
        return '"(?:' + (_FORMATS[fmt] if fmt is not None else _pattern(pattern, path)) + ')"'

    def _object(self, schema: dict, path: Path) -> str:
        props, required = schema.get("properties", {}), schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        if not isinstance(props, dict):
            raise _err("properties", path, "must be an object of schemas")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise _err("required", path, "must be an array of property names")
        members = [(self._member(name, sub, path + ("properties", name)), name in required)
                   for name, sub in props.items() if sub is not False or name in required]
        for name in dict.fromkeys(r for r in required if r not in props):
            if extra is False:
                raise _err("required", path, f"lists {name!r}, which is not in properties while "
                           "additionalProperties is false: no object can satisfy it")
            members.append((self._member(name, extra, path + ("additionalProperties",)), True))
        if _count(schema, "minProperties", path, 0) > sum(req for _, req in members):
            raise _err("minProperties", path, "is above the number of required properties: list them in 'required'")
        if _count(schema, "maxProperties", path, len(members)) < len(members):
            raise _err("maxProperties", path, "is below the number of properties: drop properties instead")
        return self._members(members)

    def _member(self, name: str, schema: Any, path: Path) -> str:
        return f"{_escape(_dump(name, 'properties', path))}{self.ws}:{self.ws}{self.compile(schema, path)}"

    def _members(self, members: List[Tuple[str, bool]]) -> str:
        """Members in order, the optional ones skippable, linear in their size: optional ones before
        the first required one carry their comma after, the others before."""
        ws, sep = self.ws, self.sep
        first = next((i for i, (_, req) in enumerate(members) if req), None)
        if not members:
            return rf"\{{{ws}\}}"
        if first is None:
            return rf"\{{{ws}(?:{self._subsets([regex for regex, _ in members])}{ws})?\}}"
        head = "".join(f"(?:{regex}{sep})?" for regex, _ in members[:first])
        tail = "".join(f"{sep}{regex}" if req else f"(?:{sep}{regex})?" for regex, req in members[first + 1:])
        return rf"\{{{ws}{head}{members[first][0]}{tail}{ws}\}}"

    def _subsets(self, regexes: List[str]) -> str:
        """The non-empty in-order subsets of the members, comma-separated: U_k = (?:H_k|(?:H_k,)?U_k+1)
        over at most 16 blocks (the engine limits group nesting), where H_k, the non-empty subsets of
        block k, alternates its first present member; size linear up to 16 members, then ~n^2/32."""
        size = -(-len(regexes) // 16)
        blocks = [regexes[i:i + size] for i in range(0, len(regexes), size)]
        subsets = ["(?:" + "|".join(r + "".join(f"(?:{self.sep}{x})?" for x in block[i + 1:])
                                    for i, r in enumerate(block)) + ")" for block in blocks]
        body = subsets[-1]
        for h in reversed(subsets[:-1]):
            body = f"(?:{h}|(?:{h}{self.sep})?{body})"
        return body

    def _array(self, schema: dict, path: Path) -> str:
        """Prefix items in place (those past minItems optional, nested), then the others repeated."""
        lo, hi = _count(schema, "minItems", path, 0), _count(schema, "maxItems", path, None)
        if schema.get("uniqueItems", False) is not False and (hi is None or hi > 1):
            raise _unsupported("uniqueItems", path)
        prefix, prefix_key, rest, rest_key = schema.get("prefixItems", []), "prefixItems", schema.get("items", True), \
            "items"
        if isinstance(rest, list):  # draft 4-7 tuple form
            prefix, prefix_key, rest, rest_key = rest, "items", schema.get("additionalItems", True), "additionalItems"
        if not isinstance(prefix, list):
            raise _err(prefix_key, path, "must be an array of schemas")
        hi = (len(prefix) if hi is None else min(hi, len(prefix))) if rest is False else hi
        if hi is not None and hi < lo:
            raise _err("minItems", path, "exceeds maxItems (or the prefixItems when no others are allowed)")
        k = len(prefix) if hi is None else min(len(prefix), hi)
        elems = [self.compile(p, path + (prefix_key, str(i))) for i, p in enumerate(prefix[:k])]
        more = "" if hi is not None and hi <= k else self.compile(rest, path + (rest_key,))
        if not elems:
            body = more and more + _repeat(f"(?:{self.sep}{more})", max(lo - 1, 0), None if hi is None else hi - 1)
            return self._brackets(body, lo == 0) if body else rf"\[{self.ws}\]"
        body = _repeat(f"(?:{self.sep}{more})", max(lo - k, 0), None if hi is None else hi - k) if more else ""
        for i in range(k - 1, 0, -1):
            body = self.sep + elems[i] + body
            body = f"(?:{body})?" if i >= lo else body
        return self._brackets(elems[0] + body, lo == 0)

    def _brackets(self, body: str, optional: bool) -> str:
        inner = f"(?:{body}{self.ws})?" if optional else body + self.ws
        return rf"\[{self.ws}{inner}\]"
