"""``insert_cached_mlstm`` (cache_init): xLSTM's mLSTM gets a per-sequence state.

Before (the lean custom xLSTM model emits it)::

    h = autodeploy.torch_mlstm(q, k, v, i, f, eps)        # q/k [b, s, nh, dqk], v [b, s, nh, dv], i/f [b, s, nh]

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    h = autodeploy.torch_cached_mlstm(q, k, v, i, f, batch_info, seq_len, cu_seqlen, slot_idx,
                                      use_initial_state, mlstm_state_0, eps)

``mlstm_state_<i>`` is ``[num_slots, nh, dqk + 1, dv + 1]`` in fp32: the matrix memory ``C`` with the
normaliser ``n`` as an extra column and the stabiliser ``m`` in the corner (``autodeploy.ops.mlstm``).
"""

import torch
from torch import fx

from ...cache.resources import StateHandler
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, fake, insert_state_caches


def mlstm_state(node: fx.Node, dtype: torch.dtype) -> StateHandler:
    """``[nh, dqk + 1, dv + 1]`` fp32 from the node's q ``[b, s, nh, dqk]`` and v ``[b, s, nh, dv]``."""
    _, _, heads, dqk = fake(node, 0).shape
    return StateHandler((int(heads), int(dqk) + 1, int(fake(node, 2).shape[-1]) + 1), torch.float32)


class InsertCachedMlstmConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_mlstm")
class InsertCachedMlstm(BaseTransform):
    config_class = InsertCachedMlstmConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        op = StateOp(ops.torch_mlstm, ops.torch_cached_mlstm.default, 5, "mlstm_state", mlstm_state)
        return insert_state_caches(gm, ctx, [op])
