"""Shared by ``fuse_int4_linear`` and ``fuse_int8_linear``: the implementation of a weight-only
quantized linear, chosen per weight at build time.

Before::

    y = autodeploy.torch_quant_int4_linear(x, W.q, b, W.scales, W.zeros, g)   # decodes W every call
    y = autodeploy.torch_quant_int8_linear(x, W.q, b, W.scales)

After, ``packed`` (torch's CPU kernels over the quantized weight, see ``ops/quant/cpu_kernels``)::

    y = autodeploy.cpu_int4pack_linear(x, W.packed, W.scales_and_zeros, g, N, b)
    y = autodeploy.cpu_int8pack_linear(x, W.q, W.scales_bf16, b)

After, ``dequantized`` (the weight decoded once into the deployment dtype)::

    y = aten.linear(x, W.weight, b)      # then packed for oneDNN by select_linear_backend on CPU

``auto`` (default) takes ``packed`` for a weight where the kernel exists on this CPU and
measured faster than a float32 GEMV of the same shape at one row (``measure_weight_only_speedup``,
~0.1-0.3 s per distinct shape at build time; the CPUs this project runs on differ: on one with
AVX-512 BF16 the int4 kernel read a 4096x4096 weight 3.8x faster than float32, machines without
it may not gain), else ``dequantized``. On CUDA ``auto`` is ``dequantized`` (no packed kernel
here yet). ``reference`` keeps the canonical op (decodes per call: for checks only).

Precision: the packed kernels take bfloat16 activations (their only vectorised path), so each
packed linear rounds its input and output to bfloat16 (measured rel. RMSE vs the exact product
<= 5e-3, small next to int4/int8 quantization error itself); ``dequantized`` is exact to float32.
"""

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from pydantic import Field
from torch import fx

from ...ops.quant import cpu_kernels, formats
from ...utils.logging import get_logger
from ..graph_utils import add_tensor, get_attr_value, nodes_calling, owner_of
from ..interface import PipelineContext, Stage, TransformConfig

logger = get_logger(__name__)
Backend = Literal["auto", "packed", "dequantized", "reference"]


class WeightOnlyBackendConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    backend: Backend = Field(
        default="auto",
        description="auto: per weight, the packed CPU kernel where it exists and measured faster than a float32 "
        "GEMV of that shape, else dequantized; packed: the kernel wherever the shape allows; dequantized: decode "
        "once to the deployment dtype (exact, float memory); reference: keep the canonical op (decodes per call).",
    )


@dataclass(frozen=True)
class WeightOnlyKind:
    name: str  # "int4" | "int8"
    op: Any  # the canonical op
    decode: Callable[..., torch.Tensor]  # (weight, *args after bias) -> float32 [N, K]
    pack: Callable[..., Any]  # (weight, *args after bias) -> packed tensors (ValueError when refused)
    packed_call: Callable[[fx.GraphModule, Any, Any, Any, str], fx.Node]  # (gm, x, packed, bias, owner path)
    group: Callable[..., int]  # (*args after bias) -> group size (0 for int8)


def _choose(kind: WeightOnlyKind, backend: str, device: torch.device, n: int, k: int, group: int) -> str:
    if backend != "auto":
        return backend
    if device.type != "cpu" or not cpu_kernels.kernel_available(kind.name):
        return "dequantized"
    return "packed" if cpu_kernels.measure_weight_only_speedup(kind.name, n, k, group) > 1.0 else "dequantized"


def _drop_unused(gm: fx.GraphModule, attrs) -> None:
    for a in attrs:
        if isinstance(a, fx.Node) and a.op == "get_attr" and not a.users:
            owner, leaf = owner_of(gm, str(a.target))
            owner._buffers.pop(leaf, None)
            owner._parameters.pop(leaf, None)
            gm.graph.erase_node(a)


def select_weight_only_backend(gm: fx.GraphModule, ctx: PipelineContext, kind: WeightOnlyKind, backend: str) -> int:
    """Rewrite every ``kind.op`` over module tensors with the chosen implementation; returns how many."""
    if backend == "reference":
        return 0
    device = torch.device(ctx.device)
    chosen = {"packed": 0, "dequantized": 0}
    for node in nodes_calling(gm, kind.op):
        x, weight, bias, *rest = node.args
        tensors = [weight, *(a for a in rest if isinstance(a, fx.Node))]
        if any(a.op != "get_attr" for a in tensors):
            continue
        values = [get_attr_value(gm, a) if isinstance(a, fx.Node) else a for a in (weight, *rest)]
        n = values[0].shape[0]
        k = values[0].shape[1] * (2 if kind.name == "int4" else 1)
        how = _choose(kind, backend, device, n, k, kind.group(*values[1:]))
        path = str(weight.target).rpartition(".")[0]
        new = None
        with gm.graph.inserting_before(node):
            if how == "packed":
                try:
                    packed = kind.pack(*values)
                except ValueError as exc:
                    logger.info("%s: %s; decoding it to float instead", path, exc)
                    how = "dequantized"
                else:
                    new = kind.packed_call(gm, x, packed, bias, path)
            if how == "dequantized":
                decoded = kind.decode(*values).to(ctx.dtype)
                w = gm.graph.get_attr(add_tensor(gm, path, "weight", decoded, parameter=True))
                new = gm.graph.call_function(torch.ops.aten.linear.default, (x, w, bias))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        _drop_unused(gm, tensors)
        chosen[how] += 1
    if sum(chosen.values()):
        logger.info("%s linears: %d on the packed CPU kernel (bfloat16 activations), %d decoded to %s",
                    kind.name, chosen["packed"], chosen["dequantized"], str(ctx.dtype).replace("torch.", ""))
    gm.graph.lint()
    gm.recompile()
    return sum(chosen.values())


def _int4_call(gm: fx.GraphModule, x: Any, packed: cpu_kernels.Int4Packed, bias: Any, path: str) -> fx.Node:
    w = gm.graph.get_attr(add_tensor(gm, path, "int4_packed", packed.weight))
    sz = gm.graph.get_attr(add_tensor(gm, path, "int4_scales_and_zeros", packed.scales_and_zeros))
    return gm.graph.call_function(torch.ops.autodeploy.cpu_int4pack_linear.default,
                                  (x, w, sz, packed.group_size, packed.out_features, bias))


def _int8_call(gm: fx.GraphModule, x: Any, packed: cpu_kernels.Int8Packed, bias: Any, path: str) -> fx.Node:
    w = gm.graph.get_attr(add_tensor(gm, path, "int8_packed", packed.weight))
    s = gm.graph.get_attr(add_tensor(gm, path, "int8_scales_bf16", packed.scales))
    return gm.graph.call_function(torch.ops.autodeploy.cpu_int8pack_linear.default, (x, w, s, bias))


INT4 = WeightOnlyKind(
    name="int4",
    op=torch.ops.autodeploy.torch_quant_int4_linear.default,
    decode=formats.dequantize_int4,
    pack=cpu_kernels.pack_int4_for_cpu,
    packed_call=_int4_call,
    group=lambda scales, zeros, group_size: int(group_size),
)
INT8 = WeightOnlyKind(
    name="int8",
    op=torch.ops.autodeploy.torch_quant_int8_linear.default,
    decode=formats.dequantize_int8,
    pack=cpu_kernels.pack_int8_for_cpu,
    packed_call=_int8_call,
    group=lambda scales: 0,
)

