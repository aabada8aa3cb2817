"""``insert_cached_cca_conv`` (cache_init): ZAYA's CCA convolutions get a per-sequence window.

Before (from the ``zaya_cca`` export patch)::

    qk = autodeploy.torch_cca_conv(x, dw_weight, dw_bias, g_weight, g_bias, groups)     # x [b, s, c]

After (the graph takes the flattened step, ``autodeploy.cache.sequence_info``)::

    qk = autodeploy.torch_cached_cca_conv(x, dw_weight, dw_bias, g_weight, g_bias, batch_info, seq_len,
                                          cu_seqlen, slot_idx, use_initial_state, cca_conv_state_0, groups)

``cca_conv_state_<i>`` is ``[num_slots, c, K]`` with ``K = (t0 - 1) + (t1 - 1)``, the last ``K``
inputs in the model's dtype (raw inputs, as HF's conv cache). The one-token delay of the values
is a width-2 ``torch_causal_conv1d``: ``insert_cached_causal_conv``'s.
"""

import torch
from torch import fx

from ...cache.resources import StateHandler
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._state_cache import StateOp, fake, insert_state_caches


def cca_conv_state(node: fx.Node, dtype: torch.dtype) -> StateHandler:
    """``[c, K]`` in x's dtype from the node's x ``[b, s, c]`` and the two kernels' widths."""
    x = fake(node, 0)
    window = (int(fake(node, 1).shape[-1]) - 1) + (int(fake(node, 3).shape[-1]) - 1)
    return StateHandler((int(x.shape[-1]), window), x.dtype)


class InsertCachedCcaConvConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True


@TransformRegistry.register("insert_cached_cca_conv")
class InsertCachedCcaConv(BaseTransform):
    config_class = InsertCachedCcaConvConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = torch.ops.autodeploy
        op = StateOp(ops.torch_cca_conv, ops.torch_cached_cca_conv.default, 5, "cca_conv_state", cca_conv_state)
        return insert_state_caches(gm, ctx, [op])
