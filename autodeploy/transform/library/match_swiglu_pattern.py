"""``match_swiglu_pattern`` (pattern_matcher): the gated-SiLU MLP -> ``torch_swiglu_mlp``.

Before (Llama, Mistral, Qwen, ...)::

    y = aten.linear(mul(silu(aten.linear(x, w_gate)), aten.linear(x, w_up)), w_down)

After::

    y = autodeploy.torch_swiglu_mlp(x, w_gate, w_up, w_down)

Biases are carried when all three linears have them. Another activation (GeGLU), or an MLP whose
gate and up read different inputs, is left alone.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ..pattern_matcher import PatternSet


def _swiglu(x, gate_w, up_w, down_w):
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def _swiglu_up_first(x, gate_w, up_w, down_w):
    return F.linear(F.linear(x, up_w) * F.silu(F.linear(x, gate_w)), down_w)


def _replace(x, gate_w, up_w, down_w):
    return torch.ops.autodeploy.torch_swiglu_mlp(x, gate_w, up_w, down_w)


def _swiglu_bias(x, gate_w, up_w, down_w, gate_b, up_b, down_b):
    return F.linear(F.silu(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)


def _replace_bias(x, gate_w, up_w, down_w, gate_b, up_b, down_b):
    return torch.ops.autodeploy.torch_swiglu_mlp(x, gate_w, up_w, down_w, gate_b, up_b, down_b)


_PATTERNS: Optional[PatternSet] = None


def swiglu_patterns() -> PatternSet:
    global _PATTERNS
    if _PATTERNS is None:
        ps = PatternSet("match_swiglu_pattern")
        x, g, u, d = torch.randn(2, 3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
        for search in (_swiglu, _swiglu_up_first):
            ps.add(search, [x, g, u, d], replace_fn=_replace, static_inputs=(1, 2, 3))
        ps.add(_swiglu_bias, [x, g, u, d, torch.randn(16), torch.randn(16), torch.randn(8)], replace_fn=_replace_bias,
               static_inputs=(1, 2, 3, 4, 5, 6))
        _PATTERNS = ps
    return _PATTERNS


class MatchSwigluConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_swiglu_pattern")
class MatchSwigluPattern(BaseTransform):
    config_class = MatchSwigluConfig
    # quantized linears first: their gate/up/down must not be read as a float SwiGLU
    run_after = ("cleanup_noop_cast", "quantize_fp8_linear_from_config", "quantize_nvfp4_linear_from_config",
                 "quantize_finegrained_fp8_linear_from_config", "quantize_int4_linear_from_config")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = swiglu_patterns().apply(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
