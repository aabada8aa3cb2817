"""``match_linear_simple`` (pattern_matcher): ``aten.linear`` -> ``torch_linear_simple``.

Before::

    y = aten.linear(x, w, b)

After::

    y = autodeploy.torch_linear_simple(x, w, b)

Off by default: export IR already spells every plain linear as ``aten.linear``, which backends
and ``torch.compile`` understand. Turn it on when a later pass (sharding, quantisation, a
custom backend) wants all linears behind one opaque op. Linears whose weight is computed in
the graph rather than a parameter are left alone (they are not weights a pass can rewrite).
"""

import torch
from torch import fx

from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten


class MatchLinearSimpleConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("match_linear_simple")
class MatchLinearSimple(BaseTransform):
    config_class = MatchLinearSimpleConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = 0
        for node in list(gm.graph.nodes):
            if not is_op(node, aten.linear) or not isinstance(node.args[1], fx.Node):
                continue
            if node.args[1].op != "get_attr":
                continue
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(
                    torch.ops.autodeploy.torch_linear_simple.default, (node.args[0], node.args[1], bias)
                )
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            count += 1
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
