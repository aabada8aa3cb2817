"""``match_sdpa_attention`` (pattern_matcher): ``aten.scaled_dot_product_attention`` -> ``torch_attention``.

Before (bnsd, HF's sdpa route)::

    m = autodeploy.torch_causal_mask(b, s, s, window, bool, dev)
    o = aten.scaled_dot_product_attention(q, k, v, m, scale=0.25)          # [b, n, s, d]
    y = transpose(o, 1, 2)

After (bsnd; the model's own transposes cancel)::

    y = autodeploy.torch_attention(q_bsnd, k_bsnd, v_bsnd, None, 0.0, True, 0.25, None, window, None)

Any other mask stays an explicit ``attn_mask``. SDPA with dropout (a training graph) is left
alone, as is anything not 4-D. ``is_causal`` of SDPA is top-left aligned and ours bottom-right;
they agree when query and key lengths are provably equal (always, in an exported graph without
cache), and only then is ``is_causal`` rewritten.
"""

import torch
from torch import fx

from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._attention_utils import all_rank4, emit_attention_bnsd, read_mask, same_seq_len

aten = torch.ops.aten


class MatchSdpaConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_sdpa_attention")
class MatchSdpaAttention(BaseTransform):
    config_class = MatchSdpaConfig
    run_after = ("cleanup_noop_slice", "cleanup_noop_view")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = 0
        for node in list(gm.graph.nodes):
            if not is_op(node, aten.scaled_dot_product_attention):
                continue
            q, k, v = node.args[:3]
            if arg(node, 4, "dropout_p", 0.0) != 0.0 or not all_rank4(q, k, v):
                continue
            mask, causal_from_mask, window = read_mask(arg(node, 3, "attn_mask"))
            is_causal = bool(arg(node, 5, "is_causal", False))
            if is_causal and mask is not None:
                continue  # SDPA rejects this combination; not ours to reinterpret
            if is_causal and not same_seq_len(q, k):
                continue  # SDPA's causal mask is top-left aligned, ours bottom-right
            emit_attention_bnsd(
                gm.graph, node, q, k, v,
                mask=mask, is_causal=is_causal or causal_from_mask, scale=node.kwargs.get("scale", arg(node, 6, "scale")),
                sliding_window=window,
            )
            gm.graph.erase_node(node)
            count += 1
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
