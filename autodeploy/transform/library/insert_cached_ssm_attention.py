"""``insert_cached_ssm_attention`` (cache_init): the selective scans get a per-sequence SSM state.

Before (per Mamba mixer, from the ``state_kernels`` export patch)::

    y = autodeploy.torch_ssm(x, dt, A, B, C, D, dt_bias, time_step_limit)      # Mamba2: x [b, s, h, p]
    y = autodeploy.torch_ssm_mamba1(x, dt, A, B, C, D, dt_bias)                # Mamba1: x [b, s, c]

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    y = autodeploy.torch_cached_ssm(x, dt, A, B, C, D, dt_bias, batch_info, seq_len, cu_seqlen, slot_idx,
                                    use_initial_state, ssm_state_0, time_step_limit)
    y = autodeploy.torch_cached_ssm_mamba1(x, dt, A, B, C, D, dt_bias, batch_info, seq_len, cu_seqlen,
                                           slot_idx, use_initial_state, ssm_state_1)

``ssm_state_<i>`` is ``[num_slots, heads, head_dim, state]`` (Mamba2) or ``[num_slots, channels,
state]`` (Mamba1), always fp32: it is a running sum over the whole sequence (as HF keeps it).
The seed's key is kept: in AutoDeploy the scan is "SSM attention".
"""

import torch
from torch import fx

from ...cache.resources import StateHandler
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, fake, insert_state_caches


def _mamba2_state(node: fx.Node, dtype: torch.dtype) -> StateHandler:
    _, _, heads, head_dim = fake(node, 0).shape
    return StateHandler((int(heads), int(head_dim), int(fake(node, 3).shape[-1])), torch.float32)


def _mamba1_state(node: fx.Node, dtype: torch.dtype) -> StateHandler:
    channels, state = fake(node, 2).shape  # A [c, n]
    return StateHandler((int(channels), int(state)), torch.float32)


class InsertCachedSSMAttentionConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_ssm_attention")
class InsertCachedSSMAttention(BaseTransform):
    config_class = InsertCachedSSMAttentionConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        return insert_state_caches(gm, ctx, [
            StateOp(ops.torch_ssm, ops.torch_cached_ssm.default, 7, "ssm_state", _mamba2_state),
            StateOp(ops.torch_ssm_mamba1, ops.torch_cached_ssm_mamba1.default, 7, "ssm_state", _mamba1_state),
        ])
