"""``insert_cached_diagonal_recurrence`` (cache_init): the diagonal linear recurrence (RecurrentGemma's
RG-LRU scan) gets a per-sequence state.

Before (from the ``rg_lru`` export patch)::

    h = autodeploy.torch_diagonal_recurrence(x, a)          # x, a [b, s, w]: h_t = a_t h_{t-1} + x_t

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    h = autodeploy.torch_cached_diagonal_recurrence(x, a, batch_info, seq_len, cu_seqlen, slot_idx,
                                                    use_initial_state, recurrence_state_0)

``recurrence_state_<i>`` is ``[num_slots, w]`` in fp32 (HF keeps ``recurrent_states`` in fp32 too).
The block's short convolution is ``insert_cached_causal_conv``'s.
"""

import torch
from torch import fx

from ...cache.resources import StateHandler
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, fake, insert_state_caches


def recurrence_state(node: fx.Node, dtype: torch.dtype) -> StateHandler:
    """``[w]`` fp32 from the node's x ``[b, s, w]``."""
    return StateHandler((int(fake(node, 0).shape[-1]),), torch.float32)


class InsertCachedDiagonalRecurrenceConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_diagonal_recurrence")
class InsertCachedDiagonalRecurrence(BaseTransform):
    config_class = InsertCachedDiagonalRecurrenceConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        op = StateOp(ops.torch_diagonal_recurrence, ops.torch_cached_diagonal_recurrence.default, 2,
                     "recurrence_state", recurrence_state)
        return insert_state_caches(gm, ctx, [op])
