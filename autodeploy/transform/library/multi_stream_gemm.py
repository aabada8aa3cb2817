"""``multi_stream_gemm`` (compile, before ``compile_model``; off by default): independent GEMMs that
read the same input run on two CUDA streams.

``fuse_gemms`` already turns most linears sharing an input into one GEMM; what it leaves are
linears it cannot concatenate (different weight dtypes or formats, bias on one and not the other,
a quantized linear next to a float one). Before::

    a = aten.linear(x, W_big)            # main stream
    b = aten.linear(x, W_small)          # waits for a: same stream

After (the largest GEMM by weight size stays on the main stream, the others go to the aux one)::

    autodeploy.fork_to_aux([x])
    b = aten.linear(x, W_small)          # aux stream
    autodeploy.end_aux([b])
    a = aten.linear(x, W_big)            # main stream, concurrently with b
    autodeploy.join_from_aux([b])
    ... readers of a and b ...

A GEMM that reads another GEMM of the group (``linear(x, w, bias=linear(x, v))``) is not
independent and is left out; chained GEMMs (``linear(linear(x))``) share no input. Every linear form
counts (``ops.linear.linear_forms``: ``aten.linear``, the backend linears, the quantized linears),
with the activation as first argument. Pays where the GEMMs are too small to fill the GPU alone
(decode); ``default.yaml`` keeps it off until measured there. On a non-CUDA device and for the
retracing compile backends it is a documented no-op (``_multi_stream.skip_reason``).
"""

from typing import List, Tuple

import torch
from torch import fx

from ...ops.linear import linear_forms
from ..graph_utils import get_attr_value, is_op, val
from ..interface import BaseTransform, PipelineContext, TransformInfo, TransformRegistry
from ._multi_stream import MultiStreamConfig, insert_aux_region, skip_reason


class MultiStreamGemmConfig(MultiStreamConfig):
    pass


def _weight_size(gm: fx.GraphModule, linear: fx.Node) -> int:
    weight = linear.args[1] if len(linear.args) > 1 else linear.kwargs.get("weight")
    value = None
    if isinstance(weight, fx.Node):
        value = get_attr_value(gm, weight) if weight.op == "get_attr" else val(weight)
    return value.numel() if isinstance(value, torch.Tensor) else 0


def _ancestors(node: fx.Node, stop: fx.Node) -> set:
    seen, todo = set(), [a for a in node.all_input_nodes if a is not stop]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(a for a in n.all_input_nodes if a is not stop)
    return seen


def find_shared_input_gemms(gm: fx.GraphModule) -> List[Tuple[fx.Node, List[fx.Node]]]:
    """``(x, linears)`` for every input ``x`` read (as the activation) by two or more linears that
    do not depend on each other; the linears in graph order."""
    forms = linear_forms()
    groups = []
    for x in gm.graph.nodes:
        linears = [u for u in x.users if is_op(u, forms) and u.args and u.args[0] is x]
        if len(linears) < 2:
            continue
        members = set(linears)
        independent = [lin for lin in linears if not (_ancestors(lin, x) & members)]
        if len(independent) >= 2:
            groups.append((x, independent))
    return groups


@TransformRegistry.register("multi_stream_gemm")
class MultiStreamGemm(BaseTransform):
    config_class = MultiStreamGemmConfig
    run_after = ("cleanup_identity_dtype_cast", "fuse_causal_conv_activation", "multi_stream_moe",
                 "multi_stream_mla_attn")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        reason = skip_reason(ctx, gm)
        if reason is not None:
            return TransformInfo(skipped=True, reason=reason, is_clean=True, has_valid_shapes=True)
        count = 0
        for _, linears in find_shared_input_gemms(gm):
            biggest = max(linears, key=lambda n: _weight_size(gm, n))
            aux = [n for n in linears if n is not biggest]
            count += insert_aux_region(gm, aux, main=[biggest])
        if count:
            gm.graph.lint()
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
