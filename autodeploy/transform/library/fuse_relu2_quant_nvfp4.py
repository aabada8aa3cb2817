"""``fuse_relu2_quant_nvfp4`` (post_load_fusion): squared ReLU emits the NVFP4 input of the down projection.

Before (a ModelOpt NVFP4 Nemotron MLP after ``fuse_nvfp4_linear``; transformers' ``relu2``
activation exports as ``relu`` then ``square``)::

    u = aten.linear(xq, P.up_proj.weight)
    r = aten.relu(u)
    a = aten.square(r)                       # also matched: aten.pow(r, 2), aten.mul(r, r)
    aq = autodeploy.torch_quant_nvfp4_activation(a, P.down_proj.input_scale)
    y = aten.linear(aq, P.down_proj.weight)

After::

    aq = autodeploy.torch_relu2_quant_nvfp4(u, P.down_proj.input_scale)
    y = aten.linear(aq, P.down_proj.weight)

Matches only when the ReLU's one user is the square and every user of the square is an NVFP4
activation quantization with an equal ``input_scale`` value; a squared ReLU read by anything
else (or a ReLU used elsewhere) is left alone. FP8 checkpoints keep their separate ops (no
fused FP8 twin is in the catalogue).

Why: on a GPU (Blackwell) the activation kernel writes e2m1 values and block scales straight
from the up projection's output, never storing the squared activation in 16 bits. On the CPU
the op runs the same elementwise steps (the same functions as the unfused graph, so the result
is identical) and saves only two op dispatches and one intermediate tensor, next to NVFP4's
emulated rounding: measured at the ``small`` preset's MLP width (2048; 2-core AMD EPYC, one
thread, interleaved rounds, medians) 221 -> 219 us at one row, 389 -> 387 us at 8 rows, within
noise at 32 and 512. It is kept on because it costs nothing and is the form a GPU kernel needs.
"""

from typing import Optional

import torch
from torch import fx

from ...ops.quant import fused  # noqa: F401  (registers the fused ops)
from ...utils.logging import get_logger
from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_norm_fusion import retire_quant_users, scale_before, shared_quant_scale

logger = get_logger(__name__)
aten = torch.ops.aten
ad = torch.ops.autodeploy


def _squared_relu_input(node: fx.Node) -> Optional[fx.Node]:
    """``x`` when ``node`` computes ``relu(x) ** 2`` and the ReLU has no other user; else None."""
    if is_op(node, aten.square.default):
        relu = node.args[0]
    elif is_op(node, aten.pow.Tensor_Scalar) and node.args[1] == 2:
        relu = node.args[0]
    elif is_op(node, aten.mul.Tensor) and node.args[0] is node.args[1]:
        relu = node.args[0]
    else:
        return None
    if not is_op(relu, aten.relu.default) or len(relu.users) != 1 or node.kwargs:
        return None
    return relu.args[0]


def fuse_relu2_quant(gm: fx.GraphModule) -> int:
    """Replace every matching ``quant(square(relu(x)))`` (see the module docstring); returns the count."""
    count = 0
    for square in list(gm.graph.nodes):
        x = _squared_relu_input(square)
        found = shared_quant_scale(gm, square, ad.torch_quant_nvfp4_activation) if x is not None else None
        if found is None:
            continue
        users, scale = found
        scale_node = scale_before(gm, scale, square)
        with gm.graph.inserting_before(square):
            fused_node = gm.graph.call_function(ad.torch_relu2_quant_nvfp4.default, (x, scale_node))
        fused_node.meta["val"] = users[0].meta.get("val")
        relu = square.args[0]
        retire_quant_users(gm, users, fused_node)
        gm.graph.erase_node(square)
        gm.graph.erase_node(relu)
        count += 1
    if count:
        logger.info("fuse_relu2_quant_nvfp4: %d squared ReLUs emit NVFP4 directly", count)
        gm.graph.lint()
    return count


class FuseRelu2QuantNVFP4Config(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION


@TransformRegistry.register("fuse_relu2_quant_nvfp4")
class FuseRelu2QuantNVFP4(BaseTransform):
    config_class = FuseRelu2QuantNVFP4Config
    run_after = ("fuse_nvfp4_linear",)  # the activation ops it folds in exist only after it

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_relu2_quant(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
