"""``fuse_mxfp4_moe`` (post_load_fusion): how MXFP4 experts run - decoded once, or kept in MXFP4.

``quantize_mxfp4_moe_from_config`` leaves each MXFP4 MoE layer as
``torch_quant_mxfp4_moe_fused`` on its uint8 blocks and scales. With ``backend: decoded`` this
transform decodes them, once, after loading::

    y = autodeploy.torch_quant_mxfp4_moe_fused(x, sel, w, P.gate_up_blocks, P.gate_up_scales,
                                               P.down_blocks, P.down_scales, b_gu, b_d, act, alpha, limit)
  ->
    y = autodeploy.torch_moe_fused(x, sel, w, P.moe_gate_up_weight, P.moe_down_weight, b_gu, b_d, act, alpha, limit)
        # float [E, 2I, H] and [E, H, I] in the model's dtype; the blocks and scales are freed

and ``fuse_moe``, which runs next, makes it the grouped implementation a float checkpoint gets.
Decoding is exact (every MXFP4 value is representable in bf16 and fp32), so the numerics are
those of HF's ``Mxfp4Config(dequantize=True)`` model; layers are decoded one at a time, so the
peak is the model plus one layer's decoded experts. The cost is memory: 4 bytes per expert
weight in fp32, 7.5x MXFP4's 0.53.

``backend: mxfp4`` keeps the op (each active expert decoded when it runs: memory stays at
MXFP4's size, each step pays the decode). ``auto`` decodes when all decoded experts fit in half
of the device's free memory, else keeps MXFP4, and logs the sizes it compared.
"""

from typing import List, Literal

import torch
from pydantic import Field
from torch import fx, nn

from ...ops.quant.formats import dequantize_mxfp4
from ...utils.logging import get_logger
from ...utils.memory import free_memory_bytes
from ..graph_utils import get_attr_value, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._gemm_fusion import release_unused

ad = torch.ops.autodeploy
logger = get_logger(__name__)


class FuseMXFP4MoEConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # decoded experts replace their (7.5x smaller) MXFP4 blocks
    backend: Literal["auto", "decoded", "mxfp4"] = Field(
        default="auto",
        description="decoded: MXFP4 experts decoded once into the model dtype and run like a float checkpoint's "
        "(fastest; 4 bytes per weight in fp32); mxfp4: kept in MXFP4 (0.53 bytes per weight), each active expert "
        "decoded when it runs; auto: decoded when the decoded experts fit in half the free memory, else mxfp4.",
    )


def _decoded_bytes(gm: fx.GraphModule, nodes: List[fx.Node], dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for node in nodes:
        for blocks in (node.args[3], node.args[5]):
            total += get_attr_value(gm, blocks).numel() * 2 * size  # two values per byte
    return total


def _decode_layer(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> None:
    graph = gm.graph
    leaves = list(node.args[3:7])
    names = []
    for blocks, scales, leaf in ((node.args[3], node.args[4], "moe_gate_up_weight"),
                                 (node.args[5], node.args[6], "moe_down_weight")):
        with torch.no_grad():
            weight = dequantize_mxfp4(get_attr_value(gm, blocks), get_attr_value(gm, scales)).to(dtype)
        owner = str(blocks.target).rpartition(".")[0]
        gm.get_submodule(owner).register_parameter(leaf, nn.Parameter(weight, requires_grad=False))
        names.append(f"{owner}.{leaf}")
    with graph.inserting_before(node):
        weights = [graph.get_attr(n) for n in names]
        new = graph.call_function(ad.torch_moe_fused.default, (*node.args[:3], *weights, *node.args[7:]),
                                  dict(node.kwargs))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    release_unused(gm, leaves)


@TransformRegistry.register("fuse_mxfp4_moe")
class FuseMXFP4MoE(BaseTransform):
    config_class = FuseMXFP4MoEConfig
    requires = ("load_weights",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        nodes = [n for n in gm.graph.nodes if is_op(n, ad.torch_quant_mxfp4_moe_fused)]
        if not nodes:
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        x_val = nodes[0].args[0].meta.get("val")
        dtype = x_val.dtype if x_val is not None else torch.float32
        backend = self._backend(gm, ctx, nodes, dtype)
        if backend == "mxfp4":
            logger.info("fuse_mxfp4_moe: %d MoE layers keep their experts in MXFP4", len(nodes))
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        for node in nodes:
            _decode_layer(gm, node, dtype)
        gm.graph.lint()
        gm.recompile()
        logger.info("fuse_mxfp4_moe: %d MoE layers' experts decoded once into %s", len(nodes), dtype)
        return TransformInfo(num_matches=len(nodes), is_clean=False, has_valid_shapes=True)

    def _backend(self, gm: fx.GraphModule, ctx: PipelineContext, nodes: List[fx.Node], dtype: torch.dtype) -> str:
        cfg: FuseMXFP4MoEConfig = self.config  # type: ignore[assignment]
        if cfg.backend != "auto":
            return cfg.backend
        decoded = _decoded_bytes(gm, nodes, dtype)
        free = free_memory_bytes(torch.device(ctx.device))
        backend = "decoded" if decoded <= free // 2 else "mxfp4"
        logger.info("MXFP4 experts: %.2f GiB decoded, %.2f GiB free -> backend %s", decoded / 2**30, free / 2**30,
                    backend)
        return backend
