"""``quantize_mxfp4_moe_from_config`` (pattern_matcher): GPT-OSS's MXFP4 experts, decoded once at load.

Applies when ``config.json`` declares ``quant_method: mxfp4`` (OpenAI's GPT-OSS releases). Such
a checkpoint stores each MoE layer's stacked expert weights as OCP MXFP4: for the parameter
``P.gate_up_proj`` (HF's layout ``[E, H, 2I]``, gate and up interleaved) the tensors
``P.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]`` (two e2m1 codes per byte, element 2i in
the low nibble) and ``P.gate_up_proj_scales`` uint8 ``[E, 2I, H/32]`` (E8M0 exponents); the same
for ``P.down_proj`` (``[E, I, H]``; blocks ``[E, H, I/32, 16]``). Biases, attention, the router,
embeddings and ``lm_head`` stay float (``modules_to_not_convert``). Which parameters are MXFP4 is
read from the checkpoint's tensors (a ``_blocks`` next to the parameter's name), as for the
quantized linears.

Before::

    y = autodeploy.torch_moe_fused(x, sel, w, <layout ops>(P.gate_up_proj), <layout ops>(P.down_proj), b_gu, b_d, ...)
        # P.gate_up_proj: float [E, H, 2I] on meta (HF's layout); the checkpoint has no such tensor

After::

    y = autodeploy.torch_quant_mxfp4_moe_fused(x, sel, w, P.gate_up_blocks, P.gate_up_scales,
                                               P.down_blocks, P.down_scales, b_gu, b_d, ...)
        # uint8 buffers in the canonical layout: gate_up [E, 2I, H/32, (16)] gate rows first; down [E, H, I/32, (16)]

The layout ops between a parameter and the MoE op (GPT-OSS's transpose and gate/up
de-interleave) are read by running them on index probes: they must amount to a transpose and a
permutation of the output rows, which load hooks then apply to the blocks' and scales' rows once
at load (rows are whole groups, so this is exact). Anything else is one error naming the
parameter. ``fuse_mxfp4_moe`` (post_load_fusion) then chooses how the op runs: experts decoded
once into float (``torch_moe_fused`` -> ``fuse_moe``), or kept in MXFP4.

Every MXFP4 parameter is checked against the safetensors headers before anything loads: both
tensors present, uint8, with the shapes the parameter implies (expert count, block layout).
"""

import re
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx

from ...models.load_hooks import LoadHook
from ...ops.quant.formats import MXFP4_GROUP
from ...utils.errors import ModelSourceError
from ...utils.logging import get_logger
from ..graph_utils import is_op, weight_expression
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_from_config import GRAPH_LOAD_HOOKS

logger = get_logger(__name__)

Shape = Tuple[int, ...]


def _expected(param: str, shape: Shape) -> Dict[str, Tuple[Shape, str]]:
    """The checkpoint tensors a stacked expert parameter ``[E, in, out]`` needs, with their shapes."""
    if len(shape) != 3:
        raise ModelSourceError(f"'{param}' has shape {list(shape)}; MXFP4 experts are stacked [experts, in, out]")
    experts, k, n = shape
    if k % MXFP4_GROUP:
        raise ModelSourceError(f"'{param}' has {k} inputs per expert; MXFP4 groups of {MXFP4_GROUP} do not divide it")
    groups = k // MXFP4_GROUP
    return {
        f"{param}_blocks": ((experts, n, groups, MXFP4_GROUP // 2), "packed e2m1 blocks"),
        f"{param}_scales": ((experts, n, groups), "E8M0 scale per group of 32"),
    }


def _validate(param: str, shape: Shape, headers: Dict[str, Tuple[str, Shape]]) -> List[str]:
    sources = []
    for key, (want, what) in _expected(param, shape).items():
        if key not in headers:
            raise ModelSourceError(f"checkpoint tensor '{key}' is missing: MXFP4 stores {what} (uint8) next to "
                                   f"'{param}_blocks'. Is the checkpoint complete?")
        dtype, got = headers[key]
        if dtype != "U8":
            raise ModelSourceError(f"checkpoint tensor '{key}' is {dtype}; MXFP4 stores its {what} as uint8")
        if tuple(got) != want:
            raise ModelSourceError(
                f"checkpoint tensor '{key}' has shape {list(got)}; for '{param}' of shape {list(shape)} "
                f"([experts, in, out]) MXFP4 expects its {what} to have shape {list(want)}"
            )
        sources.append(key)
    return sources


class QuantizeMXFP4MoEFromConfigConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("quantize_mxfp4_moe_from_config")
class QuantizeMXFP4MoEFromConfig(BaseTransform):
    config_class = QuantizeMXFP4MoEFromConfigConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        info = getattr(ctx.factory, "quantization", None)
        if info is None or info.transform != "quantize_mxfp4_moe_from_config":
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        headers = ctx.factory.checkpoint_index().headers()
        params = {}
        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op == "get_attr" and f"{name}_blocks" in headers:
                params[name] = _validate(name, tuple(gm.get_parameter(name).shape), headers)
        if not params:
            raise ModelSourceError("the checkpoint declares quant_method 'mxfp4' but no parameter of the model has "
                                   "'<name>_blocks' / '<name>_scales' tensors in it; is it a GPT-OSS MXFP4 checkpoint?")
        hooks: List[LoadHook] = gm.meta.setdefault(GRAPH_LOAD_HOOKS, [])
        count = sum(_keep_mxfp4(gm, node, params, hooks) for node in list(gm.graph.nodes)
                    if is_op(node, torch.ops.autodeploy.torch_moe_fused))
        gm.graph.eliminate_dead_code()  # the layout ops of the rewritten layers
        left = sorted({str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) in params})
        if left:
            raise ModelSourceError(f"the checkpoint stores '{left[0]}' in MXFP4, but the graph does not use it only as "
                                   "the weight of a MoE op; autodeploy loads MXFP4 experts of MoE layers only")
        for name in params:
            owner, _, leaf = name.rpartition(".")
            gm.get_submodule(owner)._parameters.pop(leaf, None)
        gm.graph.lint()
        gm.recompile()
        logger.info("MXFP4: %d MoE layers run on MXFP4 experts (torch_quant_mxfp4_moe_fused)", count)
        return TransformInfo(num_matches=count, is_clean=False, has_valid_shapes=True)


def _layout_permutation(gm: fx.GraphModule, expression: List[fx.Node], param: fx.Node) -> Optional[torch.Tensor]:
    """``perm`` such that the expression's result is ``param.transpose(1, 2)[:, perm]``, read by
    running its ops (graph order) from the parameter ``[E, in, out]`` on index probes; None when
    they are something else."""
    e, k, n = gm.get_parameter(str(param.target)).shape
    outs = []
    for probe in (torch.arange(n, dtype=torch.float32).expand(e, k, n),
                  torch.arange(k, dtype=torch.float32)[:, None].expand(e, k, n)):
        env: Dict[fx.Node, Any] = {param: probe.contiguous()}
        for node in expression:
            if node.op == "call_function":
                load = lambda a: fx.node.map_arg(a, env.__getitem__)  # noqa: E731
                env[node] = node.target(*load(node.args), **load(node.kwargs))
        outs.append(env[expression[-1]])
    rows, cols = outs
    if tuple(rows.shape) != (e, n, k):
        return None
    perm = rows[0, :, 0].long()
    if not (torch.equal(rows, perm.float()[None, :, None].expand(e, n, k))
            and torch.equal(cols, torch.arange(k, dtype=torch.float32).expand(e, n, k))
            and torch.equal(perm.sort().values, torch.arange(n))):
        return None
    return perm


def _keep_mxfp4(gm: fx.GraphModule, node: fx.Node, params: Dict[str, List[str]], hooks: List[LoadHook]) -> int:
    """Rewrite one ``torch_moe_fused`` over MXFP4 parameters into ``torch_quant_mxfp4_moe_fused``."""
    found = [_expression_of(use, params) for use in node.args[3:5]]
    if any(f is None for f in found):
        return 0  # a float MoE layer (excluded from the quantization)
    new_args = []
    for expression, param in found:  # type: ignore[misc]
        perm = _layout_permutation(gm, expression, param)
        if perm is None:
            raise ModelSourceError(f"MXFP4: the ops between '{param.target}' and its MoE op are not a transpose and a "
                                   "row permutation of its [experts, in, out] layout; autodeploy cannot lay out its "
                                   "MXFP4 blocks for the MoE op")
        name = str(param.target)
        owner, _, leaf = name.rpartition(".")
        stem = leaf[: -len("_proj")] if leaf.endswith("_proj") else leaf
        for kind, source in zip(("blocks", "scales"), params[name]):
            buffer = f"{stem}_{kind}"
            gm.get_submodule(owner).register_buffer(
                buffer, torch.empty(_shape_of(gm, name, kind), dtype=torch.uint8, device="meta"))
            hooks.append(LoadHook(re.escape(f"{owner}.{buffer}"), [source], _rows(perm),
                                  f"MXFP4 {source} -> {owner}.{buffer} (canonical rows)", decodes=True))
            with gm.graph.inserting_before(node):
                new_args.append(gm.graph.get_attr(f"{owner}.{buffer}"))
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.ops.autodeploy.torch_quant_mxfp4_moe_fused.default,
                                     (*node.args[:3], *new_args, *node.args[5:]), dict(node.kwargs))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return 1


def _expression_of(use: Any, params: Dict[str, List[str]]) -> Optional[Tuple[List[fx.Node], fx.Node]]:
    """The nodes computing ``use`` from one MXFP4 parameter alone (graph order, ``use`` last) and
    that parameter's ``get_attr``; None otherwise."""
    nodes = weight_expression(use)
    attrs = [n for n in nodes or [] if n.op == "get_attr"]
    if len(attrs) != 1 or str(attrs[0].target) not in params:
        return None
    return nodes, attrs[0]  # type: ignore[return-value]


def _shape_of(gm: fx.GraphModule, name: str, kind: str) -> Shape:
    e, k, n = gm.get_parameter(name).shape
    groups = k // MXFP4_GROUP
    return (e, n, groups, MXFP4_GROUP // 2) if kind == "blocks" else (e, n, groups)


def _rows(perm: torch.Tensor):
    def take(tensors: List[torch.Tensor]) -> torch.Tensor:
        return tensors[0][:, perm].contiguous()
    return take
