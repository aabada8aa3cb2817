"""``insert_cached_gated_delta_rule`` (cache_init): the gated delta rules get a per-sequence state.

Before (from the ``state_kernels`` export patch)::

    o = autodeploy.torch_gated_delta_rule(q, k, v, g, beta, scale, use_qk_l2norm)        # g [b, s, h]: Qwen3-Next,
                                                                                          # Qwen3.5, OLMo-Hybrid
    o = autodeploy.torch_gated_delta_rule_channelwise(q, k, v, g, beta, scale, use_qk_l2norm)  # g [b, s, h, dk]: Kimi

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    o = autodeploy.torch_cached_gated_delta_rule(q, k, v, g, beta, batch_info, seq_len, cu_seqlen, slot_idx,
                                                 use_initial_state, delta_state_0, scale, use_qk_l2norm)
    o = autodeploy.torch_cached_gated_delta_rule_channelwise(..., delta_state_1, scale, use_qk_l2norm)

``delta_state_<i>`` is ``[num_slots, h, dk, dv]`` in fp32, as for ``insert_cached_delta_rule``.
"""

import torch
from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, insert_state_caches
from .insert_cached_delta_rule import delta_state


class InsertCachedGatedDeltaRuleConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_gated_delta_rule")
class InsertCachedGatedDeltaRule(BaseTransform):
    config_class = InsertCachedGatedDeltaRuleConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv", "insert_cached_delta_rule")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        return insert_state_caches(gm, ctx, [
            StateOp(ops.torch_gated_delta_rule, ops.torch_cached_gated_delta_rule.default, 5, "delta_state",
                    delta_state),
            StateOp(ops.torch_gated_delta_rule_channelwise, ops.torch_cached_gated_delta_rule_channelwise.default,
                    5, "delta_state", delta_state),
        ])
