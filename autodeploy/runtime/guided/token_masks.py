"""Which tokens may come next: for an automaton state, the tokens whose bytes it can consume.

Checking each of a vocabulary's 32k-256k tokens byte by byte would cost a Python loop over every
byte of the vocabulary per step. Instead the tokens are sorted by their bytes once, and a walk
over the sorted list steps the automaton only over the bytes a token does not share with the one
before it (the states of the shared prefix are kept on a stack, as a trie walk would): the work is
the size of the vocabulary's trie restricted to what the automaton allows. When a byte is refused,
every token starting with the same prefix is refused too and skipped with one binary search. The
result is a ``[vocab]`` bool mask, cached by the automaton's ``mask_key`` (a regular expression's
DFA state; for JSON the innermost containers), so a state seen before costs a dict lookup.

Where a state steps to itself on most bytes (the inside of a string), the tokens made only of
such bytes are allowed without a walk: one ``[tokens, 256]`` bool reduction finds them, and only
the rest are walked.

An automaton with small integer states (``int_states``: a regular expression's DFA, so every JSON
Schema, choice and regex constraint) gets its masks from ``dense_masks`` instead: all tokens
stepped at once in tensor operations over a transition table, which does not grow with how much
of the vocabulary a state allows. The walk stays for the JSON-object recognizer, whose states are
stacks.

Automata (``RegexAutomaton``, ``JsonObjectAutomaton``) share this interface: ``initial``,
``step(state, byte) -> state or None`` (None: no continuation can complete the output; a state
returned is always still completable), ``accepting(state)`` and, optionally, ``mask_key(state)``.
"""

from bisect import bisect_left
from collections import OrderedDict
from typing import Any, Hashable, List, Optional, Sequence, Tuple

import torch

from .dense_masks import DfaTable, TokenColumns, bitset
from .vocab import TokenVocab

# masks kept per constraint: a mask is one byte per vocabulary entry (128 KiB for a 128k vocabulary)
MASK_CACHE_SIZE = 256


def _successor(prefix: bytes) -> Optional[bytes]:
    """The smallest byte string greater than every string starting with ``prefix`` (None: none)."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return None
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


class _SortedTokens:
    """A vocabulary's non-empty token byte strings in sorted order, with their ids, and which
    bytes each holds (``[n, 4]`` int64: a 256-bit set per token, for the self-loop shortcut)."""

    def __init__(self, tokens: Sequence[Optional[bytes]]):
        pairs = sorted((b, i) for i, b in enumerate(tokens) if b)
        self.bytes: List[bytes] = [b for b, _ in pairs]
        self.ids: List[int] = [i for _, i in pairs]
        self.holds = torch.tensor([bitset(set(b)) for b in self.bytes], dtype=torch.int64).reshape(-1, 4)


def _self_loop_tokens(automaton: Any, state: Hashable, tokens: _SortedTokens) -> Optional[List[bool]]:
    """Per sorted token, whether all its bytes leave ``state`` as it is (so it is allowed without
    a walk: inside a JSON string, most of a vocabulary). None when no byte loops."""
    leaves = [byte for byte in range(256) if automaton.step(state, byte) != state]
    if len(leaves) == 256:
        return None
    return ((tokens.holds & torch.tensor(bitset(leaves), dtype=torch.int64)) == 0).all(dim=1).tolist()


def allowed_tokens(automaton: Any, state: Hashable, tokens: _SortedTokens) -> List[int]:
    """The ids of the tokens whose bytes ``automaton`` can consume from ``state``."""
    allowed: List[int] = []
    seq, ids, n = tokens.bytes, tokens.ids, len(tokens.bytes)
    looping = _self_loop_tokens(automaton, state, tokens)
    states: List[Hashable] = [state]  # states[d]: the state after the first d bytes of ``prev``
    prev = b""
    i = 0
    while i < n:
        if looping is not None and looping[i]:  # (``prev`` and ``states`` stay those of the last walk)
            allowed.append(ids[i])
            i += 1
            continue
        tok = seq[i]
        shared = 0
        limit = min(len(prev), len(tok), len(states) - 1)
        while shared < limit and prev[shared] == tok[shared]:
            shared += 1
        del states[shared + 1:]
        depth, refused = shared, False
        while depth < len(tok):
            nxt = automaton.step(states[depth], tok[depth])
            if nxt is None:
                refused = True
                break
            states.append(nxt)
            depth += 1
        prev = tok
        if not refused:
            allowed.append(ids[i])
            i += 1
            continue
        after = _successor(tok[:depth + 1])  # every token starting with the refused prefix is out
        i = n if after is None else bisect_left(seq, after, i + 1)
    return allowed


class TokenMasks:
    """The masks of one automaton over one vocabulary."""

    def __init__(self, automaton: Any, vocab: TokenVocab, cache_size: int = MASK_CACHE_SIZE, dense: bool = True):
        """``dense``: use ``dense_masks`` where the automaton allows it (False: always walk)."""
        self.automaton = automaton
        self.tokens, self.tokens_first = vocab.tokens, vocab.first
        # the first output token: a SentencePiece decoder strips its leading space
        same = vocab.first is vocab.tokens
        self._table: Optional[DfaTable] = None
        if dense and getattr(automaton, "int_states", False):
            self._table = DfaTable(automaton)
            self._columns = vocab.derived("columns", lambda: TokenColumns(vocab.tokens))
            self._columns_first = self._columns if same else vocab.derived(
                "columns_first", lambda: TokenColumns(vocab.first))
        else:
            self._sorted = vocab.derived("sorted", lambda: _SortedTokens(vocab.tokens))
            self._sorted_first = self._sorted if same else vocab.derived(
                "sorted_first", lambda: _SortedTokens(vocab.first))
        self._cache: "OrderedDict[Tuple[bool, int, Hashable], torch.Tensor]" = OrderedDict()
        self._cache_size = cache_size
        self.num_built = 0  # masks computed (not read from the cache): for tests and logs

    def mask(self, state: Hashable, first: bool, width: int) -> torch.Tensor:
        """``[width]`` bool: the tokens that may follow ``state`` (read-only, shared). ``width``:
        the model's logits width, which may differ from the tokenizer's length (ids the tokenizer
        does not have are never allowed)."""
        key_of = getattr(self.automaton, "mask_key", None)
        key = (first, width, key_of(state) if key_of is not None else state)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        if self._table is not None:
            ids = self._table.allowed(state, self._columns_first if first else self._columns)
        else:
            ids = torch.tensor(allowed_tokens(self.automaton, state, self._sorted_first if first else self._sorted),
                               dtype=torch.long)
        mask = torch.zeros(width, dtype=torch.bool)
        mask[ids[ids < width]] = True
        self._cache[key] = mask
        self.num_built += 1
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return mask
