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
* $ref: local JSON pointers (``#/$defs/Name``), inlined. A recursive reference (a tree, a linked
  list, ``"#"``) cannot be inlined: its target becomes a *rule*, written into the regex as one
  placeholder character (``compile_schema``), and ``schema_grammar`` runs the regexes as the rules
  of a grammar on the pushdown recognizer (a cut-off depth would silently reject valid data). A
  recursive reference beside other keywords, or under allOf, is an error.
* Strings: ``\\uXXXX`` escapes exclude surrogates (astral characters come as themselves), so
  minLength/maxLength count code points. ``pattern`` full-matches the raw text between the quotes,
  restricted to characters JSON carries unescaped (so raw text == value).
* Numbers: whole-number bounds by digit ranges, exact as decimals and safe for json.loads' floats
  (15 significant digits next to an exclusive bound, whole numbers beyond 2^53); bounded numbers
  take no exponent unless the only bound is ``minimum: 0``; ``-0`` is never generated. Other
  bounds, and multipleOf other than 1, raise.

Strings, numbers, formats and the keyword errors are built in ``json_schema_scalars``; this module
walks the schema (types, objects, arrays, unions, references).
"""

import json
import re
from typing import Any, Dict, List, Optional, Tuple, Union

from .errors import GuidedDecodingError
from .json_schema_scalars import (
    _CHAR, _count, _err, _escape, _fmt, _FORMATS, _KNOWN, MAX_REGEX_CHARS, NUMBER, _numeric, Path,
    _pattern, _repeat, _STRING, _TYPE_KEYWORDS, _TYPES, _unsupported, _UNSUPPORTED,
)


WHITESPACE = r"[ \n]{0,8}"  # one gap between tokens: bounded, so that a model cannot loop on whitespace
# Container levels of a value the schema leaves unconstrained. Each level multiplies the regex ~4x
# and the engine's NFA ~8x: level 3 would be ~80k NFA states per occurrence (the engine takes 250k).
ANY_DEPTH = 2
# A recursive reference is written into the regex as one lone surrogate: no user text reaches a
# compiled regex as one (_dump escapes them, patterns refuse them), and the engine reads it back as
# a rule reference (regex_parser's placeholders).
RULE_MARKS = (0xD800, 0xDFFF)
Rules = Dict[str, Tuple[str, str]]  # placeholder character -> (the target's JSON pointer, its regex)


def schema_to_regex(schema: Union[dict, bool, str], whitespace: str = WHITESPACE) -> str:
    """The regex of the JSON texts valid against ``schema`` (a dict, a boolean or the schema's JSON
    text). ``whitespace`` is the regex of one gap between tokens: it must match only JSON whitespace.
    A recursive schema has no regex: ``GuidedDecodingError`` (``compile_schema`` takes it)."""
    regex, rules = compile_schema(schema, whitespace)
    if rules:
        name = next(iter(rules.values()))[0]
        raise GuidedDecodingError(f"The schema refers to {name!r} recursively: it has no regular expression")
    return regex


def compile_schema(schema: Union[dict, bool, str], whitespace: str = WHITESPACE) -> Tuple[str, Rules]:
    """The regex of ``schema`` (as ``schema_to_regex``) and, when it recurses, its rules: each
    placeholder character in a regex stands for the JSON texts of that rule's regex."""
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
    return _Compiler(schema, whitespace if simple else f"(?:{whitespace})").compile_rules(schema)



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
        self.marks: Dict[Path, str] = {}  # targets of recursive references -> their placeholders

    def compile_rules(self, schema: Any) -> Tuple[str, Rules]:
        """The root's regex and the rules of the recursive references met on the way (a rule's own
        regex may meet more: compiled until none is left)."""
        regex, rules = self.compile(schema, ()), {}
        while len(rules) < len(self.marks):
            where, mark = next((w, m) for w, m in self.marks.items() if m not in rules)
            pointer = "#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in where)
            target = self.root
            for part in where:  # resolved before: the path exists
                target = target[int(part)] if isinstance(target, list) else target[part]
            rules[mark] = (pointer, regex if not where else self.compile(target, where))
        return regex, rules

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

    def _recursive(self, where: Path, path: Path) -> bool:
        """Whether a reference to ``where`` is recursive: the target holds a place being expanded."""
        return any(p[:len(where)] == where for p in self.origins + [path])

    def _target(self, schema: dict, path: Path) -> Tuple[Any, Path]:
        """A $ref's target and its path, for allOf (which merges targets: it cannot follow recursion)."""
        target, where = self._resolve(schema["$ref"], path)
        if self._recursive(where, path):
            raise _err("$ref", path, f"is {schema['$ref']!r}, a recursive reference under allOf: its keywords "
                       "cannot be merged into the schema that holds it; refer to it outside allOf")
        return target, where

    def _ref(self, schema: dict, path: Path) -> str:
        """The target merged with the sibling keywords; a recursive reference, the target's rule.
        A target without siblings is compiled once (its regex is the same wherever it is met)."""
        target, where = self._resolve(schema["$ref"], path)
        siblings = {k: v for k, v in schema.items() if k in _KNOWN and k != "$ref"}
        if self._recursive(where, path):
            if siblings:
                raise _err("$ref", path, f"is {schema['$ref']!r}, a recursive reference beside the keywords "
                           f"{', '.join(siblings)}: move them into the schema it refers to")
            if where not in self.marks and len(self.marks) > RULE_MARKS[1] - RULE_MARKS[0]:
                raise _err("$ref", path, "is one recursive reference too many: the schema recurses through "
                           f"over {RULE_MARKS[1] - RULE_MARKS[0] + 1} targets")
            return self.marks.setdefault(where, chr(RULE_MARKS[0] + len(self.marks)))
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
        if check is not None and any(c in check.pattern for c in self.marks.values()):
            raise _err(key, path, "sits beside a recursive reference, which cannot check its values; drop one")
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
