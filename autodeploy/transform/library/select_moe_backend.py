"""``select_moe_backend`` (post_load_fusion): the experts' GEMMs on oneDNN over weights packed once.

After ``fuse_moe`` / ``fuse_<format>_moe`` a MoE layer is ``grouped_moe_fused`` (float experts)
or ``grouped_quant_moe_fused`` (quantized experts decoded once), over stacked float32 weights.
On CPU (``backend: auto`` or ``onednn``) each expert's slice is packed for oneDNN, once, and the
layer runs ``onednn_grouped_moe_fused``::

    y = autodeploy.grouped_moe_fused(x, sel, w, P.W_gu, P.W_d, b_gu, b_d, act, alpha, limit, 0)
  ->
    y = autodeploy.onednn_grouped_moe_fused(x, sel, w, [P.W_gu_0, .., P.W_gu_E-1], [P.W_d_0, ..], b_gu, b_d,
                                            act, alpha, limit, "none", None, None, 128)
        # each W_*_e an opaque oneDNN-packed [2I, H] / [H, I]; the stacked tensors are freed

    y = autodeploy.grouped_quant_moe_fused(x, sel, w, P.W_gu, P.W_d, s_gu, s_d, b_gu, b_d, act, alpha, limit,
                                           act_quant, group, 0)
  -> y = autodeploy.onednn_grouped_moe_fused(x, sel, w, [..], [..], b_gu, b_d, act, alpha, limit, act_quant,
                                             s_gu, s_d, group)

Why: the dense linears already run on packed weights (``select_linear_backend``), 1.3-3.4x faster
than torch's BLAS on the AMD CPUs measured; a stacked ``[E, 2I, H]`` cannot be packed as one, so
the experts stayed on ``F.linear``: 1.9-2.6x slower per expert GEMM (``ops/moe_onednn.py``). The
memory is the same (each packed slice replaces its part of the stack, one layer at a time).
Left alone: the gathered-weight strategy (``bmm_max_pairs`` > 0 needs the stack), non-float32
experts, other devices, and graphs for ``torch-compile`` (it retraces the graph and cannot take the
opaque packed tensors).
"""

from typing import Any, Dict, List, Literal, Optional

import torch
from pydantic import Field
from torch import fx

from ...utils.logging import get_logger
from ..graph_utils import arg, get_attr_value, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._gemm_fusion import release_unused
from .select_linear_backend import _RETRACING_BACKENDS, onednn_available

ad = torch.ops.autodeploy
logger = get_logger(__name__)


class SelectMoEBackendConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    backend: Literal["auto", "torch", "onednn"] = Field(
        default="auto",
        description="GEMM implementation of the grouped MoE experts: onednn (per-expert float32 weights packed once "
        "at load for oneDNN, CPU), torch (torch's BLAS on the stacked weights); auto: onednn on CPU.",
    )


# each grouped op's arguments (name, default), to read a call whatever it spelled out
_FLOAT_ARGS = (("x", None), ("selected_experts", None), ("routing_weights", None), ("gate_up_weight", None),
               ("down_weight", None), ("gate_up_bias", None), ("down_bias", None), ("act", "silu"), ("alpha", 1.0),
               ("limit", 0.0), ("bmm_max_pairs", 0))
_QUANT_ARGS = (*_FLOAT_ARGS[:5], ("gate_up_input_scale", None), ("down_input_scale", None), *_FLOAT_ARGS[5:10],
               ("act_quant", "fp8"), ("group_size", 128), ("bmm_max_pairs", 0))


def _arguments(node: fx.Node) -> Dict[str, Any]:
    spec = _FLOAT_ARGS if is_op(node, ad.grouped_moe_fused) else _QUANT_ARGS
    return {name: arg(node, i, name, default) for i, (name, default) in enumerate(spec)}


def _stacked(gm: fx.GraphModule, a: Dict[str, Any]) -> Optional[List[torch.Tensor]]:
    """The layer's stacked gate_up / down weights when they can be packed, else None."""
    weights = (a["gate_up_weight"], a["down_weight"])
    if a["bmm_max_pairs"] or not all(isinstance(w, fx.Node) and w.op == "get_attr" for w in weights):
        return None
    values = [get_attr_value(gm, w) for w in weights]
    if any(v.dtype != torch.float32 or v.device.type != "cpu" or v.dim() != 3 for v in values):
        return None
    return values


def _pack_layer(gm: fx.GraphModule, node: fx.Node, a: Dict[str, Any], stacked: List[torch.Tensor]) -> None:
    graph = gm.graph
    owner = str(a["gate_up_weight"].target).rpartition(".")[0]
    module = gm.get_submodule(owner) if owner else gm
    lists = []
    for kind, value in zip(("gate_up", "down"), stacked):
        names = []
        for e in range(value.shape[0]):
            name = f"moe_{kind}_onednn_{e}"
            module.register_buffer(name, torch.ops.mkldnn._reorder_linear_weight(value[e].contiguous()),
                                   persistent=False)
            names.append(f"{owner}.{name}" if owner else name)
        with graph.inserting_before(node):
            lists.append([graph.get_attr(n) for n in names])
    quantized = is_op(node, ad.grouped_quant_moe_fused)
    args = (a["x"], a["selected_experts"], a["routing_weights"], *lists, a["gate_up_bias"], a["down_bias"], a["act"],
            a["alpha"], a["limit"], a["act_quant"] if quantized else "none", a.get("gate_up_input_scale"),
            a.get("down_input_scale"), a["group_size"] if quantized else 128)
    with graph.inserting_before(node):
        new = graph.call_function(ad.onednn_grouped_moe_fused.default, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    release_unused(gm, [a["gate_up_weight"], a["down_weight"]])


@TransformRegistry.register("select_moe_backend")
class SelectMoEBackend(BaseTransform):
    config_class = SelectMoEBackendConfig
    requires = ("load_weights",)
    run_after = ("fuse_moe", "fuse_fp8_moe", "fuse_finegrained_fp8_moe", "fuse_nvfp4_moe", "fuse_mxfp4_moe")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        backend = self._resolve(ctx)
        if backend != "onednn":
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason=backend)
        count = 0
        for node in list(gm.graph.nodes):
            if not is_op(node, (ad.grouped_moe_fused, ad.grouped_quant_moe_fused)):
                continue
            a = _arguments(node)
            stacked = _stacked(gm, a)
            if stacked is None:
                continue
            _pack_layer(gm, node, a, stacked)
            count += 1
        gm.graph.lint()
        gm.recompile()
        if count:
            logger.info("select_moe_backend: %d MoE layers' experts packed for oneDNN", count)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)

    def _resolve(self, ctx: PipelineContext) -> str:
        backend: str = self.config.backend  # type: ignore[attr-defined]
        if backend == "torch":
            return "backend torch: experts keep torch's BLAS"
        if torch.device(ctx.device).type != "cpu" or not onednn_available():
            if backend == "onednn":
                logger.warning("MoE backend 'onednn' is CPU-only and needs a torch with oneDNN; keeping torch's")
            return "oneDNN packing is for CPU (and a torch build with oneDNN)"
        if ctx.compile_backend in _RETRACING_BACKENDS:
            return f"compile backend {ctx.compile_backend} retraces the graph and cannot take packed weights"
        return "onednn"
