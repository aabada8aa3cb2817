"""``insert_cached_wkv`` (cache_init): RWKV-4's WKV recurrence gets a per-sequence state.

Before (from the ``rwkv`` export patch)::

    wkv = autodeploy.torch_wkv(time_decay, time_first, k, v)          # k, v [b, s, c]

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    wkv = autodeploy.torch_cached_wkv(time_decay, time_first, k, v, batch_info, seq_len, cu_seqlen,
                                      slot_idx, use_initial_state, wkv_state_0)

``wkv_state_<i>`` is ``[num_slots, 3, c]`` in fp32 (numerator, denominator, exponent; zeros are
the empty state). The blocks' token shifts are width-2 causal convs: ``insert_cached_causal_conv``'s.
"""

import torch
from torch import fx

from ...cache.resources import StateHandler
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, fake, insert_state_caches


def wkv_state(node: fx.Node, dtype: torch.dtype) -> StateHandler:
    """``[3, c]`` fp32 from the node's k ``[b, s, c]``."""
    return StateHandler((3, int(fake(node, 2).shape[-1])), torch.float32)


class InsertCachedWkvConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_wkv")
class InsertCachedWkv(BaseTransform):
    config_class = InsertCachedWkvConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        op = StateOp(ops.torch_wkv, ops.torch_cached_wkv.default, 4, "wkv_state", wkv_state)
        return insert_state_caches(gm, ctx, [op])
