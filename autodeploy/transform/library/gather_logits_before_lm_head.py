"""``gather_logits_before_lm_head`` (cache_init): run the LM head only on the rows whose logits are used.

Before (``T`` tokens in the step, ``B`` sequences)::

    h = ...                                   # [1, T, hidden]
    logits = aten.linear(h, lm_head_w)        # [1, T, vocab]   (+ elementwise ops, e.g. soft-cap)
                                              # (or the oneDNN/BLAS linear select_linear_backend chose)

After::

    idx = _to_copy(logits_index, long)        # step metadata: each sequence's last token
    logits = aten.linear(aten.index_select(h, 1, idx), lm_head_w)   # [1, R, vocab]

A 512-token prefill then computes one row of the 32000-wide head instead of 512. The graph's
output becomes one row per entry of ``logits_index`` (``cache.gathered_logits``): the last
token of each sequence, plus every prompt token of a request that asked for its prompt's
log-probabilities (``SamplingParams.prompt_logprobs``) - so scoring a prompt costs the head
only for that request, not for the others in the step. It needs the step metadata, so it runs
after ``insert_cached_attention`` (DESIGN lists it under post_load_fusion, where that metadata
does not exist yet).
"""

from typing import Optional

import torch
from torch import fx

from ...ops.linear import linear_forms
from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten
# Ops between the LM head and the output that act on each token independently.
TOKENWISE = (aten.mul, aten.div, aten.add, aten.sub, aten.tanh, aten.to, aten._to_copy)
# The linear forms the head may have by now (select_linear_backend runs before this).
LINEARS = linear_forms()


def find_lm_head(gm: fx.GraphModule) -> Optional[fx.Node]:
    """The linear that produces the graph's output, through token-wise ops only."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    node = output.args[0]
    while isinstance(node, fx.Node):
        if is_op(node, LINEARS):
            return node
        if not is_op(node, TOKENWISE) or len(node.users) != 1:
            return None
        tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
        if len(tensor_args) != 1:
            return None
        node = tensor_args[0]
    return None


class GatherLogitsConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT


@TransformRegistry.register("gather_logits_before_lm_head")
class GatherLogitsBeforeLMHead(BaseTransform):
    config_class = GatherLogitsConfig
    requires = ("insert_cached_attention",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        rows = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "logits_index"), None)
        head = find_lm_head(gm)
        if rows is None or head is None or ctx.cache is None:
            why = "no LM head feeds the output through token-wise ops" if head is None else "the graph is not cached"
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason=why)
        graph = gm.graph
        hidden = head.args[0]
        with graph.inserting_before(head):
            idx = graph.call_function(aten._to_copy.default, (rows,), {"dtype": torch.long})
            gathered = graph.call_function(aten.index_select.default, (hidden, 1, idx))
        head.replace_input_with(hidden, gathered)
        ctx.cache.gathered_logits = True
        return TransformInfo(num_matches=1, is_clean=False, has_valid_shapes=False)
