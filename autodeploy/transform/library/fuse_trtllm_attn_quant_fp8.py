"""``fuse_trtllm_attn_quant_fp8`` (post_load_fusion): the attention emits the FP8 input of the
projection after it.

Before (a ModelOpt FP8 layer after ``fuse_fp8_linear``'s dequantized backend)::

    a = autodeploy.torch_attention(q, k, v, ..., is_causal=True)          # [b, s, n, d]
    y = aten.view(a, [b, s, n * d])                                       # layout ops only
    yq = autodeploy.torch_quant_fp8_activation(y, P.o_proj.input_scale)   # e4m3(y / s) * s
    o = aten.linear(yq, P.o_proj.weight)

After::

    a = autodeploy.torch_attention(q, k, v, ..., is_causal=True, out_scale=P.o_proj.input_scale)
    y = aten.view(a, [b, s, n * d])
    o = aten.linear(y, P.o_proj.weight)

``insert_cached_attention`` carries ``out_scale`` into the cached op, which rounds its output the
same way before returning it, so every attention backend honours it. The rounding is element-wise
and the ops between are layout ops, so rounding before them gives the same numbers, bit for bit.

Why: TensorRT-LLM's attention kernels write FP8 directly when an FP8 projection follows, which
halves the output's traffic and drops the separate quantization kernel. On the CPU no kernel
writes FP8, so the same rounding happens inside the attention op instead of as an op of its own:
one op dispatch fewer per layer and step, no speed change to speak of; the op takes the scale so
a GPU backend that does write FP8 needs nothing else from the graph.

Near misses, left alone: an attention output (or a layout value after it) with another reader
(it would see rounded values), an activation quantization that is not static FP8 (NVFP4,
fine-grained FP8's dynamic groups: their scales are not one number the op can take), an
attention that already has an ``out_scale``, and MLA (``torch_mla``: its cached ops take no
output scale).
"""

from typing import Optional

import torch
from torch import fx

from ...ops.quant import activation  # noqa: F401  (registers torch_quant_fp8_activation)
from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

ad = torch.ops.autodeploy
aten = torch.ops.aten

_LAYOUT = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
           aten.contiguous.default, aten.clone.default)


class FuseAttnQuantFP8Config(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION


def _quantization_after(attn: fx.Node) -> Optional[fx.Node]:
    """The static FP8 quantization ``attn``'s output reaches through single-reader layout ops, as
    that op's only reader, else None."""
    node = attn
    while len(node.users) == 1:
        (user,) = node.users
        if is_op(user, ad.torch_quant_fp8_activation) and user.args[0] is node:
            return user
        if user.op != "call_function" or user.target not in _LAYOUT or user.args[0] is not node:
            return None
        node = user
    return None


@TransformRegistry.register("fuse_trtllm_attn_quant_fp8")
class FuseTrtllmAttnQuantFP8(BaseTransform):
    config_class = FuseAttnQuantFP8Config
    # the activation ops exist only after fuse_fp8_linear
    run_after = ("fuse_fp8_linear",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        graph = gm.graph
        count = 0
        for attn in list(graph.nodes):
            if not is_op(attn, ad.torch_attention) or arg(attn, 12, "out_scale") is not None:
                continue
            quant = _quantization_after(attn)
            if quant is None:
                continue
            scale = arg(quant, 1, "input_scale")
            if not isinstance(scale, fx.Node) or scale.op != "get_attr":
                continue  # a computed scale: it may not exist where the attention runs
            with graph.inserting_before(attn):
                moved = graph.get_attr(str(scale.target))
            attn.kwargs = {**attn.kwargs, "out_scale": moved}
            quant.replace_all_uses_with(quant.args[0])
            graph.erase_node(quant)
            if not scale.users:
                graph.erase_node(scale)
            count += 1
        if count:
            graph.lint()
            gm.recompile()
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
