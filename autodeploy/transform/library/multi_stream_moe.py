"""``multi_stream_moe`` (compile, before ``compile_model``; off by default): a MoE layer's shared
expert runs on the aux CUDA stream while the routed experts run on the main one.

Before (DeepSeek-V3 / Qwen2-MoE style: a dense MLP on the same tokens as the routed experts)::

    logits = aten.linear(x, W_router) ... topk ...            # router
    r = autodeploy.grouped_moe_fused(x, sel, w, ...)          # routed experts
    s = autodeploy.torch_fused_swiglu_mlp(x, W_gu, W_d)       # shared expert (+ its sigmoid gate)
    y = aten.add(r, s)

After::

    autodeploy.fork_to_aux([x])
    s = autodeploy.torch_fused_swiglu_mlp(x, W_gu, W_d)       # aux stream
    autodeploy.end_aux([s])
    logits = ... ; r = autodeploy.grouped_moe_fused(x, ...)   # main stream, concurrently
    autodeploy.join_from_aux([s])
    y = aten.add(r, s)

The shared expert is found from the MoE op's output: it is followed (through views) by an add,
and the add's other operand is computed by a branch nothing else reads (``exclusive_branch``:
the shared MLP in any form — fused SwiGLU op, linears — with its gate if it has one). A router
linear shared with the shared expert's gate (``fuse_gemms`` concatenates the two) stays on the
main stream and is the branch's input. Layers without a shared expert (Mixtral, Qwen3-MoE) find
nothing. On a non-CUDA device and for the retracing compile backends it is a documented no-op
(``_multi_stream.skip_reason``).
"""

from typing import List, Optional, Tuple

import torch
from torch import fx

from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, TransformInfo, TransformRegistry
from ._multi_stream import MultiStreamConfig, exclusive_branch, insert_aux_region, launches_kernel, skip_reason

aten = torch.ops.aten
_VIEWS = (aten.view, aten.reshape, aten._unsafe_view)
_ADDS = (aten.add.Tensor,)


class MultiStreamMoeConfig(MultiStreamConfig):
    pass


def moe_ops() -> Tuple[object, ...]:
    """The routed-experts ops, in every form the pipeline leaves them."""
    ad = torch.ops.autodeploy
    names = ("torch_moe", "torch_moe_fused", "grouped_moe_fused", "onednn_grouped_moe_fused",
             "torch_quant_mxfp4_moe_fused", "torch_quant_fp8_moe", "torch_quant_finegrained_fp8_moe",
             "torch_quant_nvfp4_moe", "torch_quant_fp8_moe_stacked", "torch_quant_finegrained_fp8_moe_stacked",
             "torch_quant_nvfp4_moe_stacked", "grouped_quant_moe_fused", "scaled_grouped_mm_fp8_moe")
    return tuple(getattr(ad, n).default for n in names if hasattr(ad, n))


def _merge(moe: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """(the add that merges the routed output with another value, that other operand)."""
    cur = moe
    while len(cur.users) == 1 and is_op(next(iter(cur.users)), _VIEWS):
        cur = next(iter(cur.users))
    if len(cur.users) != 1:
        return None
    add = next(iter(cur.users))
    if not is_op(add, _ADDS) or len(add.args) < 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    a, b = add.args[0], add.args[1]
    other = b if a is cur else a if b is cur else None
    return (add, other) if isinstance(other, fx.Node) and other is not cur else None


def _token_inputs(moe: fx.Node) -> List[fx.Node]:
    """The MoE's hidden-state input and what it is a view of (the shared expert reads one of them)."""
    chain = [moe.args[0]]
    while is_op(chain[-1], _VIEWS):
        chain.append(chain[-1].args[0])
    return chain


def find_moe_shared_experts(gm: fx.GraphModule) -> List[Tuple[fx.Node, List[fx.Node]]]:
    """``(moe op, shared-expert branch)`` for every routed MoE whose output is added to a shared
    expert computed from the same tokens; the branch in graph order."""
    found = []
    for moe in [n for n in gm.graph.nodes if is_op(n, moe_ops())]:
        merged = _merge(moe)
        if merged is None:
            continue
        add, other = merged
        tokens = _token_inputs(moe)
        branch = exclusive_branch([other], add, stop=tokens + [moe])
        inputs = {i for n in branch for i in n.all_input_nodes if i not in branch}
        upstream = set()
        todo = list(branch)
        while todo:  # the branch must not read the routed experts' result
            node = todo.pop()
            for inp in node.all_input_nodes:
                if inp not in upstream:
                    upstream.add(inp)
                    todo.append(inp)
        if moe in upstream or not (inputs & set(tokens)):
            continue
        if any(launches_kernel(n) for n in branch):
            found.append((moe, branch))
    return found


@TransformRegistry.register("multi_stream_moe")
class MultiStreamMoe(BaseTransform):
    config_class = MultiStreamMoeConfig
    run_after = ("cleanup_identity_dtype_cast", "fuse_causal_conv_activation")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        reason = skip_reason(ctx, gm)
        if reason is not None:
            return TransformInfo(skipped=True, reason=reason, is_clean=True, has_valid_shapes=True)
        count = sum(insert_aux_region(gm, branch) for _, branch in find_moe_shared_experts(gm))
        if count:
            gm.graph.lint()
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
