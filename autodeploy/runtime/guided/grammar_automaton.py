"""A pushdown recognizer of a recursive GBNF grammar (nested brackets, arithmetic, JSON), over the
UTF-8 bytes of a text.

The grammar is lowered to plain BNF: groups and repeats become rules of their own (``x*`` is
``r ::= x r | ""``, right-recursive), and every rule's alternatives are laid out in one flat
program of elements, each a character set, a rule reference, or the end of an alternative. A
*stack* is a tuple of program positions, innermost last: where the text is in each rule entered and
not yet finished. It is kept *settled*: its top is always a character set (or the stack is empty:
the text may end here). Settling expands a reference at the top into one stack per alternative of
the rule, and drops a finished alternative; a reference that is the last element of its
alternative does not keep a frame to come back to, so a repeat (``x*``) keeps its stack as it is,
however long the text runs.

A state is the set of the stacks still possible (the grammar may be ambiguous) and the bytes of a
character not yet complete. ``step`` returns None as soon as no stack can take the byte, and the
grammar is checked when it is built so that every stack can always still finish (no rule without
an end, no empty character set), so a state it returns is always completable: what the token masks
rely on. Grammars the recognizer cannot run are refused when built, naming the rule: left
recursion (``expr ::= expr "+" term``: settling would never end; write it ``expr ::= term ("+"
term)*``). A text whose stacks grow past ``MAX_STACKS`` ambiguous readings or ``MAX_DEPTH`` nested
rules raises ``GuidedDecodingError`` (the guide then ends the sequence with a warning).

``grammar_recognizer`` is the entry point: a grammar without recursion goes to ``regex_dfa``
instead (a DFA's masks come from a transition table, much faster than stepping stacks).
"""

from bisect import bisect_right
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

from .errors import GuidedDecodingError
from .grammar import (Alternatives, CharClass, Literal, Node, Ranges, Repeat, RuleRef, Sequence, parse_grammar,
                      recursion, rules_to_regex, too_deep_is_an_error)
from .regex_dfa import RegexAutomaton

MAX_STACKS = 1024  # readings of an ambiguous text kept at once
MAX_DEPTH = 512  # rules open at once (the nesting depth of the text, roughly)
MAX_ELEMENTS = 200_000  # the program's size (bounded repeats are unrolled)
_STEP_CACHE = 1 << 17  # (state, byte) transitions remembered

_SET, _REF, _END = 0, 1, 2
_SURROGATES = (0xD800, 0xDFFF)
Stack = Tuple[int, ...]
State = Tuple[FrozenSet[Stack], bytes]
Symbol = Tuple[int, object]  # (_SET, ranges) or (_REF, rule id)


def grammar_recognizer(grammar: str) -> Any:
    """The recognizer of a GBNF ``grammar``: a DFA when it is regular (the faster masks), the
    pushdown ``GrammarAutomaton`` when it is recursive."""
    with too_deep_is_an_error():
        rules = parse_grammar(grammar)
        if recursion(rules) is None:
            return RegexAutomaton(rules_to_regex(rules))
        return GrammarAutomaton(rules)


def _utf8_span(pending: bytes) -> Optional[Tuple[int, int]]:
    """The code points whose UTF-8 encoding starts with ``pending`` (an incomplete character), as
    ``(lo, hi)``; None when no valid encoding starts so."""
    lead = pending[0]
    if 0xC2 <= lead <= 0xDF:
        length, bits = 2, lead & 0x1F
    elif 0xE0 <= lead <= 0xEF:
        length, bits = 3, lead & 0x0F
    elif 0xF0 <= lead <= 0xF4:
        length, bits = 4, lead & 0x07
    else:
        return None
    if len(pending) >= length:
        return None
    if len(pending) > 1:  # the second byte's range depends on the lead (no overlongs, surrogates, > U+10FFFF)
        low, high = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(
            lead, (0x80, 0xBF))
        if not low <= pending[1] <= high or any(not 0x80 <= b <= 0xBF for b in pending[2:]):
            return None
    for b in pending[1:]:
        bits = (bits << 6) | (b & 0x3F)
    missing = length - len(pending)
    lo, hi = bits << (6 * missing), (bits << (6 * missing)) | ((1 << (6 * missing)) - 1)
    if len(pending) == 1:  # the second byte is not known yet: the lead's whole valid range
        lo = max(lo, (0x80, 0x800, 0x10000)[length - 2])
        hi = min(hi, 0x10FFFF)
    return lo, hi


def _without_surrogates(ranges: Ranges) -> Ranges:
    out: List[Tuple[int, int]] = []
    for lo, hi in ranges:
        for a, b in ((lo, min(hi, _SURROGATES[0] - 1)), (max(lo, _SURROGATES[1] + 1), hi)):
            if a <= b:
                out.append((a, b))
    return tuple(out)


class _Lowering:
    """The grammar as BNF: rules of alternatives of symbols, named rules first (ids 0..)."""

    def __init__(self, rules: Dict[str, Node]):
        self.names: List[str] = ["root"] + [name for name in rules if name != "root"]  # root is rule 0
        self.ids = {name: i for i, name in enumerate(self.names)}
        self.alternatives: List[List[List[Symbol]]] = [[] for _ in self.names]
        self.size = 0
        for name in list(self.names):
            self.alternatives[self.ids[name]] = self._options(rules[name], name)

    def _new_rule(self, owner: str, alternatives: List[List[Symbol]]) -> Symbol:
        self.names.append(owner)  # errors name the rule a group or repeat is written in
        self.alternatives.append(alternatives)
        return (_REF, len(self.names) - 1)

    def _options(self, node: Node, owner: str) -> List[List[Symbol]]:
        if isinstance(node, Alternatives):
            return [self._symbols(option, owner) for option in node.options]
        return [self._symbols(node, owner)]

    def _symbols(self, node: Node, owner: str) -> List[Symbol]:
        out: List[Symbol]
        if isinstance(node, Literal):
            out = [(_SET, ((ord(c), ord(c)),)) for c in node.text]
        elif isinstance(node, CharClass):
            out = [(_SET, _without_surrogates(node.ranges))]
        elif isinstance(node, RuleRef):
            out = [(_REF, self.ids[node.name])]
        elif isinstance(node, Sequence):
            out = [s for item in node.items for s in self._symbols(item, owner)]
        elif isinstance(node, Alternatives):
            out = [self._new_rule(owner, self._options(node, owner))]
        else:
            out = self._repeat(node, owner)
        self.size += len(out)
        if self.size > MAX_ELEMENTS:
            raise GuidedDecodingError(f"the grammar is too large once its repeats are unrolled (over {MAX_ELEMENTS} "
                                      "elements): use '*' or '+', or smaller counts")
        return out

    def _repeat(self, node: Repeat, owner: str) -> List[Symbol]:
        body = self._symbols(node.item, owner)
        out = body * node.low
        if node.high is None:  # r ::= body r | ""  (the reference is last: the stack does not grow)
            star = self._new_rule(owner, [])
            self.alternatives[star[1]] = [body + [star], []]  # type: ignore[index]
            return out + [star]
        tail: Optional[Symbol] = None  # body{0,k} as r_k ::= body r_(k-1) | ""
        for _ in range(node.high - node.low):
            tail = self._new_rule(owner, [body + ([tail] if tail else []), []])
        return out + ([tail] if tail else [])


def _check(lowered: _Lowering) -> None:
    """Refuse what the recognizer cannot run: left recursion (settling would not end) and rules or
    character sets that can never finish (a state would not always be completable)."""
    n = len(lowered.names)
    nullable = [False] * n
    productive = [False] * n
    changed = True
    while changed:
        changed = False
        for r, alts in enumerate(lowered.alternatives):
            if not nullable[r] and any(all(k == _REF and nullable[v] for k, v in alt) for alt in alts):
                nullable[r] = changed = True
            if not productive[r] and any(all(productive[v] if k == _REF else bool(v) for k, v in alt)
                                         for alt in alts):
                productive[r] = changed = True
    reachable, todo = {0}, [0]  # rule 0 is root's
    while todo:
        for alt in lowered.alternatives[todo.pop()]:
            for kind, value in alt:
                if kind == _REF and value not in reachable:
                    reachable.add(value)  # type: ignore[arg-type]
                    todo.append(value)  # type: ignore[arg-type]
    for r in sorted(reachable):
        if any(k == _SET and not v for alt in lowered.alternatives[r] for k, v in alt):
            raise GuidedDecodingError(f"rule '{lowered.names[r]}' of the grammar has a character class that matches "
                                      "no character")
    for r in sorted(reachable):
        if not productive[r]:
            raise GuidedDecodingError(f"rule '{lowered.names[r]}' of the grammar can never end (each alternative "
                                      "refers back to it, or to a rule that cannot end, with no way out)")
    left: List[List[int]] = [[] for _ in range(n)]  # rules that may start a rule's text
    for r, alts in enumerate(lowered.alternatives):
        for alt in alts:
            for kind, value in alt:
                if kind == _SET:
                    break
                left[r].append(value)  # type: ignore[arg-type]
                if not nullable[value]:  # type: ignore[index]
                    break
    state = [0] * n  # 0 unseen, 1 on the path, 2 done

    def visit(r: int, path: List[int]) -> None:
        state[r] = 1
        for s in left[r]:
            if state[s] == 1:
                loop = (path + [r])[(path + [r]).index(s):]
                names = [lowered.names[x] for i, x in enumerate(loop)
                         if i == 0 or lowered.names[x] != lowered.names[loop[i - 1]]]  # a group: its rule
                if len(names) > 1 and names[-1] == names[0]:
                    names.pop()
                cycle = " -> ".join(names + [names[0]])
                raise GuidedDecodingError(
                    f"the grammar is left-recursive ({cycle}): a rule may refer back to itself only after some text, "
                    "e.g. write 'list ::= list \",\" item | item' as 'list ::= item (\",\" item)*'; a '*' or '+' "
                    "over something that can be empty loops the same way")
            if state[s] == 0:
                visit(s, path + [r])
        state[r] = 2

    for r in range(n):
        if state[r] == 0:
            visit(r, [])


class GrammarAutomaton:
    """Full-match recognizer of a recursive GBNF grammar's ``root`` (see the module docstring):
    ``initial``, ``step(state, byte)``, ``accepting(state)``, as ``token_masks`` expects."""

    def __init__(self, rules: Dict[str, Node]):
        lowered = _Lowering(rules)
        _check(lowered)
        self._kind: List[int] = []
        self._ranges: List[Ranges] = []
        self._lows: List[Tuple[int, ...]] = []
        self._ascii: List[int] = []  # per set: its ASCII members as a 128-bit mask
        self._target: List[int] = []  # per reference: its rule
        starts: List[List[int]] = []
        for alts in lowered.alternatives:
            starts.append([])
            for alt in alts:
                starts[-1].append(len(self._kind))
                for kind, value in alt + [(_END, None)]:
                    self._add(kind, value)
        self._starts = starts
        self._steps: Dict[Tuple[State, int], Optional[State]] = {}
        self.initial: State = (self._settle([(start,) for start in starts[0]]), b"")

    def _add(self, kind: int, value: object) -> None:
        ranges: Ranges = value if kind == _SET else ()  # type: ignore[assignment]
        self._kind.append(kind)
        self._ranges.append(ranges)
        self._lows.append(tuple(lo for lo, _ in ranges))
        self._ascii.append(sum(((1 << (min(hi, 127) + 1)) - (1 << lo)) for lo, hi in ranges if lo < 128))
        self._target.append(value if kind == _REF else -1)  # type: ignore[arg-type]

    def _settle(self, stacks: List[Stack]) -> FrozenSet[Stack]:
        """The settled stacks ``stacks`` stand for (tops are character sets, or empty)."""
        out: Set[Stack] = set()
        seen: Set[Stack] = set()
        todo = list(stacks)
        while todo:
            stack = todo.pop()
            if stack in seen:
                continue
            seen.add(stack)
            if not stack:
                out.add(stack)
                continue
            pos = stack[-1]
            kind = self._kind[pos]
            if kind == _SET:
                out.add(stack)
            elif kind == _END:
                todo.append(stack[:-1])
            else:
                rest = stack[:-1] if self._kind[pos + 1] == _END else stack[:-1] + (pos + 1,)
                if len(rest) >= MAX_DEPTH:
                    raise GuidedDecodingError(f"the text nests the grammar's rules more than {MAX_DEPTH} deep")
                todo.extend(rest + (start,) for start in self._starts[self._target[pos]])
        if len(out) > MAX_STACKS:
            raise GuidedDecodingError(f"the grammar reads the text in more than {MAX_STACKS} ways at once (it is too "
                                      "ambiguous to follow)")
        return frozenset(out)

    def _takes(self, pos: int, cp: int) -> bool:
        if cp < 128:
            return bool(self._ascii[pos] >> cp & 1)
        i = bisect_right(self._lows[pos], cp) - 1
        return i >= 0 and cp <= self._ranges[pos][i][1]

    def _may_take(self, pos: int, lo: int, hi: int) -> bool:
        """Some code point in ``lo..hi`` is in the set at ``pos``."""
        return any(a <= hi and lo <= b for a, b in self._ranges[pos])

    def accepting(self, state: State) -> bool:
        return not state[1] and () in state[0]

    def step(self, state: State, byte: int) -> Optional[State]:
        key = (state, byte)
        if key in self._steps:
            return self._steps[key]
        nxt = self._compute(state, byte)
        if len(self._steps) >= _STEP_CACHE:
            self._steps.clear()
        self._steps[key] = nxt
        return nxt

    def _compute(self, state: State, byte: int) -> Optional[State]:
        stacks, pending = state
        if not pending and byte < 0x80:
            return self._advance(stacks, byte)
        data = pending + bytes([byte])
        if pending and not 0x80 <= byte <= 0xBF:
            return None
        span = _utf8_span(data)
        if span is None:  # complete (or invalid)
            try:
                cp = ord(data.decode("utf-8"))
            except UnicodeDecodeError:
                return None
            return self._advance(stacks, cp)
        if not any(s and self._may_take(s[-1], *span) for s in stacks):
            return None
        return stacks, data

    def _advance(self, stacks: FrozenSet[Stack], cp: int) -> Optional[State]:
        moved = [s[:-1] + (s[-1] + 1,) for s in stacks if s and self._takes(s[-1], cp)]
        if not moved:
            return None
        return self._settle(moved), b""

    def matches(self, data: bytes) -> bool:
        """The whole of ``data`` is a text of the grammar (for tests and tools)."""
        state: Optional[State] = self.initial
        for byte in data:
            state = self.step(state, byte)  # type: ignore[arg-type]
            if state is None:
                return False
        return self.accepting(state)  # type: ignore[arg-type]
