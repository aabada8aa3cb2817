"""``fuse_swiglu`` (post_load_fusion): gate and up weights of a SwiGLU concatenated once.

Before::

    y = autodeploy.torch_swiglu_mlp(x, w_gate, w_up, w_down)

After::

    y = autodeploy.torch_fused_swiglu_mlp(x, cat([w_gate, w_up]), w_down)   # one GEMM for gate+up

The concatenation happens at load time, one MLP at a time, and the separate weights are freed
(peak memory: the model plus one gate/up pair).
"""

import torch
from torch import fx

from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._gemm_fusion import FusedNames, _concat_params, release_unused


class FuseSwigluConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True


def _is_param(node) -> bool:
    return node is None or (isinstance(node, fx.Node) and node.op == "get_attr")


@TransformRegistry.register("fuse_swiglu")
class FuseSwiglu(BaseTransform):
    config_class = FuseSwigluConfig
    requires = ("load_weights",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        graph = gm.graph
        count = 0
        made: FusedNames = {}  # an MLP applied twice shares one concatenated weight
        for node in list(graph.nodes):
            if not is_op(node, torch.ops.autodeploy.torch_swiglu_mlp):
                continue
            x, gate_w, up_w, down_w = node.args[:4]
            gate_b, up_b, down_b = (arg(node, i, n) for i, n in ((4, "gate_bias"), (5, "up_bias"), (6, "down_bias")))
            if not all(_is_param(n) for n in (gate_w, up_w, gate_b, up_b)) or (gate_b is None) != (up_b is None):
                continue
            w_name = _concat_params(gm, [gate_w, up_w], made)
            b_name = _concat_params(gm, [gate_b, up_b], made) if gate_b is not None else None
            with graph.inserting_before(node):
                w = graph.get_attr(w_name)
                b = graph.get_attr(b_name) if b_name else None
                fused = graph.call_function(torch.ops.autodeploy.torch_fused_swiglu_mlp.default, (x, w, down_w, b, down_b))
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            release_unused(gm, [gate_w, up_w, gate_b, up_b])
            count += 1
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
