"""Quantized checkpoints: recognising them, and refusing those autodeploy cannot load.

A quantized checkpoint stores its linear weights in a narrow type (FP8, FP4, packed int4/int8)
next to scale tensors; loading it as a float model (casting the narrow weights, dropping the
scales) builds fine and generates garbage. So a checkpoint is checked at three points:

* the factory reads ``quantization_config`` from ``config.json`` and ModelOpt's
  ``hf_quant_config.json`` before anything is built (:func:`check_quantization`);
* the weight loader refuses a checkpoint tensor whose kind does not match the parameter
  (:func:`check_tensor_dtype`: FP8/FP4/integer data for a floating parameter);
* the weight loader refuses unused tensors named like the companions of a quantization format
  (:func:`quantization_companions`: ``weight_scale``, ``qzeros``, ``*_blocks``, ...).

:data:`SUPPORTED_QUANTIZATION` lists the formats that load, each through one
``quantize_*_from_config`` transform (``transform/library/quantize_*_from_config.py``) that
rewrites the checkpoint's quantized linears into canonical quantized ops before the weights load.
Supporting another format means adding its ``quant_method`` there and writing its transform.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch

from ..utils.errors import ModelSourceError

MODELOPT_CONFIG = "hf_quant_config.json"

# quant_method -> the algorithms of that method autodeploy loads (upper case; None: all of them),
# and the transform that loads it.
SUPPORTED_QUANTIZATION: Dict[str, Optional[FrozenSet[str]]] = {
    "modelopt": frozenset({"FP8", "NVFP4"}),
    "fp8": None,  # fine-grained (block) FP8
    "gptq": None,
    "awq": None,
    "compressed-tensors": frozenset({"PACK-QUANTIZED"}),
    "mxfp4": None,  # GPT-OSS's MXFP4 experts
}
QUANTIZATION_TRANSFORMS: Dict[Tuple[str, Optional[str]], str] = {
    ("modelopt", "FP8"): "quantize_fp8_linear_from_config",
    ("modelopt", "NVFP4"): "quantize_nvfp4_linear_from_config",
    ("fp8", None): "quantize_finegrained_fp8_linear_from_config",
    ("gptq", None): "quantize_int4_linear_from_config",
    ("awq", None): "quantize_int4_linear_from_config",
    ("compressed-tensors", "PACK-QUANTIZED"): "quantize_int4_linear_from_config",
    ("mxfp4", None): "quantize_mxfp4_moe_from_config",
}

# Floating dtypes a checkpoint tensor may be cast from into a floating parameter.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Names (last dotted component) of tensors that quantization formats store next to or instead of
# a weight. Generic names are matched exactly (a float model may well have a ``per_layer_input_scale``)...
COMPANION_LEAVES = frozenset({
    # ModelOpt FP8 / NVFP4 / INT4-AWQ: per-tensor or per-block scales, KV-cache scales, fake-quant amax
    "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "k_scale", "v_scale", "_amax",
    "_pre_quant_scale",
    "activation_scale",  # fine-grained FP8 with static activation scales
    "qweight", "qzeros", "scales", "g_idx",  # GPTQ / AWQ
    # compressed-tensors
    "weight_packed", "weight_shape", "weight_zero_point", "weight_global_scale", "input_global_scale",
    "weight_g_idx", "input_zero_point",
    "SCB", "weight_format", "absmax", "quant_map", "nested_absmax", "nested_quant_map",  # bitsandbytes
    "bitsandbytes__nf4", "bitsandbytes__fp4",  # bitsandbytes ``weight.quant_state.bitsandbytes__nf4``
})
# ... names only quantization formats use by their ending.
COMPANION_SUFFIXES = (
    "_weight_scale", "_weight_scale_2",  # fused experts: ``gate_up_proj_weight_scale``
    "weight_scale_inv", "_scale_inv",  # fine-grained (block) FP8, DeepSeek-V3 style; ``gate_up_proj_scale_inv``
    "_blocks", "_scales",  # GPT-OSS MXFP4 experts: ``gate_up_proj_blocks`` / ``gate_up_proj_scales``
)

_FLOAT_CHECKPOINT = (
    "a float checkpoint of the model instead (bf16/fp16/fp32 weights, e.g. the original model the quantized "
    "one was made from)"
)
FIX_HINT = "use " + _FLOAT_CHECKPOINT
FIX_SENTENCE = "Use " + _FLOAT_CHECKPOINT
# a quantized checkpoint that does not say so (or whose tensors its declared format does not explain)
UNDECLARED_HINT = (
    "a quantized checkpoint loads only when its config.json quantization_config (or ModelOpt's "
    "hf_quant_config.json) declares a supported format that matches its tensors; otherwise " + FIX_HINT
)


@dataclass(frozen=True)
class QuantizationInfo:
    """What a checkpoint declares about its quantization."""

    method: str  # quant_method, lower case ("modelopt", "fp8", "gptq", ...)
    algo: Optional[str] = None  # ModelOpt quant_algo (FP8, NVFP4, ...) or the format of the method
    declared_in: str = "config.json"
    details: Tuple[Tuple[str, Any], ...] = field(default=())
    # the whole quantization_config (merged over hf_quant_config.json's "quantization"): the
    # format's parameters (block sizes, bits, group size, excluded modules)
    config: Dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def transform(self) -> Optional[str]:
        """The ``quantize_*_from_config`` transform that loads this format."""
        return QUANTIZATION_TRANSFORMS.get((self.method, (self.algo or "").upper() or None)) or \
            QUANTIZATION_TRANSFORMS.get((self.method, None))

    def describe(self) -> str:
        text = f"quant_method '{self.method}'"
        if self.algo:
            text += f", quant_algo {self.algo}"
        return text + "".join(f", {key} {value}" for key, value in self.details)


def register_quantization(method: str, algos: Optional[Iterable[str]] = None) -> None:
    """Declare that autodeploy loads checkpoints of ``method`` (only ``algos`` of it, if given)."""
    SUPPORTED_QUANTIZATION[method.lower()] = frozenset(a.upper() for a in algos) if algos is not None else None


def is_supported(info: QuantizationInfo) -> bool:
    if info.method not in SUPPORTED_QUANTIZATION:
        return False
    algos = SUPPORTED_QUANTIZATION[info.method]
    return algos is None or (info.algo or "").upper() in algos


def _algo_of(qcfg: Dict[str, Any]) -> Optional[str]:
    for key in ("quant_algo", "format", "quant_type", "bnb_4bit_quant_type"):
        value = qcfg.get(key)
        if isinstance(value, str) and value:
            return value
    if qcfg.get("load_in_4bit"):
        return "4-bit"
    if qcfg.get("load_in_8bit"):
        return "8-bit"
    return None


def _details_of(qcfg: Dict[str, Any]) -> Tuple[Tuple[str, Any], ...]:
    keys = ("kv_cache_quant_algo", "weight_block_size", "bits", "group_size")
    return tuple((k, qcfg[k]) for k in keys if qcfg.get(k) not in (None, "", []))


def _read_modelopt_config(directory: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(directory, MODELOPT_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    quant = raw.get("quantization", raw) if isinstance(raw, dict) else {}
    return quant if isinstance(quant, dict) else {}


def _quantization_configs(raw_config: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """``quantization_config`` entries of ``config.json``, top level and in sub-configs."""
    found = [("config.json", raw_config.get("quantization_config"))]
    for key, value in raw_config.items():
        if isinstance(value, dict) and key.endswith("_config") and key != "quantization_config":
            found.append((f"config.json {key}", value.get("quantization_config")))
    return [(where, q) for where, q in found if q]


def detect_quantization(directory: str, raw_config: Dict[str, Any]) -> Optional[QuantizationInfo]:
    """The quantization a checkpoint declares (config.json, hf_quant_config.json), or None."""
    modelopt = _read_modelopt_config(directory)
    modelopt_algo = None
    if modelopt is not None:
        modelopt_algo = modelopt.get("quant_algo") or None
    for where, qcfg in _quantization_configs(raw_config):
        if not isinstance(qcfg, dict):
            return QuantizationInfo("unknown", None, where)
        legacy_bnb = _algo_of(qcfg) in ("4-bit", "8-bit")  # old bitsandbytes configs name no quant_method
        method = str(qcfg.get("quant_method") or ("bitsandbytes" if legacy_bnb else "unknown"))
        algo = _algo_of(qcfg) or (modelopt_algo if method.lower() == "modelopt" else None)
        merged = {**(modelopt or {}), **qcfg} if method.lower() == "modelopt" else dict(qcfg)
        return QuantizationInfo(method.lower(), algo, where, _details_of(qcfg), merged)
    if modelopt is not None and (modelopt_algo or modelopt.get("kv_cache_quant_algo")):
        return QuantizationInfo("modelopt", modelopt_algo, MODELOPT_CONFIG, _details_of(modelopt), dict(modelopt))
    return None


def check_quantization(directory: str, raw_config: Dict[str, Any], model: str) -> Optional[QuantizationInfo]:
    """Refuse a checkpoint whose declared quantization autodeploy cannot load; returns what it declares."""
    info = detect_quantization(directory, raw_config)
    if info is None or is_supported(info):
        return info
    raise ModelSourceError(
        f"{model} is a quantized checkpoint ({info.declared_in} declares {info.describe()}); autodeploy cannot "
        f"load this quantization format yet (supported: {supported_formats()}), and loading its weights as "
        f"float without their scales would generate garbage. {FIX_SENTENCE}"
    )


def supported_formats() -> str:
    """The formats that load, for error messages: ``modelopt (FP8, NVFP4), fp8, ...``."""
    parts = []
    for method, algos in sorted(SUPPORTED_QUANTIZATION.items()):
        parts.append(method + (f" ({', '.join(sorted(algos))})" if algos else ""))
    return ", ".join(parts)


# ---- checkpoint tensors -------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """FP8/FP4/E8M0 and other floating types that are only storage for quantized data."""
    return dtype.is_floating_point and dtype not in FLOAT_DTYPES


def check_tensor_dtype(key: str, source_dtype: torch.dtype, target: str, target_dtype: torch.dtype) -> None:
    """Refuse casting checkpoint tensor ``key`` into ``target`` across kinds (FP8/FP4/integer data
    into a floating parameter); float-to-float casts and integer buffers pass."""
    if source_dtype == target_dtype:
        return  # a quantized op's own tensor (FP8 weight into an FP8 buffer)
    if target_dtype.is_floating_point:
        ok = source_dtype in FLOAT_DTYPES
    else:
        ok = not is_quantized_dtype(source_dtype)
    if ok:
        return
    where = f"'{key}'" + (f" (for '{target}')" if target != key else "")
    raise ModelSourceError(
        f"checkpoint tensor {where} is {dtype_name(source_dtype)}, but the model expects "
        f"{dtype_name(target_dtype)}; casting it would silently corrupt the weights. The checkpoint looks "
        f"quantized (narrow or packed weights stored with scale tensors): {UNDECLARED_HINT}"
    )


def is_quantization_companion(name: str) -> bool:
    leaf = name.rpartition(".")[2]
    return leaf in COMPANION_LEAVES or leaf.endswith(COMPANION_SUFFIXES)


def quantization_companions(names: Iterable[str]) -> List[str]:
    return sorted(n for n in names if is_quantization_companion(n))


def companions_error(directory: str, companions: List[str], missing: Iterable[str] = ()) -> ModelSourceError:
    shown = ", ".join(companions[:5]) + (f" and {len(companions) - 5} more" if len(companions) > 5 else "")
    missing = list(missing)
    also = f"; {len(missing)} model tensors have no float weight in it (e.g. {missing[0]})" if missing else ""
    return ModelSourceError(
        f"checkpoint {directory} has tensors of a quantization format that the model does not use ({shown})"
        f"{also}: the checkpoint looks quantized, and its weights would be used without their scales. "
        f"{UNDECLARED_HINT}"
    )


# safetensors header dtype names of the quantized floating types, as torch names them
SAFETENSORS_DTYPE_NAMES = {
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F4": "float4_e2m1fn_x2",
}


def quantized_dtype_error(directory: str, tensors: List[Tuple[str, str]], expected: torch.dtype) -> ModelSourceError:
    """``tensors``: (name, safetensors dtype) of checkpoint tensors in FP8/FP4 types."""
    shown = ", ".join(f"'{name}' ({SAFETENSORS_DTYPE_NAMES.get(dt, dt)})" for name, dt in tensors[:3]) + (
        f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
    )
    return ModelSourceError(
        f"checkpoint {directory} stores {len(tensors)} tensors in quantized types: {shown}, but its config.json "
        f"declares no quantization_config and the model expects {dtype_name(expected)} weights; casting them "
        f"would silently corrupt the weights. The checkpoint looks quantized: {UNDECLARED_HINT}"
    )
