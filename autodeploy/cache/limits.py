"""Batch size and pool size when the user leaves them to us.

``max_batch_size`` caps how many sequences run at once; the page pool is what really limits
them (a new sequence is admitted only when its pages are free, and a growing one preempts the
youngest when they run out). So the batch cap should never be the reason a batch waits while
the pool has room: unset, it is the number of full-length (``max_seq_len``) sequences the pool
holds, at least ``MIN_AUTO_BATCH_SIZE`` (real sequences are mostly far shorter than the
maximum) and at most ``MAX_BATCH_SIZE_CAP`` (vLLM's default ``max_num_seqs``; above it a CPU
step is compute-bound and only latency grows). Before the pool exists the graph and cache are
built for the cap.

On CPU the pool also has a size cap (``resize_kv_cache.cpu_max_cache_gb``, 4 GiB by default, as
vLLM's CPU backend reserves): RAM is shared with everything else on the machine, and a pool is
zero-filled when allocated.

Per-sequence state caches (SSM, conv, delta-rule states) are different: every running sequence
holds its whole state whatever its length, so a batch cap costs ``(cap + 1) * state_bytes``
up front. With state caches the cap is also bounded by the bytes left for them, and the cap
is chosen before they are allocated (``UNSIZED_STATE_BUDGET`` until ``resize_kv_cache``
measures the real budget), so a large model never allocates 257 states it cannot afford.
Prefix caching keeps copies of such states at page boundaries (``runtime.state_snapshots``,
``snapshot_capacity`` of them); ``resize_kv_cache`` takes them out of the same budget.
"""

from typing import Optional

from .interface import CachedSequenceInterface

MAX_BATCH_SIZE_CAP = 256
MIN_AUTO_BATCH_SIZE = 64
# What state caches may take before resize_kv_cache has measured the memory (and when it is off).
UNSIZED_STATE_BUDGET = 2**30
# State copies prefix caching keeps when the user sets no number (``prefix_state_snapshots``):
# enough for a few shared system prompts and their parting points, in at most the memory of 16
# running states.
DEFAULT_STATE_SNAPSHOTS = 16


def snapshot_capacity(setting: Optional[int], max_batch_size: int) -> int:
    """How many state copies prefix caching keeps: ``prefix_state_snapshots``, or unset
    ``min(DEFAULT_STATE_SNAPSHOTS, max_batch_size)`` (every rank of a group computes the same)."""
    return setting if setting is not None else min(DEFAULT_STATE_SNAPSHOTS, max_batch_size)


def batch_for_states(num_states: int, snapshots: Optional[int] = 0) -> int:
    """The most sequences whose states fit in ``num_states`` states: one slot each, the spare,
    and the prefix-caching copies ``snapshot_capacity(snapshots, batch)`` (at least 1)."""
    if snapshots is not None:
        return max(1, num_states - 1 - snapshots)
    if num_states - 1 - DEFAULT_STATE_SNAPSHOTS >= DEFAULT_STATE_SNAPSHOTS:
        return num_states - 1 - DEFAULT_STATE_SNAPSHOTS
    return max(1, (num_states - 1) // 2)  # as many copies as sequences


def auto_batch_size(cache: CachedSequenceInterface, state_budget: Optional[int] = None,
                    snapshots: Optional[int] = 0) -> int:
    """The batch cap for the pool ``cache`` holds now (see the module docstring); with state
    caches, at most what ``state_budget`` bytes hold (one slot per sequence, the spare, and the
    ``snapshots`` setting's copies)."""
    full_length = cache.allocatable_pages // max(1, cache.pages_per_sequence)
    size = max(MIN_AUTO_BATCH_SIZE, min(MAX_BATCH_SIZE_CAP, full_length))
    per_sequence = cache.state_bytes_per_sequence()
    if per_sequence and state_budget is not None:
        size = min(size, batch_for_states(state_budget // per_sequence, snapshots))
    return size
