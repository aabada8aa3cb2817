"""``fuse_silu_mul`` (post_load_fusion): gated activation on a fused gate/up GEMM -> one op.

Before (after ``fuse_gemms`` fused gate/up, or a model with a fused gate_up weight such as Phi-3)::

    gu = aten.linear(x, w_gate_up)
    g = narrow(gu, -1, 0, d)  (or split/chunk/slice);  u = narrow(gu, -1, d, d)
    y = mul(silu(g), u)

After::

    y = autodeploy.torch_silu_and_mul(gu)

Only exact halves with the gate first match; ``silu(u) * g`` (gate second) or uneven splits are
left alone.
"""

import operator
from typing import Any, Optional, Tuple

import torch
from torch import fx

from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten
INT64_MAX = 2**63 - 1


def half_of(node: Any) -> Optional[Tuple[fx.Node, int]]:
    """``(source, 0 | 1)`` if ``node`` is the first or second half of ``source``'s last dim."""
    if not isinstance(node, fx.Node):
        return None
    if is_op(node, operator.getitem) and is_op(node.args[0], (aten.split_with_sizes, aten.split.Tensor, aten.chunk)):
        split, index = node.args[0], node.args[1]
        src = split.args[0]
        size = src.meta["val"].shape[-1]
        dim = arg(split, 2, "dim", 0) if not is_op(split, aten.chunk) else arg(split, 2, "dim", 0)
        if dim % src.meta["val"].dim() != src.meta["val"].dim() - 1:
            return None
        if is_op(split, aten.split_with_sizes):
            ok = list(split.args[1]) == [size // 2, size // 2]
        elif is_op(split, aten.chunk):
            ok = split.args[1] == 2
        else:
            ok = split.args[1] == size // 2
        return (src, index) if ok and index in (0, 1) and size % 2 == 0 else None
    if is_op(node, (aten.narrow, aten.slice.Tensor)):
        src = node.args[0]
        v = src.meta.get("val")
        if v is None or arg(node, 1, "dim", 0) % v.dim() != v.dim() - 1 or v.shape[-1] % 2:
            return None
        half = v.shape[-1] // 2
        if is_op(node, aten.narrow):
            start, length = node.args[2], node.args[3]
            end = start + length
        else:
            start, end = arg(node, 2, "start", 0) or 0, arg(node, 3, "end", INT64_MAX)
            if arg(node, 4, "step", 1) != 1:
                return None
            end = min(end, v.shape[-1])
        if (start, end) == (0, half):
            return src, 0
        if (start, end) == (half, v.shape[-1]):
            return src, 1
    return None


class FuseSiluMulConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    requires_shape_prop: bool = True


@TransformRegistry.register("fuse_silu_mul")
class FuseSiluMul(BaseTransform):
    config_class = FuseSiluMulConfig
    run_after = ("fuse_gemms", "fuse_gemms_mixed_children", "fuse_fp8_gemms", "fuse_fp4_gemms")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        graph = gm.graph
        count = 0
        for node in list(graph.nodes):
            if not is_op(node, aten.mul) or len(node.args) != 2:
                continue
            for gate_side, up_side in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
                if not is_op(gate_side, aten.silu) or len(gate_side.users) != 1:
                    continue
                g, u = half_of(gate_side.args[0]), half_of(up_side)
                if g is None or u is None or g[0] is not u[0] or (g[1], u[1]) != (0, 1):
                    continue
                with graph.inserting_before(node):
                    fused = graph.call_function(torch.ops.autodeploy.torch_silu_and_mul.default, (g[0],))
                node.replace_all_uses_with(fused)
                graph.erase_node(node)
                count += 1
                break
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
