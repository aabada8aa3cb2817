"""Shared by ``fuse_fp8_gemms``, ``fuse_fp4_gemms``, ``fuse_finegrained_fp8_swiglu`` and
``fuse_nvfp4_swiglu``: canonical quantized linears that read the same input become one quantized
linear over concatenated weights (the float analogue is ``_gemm_fusion``).

Two shapes of match:

* **gemms** (q/k/v, or gate/up without the SwiGLU form): every user of ``x`` is such a linear;
  the fused output is split back with ``split_with_sizes`` + ``getitem``, as ``fuse_gemms`` does.
* **swiglu**: ``mul(silu(gate(x)), up(x))`` with gate and up used only there; the fused output
  [gate; up] feeds ``torch_silu_and_mul`` (gate half first, see ``ops/mlp.py``).

What one op over the concatenated weight needs, per format (a :class:`QuantGemmFormat`):

* **FP8 per-tensor**: one static activation scale, so equal ``input_scale`` values (else the
  activations would be rounded differently: left alone). The weights keep their codes and their
  own scales: the fused op's ``weight_scale`` becomes a per-row vector (each linear's scale over
  its rows; still the scalar when they were all equal). TensorRT-LLM instead re-quantizes every
  weight to ``max(s_i)``, which rounds the others a second time: on the tiny test Llama that moved
  the logits by 4.4% relative RMS and changed greedy tokens at near-ties, for nothing a CPU gains
  (its backend decodes the weight to float anyway), and Hopper's ``_scaled_mm`` takes row-wise
  scales natively. So fusing is exact here.
* **NVFP4**: equal ``input_scale``; the e2m1 codes and e4m3 block scales concatenate, and
  ``weight_scale_2`` becomes a per-row vector the same way (TensorRT-LLM re-rounds the block
  scales to the largest ``weight_scale_2``; measured 13.5% on the test logits: not done here).
* **Fine-grained FP8**: tile scales are local, so weights and ``weight_scale_inv`` rows simply
  concatenate along N; exact, but only when every linear except the last has N a multiple of
  ``block_n`` (otherwise one 128-row tile would straddle two weights with two scales).

Memory: groups are fused one at a time; each group's original tensors are freed as soon as its
fused ones exist (peak: the model plus one group). The fused tensors live in a new submodule
next to the originals (``...self_attn.fused_q_proj_k_proj_v_proj.{weight, input_scale, ...}``),
buffers like the checkpoint's quantized tensors (a bias stays a parameter).
"""

import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, fx, nn

from ...ops.quant import formats
from ...utils.logging import get_logger
from ..graph_utils import arg, get_attr_value, is_op
from ._gemm_fusion import FusedNames, _fused_name, _owner, release_unused

aten = torch.ops.aten
logger = get_logger(__name__)

Values = Dict[str, Any]  # one linear's tensors ("weight", "bias", scales) and constants, by argument name


@dataclass(frozen=True)
class QuantGemmFormat:
    """What fusing linears of one canonical quantized op takes."""

    name: str
    op: Any  # the canonical op (``.default``)
    tensors: Tuple[str, ...]  # its tensor arguments after ``bias``, by schema name, in order
    constants: Tuple[Tuple[str, Any], ...]  # trailing non-tensor arguments (name, default)
    refuse: Callable[[List[Values]], Optional[str]]  # why these linears cannot be one op (None: they can)
    merge: Callable[[List[Values]], Dict[str, Tensor]]  # the fused "weight" and scale tensors


@dataclass(frozen=True)
class QuantLinear:
    """A call of ``fmt.op`` whose tensors are all module attributes (loaded weights)."""

    node: fx.Node
    x: fx.Node
    attrs: Dict[str, Optional[fx.Node]]  # "weight", "bias" (None when absent) and ``fmt.tensors``
    constants: Tuple[Any, ...]


def parse(node: Any, fmt: QuantGemmFormat) -> Optional[QuantLinear]:
    if not is_op(node, fmt.op):
        return None
    x = arg(node, 0, "x")
    names = ("weight", "bias", *fmt.tensors)
    attrs = {name: arg(node, i + 1, name) for i, name in enumerate(names)}
    if not isinstance(x, fx.Node) or any(
            a is not None and (not isinstance(a, fx.Node) or a.op != "get_attr") for a in attrs.values()):
        return None
    if attrs["weight"] is None or any(attrs[t] is None for t in fmt.tensors):
        return None
    first = 1 + len(names)
    constants = tuple(arg(node, first + i, name, default) for i, (name, default) in enumerate(fmt.constants))
    return QuantLinear(node, x, attrs, constants)


def _values(gm: fx.GraphModule, ql: QuantLinear, fmt: QuantGemmFormat) -> Values:
    out: Values = {k: (get_attr_value(gm, n) if n is not None else None) for k, n in ql.attrs.items()}
    out.update({name: c for (name, _), c in zip(fmt.constants, ql.constants)})
    return out


def refusal(fmt: QuantGemmFormat, values: List[Values]) -> Optional[str]:
    """Why ``values`` (one linear each) cannot share one ``fmt.op``; None when they can."""
    w = [v["weight"] for v in values]
    if len({(t.shape[1:], t.dtype, t.device) for t in w}) != 1:
        return "the weights differ in input size, dtype or device"
    if len({v["bias"] is None for v in values}) != 1:
        return "some have a bias and some do not"
    if len({tuple(v[name] for name, _ in fmt.constants) for v in values}) != 1:
        return "their block sizes differ"
    return fmt.refuse(values)


# ---- the formats ------------------------------------------------------------------------------


def _per_row(scales: List[Tensor], rows: List[int]) -> Tensor:
    """One per-tensor scale per linear -> the fused op's scale: the common scalar when they are
    all equal, else a float32 vector with each linear's scale repeated over its output rows."""
    first = scales[0]
    if all(torch.equal(s, first) for s in scales[1:]):
        return first.clone()
    return torch.cat([s.float().reshape(1).expand(n) for s, n in zip(scales, rows)])


def _equal_input_scales(values: List[Values]) -> Optional[str]:
    first = values[0]["input_scale"]
    if all(torch.equal(v["input_scale"], first) for v in values[1:]):
        return None
    got = ", ".join(f"{v['input_scale'].float().item():.6g}" for v in values)
    return f"their input scales differ ({got}): one op quantizes its input once"


def _merge_fp8(values: List[Values]) -> Dict[str, Tensor]:
    rows = [v["weight"].shape[0] for v in values]
    return {"weight": torch.cat([v["weight"] for v in values]), "input_scale": values[0]["input_scale"].clone(),
            "weight_scale": _per_row([v["weight_scale"] for v in values], rows)}


def _merge_nvfp4(values: List[Values]) -> Dict[str, Tensor]:
    rows = [v["weight"].shape[0] for v in values]
    return {"weight": torch.cat([v["weight"] for v in values]), "input_scale": values[0]["input_scale"].clone(),
            "weight_scale": torch.cat([v["weight_scale"] for v in values]),
            "weight_scale_2": _per_row([v["weight_scale_2"] for v in values], rows)}


def _refuse_straddling_tiles(values: List[Values]) -> Optional[str]:
    block_n = values[0]["block_n"]
    sizes = [int(v["weight"].shape[0]) for v in values]
    if any(n % block_n for n in sizes[:-1]):
        return (f"output sizes {sizes} are not all multiples of block_n={block_n} (but the last): a weight tile "
                f"would straddle two linears with different scales")
    tiles = [int(v["weight_scale_inv"].shape[0]) for v in values]
    if tiles != [-(-n // block_n) for n in sizes]:
        return f"weight_scale_inv rows {tiles} do not match output sizes {sizes} in tiles of {block_n}"
    return None


def _merge_finegrained(values: List[Values]) -> Dict[str, Tensor]:
    return {"weight": torch.cat([v["weight"] for v in values]),
            "weight_scale_inv": torch.cat([v["weight_scale_inv"] for v in values])}


FP8 = QuantGemmFormat("FP8", torch.ops.autodeploy.torch_quant_fp8_linear.default, ("input_scale", "weight_scale"),
                      (), _equal_input_scales, _merge_fp8)
NVFP4 = QuantGemmFormat("NVFP4", torch.ops.autodeploy.torch_quant_nvfp4_linear.default,
                        ("input_scale", "weight_scale", "weight_scale_2"), (), _equal_input_scales, _merge_nvfp4)
FINEGRAINED_FP8 = QuantGemmFormat("fine-grained FP8", torch.ops.autodeploy.torch_quant_finegrained_fp8_linear.default,
                                  ("weight_scale_inv",), (("block_n", 128), ("block_k", 128)),
                                  _refuse_straddling_tiles, _merge_finegrained)


# ---- rewriting --------------------------------------------------------------------------------


def _fused_tensors(gm: fx.GraphModule, fmt: QuantGemmFormat, linears: List[QuantLinear], values: List[Values],
                   made: FusedNames) -> str:
    """Path of a new submodule holding the fused tensors (reused when the same weights were fused
    before, e.g. one layer applied twice)."""
    targets = [str(ql.attrs["weight"].target) for ql in linears]
    key = tuple(targets)
    if key in made:
        owner, leaf = _owner(gm, made[key])
        if hasattr(owner, leaf):
            return made[key]
    merged = fmt.merge(values)
    module = nn.Module()
    for name, tensor in merged.items():
        module.register_buffer(name, tensor)
    if values[0]["bias"] is not None:
        bias = torch.cat([v["bias"].detach() for v in values])
        module.register_parameter("bias", nn.Parameter(bias, requires_grad=False))
    path = _fused_name(gm, targets)
    owner, leaf = _owner(gm, path)
    owner.add_module(leaf, module)
    made[key] = path
    return path


def _fused_call(gm: fx.GraphModule, fmt: QuantGemmFormat, linears: List[QuantLinear], path: str) -> fx.Node:
    """``fmt.op`` over the fused tensors at ``path``, at the graph's current insertion point."""
    graph = gm.graph
    names = ("weight", "bias", *fmt.tensors)
    has_bias = linears[0].attrs["bias"] is not None
    nodes = [graph.get_attr(f"{path}.{n}") if (n != "bias" or has_bias) else None for n in names]
    return graph.call_function(fmt.op, (linears[0].x, *nodes, *linears[0].constants))


def _erase_linears(gm: fx.GraphModule, linears: List[QuantLinear]) -> None:
    for ql in linears:
        gm.graph.erase_node(ql.node)
    release_unused(gm, [a for ql in linears for a in ql.attrs.values()])


def _split_outputs(gm: fx.GraphModule, fmt: QuantGemmFormat, linears: List[QuantLinear], path: str) -> None:
    """Replace ``linears`` by one fused op and a split of its output (as ``_gemm_fusion.fuse_group``)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((ql.node for ql in linears), key=order.__getitem__)
    sizes = [int(get_attr_value(gm, ql.attrs["weight"]).shape[0]) for ql in linears]
    with graph.inserting_before(first):
        fused = _fused_call(gm, fmt, linears, path)
        split = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
        outs = [graph.call_function(operator.getitem, (split, i)) for i in range(len(linears))]
    for ql, out in zip(linears, outs):
        # a view of a split output may merge the split dim, which needs a copy: reshape does it
        for user in list(ql.node.users):
            if is_op(user, (aten.view, aten._unsafe_view)):
                user.target = aten.reshape.default
        ql.node.replace_all_uses_with(out)
    _erase_linears(gm, linears)


def _next_group(gm: fx.GraphModule, fmt: QuantGemmFormat, seen: Set[fx.Node]) -> Optional[List[QuantLinear]]:
    """The first input not in ``seen`` whose 2+ users are all ``fmt.op`` linears reading it as ``x``."""
    for node in gm.graph.nodes:
        if node in seen or len(node.users) < 2:
            continue
        linears = [parse(u, fmt) for u in node.users]
        if all(ql is not None and ql.x is node and node not in ql.node.args[1:] for ql in linears):
            return linears  # type: ignore[return-value]
    return None


def fuse_quant_gemms(gm: fx.GraphModule, fmt: QuantGemmFormat) -> int:
    """Fuse every group of ``fmt`` linears sharing an input, one group at a time (looking again
    after each: a fused group's outputs can be another group's input). Returns the count."""
    count, seen, made = 0, set(), {}
    refused: List[str] = []
    while True:
        linears = _next_group(gm, fmt, seen)
        if linears is None:
            break
        seen.add(linears[0].x)
        values = [_values(gm, ql, fmt) for ql in linears]
        reason = refusal(fmt, values)
        if reason:
            refused.append(f"{[str(ql.attrs['weight'].target) for ql in linears]}: {reason}")
            continue
        _split_outputs(gm, fmt, linears, _fused_tensors(gm, fmt, linears, values, made))
        count += 1
    _log(fmt, "linear groups", count, refused)
    return count


def _swiglu_pair(node: fx.Node, fmt: QuantGemmFormat) -> Optional[Tuple[fx.Node, QuantLinear, QuantLinear]]:
    """(silu, gate, up) when ``node`` is ``mul(silu(gate(x)), up(x))`` over ``fmt`` linears used only there."""
    if not is_op(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for silu, other in (node.args, node.args[::-1]):
        if not is_op(silu, aten.silu) or len(silu.users) != 1:
            continue
        gate, up = parse(silu.args[0], fmt), parse(other, fmt)
        if gate is None or up is None or gate.node is up.node or gate.x is not up.x:
            continue
        if len(gate.node.users) == 1 and len(up.node.users) == 1:
            return silu, gate, up
    return None


def fuse_quant_swiglus(gm: fx.GraphModule, fmt: QuantGemmFormat) -> int:
    """``mul(silu(gate(x)), up(x))`` -> ``torch_silu_and_mul(fmt.op(x, [gate; up]))``. Returns the count."""
    graph = gm.graph
    count, made = 0, {}
    refused: List[str] = []
    for node in list(graph.nodes):
        match = _swiglu_pair(node, fmt)
        if match is None:
            continue
        silu, gate, up = match
        linears = [gate, up]
        values = [_values(gm, ql, fmt) for ql in linears]
        reason = refusal(fmt, values)
        if reason is None and values[0]["weight"].shape[0] != values[1]["weight"].shape[0]:
            reason = "gate and up differ in size: silu_and_mul takes two equal halves"
        if reason:
            refused.append(f"{str(gate.attrs['weight'].target)}: {reason}")
            continue
        path = _fused_tensors(gm, fmt, linears, values, made)
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.autodeploy.torch_silu_and_mul.default,
                                        (_fused_call(gm, fmt, linears, path),))
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(silu)
        _erase_linears(gm, linears)
        count += 1
    _log(fmt, "SwiGLU gate/up pairs", count, refused)
    return count


def _log(fmt: QuantGemmFormat, what: str, count: int, refused: List[str]) -> None:
    if count:
        logger.info("%s: %d %s fused into one GEMM each", fmt.name, count, what)
    for line in refused:
        logger.debug("%s: left alone %s", fmt.name, line)
    if refused:
        logger.info("%s: %d %s left alone, e.g. %s", fmt.name, len(refused), what, refused[0])
