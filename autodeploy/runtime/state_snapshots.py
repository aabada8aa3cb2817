"""Snapshots of per-sequence state at page boundaries: prefix caching for state-cache models.

A cached page holds keys and values that depend only on the tokens up to it, so attention can
start a new sequence from it. A state cache (an SSM state, a convolution window, a delta-rule
matrix) is different: it holds one running summary of *every* token so far, and a sequence that
skips tokens must start from the state those tokens left. So a state model can resume after
``k`` cached pages only if a copy of some sequence's state exactly after those ``k`` pages was
kept. This store keeps such copies, keyed by the page pool's entry id of page ``k`` (ids name a
whole prefix and are never reused, so a key is exact), in ``capacity`` rows of its own tensors
beside the running slots (never in the graph's cache tensors: a compiled or captured graph holds
those by address). The least recently used copy makes room for a new one. Copies of a state at
the end of a sequence (``tail``: under its whole tail's id, ``PagePool``, or after its last page
when it ends on one; what a conversation's next turn resumes from) live in spare rows only: a new
copy of either kind replaces the least recently used tail copy first, and a tail copy never
replaces a page-boundary copy (it is left out instead). Most sequences are never continued,
while a page-boundary copy serves every prompt sharing those pages: in a simulated chat
workload (page size 16, 16 copies, 32 users with a shared system prompt, 5 turns each) one LRU
for both kinds lost 6% of the prefix hits of no whole tails at all, and letting tails take up to
a quarter of the rows lost 64% (while gaining 65% with 16 users); spare rows only lost none, and
gained 49% with 4 users, 11% with 16, 26% with 64 copies.

Where copies are taken (the scheduler decides; ``Scheduler`` docstring): a state only exists at
the end of a step, so a prefill chunk is ended at a page boundary where a copy is wanted. That
is where two prompts were seen to part (a sequence matched more cached pages than any copy
covers: it computes them again and leaves a copy at the deepest one, so the third request
sharing a system prompt starts from it) and the prompt's last whole page for the first choice
of an ``n > 1`` request (its siblings wait for it and start there).

Under tensor parallelism every rank holds its own shard of each state, so every rank keeps its
own copies: rank 0's store decides (which row, which slot) and records each copy
(``Copy``); the model runner sends the copies made since the last step with the next step
(``step_broadcast``), and each other rank repeats them on its ``StateReplica`` before that step
runs, in the order rank 0 made them (a copy taken after step ``k`` is made before step ``k + 1``
on both sides, and no step runs in between).
"""

from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Set

import torch

from ..cache.interface import CachedSequenceInterface


SAVE, RESTORE, PAGE = 0, 1, 2


def _allocate_rows(cache: CachedSequenceInterface, capacity: int) -> Dict[str, torch.Tensor]:
    return {name: torch.empty((capacity, *cache.caches[name].shape[1:]), dtype=cache.caches[name].dtype,
                              device=cache.caches[name].device)
            for name in cache.state_names}


class Copy(NamedTuple):
    """One copy a rank makes before a step: between a running slot and a snapshot row (``SAVE``
    slot -> row, ``RESTORE`` row -> slot), or ``PAGE``: page ``row`` into page ``slot`` of every
    paged cache (a tail page, ``PagePool.match_tail``; not a state copy, it rides along)."""

    kind: int
    row: int
    slot: int


def _copy(cache: CachedSequenceInterface, rows: Dict[str, torch.Tensor], copy: Copy) -> None:
    for name, stored in rows.items():
        if copy.kind == SAVE:
            stored[copy.row].copy_(cache.caches[name][copy.slot])
        else:
            cache.caches[name][copy.slot].copy_(stored[copy.row])


class StateSnapshots:
    def __init__(self, cache: CachedSequenceInterface, capacity: int, record: bool = False):
        """``record``: keep every copy for ``take_copies`` (rank 0 under tensor parallelism)."""
        if capacity < 1:
            raise ValueError("a snapshot store needs room for at least one snapshot")
        self.cache = cache
        self.capacity = capacity
        self._rows = _allocate_rows(cache, capacity)
        self._free: List[int] = list(range(capacity - 1, -1, -1))
        self._row_of: "OrderedDict[int, int]" = OrderedDict()  # entry id -> row, least recently used first
        self._tails: Set[int] = set()  # the entry ids of copies at the end of a sequence (evicted first)
        self.num_saved = 0
        self.num_restored = 0
        self._record = record
        self._copies: List[Copy] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._rows.values())

    def __len__(self) -> int:
        return len(self._row_of)

    def deepest(self, entry_ids: List[int]) -> int:
        """How many of a match's pages (``entry_ids``, in order) a sequence can resume after: the
        most ``k`` with a snapshot of the state after page ``k``; 0 when none has one."""
        for k in range(len(entry_ids), 0, -1):
            if entry_ids[k - 1] in self._row_of:
                return k
        return 0

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._row_of

    def entry_ids(self) -> List[int]:
        """The entry ids with a copy, least recently used first."""
        return list(self._row_of)

    def copy_of(self, entry_id: int) -> Dict[str, torch.Tensor]:
        """The copy of the state after the page of ``entry_id``: each state cache's row (views)."""
        row = self._row_of[entry_id]
        return {name: rows[row] for name, rows in self._rows.items()}

    def save(self, entry_id: int, slot: int, tail: bool = False) -> None:
        """Copy the state in ``slot`` (a sequence exactly after the page of ``entry_id``, or after
        all the tokens of the whole tail ``entry_id``). ``tail``: a copy at the end of a sequence
        (spare rows only, module docstring)."""
        if entry_id in self._row_of:
            self._row_of.move_to_end(entry_id)
            if not tail:  # an end-of-sequence copy wanted at a page boundary now: it stays like one
                self._tails.discard(entry_id)
            return
        if self._free:
            row = self._free.pop()
        else:
            victim = self._victim(tail)
            if victim is None:
                return
            row = self._row_of.pop(victim)
            self._tails.discard(victim)
        self._do(Copy(SAVE, row, slot))
        self._row_of[entry_id] = row
        if tail:
            self._tails.add(entry_id)
        self.num_saved += 1

    def _victim(self, tail: bool) -> Optional[int]:
        """The copy a new one replaces when every row is taken: the least recently used tail
        copy, else (for a page copy) the least recently used copy; None: a tail copy stays out."""
        oldest_tail = next((e for e in self._row_of if e in self._tails), None)
        if oldest_tail is not None or tail:
            return oldest_tail
        return next(iter(self._row_of))

    def restore(self, entry_id: int, slot: int) -> None:
        """Put the snapshot of ``entry_id`` into ``slot``, where the sequence resuming from it runs."""
        row = self._row_of[entry_id]
        self._row_of.move_to_end(entry_id)
        self._do(Copy(RESTORE, row, slot))
        self.num_restored += 1

    def _do(self, copy: Copy) -> None:
        _copy(self.cache, self._rows, copy)
        if self._record:
            self._copies.append(copy)

    def take_copies(self) -> List[Copy]:
        """The copies made since the last call, in order (recording stores only)."""
        copies, self._copies = self._copies, []
        return copies


class StateReplica:
    """A rank other than 0: its own shard's snapshot rows (as many as rank 0's store,
    ``cache.limits.snapshot_capacity``), copied as rank 0's store says."""

    def __init__(self, cache: CachedSequenceInterface, capacity: int):
        self.cache = cache
        self.capacity = capacity
        self._rows = _allocate_rows(cache, capacity)

    def apply(self, copies: List[Copy]) -> None:
        for copy in copies:
            if copy.kind not in (SAVE, RESTORE) or not 0 <= copy.row < self.capacity:
                raise ValueError(f"state copy {copy} does not fit this rank's {self.capacity} snapshot rows; do all "
                                 "ranks have the same prefix_state_snapshots?")
            _copy(self.cache, self._rows, copy)
