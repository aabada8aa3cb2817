"""``insert_cached_causal_conv`` (cache_init): ``torch_causal_conv1d`` -> ``torch_cached_causal_conv1d``.

Before (per conv; the Mamba mixers' and LFM2's short convolution, from the ``state_kernels``
export patch)::

    y = autodeploy.torch_causal_conv1d(x, weight, bias, activation)          # x [b, s, c]

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    graph(input_ids, position_ids, batch_info, ..., slot_idx, use_initial_state, ..., conv_state_0, ...)
    y = autodeploy.torch_cached_causal_conv1d(x, weight, bias, batch_info, seq_len, cu_seqlen, slot_idx,
                                              use_initial_state, conv_state_0, activation)

``conv_state_<i>`` is a per-sequence state cache ``[num_slots, c, k - 1]`` in the model's dtype:
the last ``k - 1`` inputs of each running sequence (raw inputs, nothing accumulates in them).
"""

import torch
from torch import fx

from ...cache.resources import StateHandler
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, fake, insert_state_caches


def _conv_state(node: fx.Node, dtype: torch.dtype) -> StateHandler:
    channels, kernel = int(fake(node, 1).shape[0]), int(fake(node, 1).shape[-1])
    return StateHandler((channels, kernel - 1), dtype)


class InsertCachedCausalConvConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_causal_conv")
class InsertCachedCausalConv(BaseTransform):
    config_class = InsertCachedCausalConvConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        conv = StateOp(ops.torch_causal_conv1d, ops.torch_cached_causal_conv1d.default, 3, "conv_state", _conv_state)
        return insert_state_caches(gm, ctx, [conv])
