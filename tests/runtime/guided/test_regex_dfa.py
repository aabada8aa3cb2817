"""The byte-level regex DFA of guided decoding against Python's ``re.fullmatch``: agreement on
hand-made, random and mutated strings (ASCII and non-ASCII) and on random patterns, viability of
every prefix of a match, dead states, memoization, and a named error for every unsupported or
malformed pattern."""

import logging
import random
import re
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import pytest

from autodeploy.runtime.guided.errors import GuidedDecodingError
from autodeploy.runtime.guided.regex_dfa import RegexAutomaton
from autodeploy.runtime.guided.regex_parser import MAX_REPEAT

logger = logging.getLogger(__name__)

JSON_STRING = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"

# pattern -> strings that match it (checked against re too, so a wrong example fails loudly)
PATTERNS = {
    JSON_STRING: ['""', '"abc"', r'"a\"b"', r'"\\"', r'"\u00e9x"', '"é中😀"', r'"\n\t\/"'],
    JSON_NUMBER: ["0", "-0", "12", "-3.25", "1e10", "2.5E-3", "10.0e+7"],
    "cat|dog|bird|": ["cat", "dog", "bird", ""],
    "(red|green|blue)(, (red|green|blue))*": ["red", "red, blue", "blue, green, red"],
    "[a-z]{2,4}": ["ab", "abc", "abcd"],
    "x{3}y{0,2}z{2,}": ["xxxzz", "xxxyzzz", "xxxyyzz"],
    "ab{0}c(de){,0}f?": ["ac", "acf"],
    "a{,3}b{,}": ["", "aaa", "abbbb", "b"],
    "((ab|c)+(d(e|f)?)*)?g": ["g", "abg", "cabdedg", "cddfg"],
    "(a|)*b": ["b", "aab"],
    "(?:a|b)*abb": ["abb", "babb", "aababb"],
    "(?P<year>[0-9]{4})-(?P<month>[0-9]{2})": ["2024-01", "1999-12"],
    r"[\d\s_-]+": ["1 2", "_-", "\t9\n"],
    r"[^\d\s]+": ["abc", "é中", "😀!"],
    r"\w+@\w+\.(com|org)": ["me@example.com", "a_1@b2.org"],
    r"[]a-]+|[\]\[]": ["]", "a-]", "[", "]a"],
    r"[\b\t]\x08": ["\b\b", "\t\b"],
    r"x|ab[^\s\S]c|a(bc|d)": ["x", "abc", "ad"],
    r"[-+*/]|\(|\)|\.\*|\$|\^": ["-", "/", "(", ")", ".*", "$", "^"],
    r"\D\W\S": ["a!x", "é é", "x\n中"],
    "a{|{}|a{1,x}|b{,": ["a{", "{}", "a{1,x}", "b{,"],
    "caf(é|e)s?": ["café", "cafe", "cafés"],
    "中文+|😀{2}": ["中文", "中文文", "😀😀"],
    "...": ["abc", "é中😀", " \t\r"],
    ".*": ["", "anything é", "\r"],
    r"[é-ü]+[\u4e00-\u9fff]?": ["é", "üé中"],
    r"\x41\u00e9\U0001F600\n\t\r\f\v\a": ["Aé😀\n\t\r\f\v\a"],
    r"^abc$": ["abc"],
    r"a\$": ["a$"],
    r"a\\$": ["a\\"],
    r"\.\+\?\*\{\}\/\"\-": ['.+?*{}/"-'],
    "(((a)))b*?c+?d??": ["ac", "abbcccd"],
    "": [""],
}
EXTRA_CHARS = ["a", "b", "0", "9", " ", "\n", '"', "\\", "-", ".", "é", "中", "😀", "\x00",
               "\x1f"]


def _pyre_flags(pattern: str) -> int:
    """Python's \\d \\w \\s are Unicode-aware; ours are ASCII, as with re.ASCII."""
    return re.ASCII if re.search(r"\\[dDwWsS]", pattern) else 0


def _agrees(automaton: RegexAutomaton, pattern: str, text: str) -> None:
    expected = re.fullmatch(pattern, text, _pyre_flags(pattern)) is not None
    assert automaton.matches(text.encode()) == expected, (pattern, text)


def _mutations(text: str, alphabet: list, rng: random.Random, count: int) -> list:
    """Prefixes, deletions, insertions, substitutions and doublings of a matching string."""
    out = [text[:i] for i in range(len(text) + 1)]
    for _ in range(count):
        i = rng.randrange(len(text) + 1)
        c = rng.choice(alphabet)
        out += [text[:i] + text[i + 1:], text[:i] + c + text[i:], text[:i] + c + text[i + 1:],
                text + text[i:]]
    return out


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_agrees_with_re_on_examples_random_and_mutated_strings(pattern):
    automaton = RegexAutomaton(pattern)
    rng = random.Random(zlib.crc32(pattern.encode()))
    alphabet = sorted(set(pattern) | set(EXTRA_CHARS))
    for text in PATTERNS[pattern]:
        assert re.fullmatch(pattern, text, _pyre_flags(pattern)), (pattern, text)
        assert automaton.matches(text.encode()), (pattern, text)
        for mutated in _mutations(text, alphabet, rng, 30):
            _agrees(automaton, pattern, mutated)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(9)))
        _agrees(automaton, pattern, text)


def _shortest_completion(automaton: RegexAutomaton, state: int) -> bytes:
    """The shortest bytes from ``state`` to an accepting state (breadth-first over step)."""
    paths, queue = {state: b""}, deque([state])
    while queue:
        cur = queue.popleft()
        if automaton.accepting(cur):
            return paths[cur]
        for byte in range(256):
            nxt = automaton.step(cur, byte)
            if nxt is not None and nxt not in paths:
                paths[nxt] = paths[cur] + bytes([byte])
                queue.append(nxt)
    raise AssertionError(f"state {state} of {automaton.pattern!r} was returned but is a dead end")


def _random_walk(automaton: RegexAutomaton, rng: random.Random, max_len: int = 30) -> bytes:
    """A random byte string the automaton accepts: random viable bytes, then the shortest way to
    an accepting state (which every returned state must have)."""
    state, out = automaton.initial, bytearray()
    while len(out) < max_len and not (automaton.accepting(state) and rng.random() < 0.15):
        viable = [b for b in range(256) if automaton.step(state, b) is not None]
        if not viable:
            break
        byte = rng.choice(viable)
        out.append(byte)
        state = automaton.step(state, byte)
    return bytes(out) + _shortest_completion(automaton, state)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_accepted_byte_strings_are_utf8_matches(pattern):
    automaton = RegexAutomaton(pattern)
    rng = random.Random(7)
    for _ in range(40):
        data = _random_walk(automaton, rng)
        text = data.decode("utf-8")  # strict: accepted bytes are always valid UTF-8
        assert re.fullmatch(pattern, text, _pyre_flags(pattern)), (pattern, text)


RANDOM_ATOMS = ["a", "b", ".", "[ab]", "[^a]", "[a-c]", "é", "中", r"\d", r"\W", "(?:)", r"\.",
                "x{", "[-a]"]
RANDOM_QUANTIFIERS = ["*", "+", "?", "{2}", "{0,2}", "{1,}", "{,2}", "*?", "{2,3}"]


def _random_pattern(rng: random.Random, depth: int) -> str:
    """A random pattern of atoms, concatenations, alternations, groups and quantifiers."""
    roll = rng.random()
    if depth <= 0 or roll < 0.3:
        pattern = rng.choice(RANDOM_ATOMS)
    elif roll < 0.55:
        pattern = "".join(_random_pattern(rng, depth - 1) for _ in range(rng.randint(2, 3)))
    elif roll < 0.8:
        options = [_random_pattern(rng, depth - 1) for _ in range(rng.randint(2, 3))]
        pattern = "(" + "|".join(options) + ")"
    else:
        pattern = "(" + _random_pattern(rng, depth - 1) + ")"
    if rng.random() < 0.35:
        pattern = "(?:" + pattern + ")" + rng.choice(RANDOM_QUANTIFIERS)
    return pattern


@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_re_on_random_patterns(seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "é", "中", "\n", ".", "1", "x", "{", "-", "😀"]
    for _ in range(40):
        pattern = _random_pattern(rng, 3)
        automaton = RegexAutomaton(pattern)
        for _ in range(100):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(7)))
            _agrees(automaton, pattern, text)
        data = _random_walk(automaton, rng, 10)
        assert re.fullmatch(pattern, data.decode(), re.ASCII), (pattern, data)


@pytest.mark.parametrize("pattern", ["ab|ac", "(a|b)*abb", JSON_NUMBER, "[a-z]{2,4}", "caf(é|e)",
                                     r"\D\W", "x{2}(y|zz){1,3}", ".{2}", "(a|)*(b|c)?",
                                     r"x|ab[^\s\S]|a(c|db[^\x00-\U0010ffff])*"])
def test_every_reachable_state_can_reach_an_accepting_one(pattern):
    """The whole reachable DFA, explored through step: no returned state is a dead end."""
    automaton = RegexAutomaton(pattern)
    order, seen = [automaton.initial], {automaton.initial}
    edges = {}
    for state in order:
        edges[state] = [automaton.step(state, b) for b in range(256)]
        for nxt in edges[state]:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                order.append(nxt)
    live = {s for s in seen if automaton.accepting(s)}
    changed = True
    while changed:
        grown = {s for s in seen if s not in live and any(t in live for t in edges[s])}
        changed = bool(grown)
        live |= grown
    assert live == seen
    assert automaton.num_states == len(seen)


def test_every_prefix_of_a_match_is_viable():
    automaton = RegexAutomaton(JSON_STRING)
    for text in PATTERNS[JSON_STRING]:
        state = automaton.initial
        data = text.encode()
        for i, byte in enumerate(data):
            state = automaton.step(state, byte)
            assert state is not None, (text, i)
            assert automaton.accepting(state) == (i == len(data) - 1), (text, i)


def test_dead_at_first_bad_byte_and_viable_prefix_not_accepting():
    automaton = RegexAutomaton("ab")
    after_a = automaton.step(automaton.initial, ord("a"))
    assert after_a is not None and not automaton.accepting(after_a)
    assert automaton.step(after_a, ord("c")) is None
    assert automaton.accepting(automaton.step(after_a, ord("b")))
    assert automaton.step(automaton.step(after_a, ord("b")), ord("b")) is None
    assert not automaton.accepting(automaton.initial)


def test_a_branch_through_an_empty_class_is_dead():
    """``b`` after ``a`` can only lead into a class that matches nothing: not viable."""
    automaton = RegexAutomaton(r"x|ab[^\s\S]c|ad")
    after_a = automaton.step(automaton.initial, ord("a"))
    assert after_a is not None and automaton.step(after_a, ord("b")) is None
    assert automaton.accepting(automaton.step(after_a, ord("d")))


def test_half_a_character_is_viable_only_when_it_can_complete():
    letters = RegexAutomaton("[a-z]+")
    assert letters.step(letters.initial, "é".encode()[0]) is None  # no match starts with 0xC3
    accented = RegexAutomaton("é+")
    half = accented.step(accented.initial, 0xC3)
    assert half is not None and not accented.accepting(half)
    assert accented.step(half, 0xA8) is None  # è: same lead byte, wrong continuation
    assert accented.accepting(accented.step(half, 0xA9))


@pytest.mark.parametrize("pattern", [
    ".", "[^a]", r"\D", r"[é-ü]", "[\u0100-\u07ff]", "[\u0800-\uffff]", "[^\u00e0-\u4e00]",
    r"[\U00010000-\U0010ffff]", "[\u07ff-\U00010000]", "[^\n-\U0010ffff]",
])
def test_code_points_at_utf8_boundaries_and_random(pattern):
    automaton = RegexAutomaton(pattern)
    rng = random.Random(1)
    points = [0, 9, 10, 0x61, 0x7F, 0x80, 0xDF, 0xE0, 0xFC, 0x7FF, 0x800, 0xFFF, 0x1000, 0xD7FF,
              0xE000, 0xFFFF, 0x10000, 0x3FFFF, 0x40000, 0x10FFFF, 0x4E00, 0x4DFF]
    for _ in range(3000):
        points.append(rng.choice([rng.randrange(0x800), rng.randrange(0xD800),
                                  rng.randrange(0xE000, 0x110000)]))
    for cp in points:
        expected = re.fullmatch(pattern, chr(cp), _pyre_flags(pattern)) is not None
        assert automaton.matches(chr(cp).encode()) == expected, hex(cp)


@pytest.mark.parametrize("data", [
    b"\x80", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf0\x80\x80\x80",
    b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\xc3", b"\xc3\xa9\xa9",
])
def test_invalid_utf8_never_matches_dot_or_negated_class(data):
    for pattern in (".", "[^a]", r"\S"):
        assert not RegexAutomaton(pattern).matches(data), (pattern, data)


@pytest.mark.parametrize("pattern, problem, position", [
    ("a(b", "unbalanced '('", 1),
    ("ab)", "unbalanced ')'", 2),
    ("[abc", "unterminated character set", 0),
    ("[]", "unterminated character set", 0),
    ("*a", "nothing to repeat", 0),
    ("a|+", "nothing to repeat", 2),
    ("{2}", "nothing to repeat", 0),
    ("a**", "multiple repeat", 2),
    ("a{2}{3}", "multiple repeat", 4),
    ("a*+", "possessive quantifier", 2),
    ("a{3,2}", "min repeat greater than max repeat in {3,2}", 1),
    (f"a{{{MAX_REPEAT + 1}}}", f"repeat count over {MAX_REPEAT}", 1),
    ("a{2,5000}", f"repeat count over {MAX_REPEAT}", 1),
    ("a{" + "9" * 5000 + "}", f"repeat count over {MAX_REPEAT} in {{99999", 1),
    (r"(a)\1", "backreference", 3),
    (r"\0", "octal", 0),
    ("(?P<n>a)(?P=n)", "backreference '(?P=name)'", 8),
    ("(?=a)a", "lookahead", 0),
    ("(?!a)b", "negative lookahead", 0),
    ("x(?<=a)", "lookbehind", 1),
    ("x(?<!a)", "negative lookbehind", 1),
    ("(?i)a", "inline flags", 0),
    ("(?#note)a", "comment", 0),
    ("(?>a)", "atomic group", 0),
    ("(a)(?(1)b|c)", "conditional group", 3),
    ("(?P<1x>a)", "bad group name", 0),
    ("(?<n>a)", "unknown group extension", 0),
    (r"\bword", "word boundary", 0),
    (r"a\B", "non-word boundary", 1),
    (r"\Aa", "start-of-text anchor", 0),
    (r"a\Z", "end-of-text anchor", 1),
    ("a^b", "anchor '^'", 1),
    ("a$b", "anchor '$'", 1),
    ("(a$)", "anchor '$'", 2),
    (r"\p{L}", "unsupported escape '\\p'", 0),
    ("ab\\", "trailing backslash", 2),
    (r"\x80", "above \\x7F", 0),
    (r"\xZ1", "needs 2 hex digits", 0),
    (r"a\u12", "needs 4 hex digits", 1),
    (r"\ud800", "surrogate", 0),
    (r"\U00110000", "above U+10FFFF", 0),
    ("[z-a]", "bad character range z-a", 1),
    (r"[\d-z]", "bad character range", 1),
    (r"[^\s\S]", "matches no text", None),
])
def test_bad_and_unsupported_patterns_raise_a_named_error(pattern, problem, position):
    with pytest.raises(GuidedDecodingError) as info:
        RegexAutomaton(pattern)
    message = str(info.value)
    assert problem in message and repr(pattern)[:60] in message, message
    if position is not None:
        assert f"at position {position}" in message, message
    assert isinstance(info.value, ValueError)


def test_nested_repeats_that_blow_up_the_nfa_are_refused():
    with pytest.raises(GuidedDecodingError, match="too large"):
        RegexAutomaton("((a{1000}){1000}){2}")


def test_deep_nesting_is_refused_before_python_recursion_fails():
    assert RegexAutomaton("(" * 100 + "a" + ")" * 100).matches(b"a")
    with pytest.raises(GuidedDecodingError, match="nested deeper than 100 at position 100"):
        RegexAutomaton("(" * 5000 + "a" + ")" * 5000)


def test_threads_share_one_automaton():
    """The lazy construction is locked: concurrent first steps agree with a sequential run."""
    texts = ["".join(random.Random(i).choice("ab") for _ in range(300)) for i in range(8)]
    shared = RegexAutomaton("(a|b)*a(a|b){6}")
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda t: shared.matches(t.encode()), texts))
    assert results == [bool(re.fullmatch("(a|b)*a(a|b){6}", t)) for t in texts]
    assert shared.num_states == len(set(shared._sets)) <= 2 ** 7


def test_max_states_is_enforced_lazily():
    pattern = "(a|b)*a(a|b){15}"  # 2**16 DFA states: the last 16 letters must be remembered
    rng = random.Random(3)
    text = "".join(rng.choice("ab") for _ in range(5000))
    small = RegexAutomaton(pattern, max_states=500)
    with pytest.raises(GuidedDecodingError, match="more than 500 states"):
        small.matches(text.encode())
    assert small.num_states == 500
    large = RegexAutomaton(pattern)
    for end in range(0, 5000, 97):
        assert large.matches(text[:end].encode()) == bool(re.fullmatch(pattern, text[:end]))


def test_steps_are_memoized(monkeypatch):
    automaton = RegexAutomaton(JSON_STRING)
    data = ('"' + r"plain text, \"escapes\" \u00e9 and é中😀 " * 40 + '"').encode()
    assert automaton.matches(data)
    built = automaton.num_states

    def fail(state, byte):
        raise AssertionError(f"transition ({state}, {byte}) computed again")

    monkeypatch.setattr(automaton, "_compute", fail)
    steps, start = 0, time.perf_counter()
    while steps < 100_000:
        assert automaton.matches(data)
        steps += len(data)
    elapsed = time.perf_counter() - start
    logger.info("%d memoized steps in %.3f s (%.0f ns/step)", steps, elapsed, 1e9 * elapsed / steps)
    assert automaton.num_states == built


def test_anchors_at_the_ends_are_ignored_and_escaped_dollar_is_literal():
    assert RegexAutomaton("^ab$").matches(b"ab")
    assert not RegexAutomaton("^ab$").matches(b"ab\n")
    assert RegexAutomaton(r"ab\$").matches(b"ab$")
    assert RegexAutomaton("^$").matches(b"")
    assert RegexAutomaton("a|$").matches(b"") and RegexAutomaton("a|$").matches(b"a")


def test_reachable_dfa_of_a_finite_language_is_small():
    """Kernel sets make equivalent NFA subsets one DFA state: a{0,3} has 4 states at most."""
    automaton = RegexAutomaton("a{0,3}")
    state, visited = automaton.initial, deque()
    while state is not None:
        visited.append(state)
        state = automaton.step(state, ord("a"))
    assert len(visited) == 4 and all(automaton.accepting(s) for s in visited)
