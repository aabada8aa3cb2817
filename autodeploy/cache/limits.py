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
"""

from .interface import CachedSequenceInterface

MAX_BATCH_SIZE_CAP = 256
MIN_AUTO_BATCH_SIZE = 64


def auto_batch_size(cache: CachedSequenceInterface) -> int:
    """The batch cap for the pool ``cache`` holds now (see the module docstring)."""
    full_length = cache.allocatable_pages // max(1, cache.pages_per_sequence)
    return max(MIN_AUTO_BATCH_SIZE, min(MAX_BATCH_SIZE_CAP, full_length))
