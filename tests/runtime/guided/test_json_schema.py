"""JSON Schema -> regex of guided decoding (``json_schema.schema_to_regex``), checked with Python's
``re.fullmatch``: valid instances (rendered compact, with ``json.dumps``' default separators and
indented) match, invalid ones and the documented restrictions do not; seeded mutations and strings
drawn from the regex itself (hypothesis) that match always parse and validate (against a small
validator written here, and ``jsonschema_rs`` where installed); integer, number and date ranges
exhaustively; the emitted regex stays within the engine's dialect and limits (``regex_dfa`` compiles
it and agrees with ``re``); sizes stay linear; every unsupported or malformed schema raises a
``GuidedDecodingError`` naming the keyword and its path."""

import datetime
import json
import math
import random
import re
import uuid
import zlib
from fractions import Fraction
from typing import Any, Dict, List, NamedTuple, Optional

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from autodeploy.runtime.guided.errors import GuidedDecodingError
from autodeploy.runtime.guided.json_schema import ANY_DEPTH, WHITESPACE, schema_to_regex

try:  # a second, independent validator (installed with schemathesis); the one below suffices
    import jsonschema_rs
except ImportError:  # pragma: no cover
    jsonschema_rs = None


# ---- a small validator for the supported subset (formats, nullable and local $refs included) -------
def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _is_type(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return {"object": isinstance(value, dict), "array": isinstance(value, list), "string": isinstance(value, str),
            "integer": isinstance(value, int) or (isinstance(value, float) and value.is_integer()),
            "number": isinstance(value, (int, float)), "boolean": isinstance(value, bool),
            "null": value is None}[name]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


_TIME = re.compile(r"([01]\d|2[0-3]):([0-5]\d):([0-5]\d)(\.\d+)?([zZ]|[+-]([01]\d|2[0-3]):[0-5]\d)", re.ASCII)


def _format_ok(fmt: str, text: str) -> bool:
    def date_ok(s: str) -> bool:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", s, re.ASCII):
            return False
        try:
            return bool(datetime.date(int(s[:4]), int(s[5:7]), int(s[8:])))
        except ValueError:
            return False

    if fmt == "date":
        return date_ok(text)
    if fmt == "time":
        return bool(_TIME.fullmatch(text))
    if fmt == "date-time":
        return len(text) > 11 and text[10] in "Tt" and date_ok(text[:10]) and bool(_TIME.fullmatch(text[11:]))
    if fmt == "uuid":
        return bool(re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", text)) and bool(uuid.UUID(text))
    if fmt == "email":
        local, _, domain = text.rpartition("@")
        return bool(local) and "." in domain and not re.search(r"[\s@]", domain) and not domain.startswith(".")
    raise AssertionError(fmt)


_UNICODE_SPACES = "\\s\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"


def _ecma(pattern: str) -> str:
    """ECMA-262's \\d \\w (ASCII) and \\s \\S (Unicode spaces) in Python's re with re.ASCII."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        token = pattern[i:i + 2] if pattern[i] == "\\" else pattern[i]
        if token == "\\s":
            token = _UNICODE_SPACES if in_class else f"[{_UNICODE_SPACES}]"
        elif token == "\\S" and not in_class:
            token = f"[^{_UNICODE_SPACES}]"
        in_class = (in_class or token == "[") and token != "]"
        out.append(token)
        i += len(pattern[i:i + 2]) if pattern[i] == "\\" else 1
    return "".join(out)


def _valid_number(schema: dict, value: Any) -> bool:
    x = Fraction(value) if math.isfinite(value) else value  # a huge exponent parses as inf
    for key, excl_key, sign in (("minimum", "exclusiveMinimum", 1), ("maximum", "exclusiveMaximum", -1)):
        excl = schema.get(excl_key)
        if isinstance(excl, bool):  # draft 4: a modifier of minimum/maximum
            excl = schema.get(key) if excl else None
        if key in schema and sign * (x - Fraction(schema[key])) < 0:
            return False
        if excl is not None and sign * (x - Fraction(excl)) <= 0:
            return False
    return "multipleOf" not in schema or x % Fraction(schema["multipleOf"]) == 0


def _valid_object(schema: dict, value: dict, root: Any) -> bool:
    props = schema.get("properties", {})
    if any(k not in value for k in schema.get("required", [])):
        return False
    extra = schema.get("additionalProperties", True)
    return all(validate(props[k], v, root) if k in props else validate(extra, v, root) for k, v in value.items())


def _valid_array(schema: dict, value: list, root: Any) -> bool:
    if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
        return False
    prefix, rest = schema.get("prefixItems", []), schema.get("items", True)
    if isinstance(rest, list):
        prefix, rest = rest, schema.get("additionalItems", True)
    return all(validate(prefix[i] if i < len(prefix) else rest, v, root) for i, v in enumerate(value))


def validate(schema: Any, value: Any, root: Any = None) -> bool:
    """JSON Schema validity (2020-12 semantics plus OpenAPI's nullable) of the supported subset."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return schema
    if schema.get("nullable") and value is None:
        return True
    if "$ref" in schema and not validate(_resolve(root, schema["$ref"]), value, root):
        return False
    names = schema.get("type")
    if names is not None and not any(_is_type(value, t) for t in ([names] if isinstance(names, str) else names)):
        return False
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return False
    if "const" in schema and not _same(value, schema["const"]):
        return False
    if not all(validate(s, value, root) for s in schema.get("allOf", [])):
        return False
    if "anyOf" in schema and not any(validate(s, value, root) for s in schema["anyOf"]):
        return False
    if "oneOf" in schema and sum(validate(s, value, root) for s in schema["oneOf"]) != 1:
        return False
    if isinstance(value, str):
        return (schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
                and ("pattern" not in schema or re.search(_ecma(schema["pattern"]), value, re.ASCII) is not None)
                and ("format" not in schema or _format_ok(schema["format"], value)))
    if _is_type(value, "number"):
        return _valid_number(schema, value)
    if isinstance(value, dict):
        return _valid_object(schema, value, root)
    return _valid_array(schema, value, root) if isinstance(value, list) else True


def whitespace_ok(text: str, limit: int = 8) -> bool:
    """Whitespace only between tokens, as runs of at most ``limit`` spaces/newlines."""
    runs, in_string, escaped, run = [], False, False, ""
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch in " \t\n\r":
            run += ch
            continue
        else:
            in_string = ch == '"'
        runs.append(run)
        run = ""
    runs.append(run)
    return runs[0] == runs[-1] == "" and all(len(r) <= limit and set(r) <= {" ", "\n"} for r in runs)


def _unique_keys(pairs: List[Any]) -> dict:
    assert len({k for k, _ in pairs}) == len(pairs), f"duplicate keys {pairs}"  # json.loads would take them
    return dict(pairs)


def check_sound(schema: Any, text: str, unique_keys: bool = True) -> Any:
    """A matched text must parse, validate and use only the allowed whitespace."""
    value = json.loads(text, object_pairs_hook=_unique_keys if unique_keys else None)
    assert validate(schema, value), (schema, text)
    assert whitespace_ok(text), text
    if jsonschema_rs is not None and "nullable" not in json.dumps(schema) and "Infinity" not in json.dumps(value):
        assert jsonschema_rs.validator_for(schema, validate_formats=True).is_valid(value), (schema, text)
    return value


# ---- cases ---------------------------------------------------------------------------------------
class Case(NamedTuple):
    name: str
    schema: Any
    values: List[Any]  # valid; rendered three ways (only compact where ``compact_only``)
    invalid: List[str]  # texts the regex must reject: invalid JSON or invalid against the schema
    restricted: List[str] = []  # valid texts the regex rejects by design (documented restrictions)
    texts: List[str] = []  # more valid texts that must match
    compact_only: bool = False  # enum/const: only json.dumps(v, separators=(",", ":"), ensure_ascii=False)
    repeats_keys: bool = False  # objects of an unconstrained value may repeat a key (documented)


POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
         "required": ["x", "y"], "additionalProperties": False}
FLAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False}
OPTIONAL = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                             "c": {"type": "boolean"}, "d": {"type": "null"}, "e": {"type": "number"}},
            "required": ["b", "d"]}
ALL_OPTIONAL = {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "integer"},
                                                 "z": {"type": "boolean"}}, "additionalProperties": False}
PET = {"$defs": {"Cat": {"type": "object", "properties": {"pet_type": {"const": "cat"}, "meows": {"type": "integer"}},
                         "required": ["pet_type", "meows"]},
                 "Dog": {"type": "object", "properties": {"pet_type": {"const": "dog"}, "barks": {"type": "number"}},
                         "required": ["pet_type"]}},
       "type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                                "discriminator": {"propertyName": "pet_type"}}},
       "required": ["pet"], "title": "Owner", "description": "annotations are ignored"}


def _formats_text(**bad: str) -> str:
    good = {"d": "2024-01-01", "t": "12:00:00Z", "dt": "2000-01-01T00:00:00Z",
            "u": "123e4567-e89b-12d3-a456-426614174000", "e": "a@b.co"}
    return json.dumps({**good, **bad}, separators=(",", ":"))


def _subsets(props: Dict[str, Any], required: List[str]) -> List[dict]:
    names = [n for n in props if n not in required]
    return [{k: v for k, v in props.items() if k in required or (mask >> names.index(k)) & 1}
            for mask in range(1 << len(names))]


CASES = [
    Case("flat", FLAT,
         [{"name": "Ann", "age": 31, "ok": True}, {"name": "", "age": -5, "ok": False},
          {"name": "é \"q\" \\ /\n\t", "age": 0, "ok": True}],
         ['{"name":"Ann","age":31}', '{"name":"Ann","age":"31","ok":true}', '{"name":"Ann","age":31,"ok":true,"x":1}',
          '{"name":"Ann","age":31,"ok":true,}', ' {"name":"Ann","age":31,"ok":true}',
          '{"name":"Ann","age":31,"ok":true} ', '{"name":"Ann","age":31.5,"ok":true}',
          '{"name":"Ann","age":01,"ok":true}', '{"name":"Ann","age":31,"ok":True}',
          '{"name":"A\x01","age":1,"ok":true}', '{"name":"A\\q","age":1,"ok":true}',
          '{"name":"Ann" "age":31,"ok":true}',
          '{"name":"Ann","age":1,"ok":true'],
         ['{"age":31,"name":"Ann","ok":true}', '{"name":"Ann",\t"age":31,"ok":true}',
          '{"name":"Ann",         "age":31,"ok":true}', '{"name":"Ann","age":31.0,"ok":true}',
          '{"name":"\\ud83d\\ude00","age":1,"ok":true}'],
         ['{"name":"😀 \\u00e9\\n\\"","age":-0,"ok":true}']),
    Case("optional", OPTIONAL, _subsets({"a": 7, "b": "s", "c": False, "d": None, "e": -2.5e-3}, ["b", "d"]),
         ['{"a":1,"d":null}', '{"b":"s"}', '{"b":"s",,"d":null}', '{,"b":"s","d":null}', '{"b":"s","d":null,}',
          '{"b":"s","d":null,"e":"x"}', '{"a":1"b":"s","d":null}'],
         ['{"d":null,"b":"s"}', '{"b":"s","d":null,"f":1}']),
    Case("all_optional", ALL_OPTIONAL, _subsets({"x": "a", "y": 2, "z": True}, []),
         ['{,}', '{"x":"a",}', '{"y":1"z":true}', '{"w":1}', '[]', 'null', '{"y":"2"}'],
         ['{"z":true,"x":"a"}', '{"x":"a","x":"b"}']),
    Case("nested", {"type": "object", "required": ["user"], "properties": {"user": {
        "type": "object", "required": ["id"], "properties": {
            "id": {"type": "integer", "minimum": 1},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}}},
         [{"user": {"id": 1}}, {"user": {"id": 99, "tags": []}}, {"user": {"id": 5, "tags": ["a", "b", "c"]}}],
         ['{"user":{"id":0}}', '{"user":{"id":-1}}', '{"user":{"id":1,"tags":["a","b","c","d"]}}', '{"user":{}}',
          '{"user":{"id":1,"tags":[1]}}', '{"user":{"id":1,"tags":["a",]}}', '{"user":{"id":1}']),
    Case("array_bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
         [[1, 2], [1, 2, 3], [-1, 0, 3, 4]],
         ['[1]', '[]', '[1,2,3,4,5]', '[1,"a"]', '[1,2,]', '[,1,2]', '[1 2]']),
    Case("tuple", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                   "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
         [["a", 1], ["a", 1, True], ["a", 1, True, False]],
         ['[]', '["a"]', '[1]', '["a","b"]', '["a",1,true,false,true]', '["a",1,2]', '["a",true]']),
    Case("tuple_open", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
         [[], ["a"], ["a", 1], ["a", 1, None, [2], {"b": "c"}]], ['[1]', '["a","b"]', '["a",1,]'],
         repeats_keys=True),
    Case("tuple_closed", {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
                          "items": [{"type": "null"}, {"enum": ["x", "y"]}], "additionalItems": False},
         [[], [None], [None, "x"], [None, "y"]], ['[null,"x",null]', '["x"]', '[null,"z"]']),
    Case("enum", {"enum": ["red", "green", 3, None, {"a": [1, "é"]}, True, 2.5]},
         ["red", "green", 3, None, {"a": [1, "é"]}, True, 2.5],
         ['"blue"', '4', '{"a":[1]}', 'True', '"red "', '"Red"', '[]'],
         ['2.50', '{"a": [1, "é"]}', '{"a":[1,"\\u00e9"]}', '3.0'], compact_only=True),
    Case("const", {"const": "fixed", "description": "x"}, ["fixed"], ['"fixe"', '"fixedd"', 'fixed', '""'],
         compact_only=True),
    Case("const_typed", {"type": "integer", "enum": [1, 2, "3", 4.5], "maximum": 1}, [1], ['2', '"3"', '4.5'],
         compact_only=True),
    Case("any_of", {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer", "minimum": 0, "maximum": 100}]},
         ["ab", "", 0, 100, 42], ['"abc"', '101', '-1', '1.5', 'null', '00']),
    Case("any_of_siblings", {"type": "object", "required": ["k"], "properties": {"k": {"type": "string"}},
                             "anyOf": [{"required": ["a"], "properties": {"k": {"type": "string"},
                                                                          "a": {"type": "integer"}}},
                                       {"type": "array"}]},
         [{"k": "x", "a": 1}], ['{"k":"x"}', '[]', '{"a":1}']),
    Case("type_list", {"type": ["string", "null"], "minLength": 1}, ["a", None, "é"], ['""', '1', 'false', 'nul']),
    Case("number", {"type": "number"}, [0, -1, 2.5, 1e-7, -3e300, 123456789012345678901234567890],
         ['1e', '1.e5', '01', '+1', '.5', '1E+-3', '-', '1.5.2', '0x1', '1_000', '- 1'],
         texts=['1e-5', '-2.5E+3', '0.0', '-0', '1E400', '0e0']),
    Case("required_extra", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
                            "additionalProperties": {"type": "string"}},
         [{"a": 1, "b": "x"}], ['{"a":1}', '{"a":1,"b":2}'], ['{"b":"x","a":1}']),
    Case("int_or_number", {"type": ["integer", "number", "boolean"], "maximum": 2}, [1, 1.5, -3e-2, 2, False],
         ['3', '2.5', '"1"', 'null']),
    Case("refs", {"$defs": {"Point": POINT}, "definitions": {"Color": {"enum": ["red", "blue"]}},
                  "type": "object", "required": ["a"],
                  "properties": {"a": {"$ref": "#/$defs/Point"},
                                 "b": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "maxItems": 2},
                                 "c": {"$ref": "#/definitions/Color"}}},
         [{"a": {"x": 1, "y": 2.5}}, {"a": {"x": 0, "y": 0}, "b": [{"x": 1, "y": 1}], "c": "blue"}],
         ['{"a":{"x":1}}', '{"a":{"x":1,"y":2},"c":"green"}', '{"b":[]}',
          '{"a":{"x":1,"y":2},"b":[{"x":1,"y":1},{"x":1,"y":1},{"x":1,"y":1}]}']),
    Case("all_of", {"$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "string"}}}},
                    "allOf": [{"$ref": "#/$defs/Base"}, {"required": ["b"]}]},
         [{"b": "x"}, {"a": 1, "b": "x"}], ['{"a":1}', '{}']),
    Case("formats", {"type": "object", "required": ["d", "t", "dt", "u", "e"], "properties": {
        "d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "time"},
        "dt": {"type": "string", "format": "date-time"}, "u": {"type": "string", "format": "uuid"},
        "e": {"type": "string", "format": "email"}}},
         [{"d": "2024-02-29", "t": "23:59:59.123Z", "dt": "2000-01-31T00:00:00+05:30",
           "u": "123e4567-e89b-12d3-a456-426614174000", "e": "first.last+tag@mail.example.org"}],
         [_formats_text(**{key: bad}) for key, bads in {
             "d": ["2023-02-29", "2024-13-01", "2024-1-01", "1900-02-29", "0000-01-01", "2024-01-01 "],
             "t": ["24:00:00Z", "12:00:00", "12:60:00Z", "12:00:00+24:00", "12:00Z"],
             "dt": ["2000-01-01 00:00:00Z", "2000-01-01T00:00:00", "2000-02-30T00:00:00Z"],
             "u": ["123e4567-e89b-12d3-a456-42661417400", "123e4567e89b12d3a456426614174000",
                   "g23e4567-e89b-12d3-a456-426614174000"],
             "e": ["ab.co", "a@b", "a@@b.co", "a b@c.co", ".a@b.co"]}.items() for bad in bads]),
    Case("lengths", {"type": "string", "minLength": 2, "maxLength": 5}, ["ab", "abcde", "a\nb", "\"\\/", "é€"],
         ['"a"', '"abcdef"', '"\\ud83d\\ude00"', '"ab\\"', '"\\u00e"', '"a\\nbcde"', "ab", '"a"b"'],
         texts=['"é😀"', '"\\u00e9\\u20ac"', '"ab\\/"']),
    Case("any", {}, [1, "x", None, [1, {"a": None}], {"a": {"b": 1}}, [[]], [], {}, -0.5e10],
         ['[1,]', '{"a"}', '{1:2}', "'x'", 'nan', '--1', '.5', '1.', '+1', '0x1', '"\t"'],
         ['[[[1]]]', '{"a":{"b":{}}}', '[{"a":[]}]'], texts=['{"a":1,"a":2}'], repeats_keys=True),
    Case("any_property", {"type": "object", "properties": {"meta": {}, "n": {"type": "integer"}}},
         [{}, {"meta": [1, "a", {"b": False}]}, {"meta": None, "n": 3}], ['{"meta":}', '{"n":"3"}', '{"meta":[1,]}'],
         ['{"meta":[[[]]]}'], repeats_keys=True),
    Case("number_range", {"type": "number", "minimum": -1, "maximum": 1.0},
         [0, 1, -1, 0.5, -0.999, 0.0001], ['1.01', '-1.5', '2', '-1.0001', '10', '1.', '.5', '01'],
         ['1e0', '0.5E-1', '-0', '-0.0'], texts=['1.000', '-1.0', '0.9999999']),
    Case("positive", {"type": "number", "exclusiveMinimum": 0}, [0.001, 5, 123.25],
         ['0', '-1', '0.0', '0.000', '-0.5'], ['1e3']),
    Case("non_negative", {"type": "number", "minimum": 0}, [0, 0.5, 12, 1e21, 2.5e-7],
         ['-1', '-0.5', '-1e3']),
    Case("int_range", {"type": "integer", "minimum": 10, "exclusiveMaximum": 1000}, [10, 11, 99, 100, 999],
         ['9', '1000', '1001', '-10', '10.5', '010'], ['10.0', '1e1']),
    Case("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, ["ab-12", "z-00"],
         ['"ab-1"', '"AB-12"', '"ab-123"', '"ab_12"']),
    Case("pattern_printable", {"type": "string", "pattern": "^[ -~]{1,5}$"}, ["a b", "~!#", "{}[]"],
         ['""', '"abcdef"', '"é"'], ['"a\\"b"', '"\\\\"']),
    Case("one_of", PET, [{"pet": {"pet_type": "cat", "meows": 3}}, {"pet": {"pet_type": "dog"}},
                         {"pet": {"pet_type": "dog", "barks": 1.5}}],
         ['{"pet":{"pet_type":"cat"}}', '{"pet":{"pet_type":"cow"}}', '{}', '{"pet":{"meows":3}}'],
         ['{"pet":{"pet_type":"dog","meows":3}}']),
    Case("nullable", {"type": "string", "nullable": True, "maxLength": 3}, ["abc", None],
         ['"abcd"', '0', 'nul']),
]


def renderings(case: Case, value: Any) -> List[str]:
    if case.compact_only:
        return [json.dumps(value, separators=(",", ":"), ensure_ascii=False)]
    texts = [json.dumps(value), json.dumps(value, separators=(",", ":")), json.dumps(value, indent=2),
             json.dumps(value, ensure_ascii=False)]
    return [t for t in texts if whitespace_ok(t)]


@pytest.fixture(scope="module")
def regexes() -> Dict[str, "re.Pattern[str]"]:
    return {case.name: re.compile(schema_to_regex(case.schema)) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_valid_instances_match(case: Case, regexes: Dict[str, "re.Pattern[str]"]) -> None:
    texts = [t for v in case.values for t in renderings(case, v)] + case.texts
    for text in texts:
        assert regexes[case.name].fullmatch(text), text
        check_sound(case.schema, text, not case.repeats_keys)  # the examples are right


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_invalid_and_restricted_texts_do_not_match(case: Case, regexes: Dict[str, "re.Pattern[str]"]) -> None:
    for text in case.invalid:
        assert not regexes[case.name].fullmatch(text), text
        with pytest.raises((ValueError, AssertionError)):  # the example really is invalid
            check_sound(case.schema, text)
    for text in case.restricted:
        assert not regexes[case.name].fullmatch(text), text
        assert validate(case.schema, json.loads(text)), text  # valid JSON, left out by design


def test_indented_rendering_within_depth_three_matches() -> None:
    """indent=2 puts 1 + 2 * depth whitespace characters in a gap: depth 3 fits the 8 of WHITESPACE."""
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "array", "items": {"type": "integer"}}}}}}}}
    regex = re.compile(schema_to_regex(schema))
    deep = json.dumps({"a": {"b": {"c": [1, 2]}}}, indent=2)
    assert max(len(r) for r in re.findall(r"\s+", deep)) == 9  # the 4th level: one too many
    assert not regex.fullmatch(deep) and regex.fullmatch(json.dumps({"a": {"b": {"c": [1, 2]}}}))
    assert regex.fullmatch(json.dumps({"a": {"b": {"c": []}}}, indent=2))
    assert WHITESPACE == r"[ \n]{0,8}" and ANY_DEPTH == 2
    any_value = re.compile(schema_to_regex({}))
    assert any_value.fullmatch(json.dumps({"a": [1, 2], "b": {"c": None}}, indent=2))
    assert not any_value.fullmatch('{"a":[[1]]}')  # containers nest ANY_DEPTH levels at most


_ALPHABET = ' \n\t{}[],:"\\-+.eE0123456789aAbfnrtuxz/é😀\x01'


def _mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.choice((1, 1, 2, 3))):
        i = rng.randrange(len(text) + 1)
        op = rng.randrange(5)
        if op == 0 and text:
            text = text[:i] + text[i + 1:]
        elif op == 1:
            text = text[:i] + rng.choice(_ALPHABET) + text[i:]
        elif op == 2 and text:
            text = text[:i] + rng.choice(_ALPHABET) + text[i + 1:]
        elif op == 3:
            j = rng.randrange(len(text) + 1)
            text = text[:i] + text[min(i, j):max(i, j)] + text[i:]
        else:
            text = text[:i] + text[rng.randrange(i, len(text) + 1):]
    return text


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_random_mutations_that_match_are_valid(case: Case, regexes: Dict[str, "re.Pattern[str]"]) -> None:
    rng = random.Random(zlib.crc32(case.name.encode()))
    seeds = [t for v in case.values for t in renderings(case, v)] + case.texts + case.invalid + case.restricted
    matched = 0
    for _ in range(400):
        text = _mutate(rng, rng.choice(seeds))
        if regexes[case.name].fullmatch(text):
            check_sound(case.schema, text, not case.repeats_keys)
            matched += 1
    assert matched < 400  # mutations are not all accepted (a regex that matched anything would fail here)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_texts_drawn_from_the_regex_are_valid(case: Case) -> None:
    """Strings hypothesis draws from the regex itself (seeded; no shrinking, which is slow on the
    large regexes): every one must parse and validate."""

    @settings(max_examples=60, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(text=st.from_regex(schema_to_regex(case.schema), fullmatch=True))
    def check(text: str) -> None:
        check_sound(case.schema, text, not case.repeats_keys)

    check()


def test_python_only_json_never_matches() -> None:
    """json.loads takes NaN and Infinity; JSON (and so the regex) does not."""
    for schema in ({}, {"type": "number"}, {"type": "number", "minimum": 0}, {"type": "array"}):
        regex = re.compile(schema_to_regex(schema))
        for text in ("NaN", "Infinity", "-Infinity", "[NaN]", "[Infinity]"):
            assert not regex.fullmatch(text), (schema, text)


# ---- ranges, exhaustively ------------------------------------------------------------------------
@pytest.mark.parametrize("bounds", [
    {"minimum": 0}, {"minimum": 1}, {"minimum": -5, "maximum": 5}, {"minimum": 10, "maximum": 999},
    {"minimum": -1000, "maximum": -7}, {"maximum": -3}, {"maximum": 0}, {"minimum": 7, "maximum": 7},
    {"minimum": 0, "maximum": 0}, {"minimum": 99, "maximum": 101}, {"minimum": 123, "maximum": 4567},
    {"minimum": -123, "maximum": 4567}, {"minimum": 5.5, "maximum": 10.2},
    {"exclusiveMinimum": -1, "exclusiveMaximum": 100},
    {"minimum": 3, "exclusiveMinimum": 3}, {"minimum": 0, "exclusiveMinimum": True, "maximum": 10},
], ids=str)
def test_integer_ranges_are_exact(bounds: dict) -> None:
    regex = re.compile(schema_to_regex({"type": "integer", **bounds}))
    schema = {k: v for k, v in bounds.items() if not isinstance(v, bool)}
    if bounds.get("exclusiveMinimum") is True:
        schema = {"exclusiveMinimum": bounds["minimum"], "maximum": bounds["maximum"]}
    for n in range(-1200, 5000):
        assert bool(regex.fullmatch(str(n))) == _valid_number(schema, n), n
    for text in ("-0", "00", "01", "+1", "1.0", "1e1", "", "-"):
        assert not regex.fullmatch(text), text


_DECIMALS = [f"{sign}{i}{frac}" for sign in ("", "-") for i in range(0, 13)
             for frac in ("", ".0", ".5", ".05", ".000", ".999", ".0001")]


@pytest.mark.parametrize("bounds", [
    {"minimum": -1, "maximum": 1}, {"exclusiveMinimum": 0}, {"exclusiveMinimum": 2, "exclusiveMaximum": 10},
    {"minimum": 0, "exclusiveMaximum": 1}, {"maximum": 0}, {"exclusiveMaximum": -3}, {"minimum": 5.0, "maximum": 5},
    {"minimum": -10, "exclusiveMaximum": -2}, {"minimum": 0},
], ids=str)
def test_number_ranges_are_exact_without_exponent(bounds: dict) -> None:
    regex = re.compile(schema_to_regex({"type": "number", **bounds}))
    for text in _DECIMALS:
        negative_zero = text.startswith("-") and Fraction(text) == 0
        assert bool(regex.fullmatch(text)) == (_valid_number(bounds, Fraction(text)) and not negative_zero), text
    for text in ("1e1", "-2E-3", "5e0"):
        if regex.fullmatch(text):
            assert _valid_number(bounds, Fraction(text)) and bounds == {"minimum": 0}, text


@pytest.mark.parametrize("bounds,rejected,matching", [
    ({"exclusiveMaximum": 1}, ["0.99999999999999999", "0.999999999999999"], ["0.99999999999999", "0.5000000000"]),
    ({"exclusiveMinimum": 0}, ["0." + "0" * 400 + "1", "0.000000000000001"], ["0.00000000000001", "1.5"]),
    ({"exclusiveMinimum": 2, "exclusiveMaximum": 3}, ["2.000000000000000001", "2.99999999999999999"], ["2.5"]),
    ({"maximum": 10 ** 30}, ["1000000000000000000000000000000.00", "999999999999999999999999999999.9"],
     ["1000000000000000000000000000000", "-5"]),
], ids=str)
def test_numbers_near_bounds_survive_float_rounding(bounds: dict, rejected: List[str], matching: List[str]) -> None:
    """json.loads makes floats: a value just inside an exclusive bound must not round onto it. The
    first rejected text is such a trap (valid as a decimal, not as a float); the others are left
    out by the 15-significant-digit rule."""
    regex = re.compile(schema_to_regex({"type": "number", **bounds}))
    trap = rejected[0]
    assert _valid_number(bounds, Fraction(trap)) and not _valid_number(bounds, json.loads(trap)), trap
    for text in rejected:
        assert _valid_number(bounds, Fraction(text)) and not regex.fullmatch(text), text
    for text in matching:
        assert regex.fullmatch(text) and _valid_number(bounds, json.loads(text)), text


def test_dates_are_exact() -> None:
    regex = re.compile(schema_to_regex({"type": "string", "format": "date"}))
    for year in (1, 4, 100, 400, 1900, 1999, 2000, 2023, 2024, 2100, 2400, 9999):
        for month in range(0, 14):
            for day in range(0, 33):
                try:
                    expected = bool(datetime.date(year, month, day))
                except ValueError:
                    expected = False
                assert bool(regex.fullmatch(f'"{year:04d}-{month:02d}-{day:02d}"')) == expected, (year, month, day)
    assert not regex.fullmatch('"0000-01-01"')


# ---- patterns ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern,matching,rejected", [
    (".*", ['""', '"abc"', '"é😀"'], ['"a"b"', '"a\\"b"', '"a\\nb"', '"\\u0041"']),
    ("^abc$", ['"abc"'], ['"xabcx"', '"ab"']),  # full match: a subset of what the pattern searches
    ("abc", ['"abc"'], ['"xabcx"']),
    ("^a|b$", ['"a"', '"b"'], ['"ab"']),
    ("\\d{2}\\.\\d", ['"12.3"'], ['"٣٣.٣"', '"12x3"']),
    ("a\\sb", ['"a b"', '"a\u00a0b"'], ['"a\\tb"', '"a\\nb"', '"a\tb"']),
    ("[^a-z]+", ['"ABC 1"', '"é"'], ['"abc"', '"A\\"B"', '"\\\\"']),
    ("\\D\\W\\S", ['"a!x"'], ['"1!x"', '"aax"', '"a! "', '"a!\u00a0"']),
    ("(?:ab|cd){2,3}x?", ['"abcd"', '"cdcdabx"'], ['"ab"', '"abababab"']),
    ("[\\w.+-]+@[a-z]+\\.com", ['"a.b+c-d@x.com"'], ['"a b@x.com"']),
    ("\\/\\u00e9[\\x41-\\x43]", ['"/éB"'], ['"/éD"']),
    ("a{2}?b*?", ['"aa"', '"aabb"'], ['"a"']),
    ("[\\s\\d]", ['" "', '"5"'], ['"\\n"', '"\\t"', '"x"']),
    ("é+", ['"éé"'], ['"e"']),
    ("a\\}b\\]c\\{", ['"a}b]c{"'], ['"abc"']),
])
def test_patterns(pattern: str, matching: List[str], rejected: List[str]) -> None:
    schema = {"type": "string", "pattern": pattern}
    regex = re.compile(schema_to_regex(schema))
    for text in matching:
        assert regex.fullmatch(text), text
        check_sound(schema, text)
    for text in rejected:
        assert not regex.fullmatch(text), text


# ---- dialect, sizes, whitespace, input forms -----------------------------------------------------
_DIALECT_ESCAPES = set("\\.*+?()[]{}|^$/-\"ntrdws")


def assert_in_dialect(regex: str) -> None:
    """Only the engine's dialect: allowed escapes, \\x <= 7F, (?: groups only, no anchors, bounded
    quantifiers (<= 1000), no lazy or possessive quantifiers."""
    i, in_class, after_quantifier = 0, False, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            n = regex[i + 1]
            width = {"x": 4, "u": 6}.get(n, 2)
            if n == "x":
                assert int(regex[i + 2:i + 4], 16) <= 0x7F
            elif n == "u":
                int(regex[i + 2:i + 6], 16)
            else:
                assert n in _DIALECT_ESCAPES, regex[i:i + 2]
            i, after_quantifier = i + width, False
            continue
        if in_class:
            in_class, i = c != "]", i + 1
            continue
        quantifier = c in "*+?" and not (c == "?" and regex[i - 1] == "(")
        if c == "{":
            m = re.match(r"\{(\d+)(,(\d*))?\}", regex[i:])
            assert m and all(int(x) <= 1000 for x in (m[1], m[3]) if x), regex[i:i + 12]
            quantifier, i = True, i + len(m[0]) - 1
        assert not (quantifier and after_quantifier), regex[max(0, i - 10):i + 2]
        assert c not in "^$", regex[max(0, i - 10):i + 2]
        assert c != "(" or regex[i + 1] != "?" or regex[i + 1:i + 3] == "?:", regex[i:i + 4]
        in_class = c == "["
        if in_class and regex[i + 1] == "^":
            i += 1
        i, after_quantifier = i + 1, quantifier


def test_regexes_stay_within_the_dialect() -> None:
    extra = [{"type": "string", "pattern": p} for p in ("[^a]{0,1000}", "\\D+\\S?", ".{2,}", "x{0,5}?")]
    extra += [{"type": "string", "maxLength": 2500, "minLength": 1200}, {"type": "array", "minItems": 1500}]
    for schema in [c.schema for c in CASES] + extra:
        assert_in_dialect(schema_to_regex(schema))
    long = re.compile(schema_to_regex({"type": "string", "minLength": 1200, "maxLength": 2500}))
    assert long.fullmatch('"' + "a" * 1200 + '"') and long.fullmatch('"' + "a" * 2500 + '"')
    assert not long.fullmatch('"' + "a" * 1199 + '"') and not long.fullmatch('"' + "a" * 2501 + '"')
    with pytest.raises(AssertionError):
        assert_in_dialect("(?=a)b")
    with pytest.raises(AssertionError):
        assert_in_dialect("a{1,2000}")


def test_the_engine_compiles_every_regex_and_agrees() -> None:
    """The byte-level DFA of guided decoding takes each regex within its limits (group nesting, NFA
    size) and decides the cases' texts as ``re`` does."""
    from autodeploy.runtime.guided.regex_dfa import RegexAutomaton

    for case in CASES:
        regex = schema_to_regex(case.schema)
        automaton = RegexAutomaton(regex)
        for text in [t for v in case.values for t in renderings(case, v)] + case.texts + case.invalid + case.restricted:
            assert automaton.matches(text.encode()) == bool(re.fullmatch(regex, text)), (case.name, text)
    RegexAutomaton(schema_to_regex(_optional_object(100)))


def _optional_object(n: int, required: Optional[List[int]] = None) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            "required": [f"p{i}" for i in (required or [])]}


def _nesting(regex: str) -> int:
    depth = deepest = 0
    for token in re.findall(r"\\.|\[(?:\\.|[^\]\\])*\]|[()]", regex):
        depth += {"(": 1, ")": -1}.get(token, 0)
        deepest = max(deepest, depth)
    return deepest


@pytest.mark.parametrize("required", [[], [0], [150], [299], [10, 20, 280]], ids=str)
def test_optional_properties_grow_linearly_with_bounded_nesting(required: List[int]) -> None:
    """Linear in the properties with a required one; without, linear up to 16 and then ~n^2/32 (in
    blocks, so that groups nest at most ~20 deep: the engine takes 100)."""
    small, big = (len(schema_to_regex(_optional_object(n, [r * n // 300 for r in required]))) for n in (150, 300))
    assert big < (2.1 if required else 4.2) * small, (small, big)
    assert len(schema_to_regex(_optional_object(16))) < 2.2 * len(schema_to_regex(_optional_object(8)))
    regex = re.compile(schema_to_regex(_optional_object(300, required)))
    assert _nesting(regex.pattern) <= 24
    present = sorted(set(required) | {3, 77, 298})
    text = json.dumps({f"p{i}": i for i in present})
    assert regex.fullmatch(text)
    assert not regex.fullmatch(json.dumps({f"p{i}": i for i in reversed(present)}))
    if required:
        assert not regex.fullmatch(json.dumps({f"p{i}": i for i in present if i != required[-1]}))
    else:
        assert regex.fullmatch("{}")


def test_shared_definitions_compile_once_and_blowup_is_an_error() -> None:
    defs = {"D0": {"type": "string"}}
    for i in range(1, 30):
        defs[f"D{i}"] = {"type": "array", "prefixItems": [{"$ref": f"#/$defs/D{i - 1}"}] * 2, "items": False}
    with pytest.raises(GuidedDecodingError, match="needs a regex over"):
        schema_to_regex({"$defs": defs, "$ref": "#/$defs/D29"})
    assert re.fullmatch(schema_to_regex({"$defs": defs, "$ref": "#/$defs/D3"}), json.dumps([[["a"] * 2] * 2] * 2))


def test_deep_references_without_recursion_compile() -> None:
    """A chain of 80 distinct definitions is deep, not recursive."""
    defs = {"D0": {"type": "integer"}}
    for i in range(1, 80):
        defs[f"D{i}"] = {"type": "object", "properties": {"p": {"$ref": f"#/$defs/D{i - 1}"}}, "required": ["p"]}
    regex = schema_to_regex({"$defs": defs, "$ref": "#/$defs/D79"})
    assert re.fullmatch(regex, '{"p":' * 79 + "7" + "}" * 79)
    twice = {"$defs": {"P": POINT}, "type": "object", "required": ["a", "b"],
             "properties": {"a": {"allOf": [{"$ref": "#/$defs/P"}]}, "b": {"allOf": [{"$ref": "#/$defs/P"}]}}}
    assert re.fullmatch(schema_to_regex(twice), '{"a":{"x":1,"y":2},"b":{"x":3,"y":4}}')


def test_custom_whitespace_and_json_text_input() -> None:
    schema = {"type": "array", "items": {"type": "integer"}}
    compact = re.compile(schema_to_regex(schema, whitespace=""))
    assert compact.fullmatch("[1,2]") and not compact.fullmatch("[1, 2]")
    spaced = re.compile(schema_to_regex(schema, whitespace=" |"))  # an alternation: grouped before use
    assert spaced.fullmatch("[ 1 , 2 ]") and spaced.fullmatch("[1,2]") and not spaced.fullmatch("[  1]")
    assert schema_to_regex(json.dumps(FLAT)) == schema_to_regex(FLAT)
    assert schema_to_regex(True) == schema_to_regex({}) == schema_to_regex("{}")
    with pytest.raises(GuidedDecodingError, match="whitespace"):
        schema_to_regex(schema, whitespace="[")


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("schema,needles", [
    ({"type": "object", "properties": {"a": {"type": "object", "patternProperties": {"^x": {}}}}},
     ["'patternProperties'", "#/properties/a", "not supported"]),
    ({"not": {"type": "null"}}, ["'not'", "at # "]),
    ({"type": "array", "items": {"if": {}, "then": {}}}, ["'if'", "#/items"]),
    ({"type": "array", "contains": {"type": "integer"}}, ["'contains'"]),
    ({"type": "array", "uniqueItems": True}, ["'uniqueItems'"]),
    ({"type": "integer", "multipleOf": 2}, ["'multipleOf'"]),
    ({"type": "number", "minimum": 0.5}, ["'minimum'", "whole-number"]),
    ({"type": "integer", "minimum": 5, "maximum": 4}, ["'minimum'", "no value"]),
    ({"type": "string", "format": "uri"}, ["'format'", "'uri'"]),
    ({"type": "string", "format": "date", "maxLength": 10}, ["'format'", "cannot be combined"]),
    ({"type": "string", "pattern": "(?=a)a"}, ["'pattern'", "'(?'"]),
    ({"type": "string", "pattern": "(a)\\1"}, ["'pattern'", "\\1"]),
    ({"type": "string", "pattern": "a^b"}, ["'pattern'", "'^'"]),
    ({"type": "string", "pattern": 'a"b'}, ["'pattern'", "U+0022"]),
    ({"type": "string", "pattern": "a\\nb"}, ["'pattern'", "\\n"]),
    ({"type": "string", "pattern": "a{1,2000}"}, ["'pattern'", "1000"]),
    ({"type": "string", "pattern": "(ab"}, ["'pattern'", "not a valid regular expression"]),
    ({"type": "string", "pattern": "[\\x00-\\x1f]"}, ["'pattern'", "class"]),
    ({"type": "object", "properties": {"a": {"$ref": "http://example.com/s.json"}}},
     ["'$ref'", "#/properties/a", "local"]),
    ({"$ref": "#/$defs/Nope"}, ["'$ref'", "does not resolve"]),
    ({"type": "object", "allOf": [{"$ref": "#"}]}, ["'$ref'", "recursive"]),  # recursion: test_json_schema_recursion
    ({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/B"}]}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}},
      "$ref": "#/$defs/A"}, ["'$ref'", "recursive"]),
    ({"type": "objekt"}, ["'type'", "'objekt'"]),
    ({"type": "string", "minLength": 3, "maxLength": 2}, ["'minLength'"]),
    ({"type": "string", "maxLength": 10 ** 6}, ["'maxLength'", "largest"]),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, ["'minProperties'"]),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1}, ["'maxProperties'"]),
    ({"type": "object", "required": ["z"], "additionalProperties": False}, ["'required'", "'z'"]),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, ["'oneOf'", "#/oneOf/0", "#/oneOf/1"]),
    ({"oneOf": [{"enum": ["a", "b"]}, {"enum": ["c"]}, {"enum": ["b", 1]}]}, ["'oneOf'", "#/oneOf/0", "#/oneOf/2"]),
    ({"oneOf": [{"type": "object", "properties": {"x": {}}, "required": ["x"]},
                {"type": "object", "properties": {"x": {}, "y": {}}, "required": ["x", "y"]}]}, ["'oneOf'"]),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"enum": [2, 1.0]}}, "required": ["k"]}]}, ["'oneOf'"]),
    ({"allOf": [{"type": "string", "maxLength": 2}, {"maxLength": 3}]}, ["'maxLength'", "#/allOf/1"]),
    ({"allOf": [{"properties": {"a": {}}}, {"additionalProperties": False}]}, ["'additionalProperties'"]),
    ({"type": "string", "enum": [1, 2]}, ["'enum'", "sibling"]),
    ({"enum": []}, ["'enum'", "non-empty"]),
    ({"const": 1, "enum": [2]}, ["'const'", "not in the enum"]),
    ({"anyOf": [{"type": "string"}], "type": "null"}, ["'anyOf'", "no branch"]),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, ["#/properties/a", "false"]),
])
def test_unsupported_or_malformed_schemas_raise(schema: Any, needles: List[str]) -> None:
    with pytest.raises(GuidedDecodingError) as info:
        schema_to_regex(schema)
    assert isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


_FUZZ_VALUES = {
    "type": ["object", "array", "string", "integer", "number", "boolean", "null", ["string", "null"], "bogus", [], 5],
    "enum": [[1, "a", None], [], "x", [{"a": [1]}, True]], "const": [1, "a", None, [], {"b": 2}],
    "required": [["a"], ["a", "z"], [], "a"], "pattern": ["^a+$", "[", "(?=x)", "\\", "x{2,1}", "*", "[^\\s]", 5],
    "format": ["date", "uuid", "uri", 3], "minItems": [0, 2, -1, "2", None, True], "maxItems": [1, 3, 2.0, None],
    "minLength": [0, 1, 5, None], "maxLength": [0, 3, -1], "minimum": [0, -1, 0.5, True, "1", 10 ** 30, 1e308],
    "maximum": [0, 5, -2.5], "exclusiveMinimum": [0, True, False, 1], "exclusiveMaximum": [10, False],
    "multipleOf": [1, 2, 0, True], "nullable": [True, False, "yes"], "uniqueItems": [True, False],
    "$ref": ["#/$defs/A", "#", "#/$defs/Z", "http://x", 5, "#/properties/a"], "minProperties": [0, 1, 9],
    "title": [[], "t"], "not": [{}], "additionalItems": [False, {}],
}


def _random_schema(rng: random.Random, depth: int = 0) -> Any:
    if depth > 3 or rng.random() < 0.15:
        return rng.choice([True, False, {}, {"type": "string"}])
    schema: Dict[str, Any] = {}
    for _ in range(rng.randrange(1, 5)):
        key = rng.choice(list(_FUZZ_VALUES) + ["properties", "items", "prefixItems", "anyOf", "oneOf", "allOf",
                                                "additionalProperties"] * 2)
        sub = lambda: _random_schema(rng, depth + 1)  # noqa: E731
        schema[key] = rng.choice(_FUZZ_VALUES[key]) if key in _FUZZ_VALUES else \
            {n: sub() for n in rng.sample("abcd", rng.randrange(4))} if key == "properties" else \
            [sub() for _ in range(rng.randrange(3))] if key in ("prefixItems", "anyOf", "oneOf", "allOf") else sub()
    return schema


def test_random_schemas_compile_or_raise_a_named_error() -> None:
    """Random (often malformed) schemas: a valid regex or a GuidedDecodingError, never another error."""
    rng, compiled = random.Random(7), 0
    for _ in range(1500):
        schema = _random_schema(rng)
        if isinstance(schema, dict) and rng.random() < 0.5:
            schema["$defs"] = {"A": _random_schema(rng, 1)}
        try:
            re.compile(schema_to_regex(schema))
            compiled += 1
        except GuidedDecodingError:
            pass
    assert 200 < compiled < 1400


@pytest.mark.parametrize("text,needle", [("{", "not valid JSON"), ('{"type": "string",}', "not valid JSON"),
                                         ("[1]", "object or a boolean"), ("false", "false")])
def test_bad_schema_text_raises(text: str, needle: str) -> None:
    with pytest.raises(GuidedDecodingError, match=needle):
        schema_to_regex(text)


def test_annotations_and_unknown_keywords_are_ignored() -> None:
    plain = schema_to_regex(FLAT)
    noted = dict(FLAT, title="T", description="d", examples=[{}], default={}, deprecated=True, readOnly=False,
                 writeOnly=False, **{"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "x",
                                     "$comment": "c", "x-vendor": 1})
    assert schema_to_regex(noted) == plain
