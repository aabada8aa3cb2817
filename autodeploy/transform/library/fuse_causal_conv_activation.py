"""``fuse_causal_conv_activation`` (compile, before ``compile_model``): a SiLU applied to a causal
conv's output -> the conv's own ``activation='silu'``.

Before (a model that applies the activation after the conv op instead of passing it in)::

    y = autodeploy.torch_cached_causal_conv1d(x, w, bias, <step metadata>, conv_state, None)
    z = aten.silu(y)

After::

    z = autodeploy.torch_cached_causal_conv1d(x, w, bias, <step metadata>, conv_state, 'silu')

Same for the uncached ``torch_causal_conv1d(x, w, bias, None)`` (a graph in recompute mode). One
op fewer per layer per step, and the op applies the activation in the same pass.

Only when the conv's output is read by the silu alone (another reader needs the value before
the activation), when the conv has no activation yet, and when the conv computes in its input's
dtype: the op runs conv and activation in the weight's dtype and casts to the input's dtype at the
end, so with a weight of another dtype the fused activation would be rounded differently.
``gelu`` and other activations are left alone (the op has only ``silu``).

In transformers 5.23 every HF model already passes its activation into ``causal_conv1d_fn``
(Mamba, Mamba2, the Gated DeltaNet hybrids with ``'silu'``, LFM2 with none and no silu after it),
and the export patch carries it into the op, so on the real models this finds 0 matches; it is
for graphs written the other way (a hand-written conv followed by ``F.silu``, future models).
"""

from typing import Any, Optional, Tuple

import torch
from torch import fx

from ..graph_utils import get_attr_value, is_op, val
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten
ad = torch.ops.autodeploy

# op -> (index of the activation argument, index of the weight argument)
_CONVS = {
    ad.torch_causal_conv1d.default: (3, 1),
    ad.torch_cached_causal_conv1d.default: (9, 1),
}


class FuseCausalConvActivationConfig(TransformConfig):
    stage: Stage = Stage.COMPILE


def _dtype(gm: fx.GraphModule, node: Any) -> Optional[torch.dtype]:
    """The dtype of ``node``'s value (from shape propagation, or the weight itself), or None."""
    v = val(node)
    if v is None and isinstance(node, fx.Node) and node.op == "get_attr":
        v = get_attr_value(gm, node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _activation(conv: fx.Node, index: int) -> Tuple[Any, bool]:
    """(the conv's activation argument, whether it is passed positionally)."""
    if len(conv.args) > index:
        return conv.args[index], True
    return conv.kwargs.get("activation"), False


@TransformRegistry.register("fuse_causal_conv_activation")
class FuseCausalConvActivation(BaseTransform):
    config_class = FuseCausalConvActivationConfig
    run_after = ("cleanup_identity_dtype_cast",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        graph = gm.graph
        count = 0
        for silu in list(graph.nodes):
            if not is_op(silu, aten.silu.default) or len(silu.args) != 1 or silu.kwargs:
                continue
            conv = silu.args[0]
            if not isinstance(conv, fx.Node) or conv.op != "call_function" or conv.target not in _CONVS:
                continue
            if len(conv.users) != 1:
                continue
            act_index, weight_index = _CONVS[conv.target]
            activation, positional = _activation(conv, act_index)
            if activation is not None:
                continue
            x_dtype, w_dtype = _dtype(gm, conv.args[0]), _dtype(gm, conv.args[weight_index])
            if x_dtype is None or x_dtype != w_dtype:
                continue
            if positional:
                conv.args = (*conv.args[:act_index], "silu", *conv.args[act_index + 1:])
            elif len(conv.args) == act_index:
                conv.args = (*conv.args, "silu")
                conv.kwargs = {k: v for k, v in conv.kwargs.items() if k != "activation"}
            else:  # an earlier optional argument passed by keyword too
                conv.kwargs = {**conv.kwargs, "activation": "silu"}
            silu.replace_all_uses_with(conv)
            graph.erase_node(silu)
            count += 1
        # the conv's value is now the silu's (same shape and dtype): shapes stay valid
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
