"""``fuse_fp8_moe`` (post_load_fusion): how ModelOpt FP8 experts run - decoded once, or kept in FP8.

``torch_quant_fp8_moe`` (from ``quantize_fp8_moe_from_config``) becomes, with ``backend:
decoded``, ``grouped_quant_moe_fused`` over the experts decoded once into the model's dtype
(``weight.float() * weight_scale``), each GEMM's input rows quantized to e4m3 with the expert's
static input scale (``act_quant: fp8``)::

    y = autodeploy.torch_quant_fp8_moe(x, sel, w, [gate weights], .., [gate input_scales], .., [gate weight_scales], ..)
  ->
    y = autodeploy.grouped_quant_moe_fused(x, sel, w, P.moe_gate_up_weight, P.moe_down_weight,
                                           P.moe_gate_up_input_scale, P.moe_down_input_scale, None, None,
                                           act, alpha, limit, "fp8", 128, bmm_max_pairs)

``backend: fp8`` keeps the per-expert (or stacked) op (1 byte per weight; active experts decoded each step);
``auto`` decodes when the decoded experts fit in half the free memory. See ``_quant_moe_fusion``.

``backend: scaled_mm`` (``auto`` for a bfloat16/float16 model on a CUDA GPU whose grouped FP8 GEMM
passes its trial) stacks the experts in e4m3 instead (1 byte per weight) and runs two grouped FP8
GEMMs per layer (``ops/quant/fp8_grouped_gemm.py``)::

    y = autodeploy.scaled_grouped_mm_fp8_moe(x, sel, w, P.moe_gate_up_weight_fp8, P.moe_down_weight_fp8,
                                             P.moe_gate_up_input_scale, P.moe_down_input_scale,
                                             P.moe_gate_up_weight_scale, P.moe_down_weight_scale, act, alpha, limit)
"""

from typing import Literal

import torch
from pydantic import Field
from torch import fx, nn

from ...ops.quant import formats
from ...ops.quant.fp8_grouped_gemm import grouped_scaled_mm_supported
from ...utils.logging import get_logger
from ..interface import PipelineContext, TransformInfo, TransformRegistry
from ._gemm_fusion import release_unused
from ._quant_moe_fusion import (DOWN, GATE, UP, QuantMoEFusion, QuantMoEFusionConfig, QuantMoEKind, _Layer,
                                quant_moe_layers)

logger = get_logger(__name__)
ad = torch.ops.autodeploy


class FuseFP8MoEConfig(QuantMoEFusionConfig):
    backend: Literal["auto", "decoded", "fp8", "scaled_mm"] = Field(
        default="auto",
        description="decoded: FP8 experts decoded once into the model dtype, grouped GEMMs with the activations "
        "rounded to FP8 (4 bytes per weight in fp32); fp8: kept in FP8 (1 byte per weight), each active expert "
        "decoded when it runs; scaled_mm: stacked in FP8 (1 byte per weight), two grouped FP8 GEMMs per layer "
        "(torch._scaled_grouped_mm on Hopper+ CUDA GPUs, bfloat16 output; elsewhere the same numbers expert by "
        "expert); auto: scaled_mm for a bfloat16/float16 model on a CUDA GPU whose grouped FP8 GEMM passes a "
        "trial, else decoded when the decoded experts fit in half the free memory, else fp8.",
    )


@TransformRegistry.register("fuse_fp8_moe")
class FuseFP8MoE(QuantMoEFusion):
    config_class = FuseFP8MoEConfig
    kind = QuantMoEKind(
        name="ModelOpt FP8", op=torch.ops.autodeploy.torch_quant_fp8_moe.default,
        stacked_op=torch.ops.autodeploy.torch_quant_fp8_moe_stacked.default,
        buffers=("weight", "input_scale", "weight_scale"), act_quant="fp8",
        decode=lambda t, constants: formats.dequantize_fp8(t["weight"], t["weight_scale"]),
    )

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        layers = quant_moe_layers(gm, self.kind)
        if not layers or not self._use_scaled_mm(gm, ctx, layers[0]):
            return super()._apply(gm, ctx)
        for layer in layers:
            _stack_fp8_layer(gm, layer)
        gm.graph.lint()
        gm.recompile()
        logger.info("ModelOpt FP8: %d MoE layers run as grouped FP8 GEMMs (experts stay e4m3)", len(layers))
        return TransformInfo(num_matches=len(layers), is_clean=False, has_valid_shapes=True)

    def _use_scaled_mm(self, gm: fx.GraphModule, ctx: PipelineContext, layer: _Layer) -> bool:
        backend = self.config.backend  # type: ignore[attr-defined]
        device = torch.device(ctx.device)
        if backend == "scaled_mm" and device.type != "cuda":
            return True  # asked for on CPU: the op's expert-by-expert path (memory over speed)
        if backend not in ("auto", "scaled_mm") or (backend == "auto" and ctx.dtype == torch.float32):
            return False
        inter, hidden = layer.values(gm, "weight", GATE)[0].shape
        problem = grouped_scaled_mm_supported(device, hidden, inter)
        if problem is not None and (backend == "scaled_mm" or device.type == "cuda"):
            (logger.warning if backend == "scaled_mm" else logger.info)("ModelOpt FP8 experts: %s", problem)
        return problem is None


def _stack_fp8_layer(gm: fx.GraphModule, layer: _Layer) -> None:
    """One layer's experts stacked in e4m3 with per-row weight scales; the per-expert op replaced."""
    node = layer.node

    w = [layer.values(gm, "weight", j) for j in range(3)]
    ws = [[t.float().reshape(()) for t in layer.values(gm, "weight_scale", j)] for j in range(3)]
    ins = [[t.float().reshape(()) for t in layer.values(gm, "input_scale", j)] for j in range(3)]
    inter, hidden = w[GATE][0].shape
    with torch.no_grad():
        gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(w[GATE], w[UP])])
        down = torch.stack(list(w[DOWN]))
        gate_up_scale = torch.stack([torch.cat([g.expand(inter), u.expand(inter)]) for g, u in zip(ws[GATE], ws[UP])])
        down_scale = torch.stack([d.expand(hidden) for d in ws[DOWN]])
        gate_up_in = torch.stack([torch.maximum(g, u) for g, u in zip(ins[GATE], ins[UP])])
        down_in = torch.stack(ins[DOWN])
    owner = layer.owner
    module = gm.get_submodule(owner)
    tensors_by_name = {"moe_gate_up_weight_fp8": gate_up, "moe_down_weight_fp8": down,
                       "moe_gate_up_input_scale": gate_up_in, "moe_down_input_scale": down_in,
                       "moe_gate_up_weight_scale": gate_up_scale.contiguous(), "moe_down_weight_scale": down_scale.contiguous()}
    for name, value in tensors_by_name.items():
        if name.endswith("_fp8"):
            module.register_parameter(name, nn.Parameter(value, requires_grad=False))
        else:
            module.register_buffer(name, value)
    graph = gm.graph
    with graph.inserting_before(node):
        attrs = [graph.get_attr(f"{owner}.{name}") for name in tensors_by_name]
        new = graph.call_function(ad.scaled_grouped_mm_fp8_moe.default, (*node.args[:3], *attrs, *layer.tail))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    release_unused(gm, layer.nodes)
