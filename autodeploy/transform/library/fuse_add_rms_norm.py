"""``fuse_add_rms_norm`` (post_load_fusion): residual add + RMSNorm -> one op with two outputs.

Before::

    s = aten.add(x, residual)
    y = autodeploy.torch_rmsnorm(s, w, eps)
    ... uses of s (the next residual add) and of y ...

After::

    y, s = autodeploy.torch_fused_add_rmsnorm(x, residual, w, eps)

Every other user of the sum takes the op's second output, so several users of the add or of
the norm stay correct. The fused op goes in right after the add, so a user of the sum placed
between the add and the norm (``scale * residual + sublayer(norm(residual))``, Doge's order)
still reads a value defined before it; the norm's weight, a ``get_attr``, is moved up with it (a
computed weight such as Gemma's ``1 + w`` is waited for instead). An add that is not normalised, an add with ``alpha``, or a norm of
something other than an add is left alone.
"""

import operator

import torch
from torch import fx

from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten


class FuseAddRMSNormConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION


@TransformRegistry.register("fuse_add_rms_norm")
class FuseAddRMSNorm(BaseTransform):
    config_class = FuseAddRMSNormConfig
    run_after = ("match_rmsnorm_pattern",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        graph = gm.graph
        count = 0
        for norm in list(graph.nodes):
            if not is_op(norm, torch.ops.autodeploy.torch_rmsnorm):
                continue
            add = norm.args[0]
            if not is_op(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
                continue
            x, residual = add.args
            if not isinstance(x, fx.Node) or not isinstance(residual, fx.Node):
                continue
            anchor = _insertion_point(graph, add, norm)
            if anchor is None:
                continue
            with graph.inserting_before(anchor):
                fused = graph.call_function(
                    torch.ops.autodeploy.torch_fused_add_rmsnorm.default, (x, residual, norm.args[1], norm.args[2])
                )
                normed = graph.call_function(operator.getitem, (fused, 0))
                summed = graph.call_function(operator.getitem, (fused, 1))
            norm.replace_all_uses_with(normed)
            graph.erase_node(norm)
            add.replace_all_uses_with(summed)
            graph.erase_node(add)
            count += 1
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)


def _insertion_point(graph: fx.Graph, add: fx.Node, norm: fx.Node):
    """The node to insert the fused op before: right after the add or after the norm's computed
    weight (Gemma's ``1 + w``), whichever comes later; a weight that is a parameter read placed
    later is moved above the add instead. ``None`` (leave the pair alone) when a user of the sum
    comes before that point, so no single place has every input and precedes every user."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    anchor = add
    for arg in norm.args[1:]:
        if isinstance(arg, fx.Node) and position[arg] > position[add]:
            if arg.op == "get_attr":
                add.prepend(arg)
            elif position[arg] > position[anchor]:
                anchor = arg
    if any(user is not norm and position[user] <= position[anchor] for user in add.users):
        return None
    return anchor.next
