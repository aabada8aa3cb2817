"""Shared by ``fuse_fp8_linear``, ``fuse_finegrained_fp8_linear`` and ``fuse_nvfp4_linear``: a
canonical quantized linear becomes its activation quantization plus a plain linear over the
weight decoded once.

Before::

    y = autodeploy.torch_quant_<fmt>_linear(x, P.weight, P.bias, <scales...>)   # decodes W every call

After::

    xq = autodeploy.torch_quant_<fmt>_activation(x, <activation scale args>)   # the format's numerics
    y = aten.linear(xq, P.weight, P.bias)       # P.weight: the decoded weight, deployment dtype

Why: on a CPU there is no FP8/FP4 GEMM instruction, and decoding the weight on every call
measured 30-40x slower than a float GEMV. Decoding once at load gives the same values the
reference computes (e4m3 and e2m1 values times float32 scales are exact in float32), so the
output equals the reference op's up to summation order; the activation keeps the format's
rounding, so the model sees what the narrow GEMM on a GPU would see. The decoded weight is a
plain float linear, which ``select_linear_backend`` then packs for oneDNN like any other. The
cost is memory: the weight takes the deployment dtype's width (4 bytes per value in float32)
instead of one byte (FP8) or half a byte (NVFP4).
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Sequence

import torch
from torch import fx

from ...utils.logging import get_logger
from ..graph_utils import add_tensor, get_attr_value, nodes_calling, owner_of
from ..interface import PipelineContext

logger = get_logger(__name__)


@dataclass(frozen=True)
class DecodeRule:
    """How one canonical quantized linear splits."""

    op: Any  # the canonical op (``.default``)
    # (weight, *tensor and constant args after bias) -> float32 weight [N, K]
    decode: Callable[..., torch.Tensor]
    # the activation op, and which positions of the canonical op's args after bias it takes
    activation: Any
    activation_args: Callable[[Sequence[Any]], tuple]


def _delete_attr(gm: fx.GraphModule, target: str) -> None:
    owner, leaf = owner_of(gm, target)
    owner._buffers.pop(leaf, None)
    owner._parameters.pop(leaf, None)


def decode_quantized_linears(gm: fx.GraphModule, ctx: PipelineContext, rule: DecodeRule) -> int:
    """Split every ``rule.op`` whose tensors are module attributes (see the module docstring)."""
    count = 0
    for node in nodes_calling(gm, rule.op):
        x, weight, bias, *rest = node.args
        attrs = [a for a in (weight, *rest) if isinstance(a, fx.Node)]
        if any(a.op != "get_attr" for a in attrs):
            continue  # scales computed in the graph: not a weight this pass can decode once
        values = [get_attr_value(gm, a) if isinstance(a, fx.Node) else a for a in (weight, *rest)]
        decoded = rule.decode(*values).to(ctx.dtype)
        with gm.graph.inserting_before(node):
            act = gm.graph.call_function(rule.activation, (x, *rule.activation_args(rest)))
            act.meta["val"] = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        # the quantized tensors go before the float weight is added, so peak memory is one weight
        old_targets: List[str] = [str(a.target) for a in attrs if len(a.users) == 1]
        with gm.graph.inserting_before(node):
            for target in old_targets:
                _delete_attr(gm, target)
            w_node = gm.graph.get_attr(add_tensor(gm, str(weight.target).rpartition(".")[0], "weight", decoded,
                                                  parameter=True))
            new = gm.graph.call_function(torch.ops.aten.linear.default, (act, w_node, bias))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for a in attrs:
            if not a.users:
                gm.graph.erase_node(a)
        count += 1
    if count:
        logger.info("%s: %d linears decoded once to %s, activations quantized per call", rule.op.name(), count,
                    str(ctx.dtype).replace("torch.", ""))
    gm.graph.lint()
    gm.recompile()
    return count


def first_tensor_args(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple]:
    """Positions (after bias) of the canonical op's args that the activation op takes."""
    return lambda rest: tuple(rest[i] for i in indices)
