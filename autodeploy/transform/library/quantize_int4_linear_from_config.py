"""``quantize_int4_linear_from_config`` (pattern_matcher): GPTQ, AWQ and compressed-tensors int4
linears -> ``torch_quant_int4_linear``.

The three weight-only int4 formats store the same numbers (4-bit codes, a scale and a zero point
per group of input channels) in three layouts. At load, hooks convert each to one canonical
layout, so one op and one set of fast kernels serve all of them:

=====================  ===========================================  =============================
format                 checkpoint tensors per linear                 zero point
=====================  ===========================================  =============================
GPTQ (AutoGPTQ v1)     ``qweight`` int32 [K/8, N] (8 codes along K   ``qzeros`` int32 [K/g, N/8]
                       per int32, code j at bits 4j), ``scales``     storing zero - 1 (AutoGPTQ's
                       fp16 [K/g, N], ``g_idx`` int32 [K]            kernels add the 1 back)
AWQ (GEMM)             ``qweight`` int32 [K, N/8], 8 output columns  ``qzeros`` [K/g, N/8], same
                       per int32 in the order 0,2,4,6,1,3,5,7;       packing, stored as is
                       ``scales`` fp16 [K/g, N]
compressed-tensors     ``weight_packed`` int32 [N, K/8] (codes + 8   8 (symmetric)
``pack-quantized``     along K), ``weight_scale`` [N, K/g],
                       ``weight_shape`` [2]
=====================  ===========================================  =============================

Before::

    y = aten.linear(x, P.weight, P.bias)                  # float parameter [N, K]

After::

    y = autodeploy.torch_quant_int4_linear(x, P.int4_weight, P.bias, P.int4_scales, P.int4_zeros, g)
    # P.int4_weight: uint8 [N, K/2] (element 2i in the low nibble); scales, zeros: float32 [N, K/g]

Refused with the reason: other bit widths, GPTQ with act-order (``desc_act``, a ``g_idx`` that
is not ``k // g``), AWQ's GEMV layout, asymmetric or act-order compressed-tensors schemes.
"""

from typing import Any, Dict, List, Tuple

import torch
from torch import fx

from ...models.quantization import QuantizationInfo
from ...ops.quant.formats import pack_nibbles
from ...utils.errors import ModelSourceError
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_from_config import Buffer, CheckpointTensor, LinearFormat, quantize_linears

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_NIBBLE_OF_COLUMN = tuple(_AWQ_COLUMN_OF_NIBBLE.index(c) for c in range(8))  # 0, 4, 1, 5, 2, 6, 3, 7
_SCALE_DTYPES = ("F16", "BF16", "F32")
_INT_DTYPES = ("I32",)


def _nibbles_last(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> [..., M, 8]: code j of each int32 (bits 4j..4j+3)."""
    return (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15


def _gptq_weight(ts: List[torch.Tensor]) -> torch.Tensor:
    qweight, g_idx = ts
    codes = _nibbles_last(qweight.T).reshape(qweight.shape[1], -1)  # [N, K]: along K, 8 per int32
    k = codes.shape[1]
    groups = int(g_idx.max()) + 1 if g_idx.numel() else 1
    if not torch.equal(g_idx.long(), torch.arange(k) // (k // groups)):
        raise ModelSourceError(
            "GPTQ checkpoint has a g_idx that is not k // group_size (act-order / desc_act quantization); "
            "autodeploy loads GPTQ without act-order only"
        )
    return pack_nibbles(codes)


def _gptq_zeros(ts: List[torch.Tensor]) -> torch.Tensor:
    (qzeros,) = ts
    return (_nibbles_last(qzeros).reshape(qzeros.shape[0], -1) + 1).T.float().contiguous()


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ [R, N/8] -> [R, N] in column order."""
    return _nibbles_last(packed)[..., list(_AWQ_NIBBLE_OF_COLUMN)].reshape(packed.shape[0], -1)


def _transposed_float(ts: List[torch.Tensor]) -> torch.Tensor:
    return ts[0].T.float().contiguous()


def _ct_weight(ts: List[torch.Tensor]) -> torch.Tensor:
    packed, shape = ts
    codes = _nibbles_last(packed).reshape(packed.shape[0], -1)
    if [int(v) for v in shape.flatten()] != [codes.shape[0], codes.shape[1]]:
        raise ModelSourceError(f"compressed-tensors weight_shape {shape.tolist()} does not match the packed weight "
                               f"({codes.shape[0]} x {codes.shape[1]})")
    return pack_nibbles(codes)


def _group_fn(group: int):
    return lambda k: group if group > 0 else k


def int4_format(method: str, group: int) -> LinearFormat:
    g = _group_fn(group)
    n_over_8 = lambda n, k: n // 8  # noqa: E731
    groups = lambda n, k: k // g(k)  # noqa: E731
    if method == "gptq":
        tensors = (
            CheckpointTensor("qweight", _INT_DTYPES, lambda n, k: (k // 8, n), "packed 4-bit weight"),
            CheckpointTensor("qzeros", _INT_DTYPES, lambda n, k: (groups(n, k), n_over_8(n, k)), "packed zero points"),
            CheckpointTensor("scales", _SCALE_DTYPES, lambda n, k: (groups(n, k), n), "scale per group"),
            CheckpointTensor("g_idx", _INT_DTYPES, lambda n, k: (k,), "group index per input channel"),
        )
        sources = (("qweight", "g_idx"), _gptq_weight), (("scales",), _transposed_float), (("qzeros",), _gptq_zeros)
        marker, name = "qweight", "GPTQ int4"
    elif method == "awq":
        tensors = (
            CheckpointTensor("qweight", _INT_DTYPES, lambda n, k: (k, n_over_8(n, k)), "packed 4-bit weight"),
            CheckpointTensor("qzeros", _INT_DTYPES, lambda n, k: (groups(n, k), n_over_8(n, k)), "packed zero points"),
            CheckpointTensor("scales", _SCALE_DTYPES, lambda n, k: (groups(n, k), n), "scale per group"),
        )
        sources = (
            (("qweight",), lambda ts: pack_nibbles(_awq_unpack(ts[0]).T.contiguous())),
            (("scales",), _transposed_float),
            (("qzeros",), lambda ts: _awq_unpack(ts[0]).T.float().contiguous()),
        )
        marker, name = "qweight", "AWQ int4"
    else:
        tensors = (
            CheckpointTensor("weight_packed", _INT_DTYPES, lambda n, k: (n, k // 8), "packed 4-bit weight"),
            CheckpointTensor("weight_scale", _SCALE_DTYPES, lambda n, k: (n, groups(n, k)), "scale per group"),
            CheckpointTensor("weight_shape", ("I32", "I64"), lambda n, k: (2,), "original weight shape"),
        )
        sources = (
            (("weight_packed", "weight_shape"), _ct_weight),
            (("weight_scale",), lambda ts: ts[0].float().contiguous()),
            (("weight_scale",), lambda ts: torch.full(ts[0].shape, 8.0)),
        )
        marker, name = "weight_packed", "compressed-tensors int4"
    buffers = tuple(
        Buffer(buf, dtype, shape, src, convert)
        for buf, dtype, shape, (src, convert) in zip(
            ("int4_weight", "int4_scales", "int4_zeros"),
            (torch.uint8, torch.float32, torch.float32),
            (lambda n, k: (n, k // 2), lambda n, k: (n, groups(n, k)), lambda n, k: (n, groups(n, k))),
            sources,
        )
    )

    def shape_error(n: int, k: int):
        if k % 8 or (method != "compressed-tensors" and n % 8):
            return f"{name} packs 8 codes per int32, and {k if k % 8 else n} is not a multiple of 8"
        if k % g(k):
            return f"group_size {g(k)} does not divide the {k} inputs"
        return None

    return LinearFormat(name=name, op=torch.ops.autodeploy.torch_quant_int4_linear.default, marker=marker,
                        tensors=tensors, buffers=buffers, constants=lambda n, k: (g(k),), shape_error=shape_error)


def _refuse(info: QuantizationInfo, why: str) -> ModelSourceError:
    return ModelSourceError(f"checkpoint declares {info.describe()}: {why}")


def _group_of(info: QuantizationInfo) -> Tuple[str, int]:
    """(method, group size; -1 = one group per row) after refusing the variants autodeploy cannot load."""
    cfg: Dict[str, Any] = info.config
    if info.method in ("gptq", "awq"):
        if int(cfg.get("bits", 4)) != 4:
            raise _refuse(info, f"{cfg.get('bits')}-bit weights; autodeploy loads 4-bit {info.method.upper()} only")
        if info.method == "gptq" and cfg.get("desc_act"):
            raise _refuse(info, "act-order (desc_act: true) is not supported; quantize without desc_act")
        if info.method == "gptq" and str(cfg.get("checkpoint_format", "gptq")) != "gptq":
            raise _refuse(info, f"checkpoint_format '{cfg.get('checkpoint_format')}'; autodeploy reads AutoGPTQ's "
                                f"'gptq' layout")
        if info.method == "awq" and str(cfg.get("version", "gemm")).lower() != "gemm":
            raise _refuse(info, f"AWQ version '{cfg.get('version')}'; autodeploy reads the GEMM layout")
        if info.method == "awq" and cfg.get("zero_point") is False:
            raise _refuse(info, "AWQ without zero points is not supported")
        return info.method, int(cfg.get("group_size", 128))
    groups = [g for g in (cfg.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [g.get("weights") or {} for g in groups]
    if not weights:
        raise _refuse(info, "no config_groups with a weights scheme")
    w = weights[0]
    if any(other != w for other in weights[1:]):
        raise _refuse(info, "several weight schemes in config_groups; autodeploy loads one int4 scheme")
    if w.get("num_bits") != 4 or w.get("type", "int") != "int":
        raise _refuse(info, f"{w.get('num_bits')}-bit {w.get('type')} weights; autodeploy loads int4 pack-quantized")
    if not w.get("symmetric", True):
        raise _refuse(info, "asymmetric int4 (zero points) is not supported; autodeploy loads symmetric int4")
    if w.get("actorder"):
        raise _refuse(info, f"actorder '{w.get('actorder')}' is not supported")
    if any(g.get("input_activations") for g in groups):
        raise _refuse(info, "quantized input activations; autodeploy loads weight-only int4")
    strategy = w.get("strategy", "group")
    if strategy not in ("group", "channel"):
        raise _refuse(info, f"strategy '{strategy}'; autodeploy loads group or channel int4")
    return "compressed-tensors", int(w.get("group_size") or -1) if strategy == "group" else -1


class QuantizeInt4LinearFromConfigConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("quantize_int4_linear_from_config")
class QuantizeInt4LinearFromConfig(BaseTransform):
    config_class = QuantizeInt4LinearFromConfigConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        info = getattr(ctx.factory, "quantization", None)
        if info is None or info.transform != "quantize_int4_linear_from_config":
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        method, group = _group_of(info)
        count = quantize_linears(gm, ctx, int4_format(method, group))
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
