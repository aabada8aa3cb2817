"""A regular expression as a lazily built DFA over the UTF-8 bytes of a text, for guided decoding.

Guided decoding asks, per vocabulary token, "can the text still become a full match if this token's
bytes come next?". A token may hold half a character, so the automaton reads bytes: each character
and class of the pattern becomes the UTF-8 byte sequences of its code points (exactly the valid
encodings: no overlongs, no surrogates). A recursive-descent parser (errors name the problem and its
position) builds a tree, the tree a Thompson NFA over byte ranges, and DFA states (frozensets of NFA
states) are made on first use, each kept to the NFA states that can still reach the accept state:
the empty set is the dead state, so ``step`` returning a state means a full match is reachable.

Semantics: Python's ``re.fullmatch(pattern, text)`` without flags (``.`` does not match a newline)
on this subset:

* literals (any Unicode), escaped punctuation, ``\\n \\t \\r \\f \\v \\a``, ``\\xNN`` (<= 0x7F),
  ``\\uNNNN``, ``\\UNNNNNNNN``; ``\\d \\w \\s \\D \\W \\S`` are ASCII-only, as with ``re.ASCII``:
  ``\\d`` is ``[0-9]``, ``\\w`` ``[A-Za-z0-9_]``, ``\\s`` ``[ \\t\\n\\r\\f\\v]``;
* ``.``, ``[...]``, ``[^...]`` with ranges (non-ASCII too) and escapes (``\\b`` is a backspace);
* ``(...)``, ``(?:...)``, ``(?P<name>...)``, ``|`` (empty alternatives too), ``* + ?``, ``{n}
  {n,} {,m} {n,m}`` (counts <= 1000; lazy forms act as greedy, which gives the same full matches);
  a ``{`` that starts no quantifier is a literal, as in Python;
* ``^`` as the very first and ``$`` as the very last character, ignored (matches are full anyway).

Everything else raises :class:`GuidedDecodingError`: backreferences, lookarounds, inline flags,
comments, atomic groups, conditionals, possessive quantifiers, ``\\b \\B \\A \\Z``, ``\\p``, octal
escapes, anchors elsewhere, nesting deeper than 100 groups, and patterns that match no text.
"""

import logging
import threading
from array import array
from functools import lru_cache
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from .errors import GuidedDecodingError
from .regex_parser import ByteSeq, Ranges, _Alt, _Chars, _Concat, _Node, _Parser, _Repeat, _shown, _utf8_sequences

logger = logging.getLogger(__name__)

MAX_NFA_STATES = 250_000  # nested repeats multiply; beyond this the pattern is refused up front
# a DFA state's transition row takes 1 KiB, and a compiled automaton is shared by every request
# with the same constraint and kept (``params``), so its growth is bounded: 50 MiB at most
MAX_DFA_STATES = 50_000
_UNKNOWN, _DEAD = -2, -1  # transition-table markers; real states are >= 0


@lru_cache(maxsize=1024)
def _chars_fragment(ranges: Ranges) -> Tuple[int, Tuple[Tuple[int, int, int, int], ...]]:
    """The byte edges (src, lo, hi, dst) of a code point set, states local: 0 the start, 1 the end,
    then one per distinct remaining suffix of the UTF-8 sequences, so that multi-byte characters
    share their continuation-byte tails (``.`` takes 7 inner states instead of 16)."""
    after: Dict[ByteSeq, int] = {(): 1}  # remaining suffix -> the local state that reads it
    edges = []
    for seq in _utf8_sequences(ranges):
        for i in range(len(seq) - 1, 0, -1):
            if seq[i:] not in after:
                after[seq[i:]] = len(after) + 1
                edges.append((after[seq[i:]],) + seq[i] + (after[seq[i + 1:]],))
        edges.append((0,) + seq[0] + (after[seq[1:]],))
    return len(after) - 1, tuple(edges)


def _nfa_size(node: _Node) -> int:
    """An upper bound of the NFA states ``node`` needs, to refuse a blown-up pattern up front
    (``((a{1000}){1000}){1000}``) instead of after building a quarter million states."""
    if isinstance(node, _Chars):
        return _chars_fragment(node.ranges)[0]
    if isinstance(node, _Repeat):
        return (max(node.low, node.high or 0) + 1) * (_nfa_size(node.item) + 1)
    parts = node.items if isinstance(node, _Concat) else node.options
    return sum(_nfa_size(part) + 1 for part in parts)


class _NfaBuilder:
    """Thompson construction over byte ranges: state i has ``edges[i]`` (lo, hi, target) and
    ``eps[i]`` (epsilon targets), each a shared empty tuple until the first one is added (fewer
    objects for the garbage collector to walk). Fragments go between given states, so that no
    extra epsilon states are needed."""

    def __init__(self) -> None:
        self.edges: list = []  # per state: () or a list of (lo, hi, target)
        self.eps: list = []  # per state: () or a list of targets

    def new_state(self) -> int:
        self.edges.append(())
        self.eps.append(())
        return len(self.edges) - 1

    def add_eps(self, src: int, dst: int) -> None:
        if self.eps[src]:
            self.eps[src].append(dst)
        else:
            self.eps[src] = [dst]

    def emit(self, node: _Node, start: int, end: int) -> None:
        if isinstance(node, _Chars):
            self.emit_chars(node.ranges, start, end)
        elif isinstance(node, _Concat):
            cur = start
            for i, item in enumerate(node.items):
                nxt = end if i == len(node.items) - 1 else self.new_state()
                self.emit(item, cur, nxt)
                cur = nxt
            if not node.items:
                self.add_eps(start, end)
        elif isinstance(node, _Alt):
            for option in node.options:
                self.emit(option, start, end)
        else:
            self.emit_repeat(node, start, end)

    def emit_chars(self, ranges: Ranges, start: int, end: int) -> None:
        """A copy of the class's cached byte-level fragment between ``start`` and ``end``."""
        count, template = _chars_fragment(ranges)
        local = [start, end] + [self.new_state() for _ in range(count)]
        for src, lo, hi, dst in template:
            state = local[src]
            if self.edges[state]:
                self.edges[state].append((lo, hi, local[dst]))
            else:
                self.edges[state] = [(lo, hi, local[dst])]

    def emit_repeat(self, node: _Repeat, start: int, end: int) -> None:
        """``low`` copies in a row, then a loop (unbounded) or ``high - low`` optional copies, each
        able to skip to ``end``. Loops go through a fresh state, so no other path re-enters them."""
        cur, low, high = start, node.low, node.high
        for i in range(low):
            nxt = end if high == low and i == low - 1 else self.new_state()
            self.emit(node.item, cur, nxt)
            cur = nxt
        if high is None:
            loop = self.new_state()
            self.add_eps(cur, loop)
            self.emit(node.item, loop, loop)
            self.add_eps(loop, end)
            return
        for i in range(high - low):
            self.add_eps(cur, end)
            nxt = end if i == high - low - 1 else self.new_state()
            self.emit(node.item, cur, nxt)
            cur = nxt
        if high == 0:
            self.add_eps(start, end)


def _productive(edges: Sequence[Sequence[Tuple[int, int, int]]], eps: Sequence[Sequence[int]],
                accept: int) -> List[bool]:
    """Which NFA states can reach ``accept``: a backward search over all edges. Exact for the DFA
    too, since every byte edge is explicit (no anchors, no lookarounds)."""
    reverse: List[List[int]] = [[] for _ in edges]
    for src in range(len(edges)):
        for edge in edges[src]:
            reverse[edge[2]].append(src)
        for dst in eps[src]:
            reverse[dst].append(src)
    seen = [False] * len(edges)
    seen[accept] = True
    stack = [accept]
    while stack:
        for src in reverse[stack.pop()]:
            if not seen[src]:
                seen[src] = True
                stack.append(src)
    return seen


class RegexAutomaton:
    """Full-match recognizer of a regular expression over the UTF-8 bytes of a text, as a DFA built
    lazily. States are small ints; ``step`` returns a state only while a full match is still
    reachable, and is a table lookup once a transition has been seen (the first time it is a
    subset-construction step, guarded by a lock so threads may share an automaton)."""

    int_states = True  # states are 0, 1, 2, ...: its masks can come from a transition table (dense_masks)

    def __init__(self, pattern: str, max_states: int = MAX_DFA_STATES) -> None:
        if max_states < 1:
            raise ValueError(f"max_states must be >= 1, got {max_states}")
        self.pattern = pattern
        self.max_states = max_states
        tree = _Parser(pattern).parse()
        if _nfa_size(tree) > MAX_NFA_STATES:
            raise GuidedDecodingError(
                f"regex {_shown(pattern)}: too large (over {MAX_NFA_STATES} NFA states); nested "
                "bounded repeats multiply: use '*' or '+', or smaller counts")
        builder = _NfaBuilder()
        start, accept = builder.new_state(), builder.new_state()
        builder.emit(tree, start, accept)
        # tuples: once the collector has seen them they are no longer tracked (a cached automaton
        # would otherwise add its NFA to every full collection of the server)
        self._edges = tuple(map(tuple, builder.edges))
        self._eps = tuple(map(tuple, builder.eps))
        self._accept = accept
        self._productive = _productive(builder.edges, builder.eps, accept)
        self._kernels: List[Optional[FrozenSet[int]]] = [None] * len(builder.edges)
        self._sets: List[FrozenSet[int]] = []
        self._ids: Dict[FrozenSet[int], int] = {}
        self._rows: List[Optional[array]] = []
        self._accepting: List[bool] = []
        self._lock = threading.Lock()
        first = self._kernel(start)
        if not first:
            raise GuidedDecodingError(f"regex {_shown(pattern)}: matches no text at all "
                                      "(e.g. an empty class like [^\\s\\S])")
        self.initial: int = self._add_state(first)
        logger.debug("regex %s: %d NFA states", _shown(pattern), len(self._edges))

    @property
    def num_states(self) -> int:
        """DFA states built so far (not counting the dead state)."""
        return len(self._sets)

    def step(self, state: int, byte: int) -> Optional[int]:
        """The state after ``byte`` (0..255), or None when no continuation can ever match."""
        row = self._rows[state]
        if row is not None:
            nxt = row[byte]
            if nxt >= 0:
                return nxt
            if nxt == _DEAD:
                return None
        return self._compute(state, byte)

    def accepting(self, state: int) -> bool:
        """Whether the bytes that led to ``state`` are a full match."""
        return self._accepting[state]

    def matches(self, data: bytes) -> bool:
        """Whether ``data`` (UTF-8) is a full match of the pattern."""
        state: Optional[int] = self.initial
        for byte in data:
            state = self.step(state, byte)
            if state is None:
                return False
        return self._accepting[state]

    def _kernel(self, nfa_state: int) -> FrozenSet[int]:
        """The epsilon closure of ``nfa_state``, kept to the productive states that read a byte or
        accept: equal DFA states then get equal sets, and the dead state is the empty set."""
        kernel = self._kernels[nfa_state]
        if kernel is None:
            seen, stack = {nfa_state}, [nfa_state]
            while stack:
                for nxt in self._eps[stack.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            kernel = frozenset(s for s in seen if self._productive[s]
                               and (self._edges[s] or s == self._accept))
            self._kernels[nfa_state] = kernel
        return kernel

    def _compute(self, state: int, byte: int) -> Optional[int]:
        with self._lock:
            targets: set = set()
            for nfa_state in self._sets[state]:
                for lo, hi, dst in self._edges[nfa_state]:
                    if lo <= byte <= hi:
                        targets |= self._kernel(dst)
            key = frozenset(targets)
            nxt = _DEAD if not key else self._ids.get(key)
            if nxt is None:
                nxt = self._add_state(key)
            row = self._rows[state]
            if row is None:
                row = self._rows[state] = array("i", [_UNKNOWN]) * 256
            row[byte] = nxt
        return None if nxt == _DEAD else nxt

    def _add_state(self, nfa_states: FrozenSet[int]) -> int:
        if len(self._sets) >= self.max_states:
            raise GuidedDecodingError(
                f"regex {_shown(self.pattern)}: too complex: its automaton needs more than "
                f"{self.max_states} states; simplify it (smaller {{n,m}} bounds, fewer "
                "overlapping alternatives after a '*')")
        self._sets.append(nfa_states)
        self._ids[nfa_states] = len(self._sets) - 1
        self._rows.append(None)  # a row of 256 transitions is made on the first step out
        self._accepting.append(self._accept in nfa_states)
        return len(self._sets) - 1
