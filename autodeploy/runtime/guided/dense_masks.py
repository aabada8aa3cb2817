"""Token masks of a DFA in tensor operations: every token stepped at once, one byte position at a
time.

``token_masks``' sorted walk steps the automaton in Python over the vocabulary's trie, as far as
the state allows: inside a JSON string most of a 128k vocabulary is allowed, and its bytes
are stepped one Python call each. A regular expression's DFA has small integer states, so its
transitions fit a table (``DfaTable``: ``[states + 1, 256]``, filled lazily from the automaton),
and the states of all tokens advance together: at byte position ``p``, ``state = table[state,
byte_p]`` for every token at least ``p + 1`` bytes long (``TokenColumns`` keeps the tokens
longest first, so those are a prefix of the arrays). Tokens that die are dropped at once, so the
work is one gather per byte of the tokens still alive, in C, plus one Python step per transition
the table has not seen yet. A state that steps to itself on most bytes (the inside of a string)
allows every token made only of such bytes at once (a bitset test per token); only the others are
stepped.

In the table a value ``v`` is DFA state ``v - 1``; 0 is dead (no completion possible, and it stays
dead); -1 is a transition not computed yet.
"""

from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

DEAD, UNKNOWN = 0, -1
# tokens still alive below which the rest are stepped in Python: each tensor step has a fixed cost
# of some microseconds, and a vocabulary's longest tokens (runs of spaces or dashes) go on for a
# hundred bytes and more
PYTHON_TAIL = 64
# bytes a state must step to itself on for the self-loop shortcut (the inside of a string: ~200)
SELF_LOOP_MIN = 64


def bitset(byte_values: Iterable[int]) -> List[int]:
    """A set of bytes as four signed 64-bit words (bit ``b % 64`` of word ``b // 64``)."""
    words = [0, 0, 0, 0]
    for byte in byte_values:
        words[byte >> 6] |= 1 << (byte & 63)
    return [w - (1 << 64) if w >= 1 << 63 else w for w in words]


class TokenColumns:
    """A vocabulary's non-empty tokens, longest first: ``columns[p]`` holds byte ``p`` of the
    tokens that have one (a prefix of the order), ``ids`` the token ids and ``lengths`` their
    lengths in that order, and ``by_first[b]`` the positions of the tokens starting with byte
    ``b``."""

    def __init__(self, tokens: Sequence[Optional[bytes]]):
        order = sorted((i for i, t in enumerate(tokens) if t), key=lambda i: -len(tokens[i]))  # type: ignore[arg-type]
        self.tokens: List[bytes] = [tokens[i] for i in order]  # type: ignore[misc]
        self.ids = torch.tensor(order, dtype=torch.long)
        self.lengths = torch.tensor([len(t) for t in self.tokens], dtype=torch.long)
        longest = len(self.tokens[0]) if self.tokens else 0
        flat = torch.zeros(len(order), longest, dtype=torch.uint8)
        if self.tokens:
            data = torch.frombuffer(bytearray(b"".join(self.tokens)), dtype=torch.uint8)
            row = torch.repeat_interleave(torch.arange(len(order)), self.lengths)
            starts = torch.cumsum(self.lengths, 0) - self.lengths
            flat[row, torch.arange(data.numel()) - starts[row]] = data
        self.columns: List[torch.Tensor] = [flat[: int((self.lengths > p).sum()), p].long() for p in range(longest)]
        # which bytes each token holds, a 256-bit set as four int64 words (for the self-loop shortcut)
        holds = torch.zeros(len(order), 256, dtype=torch.bool)
        if self.tokens:
            holds[row, data.long()] = True
        self.holds = (holds.view(-1, 4, 64).long() << torch.arange(64)).sum(dim=2)
        first = flat[:, 0].long() if self.tokens else torch.zeros(0, dtype=torch.long)
        self.by_first: Dict[int, torch.Tensor] = {b: (first == b).nonzero()[:, 0] for b in first.unique().tolist()}


class DfaTable:
    """The transitions of one DFA (``RegexAutomaton``) as a tensor, filled as masks need them."""

    def __init__(self, automaton: Any):
        self.automaton = automaton
        # int32: a row is 1 KiB, as the automaton's own (``MAX_DFA_STATES`` bounds both)
        self.table = torch.full((64, 256), UNKNOWN, dtype=torch.int32)
        self.table[DEAD] = DEAD

    def _grow(self, rows: int) -> None:
        if rows > self.table.shape[0]:
            bigger = torch.full((max(rows, 2 * self.table.shape[0]), 256), UNKNOWN, dtype=torch.int32)
            bigger[: self.table.shape[0]] = self.table
            self.table = bigger

    def _fill(self, codes: torch.Tensor) -> None:
        """Compute the transitions ``codes`` (``row * 256 + byte``) with the automaton."""
        codes = torch.unique(codes)
        values = []
        for code in codes.tolist():
            nxt = self.automaton.step(code // 256 - 1, code % 256)
            values.append(DEAD if nxt is None else nxt + 1)
        self._grow(max(values) + 1)
        self.table.view(-1)[codes] = torch.tensor(values, dtype=torch.int32)

    def _lookup(self, codes: torch.Tensor) -> torch.Tensor:
        nxt = self.table.view(-1)[codes]
        unknown = nxt == UNKNOWN
        if bool(unknown.any()):
            self._fill(codes[unknown])
            nxt = self.table.view(-1)[codes]
        return nxt

    def allowed(self, state: int, tokens: TokenColumns) -> torch.Tensor:
        """The ids of the tokens whose bytes the automaton can consume from ``state``. Only the
        tokens still alive are stepped: from a state that allows few first bytes, their groups
        of tokens are all that is left after the first byte."""
        if not tokens.tokens:
            return tokens.ids
        self._grow(state + 2)
        row = self._lookup((state + 1) * 256 + torch.arange(256)).long()
        row_list = row.tolist()
        alive_first = [b for b in tokens.by_first if row_list[b] != DEAD]
        if sum(tokens.by_first[b].numel() for b in alive_first) < len(tokens.tokens) // 4:
            # positions kept ascending: the tokens that end at a byte are then the tail of ``rows``
            rows = torch.sort(torch.cat([tokens.by_first[b] for b in alive_first] or [tokens.ids[:0]])).values
            current = row[tokens.columns[0][rows]]
        else:
            current = row[tokens.columns[0]]
            rows = (current != DEAD).nonzero()[:, 0]
            current = current[rows]
        done: List[torch.Tensor] = []  # alive and out of bytes: allowed
        leaving = [b for b in range(256) if row_list[b] != state + 1]
        if len(leaving) <= 256 - SELF_LOOP_MIN:  # inside a string: tokens of looping bytes only stay here
            looping = ((tokens.holds[rows] & torch.tensor(bitset(leaving))) == 0).all(dim=1)
            done.append(rows[looping])
            rows, current = rows[~looping], current[~looping]
        position = 1  # the byte of each token to step next
        while position < len(tokens.columns) and rows.numel() >= PYTHON_TAIL:
            cut = int(torch.searchsorted(rows, tokens.columns[position].numel()))  # past it: tokens that ended
            done.append(rows[cut:])
            rows, current = rows[:cut], current[:cut]
            nxt = self._lookup(current * 256 + tokens.columns[position][rows]).long()
            keep = nxt != DEAD
            rows, current = rows[keep], nxt[keep]
            position += 1
        done.append(self._finish(rows.tolist(), current.tolist(), position, tokens))
        return tokens.ids[torch.cat(done)]

    def _finish(self, rows: List[int], states: List[int], position: int, tokens: TokenColumns) -> torch.Tensor:
        """The few tokens left, stepped in Python from ``position`` on."""
        alive = []
        for row, value in zip(rows, states):
            for byte in tokens.tokens[row][position:]:
                nxt = self.automaton.step(value - 1, byte)
                if nxt is None:
                    break
                value = nxt + 1
            else:
                alive.append(row)
        return torch.tensor(alive, dtype=torch.long)
