"""Shared by ``fuse_fp8_moe``, ``fuse_finegrained_fp8_moe`` and ``fuse_nvfp4_moe`` (post_load_fusion):
how per-expert quantized experts run.

``quantize_*_moe_from_config`` leaves each quantized MoE layer as its format's per-expert op
(``torch_quant_<format>_moe``, or its ``_stacked`` form over ``[E, ...]`` tensors: each list
below one tensor) on the checkpoint's tensors. With ``backend: decoded`` the layer's
experts are decoded once, after loading, and stacked::

    y = autodeploy.torch_quant_<format>_moe(x, sel, w, [gate weights], [up ..], [down ..], <scales>, act, ..)
  ->
    y = autodeploy.grouped_quant_moe_fused(x, sel, w, P.moe_gate_up_weight, P.moe_down_weight,
                                           P.moe_gate_up_input_scale, P.moe_down_input_scale, None, None,
                                           act, alpha, limit, <format's activation quantization>, group, bmm_max_pairs)
        # float [E, 2I, H] (gate rows, then up rows) and [E, H, I] in the model's dtype; input scales [E]

the grouped implementation a float checkpoint gets from ``fuse_moe`` (one GEMM for gate+up and
one for down per expert that received tokens), with each GEMM's input rows quantized the way the
format does (the per-expert op's numerics: static formats use each expert's own input scale). The
decoded weights cost the model dtype's size per weight (4 bytes in fp32: 4x FP8, 7x NVFP4);
layers are decoded one at a time, so the peak is the model plus one layer's decoded experts.

With the format's own backend name (``fp8``, ``nvfp4``) the per-expert (or stacked) op stays: memory stays at
the format's size and each step decodes the experts that received tokens. ``auto`` decodes when
all decoded experts fit in half of the device's free memory, else keeps the format, and logs the
sizes it compared.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import torch
from pydantic import Field
from torch import fx, nn

from ...ops.quant.moe import Experts
from ...utils.logging import get_logger
from ...utils.memory import free_memory_bytes
from ..graph_utils import get_attr_value, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo
from ._gemm_fusion import release_unused

ad = torch.ops.autodeploy
logger = get_logger(__name__)

GATE, UP, DOWN = 0, 1, 2
TAIL = 3  # act, alpha, limit close every per-expert op's arguments


@dataclass(frozen=True)
class QuantMoEKind:
    """What the fusion needs to know of one per-expert quantized MoE op."""

    name: str  # "ModelOpt FP8", for logs
    op: Any  # the per-expert op (``.default``)
    stacked_op: Any  # its ``_stacked`` form: the same arguments, each list one [E, ...] tensor
    buffers: Tuple[str, ...]  # per-projection tensor kinds, in the op's argument order
    act_quant: str  # grouped_quant_moe_fused's activation quantization
    # one projection's tensors (by kind) and the op's constants -> its float32 weight
    decode: Callable[[Dict[str, torch.Tensor], Sequence[Any]], torch.Tensor]


class QuantMoEFusionConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # decoded experts replace their quantized tensors
    bmm_max_pairs: int = Field(
        default=0, description="grouped_quant_moe_fused's strategy switch, as fuse_moe's (0: sorted per-expert GEMMs)."
    )


@dataclass
class _Layer:
    node: fx.Node
    # (tensor kind, projection) -> per-expert get_attr nodes, or one get_attr of the [E, ...] stack
    lists: Dict[Tuple[str, int], Union[List[fx.Node], fx.Node]]
    constants: Sequence[Any]
    tail: Sequence[Any]

    def values(self, gm: fx.GraphModule, name: str, j: int) -> Experts:
        """The experts' ``name`` tensors of projection ``j``: expert e's is ``values(...)[e]``."""
        nodes = self.lists[(name, j)]
        return get_attr_value(gm, nodes) if isinstance(nodes, fx.Node) else [get_attr_value(gm, n) for n in nodes]

    @property
    def nodes(self) -> List[fx.Node]:
        return [n for v in self.lists.values() for n in ([v] if isinstance(v, fx.Node) else v)]

    @property
    def owner(self) -> str:
        """The experts module: ``<...>.experts`` of ``<...>.experts.gate_weight`` (stacked) or of
        ``<...>.experts.0.gate_proj.weight``."""
        first = self.lists[("weight", GATE)]
        if isinstance(first, fx.Node):
            return str(first.target).rpartition(".")[0]
        return str(first[0].target).rsplit(".", 3)[0]


def _layer(node: fx.Node, kind: QuantMoEKind) -> _Layer:
    b = len(kind.buffers)
    stacked = is_op(node, kind.stacked_op)
    lists = {(name, j): node.args[3 + 3 * i + j] if stacked else list(node.args[3 + 3 * i + j])
             for i, name in enumerate(kind.buffers) for j in range(3)}
    return _Layer(node, lists, node.args[3 + 3 * b: len(node.args) - TAIL], node.args[len(node.args) - TAIL:])


def quant_moe_layers(gm: fx.GraphModule, kind: QuantMoEKind) -> List[_Layer]:
    """Every MoE layer of ``kind``'s op, per-expert or stacked."""
    return [_layer(n, kind) for n in gm.graph.nodes if is_op(n, (kind.op, kind.stacked_op))]


def decoded_bytes(gm: fx.GraphModule, layers: List[_Layer], dtype: torch.dtype) -> int:
    """What the decoded experts of ``layers`` take in ``dtype`` (weights only; the input scales are [E])."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer in layers:
        for j in range(3):
            weights = layer.values(gm, "weight", j)
            total += len(weights) * weights[0].shape[0] * _in_features(gm, layer, j) * size
    return total


def _in_features(gm: fx.GraphModule, layer: _Layer, j: int) -> int:
    """A projection's input size, read from the layer's other weights (packed formats halve K)."""
    gate = layer.values(gm, "weight", GATE)[0]
    down = layer.values(gm, "weight", DOWN)[0]
    return down.shape[0] if j != DOWN else gate.shape[0]  # gate/up read H (= down's rows); down reads I


def _decode_layer(gm: fx.GraphModule, layer: _Layer, kind: QuantMoEKind, dtype: torch.dtype,
                  bmm_max_pairs: int) -> None:
    node = layer.node
    values = {key: layer.values(gm, *key) for key in layer.lists}
    experts = len(values[("weight", GATE)])

    def projection(j: int, e: int) -> torch.Tensor:
        return kind.decode({name: values[(name, j)][e] for name in kind.buffers}, layer.constants)

    with torch.no_grad():
        first_gate, first_down = projection(GATE, 0), projection(DOWN, 0)
        inter, hidden = first_gate.shape
        device = first_gate.device
        gate_up = torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=device)
        down = torch.empty(experts, hidden, inter, dtype=dtype, device=device)
        for e in range(experts):
            gate_up[e, :inter] = first_gate if e == 0 else projection(GATE, e)
            gate_up[e, inter:] = projection(UP, e)
            down[e] = first_down if e == 0 else projection(DOWN, e)
    owner = layer.owner
    module = gm.get_submodule(owner)
    module.register_parameter("moe_gate_up_weight", nn.Parameter(gate_up, requires_grad=False))
    module.register_parameter("moe_down_weight", nn.Parameter(down, requires_grad=False))
    names = [f"{owner}.moe_gate_up_weight", f"{owner}.moe_down_weight"]
    if "input_scale" in kind.buffers:
        scales = [[t.float().reshape(()) for t in values[("input_scale", j)]] for j in range(3)]
        gate_up_scale = torch.stack([torch.maximum(g, u) for g, u in zip(scales[GATE], scales[UP])])
        differ = sum(int(not torch.equal(g, u)) for g, u in zip(scales[GATE], scales[UP]))
        if differ:
            logger.info("%s: %d experts of %s have different gate and up input scales; each uses the larger",
                        kind.name, differ, owner)
        module.register_buffer("moe_gate_up_input_scale", gate_up_scale)
        module.register_buffer("moe_down_input_scale", torch.stack(scales[DOWN]))
        names += [f"{owner}.moe_gate_up_input_scale", f"{owner}.moe_down_input_scale"]
    group = int(layer.constants[1]) if kind.act_quant == "fp8_group" else 128
    graph = gm.graph
    with graph.inserting_before(node):
        attrs = [graph.get_attr(n) for n in names]
        if len(attrs) == 2:
            attrs += [None, None]
        new = graph.call_function(ad.grouped_quant_moe_fused.default,
                                  (*node.args[:3], *attrs, None, None, *layer.tail, kind.act_quant, group,
                                   bmm_max_pairs))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    release_unused(gm, layer.nodes)


class QuantMoEFusion(BaseTransform):
    """Base of the three fusions; a subclass sets ``kind`` and a config with its ``backend`` field."""

    kind: QuantMoEKind
    requires = ("load_weights",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        layers = quant_moe_layers(gm, self.kind)
        if not layers:
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        x_val = layers[0].node.args[0].meta.get("val")
        dtype = x_val.dtype if x_val is not None else torch.float32
        backend = self._backend(gm, ctx, layers, dtype)
        if backend != "decoded":
            logger.info("%s: %d MoE layers keep their experts quantized", self.kind.name, len(layers))
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        for layer in layers:
            _decode_layer(gm, layer, self.kind, dtype, self.config.bmm_max_pairs)  # type: ignore[attr-defined]
        gm.graph.lint()
        gm.recompile()
        logger.info("%s: %d MoE layers' experts decoded once into %s", self.kind.name, len(layers), dtype)
        return TransformInfo(num_matches=len(layers), is_clean=False, has_valid_shapes=True)

    def _backend(self, gm: fx.GraphModule, ctx: PipelineContext, layers: List[_Layer], dtype: torch.dtype) -> str:
        backend = self.config.backend  # type: ignore[attr-defined]
        if backend != "auto":
            return backend
        decoded = decoded_bytes(gm, layers, dtype)
        free = free_memory_bytes(torch.device(ctx.device))
        backend = "decoded" if decoded <= free // 2 else "quantized"
        logger.info("%s experts: %.2f GiB decoded, %.2f GiB free -> %s", self.kind.name, decoded / 2**30,
                    free / 2**30, "decoded" if backend == "decoded" else "kept quantized")
        return backend
