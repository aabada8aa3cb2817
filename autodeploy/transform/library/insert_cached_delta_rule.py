"""``insert_cached_delta_rule`` (cache_init): ``torch_delta_rule`` (DeltaNet, no decay gate) gets a
per-sequence recurrent state.

Before::

    o = autodeploy.torch_delta_rule(q, k, v, beta, scale, use_qk_l2norm)      # q/k [b, s, hk, dk], v [b, s, h, dv]

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    o = autodeploy.torch_cached_delta_rule(q, k, v, beta, batch_info, seq_len, cu_seqlen, slot_idx,
                                           use_initial_state, delta_state_0, scale, use_qk_l2norm)

``delta_state_<i>`` is ``[num_slots, h, dk, dv]`` in fp32 (the fast-weight matrix; a running sum).
The gated forms are ``insert_cached_gated_delta_rule``'s.
"""

import torch
from torch import fx

from ...cache.resources import StateHandler
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, fake, insert_state_caches


def delta_state(node: fx.Node, dtype: torch.dtype) -> StateHandler:
    """``[h, dk, dv]`` fp32 from the node's k ``[b, s, hk, dk]`` and v ``[b, s, h, dv]``."""
    dk = int(fake(node, 1).shape[-1])
    _, _, heads, dv = fake(node, 2).shape
    return StateHandler((int(heads), dk, int(dv)), torch.float32)


class InsertCachedDeltaRuleConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_delta_rule")
class InsertCachedDeltaRule(BaseTransform):
    config_class = InsertCachedDeltaRuleConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        op = StateOp(ops.torch_delta_rule, ops.torch_cached_delta_rule.default, 4, "delta_state", delta_state)
        return insert_state_caches(gm, ctx, [op])
