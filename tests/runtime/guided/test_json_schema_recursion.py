"""Recursive JSON Schemas (trees, linked lists, mutual references, ``"#"``) on the pushdown
recognizer (``schema_grammar``), against references:

* random valid instances of each schema, at depths no fixed unrolling would cover, are accepted;
* random mutations of them are accepted only when ``json.loads`` reads them and ``jsonschema_rs``
  (an independent validator) finds them valid;
* a recursive schema and the same schema unrolled by hand to a fixed depth (a regex) refuse and
  accept at the same byte on texts within that depth, and only the recursive one goes deeper;
* generation: the same tokens as under the unrolled schema while the answer stays shallower than
  the unrolling, and answers that parse and validate;
* schemas whose recursion cannot be generated are refused, named.
"""

import json
import random
from typing import Any, Callable, Dict

import jsonschema_rs
import pytest

from autodeploy import LLM, SamplingParams
from autodeploy.runtime.guided.errors import GuidedDecodingError
from autodeploy.runtime.guided.grammar_automaton import GrammarAutomaton
from autodeploy.runtime.guided.json_schema import compile_schema, schema_to_regex
from autodeploy.runtime.guided.regex_dfa import RegexAutomaton
from autodeploy.runtime.guided.schema_grammar import schema_recognizer

TREE = {"$defs": {"Node": {"type": "object", "required": ["value"], "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}},
    "$ref": "#/$defs/Node"}
LINKED = {"type": "object", "required": ["head", "tail"], "properties": {
    "head": {"type": "string", "maxLength": 6}, "tail": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
MUTUAL = {"$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/B"}},
                    "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}, "n": {"type": "boolean"}}}},
          "type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/A"}}}
EXPR = {"oneOf": [{"type": "object", "required": ["op", "args"], "properties": {
    "op": {"enum": ["+", "*"]}, "args": {"type": "array", "items": {"$ref": "#"}, "minItems": 2, "maxItems": 3}}},
    {"type": "integer", "minimum": 0, "maximum": 99}]}


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abé\"\\ \n") for _ in range(rng.randint(0, 6)))


def _tree(rng: random.Random, depth: int) -> Dict[str, Any]:
    node: Dict[str, Any] = {"value": rng.randint(-500, 500)}
    if depth > 0 and rng.random() < 0.8:
        node["children"] = [_tree(rng, depth - 1) for _ in range(rng.choice((0, 1, 1, 2)))]
    return node


def _linked(rng: random.Random, depth: int) -> Dict[str, Any]:
    return {"head": _word(rng), "tail": _linked(rng, depth - 1) if depth > 0 else None}


def _mutual(rng: random.Random, depth: int) -> Dict[str, Any]:
    def b(d: int) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if d > 0 and rng.random() < 0.7:
            out["a"] = [b(d - 1) for _ in range(rng.randint(0, 2))]
        if rng.random() < 0.5:
            out["n"] = rng.random() < 0.5
        return out
    return {"x": [b(depth) for _ in range(rng.randint(1, 2))]}


def _expr(rng: random.Random, depth: int) -> Any:
    if depth == 0 or rng.random() < 0.3:
        return rng.randint(0, 99)
    return {"op": rng.choice("+*"), "args": [_expr(rng, depth - 1) for _ in range(rng.randint(2, 3))]}


CASES: Dict[str, Any] = {"tree": (TREE, _tree), "linked": (LINKED, _linked), "mutual": (MUTUAL, _mutual),
                         "expr": (EXPR, _expr)}


def _depth(value: Any) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return 1 + max((_depth(c) for c in children), default=0)


def _first_refusal(automaton: Any, data: bytes) -> int:
    """Where the automaton refuses ``data`` (its length + 1 when it accepts it, its length when the
    whole of it is only the start of a text)."""
    state = automaton.initial
    for i, byte in enumerate(data):
        state = automaton.step(state, byte)
        if state is None:
            return i
    return len(data) + 1 if automaton.accepting(state) else len(data)


@pytest.mark.parametrize("name", sorted(CASES))
def test_random_valid_instances_are_accepted(name: str) -> None:
    schema, make = CASES[name]
    automaton, validator, rng = schema_recognizer(schema), jsonschema_rs.validator_for(schema), random.Random(7)
    assert isinstance(automaton, GrammarAutomaton)
    depths = []
    for _ in range(40):
        value = make(rng, rng.randint(0, 9))
        assert validator.is_valid(value)
        depths.append(_depth(value))
        for text in (json.dumps(value, separators=(",", ":")), json.dumps(value), json.dumps(value, ensure_ascii=False)):
            assert automaton.matches(text.encode()), text
    assert max(depths) >= 8  # deeper than any unrolling a regex could afford


def _mutate(rng: random.Random, text: str) -> str:
    i = rng.randrange(len(text) + 1)
    kind = rng.randrange(3)
    piece = rng.choice(['"', ",", ":", "{", "}", "[", "]", "null", "1", "-", " ", "e", "\\", "true", '"a":'])
    if kind == 0:
        return text[:i] + piece + text[i:]
    if kind == 1:
        return text[:i] + text[i + rng.randint(1, 3):]
    return text[:i] + piece + text[i + 1:]


@pytest.mark.parametrize("name", sorted(CASES))
def test_mutations_are_accepted_only_when_valid(name: str) -> None:
    schema, make = CASES[name]
    automaton, validator, rng = schema_recognizer(schema), jsonschema_rs.validator_for(schema), random.Random(11)
    accepted = refused = 0
    for _ in range(600):
        text = json.dumps(make(rng, rng.randint(0, 5)), separators=(",", ":"))
        for _ in range(rng.randint(1, 2)):
            text = _mutate(rng, text)
        if automaton.matches(text.encode()):
            accepted += 1
            assert validator.is_valid(json.loads(text)), text
        else:
            refused += 1
    assert accepted >= 10 and refused >= 300, (accepted, refused)


def _unrolled_linked(depth: int) -> Dict[str, Any]:
    """LINKED with its recursion written out ``depth`` times (a regular language)."""
    inner: Dict[str, Any] = {"type": "null"}
    for _ in range(depth):
        inner = {"anyOf": [{**LINKED, "properties": {**LINKED["properties"], "tail": inner}}, {"type": "null"}]}
    return inner["anyOf"][0]


def test_the_recursion_reads_as_its_unrolling_within_the_unrolled_depth() -> None:
    recursive, unrolled = schema_recognizer(LINKED), RegexAutomaton(schema_to_regex(_unrolled_linked(4)))
    rng = random.Random(5)
    for _ in range(150):
        depth = rng.randint(0, 3)
        text = json.dumps(_linked(rng, depth), separators=(",", ":"))
        for _ in range(rng.randint(0, 2)):
            text = _mutate(rng, text)
        data = text.encode()
        assert _first_refusal(recursive, data) == _first_refusal(unrolled, data), text
    deep = json.dumps(_linked(rng, 6)).encode()
    assert recursive.matches(deep) and not unrolled.matches(deep)


@pytest.mark.parametrize("schema,needles", [
    ({"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#"}}}, ["can never end"]),
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, ["left-recursive"]),
    ({"type": "array", "items": {"$ref": "#", "maxItems": 2}}, ["'$ref'", "#/items", "beside the keywords maxItems"]),
    ({"type": "object", "allOf": [{"$ref": "#"}]}, ["'$ref'", "under allOf"]),
    ({"type": "array", "items": {"$ref": "#"}, "enum": [[], [[]]]}, ["'enum'", "recursive reference"]),
])
def test_recursion_that_cannot_be_generated_is_refused(schema: Any, needles: Any) -> None:
    with pytest.raises(GuidedDecodingError) as info:
        schema_recognizer(schema)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_the_regex_entry_names_the_recursion_and_rules_compile_once() -> None:
    with pytest.raises(GuidedDecodingError, match="'#/\\$defs/Node' recursively"):
        schema_to_regex(TREE)
    regex, rules = compile_schema(MUTUAL)
    assert sorted(name for name, _ in rules.values()) == ["#/$defs/A"]
    assert len(regex) < 2 * sum(len(r) for _, r in rules.values()) + 200  # the root inlines A's body once
    # a key that looks like an escape or a placeholder stays itself
    odd = {"type": "object", "properties": {"a%41~/\ud800": {"$ref": "#"}}}
    automaton = schema_recognizer(odd)
    assert automaton.matches(json.dumps({"a%41~/\ud800": {"a%41~/\ud800": {}}}).encode())
    assert not automaton.matches('{"a%41~/\ud800":{"b":{}}}'.encode("utf-8", "surrogatepass"))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-llama", max_seq_len=128, max_batch_size=4, max_num_tokens=128, page_size=4)


PROMPTS = ["A list of", "{", "The tree", "Exceptions are raised when"]


def test_generation_equals_the_unrolled_schema_while_shallower(llm: LLM) -> None:
    for temperature in (0.0, 1.0):
        kw = dict(max_tokens=40, temperature=temperature, seed=3)
        ours = llm.generate(PROMPTS, SamplingParams(**kw, guided={"json": LINKED}))
        ref = llm.generate(PROMPTS, SamplingParams(**kw, guided={"json": _unrolled_linked(8)}))
        assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
        assert all(o.text.count('"tail":{') < 8 for o in ours)  # shallower than the unrolling


@pytest.mark.parametrize("name", ["tree", "expr"])
def test_generated_answers_parse_and_validate(llm: LLM, name: str) -> None:
    schema, _ = CASES[name]
    validator: Callable[[Any], bool] = jsonschema_rs.validator_for(schema).is_valid
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=1.0, seed=5, guided={"json": schema}))
    finished = 0
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert validator(json.loads(o.text)), o.text
            finished += 1
        else:  # cut off: still the start of a valid text
            assert _first_refusal(schema_recognizer(schema), o.text.encode()) == len(o.text.encode()), o.text
    assert finished >= 1 and any(o.text.strip() for o in outs)
