"""``insert_cached_linear_attention`` (cache_init): decayed linear attention gets a per-sequence state.

Before (from the ``lightning_attention`` export patch: MiniMax-Text-01 / M1)::

    o = autodeploy.torch_linear_attention(q, k, v, g, scale)      # q/k [b, s, h, dk], v [b, s, h, dv], g [b, s, h]

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    o = autodeploy.torch_cached_linear_attention(q, k, v, g, batch_info, seq_len, cu_seqlen, slot_idx,
                                                 use_initial_state, linear_state_0, scale)

``linear_state_<i>`` is ``[num_slots, h, dk, dv]`` in fp32 (the running ``K^T V`` sum), one slot a
running sequence, the same size whatever the sequence length.
"""

import torch
from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, insert_state_caches
from .insert_cached_delta_rule import delta_state


class InsertCachedLinearAttentionConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_linear_attention")
class InsertCachedLinearAttention(BaseTransform):
    config_class = InsertCachedLinearAttentionConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        op = StateOp(ops.torch_linear_attention, ops.torch_cached_linear_attention.default, 4, "linear_state",
                     delta_state)
        return insert_state_caches(gm, ctx, [op])
