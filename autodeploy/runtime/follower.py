"""The ranks other than 0: receive a step, run the graph, repeat, until rank 0 says stop.

A follower has no scheduler, sampler or tokenizer: rank 0 decides every step
(``step_broadcast``), and the follower only feeds the step's inputs and its own cache shard to
its shard of the graph, which meets the other ranks in the graph's all-reduces. The logits it
computes are dropped (rank 0 samples from its own, which are the same). With prefix caching of a
model with state caches it also repeats rank 0's state copies on its own shard
(``StateReplica``) before each step.
"""

import time
from typing import Callable, Optional

import torch

from ..cache.interface import CachedSequenceInterface
from ..utils.logging import get_logger
from ..distributed import process_group
from .state_snapshots import PAGE, StateReplica
from .step_broadcast import StepReceiver

logger = get_logger(__name__)


@torch.inference_mode()
def follow(model: Callable[..., object], cache: CachedSequenceInterface,
           replica: Optional[StateReplica] = None) -> int:
    """Run every step rank 0 sends until it sends stop; returns the number of steps run. Raises
    ``RankFailure`` when rank 0 (or another rank) is gone or hung for longer than the group's
    timeout. ``replica``: where rank 0's state copies go (None: this rank expects none)."""
    receiver = StepReceiver(cache.device)
    rank = process_group.rank()
    logger.info("rank %d follows rank 0", rank)
    steps, start = 0, time.monotonic()
    while True:
        step = receiver.receive()
        if step is None:
            break
        pages = [c for c in step.copies if c.kind == PAGE]  # tail pages: this rank's shard of each
        if pages:
            cache.copy_pages([c.row for c in pages], [c.slot for c in pages])
        states = [c for c in step.copies if c.kind != PAGE]
        if states:
            if replica is None:
                raise RuntimeError("rank 0 sent state copies but this rank keeps no state snapshots: give every rank "
                                   "the same enable_prefix_caching and prefix_state_snapshots")
            replica.apply(states)
        model(*cache.graph_args(step.info))
        steps += 1
    logger.info("rank %d: rank 0 said stop after %d steps (%.1f s)", rank, steps, time.monotonic() - start)
    return steps
