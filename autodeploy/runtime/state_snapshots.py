"""Snapshots of per-sequence state at page boundaries: prefix caching for state-cache models.

A cached page holds keys and values that depend only on the tokens up to it, so attention can
start a new sequence from it. A state cache (an SSM state, a convolution window, a delta-rule
matrix) is different: it holds one running summary of *every* token so far, and a sequence that
skips tokens must start from the state those tokens left. So a state model can resume after
``k`` cached pages only if a copy of some sequence's state exactly after those ``k`` pages was
kept. This store keeps such copies, keyed by the page pool's entry id of page ``k`` (ids name a
whole prefix and are never reused, so a key is exact), in ``capacity`` rows of its own tensors
beside the running slots (never in the graph's cache tensors: a compiled or captured graph holds
those by address). The least recently used copy makes room for a new one.

Where copies are taken (the scheduler decides; ``Scheduler`` docstring): a state only exists at
the end of a step, so a prefill chunk is ended at a page boundary where a copy is wanted. That
is where two prompts were seen to part (a sequence matched more cached pages than any copy
covers: it computes them again and leaves a copy at the deepest one, so the third request
sharing a system prompt starts from it) and the prompt's last whole page for the first choice
of an ``n > 1`` request (its siblings wait for it and start there).
"""

from collections import OrderedDict
from typing import Dict, List

import torch

from ..cache.interface import CachedSequenceInterface


class StateSnapshots:
    def __init__(self, cache: CachedSequenceInterface, capacity: int):
        if capacity < 1:
            raise ValueError("a snapshot store needs room for at least one snapshot")
        self.cache = cache
        self.capacity = capacity
        self._rows: Dict[str, torch.Tensor] = {
            name: torch.empty((capacity, *cache.caches[name].shape[1:]), dtype=cache.caches[name].dtype,
                              device=cache.caches[name].device)
            for name in cache.state_names
        }
        self._free: List[int] = list(range(capacity - 1, -1, -1))
        self._row_of: "OrderedDict[int, int]" = OrderedDict()  # entry id -> row, least recently used first
        self.num_saved = 0
        self.num_restored = 0

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

    def save(self, entry_id: int, slot: int) -> None:
        """Copy the state in ``slot`` (a sequence exactly after the page of ``entry_id``)."""
        if entry_id in self._row_of:
            self._row_of.move_to_end(entry_id)
            return
        if self._free:
            row = self._free.pop()
        else:
            _, row = self._row_of.popitem(last=False)
        for name, rows in self._rows.items():
            rows[row].copy_(self.cache.caches[name][slot])
        self._row_of[entry_id] = row
        self.num_saved += 1

    def restore(self, entry_id: int, slot: int) -> None:
        """Put the snapshot of ``entry_id`` into ``slot``, where the sequence resuming from it runs."""
        row = self._row_of[entry_id]
        self._row_of.move_to_end(entry_id)
        for name, rows in self._rows.items():
            self.cache.caches[name][slot].copy_(rows[row])
        self.num_restored += 1
