"""``JsonObjectAutomaton`` against ``json.loads``: it accepts exactly the texts that load as a dict
(within its documented limits: no whitespace around the object, runs of at most ``MAX_WHITESPACE``),
and every state it returns can still become a complete object."""

import json
import random

import pytest

from autodeploy.runtime.guided.json_automaton import MAX_WHITESPACE, JsonObjectAutomaton

A = JsonObjectAutomaton()
VALID = ['{}', '{"a": 1}', '{"a":[1,2.5e-3,true,false,null,{"b":"x\\"y\\u00e9"}]}', '{"k": -0.1E+2, "z": []}',
         '{"é": "中🙂"}', '{\n  "a": {\n    "b": [\n      {}\n    ]\n  }\n}', '{"n": 0, "m": -0, "f": 1e5}']
INVALID = ['[]', '"a"', '1', ' {}', '{} ', '{,}', '{"a"}', '{"a":}', '{"a":1,}', '{"a":01}', '{"a":1.}',
           '{"a":.5}', '{"a":tru}', '{"a":"\\x"}', '{"a":"\x01"}', '{"a":[1,]}', '{"a":1}}', '{"a" 1}',
           '{"a":"\\u12"}', '{' + ' ' * (MAX_WHITESPACE + 1) + '}']


def _loads_dict(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_are_accepted_and_every_prefix_is_viable(text):
    assert _loads_dict(text)
    state = A.initial
    for i, byte in enumerate(text.encode()):
        assert not A.accepting(state), text[:i]  # nothing before the closing brace is complete
        state = A.step(state, byte)
        assert state is not None, text[:i + 1]
    assert A.accepting(state)


@pytest.mark.parametrize("text", INVALID)
def test_invalid_texts_are_refused(text):
    assert not A.matches(text.encode())


def test_agrees_with_json_loads_on_mutated_objects():
    rng = random.Random(0)
    alphabet = list('{}[]":,0123456789-+.eE tnrufals\\/"abé\n')
    checked = accepted = 0
    for _ in range(30000):
        chars = list(rng.choice(VALID[:5]))
        for _ in range(rng.randint(1, 3)):
            p = rng.randrange(len(chars) + 1)
            op = rng.random()
            if op < 0.4:
                chars.insert(p, rng.choice(alphabet))
            elif chars:
                if op < 0.7:
                    del chars[min(p, len(chars) - 1)]
                else:
                    chars[min(p, len(chars) - 1)] = rng.choice(alphabet)
        text = "".join(chars)
        if text != text.strip() or " " * (MAX_WHITESPACE + 1) in text:
            continue  # outside the documented limits
        checked += 1
        expected = _loads_dict(text)
        accepted += expected
        assert A.matches(text.encode()) == expected, text
    assert checked > 20000 and 1000 < accepted < checked - 1000  # both sides well exercised


def test_states_returned_can_always_complete():
    """From any state reached by a random walk over allowed bytes, a short completion exists
    (found greedily: close strings, finish numbers and literals, close containers)."""
    rng = random.Random(1)
    for _ in range(300):
        state = A.initial
        for _ in range(rng.randint(1, 40)):
            options = [b for b in range(256) if A.step(state, b) is not None]
            if not options:  # only a complete object has no continuation
                assert A.accepting(state)
                break
            state = A.step(state, rng.choice(options))
        assert _completes(state), state


def _completes(state, depth=0):
    if A.accepting(state):
        return True
    if depth > 80:
        return False
    for byte in b'"}]0e1ul:,\x80':  # bytes that move toward the end
        nxt = A.step(state, byte)
        if nxt is not None and nxt != state and _completes(nxt, depth + 1):
            return True
    return False


def test_mask_key_ignores_containers_deeper_than_a_token_reaches():
    deep = A.initial
    for byte in b'{"a":' + b'[' * 100:
        deep = A.step(deep, byte)
    other = A.initial
    for byte in b'{"b":{"c":' + b'[' * 100:
        other = A.step(other, byte)
    assert deep != other and A.mask_key(deep) == A.mask_key(other)
    shallow_a, shallow_b = A.step(A.step(A.initial, ord("{")), ord('"')), A.initial
    assert A.mask_key(shallow_a) != A.mask_key(shallow_b)
