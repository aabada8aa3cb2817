"""``quantize_weights`` (post_load_fusion): int8 / int4 weight-only or fine-grained FP8 quantization at load.

A float checkpoint's linears are quantized once, at load (gpt-fast's and torchao's weight-only
schemes), opt-in with ``method`` or the top-level ``quantization`` setting.

Before (after ``fuse_gemms`` / ``fuse_swiglu``, float weights)::

    qkv = aten.linear(x, attn.fused_q_proj_k_proj_v_proj)                     # float [N, K]
    y = autodeploy.torch_fused_swiglu_mlp(h, mlp.fused_gate_proj_up_proj, mlp.down_proj.weight)
    logits = aten.linear(z, lm_head.weight)

After, ``method: int8`` (symmetric, one scale per output channel)::

    qkv = autodeploy.torch_quant_int8_linear(x, attn.fused_q_proj_k_proj_v_proj_q, None,
                                             attn.fused_q_proj_k_proj_v_proj_scales)   # int8 [N, K], f32 [N]
    gu = autodeploy.torch_quant_int8_linear(h, mlp.fused_gate_proj_up_proj_q, None, ..._scales)
    y = autodeploy.torch_quant_int8_linear(autodeploy.torch_silu_and_mul(gu), mlp.down_proj.weight_q, None,
                                           mlp.down_proj.weight_scales)
    logits = autodeploy.torch_quant_int8_linear(z, lm_head.weight_q, None, lm_head.weight_scales)

After, ``method: int4`` (asymmetric, a scale and an integer zero point per ``group_size`` inputs)::

    qkv = autodeploy.torch_quant_int4_linear(x, ..._q, None, ..._scales, ..._zeros, 128)  # uint8 [N, K/2]

Why: decoding one token reads every weight once, so on a CPU its time is the weights' bytes
over memory bandwidth; int8 stores a float32 weight in a quarter of the bytes, int4 (group 128)
in about a seventh. The numerics are :mod:`autodeploy.ops.quant.formats` (``quantize_int8``,
``quantize_int4``), the same ones the reference ops decode, so nothing can disagree on rounding.
The reference ops decode the whole weight on every call (slow, exact); ``fuse_int8_linear`` /
``fuse_int4_linear`` swap them for packed kernels later.

What is quantized: every ``aten.linear`` / ``torch_linear_simple`` whose weight is a 2-D float
``get_attr`` tensor, and the weights of ``torch_fused_swiglu_mlp`` (split into quantized linear
-> ``torch_silu_and_mul`` -> quantized linear; gate rows first, as the fused op reads them) and
``torch_swiglu_mlp`` (gate, up, ``silu(gate) * up``, down). It runs after the GEMM fusions so a
fused matrix is quantized as one; both formats quantize each output row independently, so that
equals quantizing the original matrices apart. ``select_linear_backend`` runs after it and packs
only what is still float. Left alone: weights computed in the graph, non-float weights (already
quantized checkpoints), and linears whose module path matches an ``exclude`` pattern.

The LM head is quantized too by default, as gpt-fast does: it is the largest single matrix of
a small model and read whole for every decoded token. What that costs, as the relative RMS
error of the logits against float (one prompt; "head alone" excludes everything but it)::

                          all linears   head excluded   head alone   weights (float32: 477.6 MiB)
    small, int8              3.2e-2        3.1e-2         7.7e-3      191.7 MiB (head float: 261.9)
    small, int4 (g128)       0.45          0.44           0.10        149.5 MiB (head float: 230.1)
    demo, int8               4.1e-3        3.1e-3         2.6e-3      (tied head, see below)
    demo, int4 (g128/64)     5.1e-2        3.5e-2         3.6e-2

``small`` has random Gaussian weights, the worst case for min/max rounding, which compounds over
its 12 layers; ``demo`` is trained (greedy argmax of every position unchanged with int8; 94% with
int4, 97% with the head excluded). Excluding the head (``exclude: [lm_head]``) buys little
accuracy for 70-80 MiB on ``small``. A head tied to the embedding (Gemma, ``demo``) is quantized
as a copy that the head reads while the embedding keeps the float table: less to read per
token, but more memory, not less.

``exclude`` patterns (``fnmatch``) are matched against a linear's module path: its weight's name
without ``.weight`` (``model.layers.0.mlp.down_proj``, ``lm_head``). A matrix that
``fuse_gemms`` / ``fuse_swiglu`` made (``model.layers.0.self_attn.fused_q_proj_k_proj_v_proj``)
is matched by that name and by each fused linear's path (``model.layers.0.self_attn.q_proj``,
...): excluding any part keeps the whole fused matrix float.

int4 needs K to be a multiple of the group: a linear whose K is not a multiple of
``group_size`` uses the largest power of two below it (down to 32) that divides K, which only
adds scales (more accurate, slightly larger); if none does, the linear stays float and one
warning names it.

Memory: one weight at a time, each float tensor released as soon as nothing reads it, so the
model never holds more than its float weights plus one weight's quantized form. Loaded weights
are views of the memory-mapped checkpoint, so what is left float (embedding, norms) is then
copied out of it, which lets the mapping, and every page quantizing read, go. Measured building
``small`` for CPU: weights 475.7 MiB float -> 189.8 (int8) / 147.6 (int4); process RSS after
the build 1013 -> 798 / 704 MiB (without that copy, int8 stayed at 1026).
"""

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import torch
from pydantic import Field, field_validator
from torch import fx

from ...ops.quant import formats
from ...utils.logging import get_logger
from ..graph_utils import add_tensor, arg, get_attr_value, owner_of
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from .select_linear_backend import _copy_out_of_checkpoint_mapping

aten = torch.ops.aten
ad = torch.ops.autodeploy
logger = get_logger(__name__)

Method = Literal["int8", "int4", "fp8"]


class QuantizeWeightsConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # the point: float weights replaced by narrow ones
    method: Optional[Method] = Field(
        default=None,
        description="quantization of float linears at load: int8 (weight-only, symmetric per output channel), "
        "int4 (weight-only, asymmetric per group_size inputs, integer zero points) or fp8 (fine-grained FP8 as "
        "DeepSeek-V3 ships it: e4m3 weights with a scale per 128x128 tile, activations quantized per token per "
        "128 channels at run time); unset: nothing changes. The top-level setting 'quantization' is its shortcut.",
    )
    group_size: int = Field(
        default=128,
        description="int4 only: input channels per scale and zero point (a power of two, at least 16). A linear "
        "whose input size is not a multiple uses the largest power of two below it, down to 32, that divides "
        "it; none: it stays float (with a warning).",
    )
    exclude: List[str] = Field(
        default_factory=list,
        description="fnmatch patterns over a linear's module path (its weight name without '.weight', e.g. "
        "'lm_head', '*.mlp.down_proj'); a fused matrix also matches through each linear fused into it. "
        "Matching linears stay float. The LM head is quantized unless excluded (as gpt-fast does).",
    )

    @field_validator("group_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 16 or value & (value - 1):
            raise ValueError(f"group_size must be a power of two of at least 16, got {value}")
        return value


# the canonical op each method emits, and fine-grained FP8's tile
_OPS = {"int8": ad.torch_quant_int8_linear.default, "int4": ad.torch_quant_int4_linear.default,
        "fp8": ad.torch_quant_finegrained_fp8_linear.default}
FP8_BLOCK = (128, 128)

# ops spelling a plain linear (x, weight, bias)
_LINEARS = (aten.linear.default, ad.torch_linear_simple.default)


@dataclass
class _Stats:
    linears: int = 0
    weights: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    left_float: List[str] = field(default_factory=list)


class _Quantizer:
    """Quantizes weights on first use (once per tensor, so a shared or tied weight is not
    quantized twice), emits the linears that read them, and frees each float tensor as soon as no
    ``get_attr`` reads it any more."""

    def __init__(self, gm: fx.GraphModule, method: str, group_size: int, exclude: Sequence[str]):
        self.gm, self.method, self.group_size, self.exclude = gm, method, group_size, list(exclude)
        self.done: Dict[str, Optional[Tuple[List[str], Tuple[Any, ...]]]] = {}  # target -> (buffers, constants)
        self.readers: Dict[str, int] = {}  # get_attr nodes per target, to know when a tensor is unread
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                self.readers[str(node.target)] = self.readers.get(str(node.target), 0) + 1
        self.stats = _Stats()

    # ---- deciding --------------------------------------------------------------------------
    def quantizable(self, weight: Any) -> bool:
        """Whether ``weight`` is a float get_attr tensor this config quantizes (decided once)."""
        if not isinstance(weight, fx.Node) or weight.op != "get_attr":
            return False
        target = str(weight.target)
        if target in self.done:
            return self.done[target] is not None
        value = get_attr_value(self.gm, weight)
        ok = (isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point()
              and value.element_size() >= 2 and not value.is_meta and not value.is_mkldnn)
        if ok and any(fnmatch.fnmatchcase(p, pat) for p in _linear_paths(self.gm, target) for pat in self.exclude):
            ok = False
        if ok and self.method == "int4" and _int4_group(int(value.shape[1]), self.group_size) is None:
            self.stats.left_float.append(target)
            ok = False
        if not ok:
            self.done[target] = None
        return ok

    # ---- rewriting -------------------------------------------------------------------------
    def linear(self, before: fx.Node, x: Any, weight: Any, bias: Any) -> fx.Node:
        """A linear of ``x`` by ``weight`` before ``before``: quantized if the weight is, else ``aten.linear``."""
        graph = self.gm.graph
        if not self.quantizable(weight):
            with graph.inserting_before(before):
                return graph.call_function(aten.linear.default, (x, weight, bias))
        buffers, constants = self._quantized(weight)
        with graph.inserting_before(before):
            q, *scales = (graph.get_attr(name) for name in buffers)
            op = _OPS[self.method]
            node = graph.call_function(op, (x, q, bias, *scales, *constants))
        for name in buffers:
            self.readers[name] = self.readers.get(name, 0) + 1
        self.stats.linears += 1
        return node

    def _quantized(self, weight: fx.Node) -> Tuple[List[str], Tuple[Any, ...]]:
        target = str(weight.target)
        done = self.done.get(target)
        if done is not None:
            return done
        value = get_attr_value(self.gm, weight).detach()
        if self.method == "int8":
            tensors = dict(zip(("q", "scales"), formats.quantize_int8(value)))
            constants: Tuple[Any, ...] = ()
        elif self.method == "fp8":
            tensors = dict(zip(("q", "scale_inv"), formats.quantize_fp8_blocks(value, FP8_BLOCK)))
            constants = FP8_BLOCK
        else:
            group = _int4_group(int(value.shape[1]), self.group_size)
            assert group is not None  # quantizable() checked
            if group != self.group_size:
                logger.debug("%s: input size %d, int4 group %d instead of %d", target, value.shape[1], group,
                             self.group_size)
            tensors = dict(zip(("q", "scales", "zeros"), formats.quantize_int4(value, group)))
            constants = (group,)
        path, _, leaf = target.rpartition(".")
        names = [add_tensor(self.gm, path, f"{leaf}_{suffix}", tensor) for suffix, tensor in tensors.items()]
        self.stats.weights += 1
        self.stats.bytes_before += value.numel() * value.element_size()
        self.stats.bytes_after += sum(t.numel() * t.element_size() for t in tensors.values())
        self.done[target] = (names, constants)
        return names, constants

    def release(self, nodes: Sequence[Any]) -> None:
        """Erase ``get_attr`` nodes nothing uses any more and free the tensors no node reads."""
        for node in nodes:
            if not isinstance(node, fx.Node) or node.op != "get_attr" or node.users:
                continue
            target = str(node.target)
            self.gm.graph.erase_node(node)
            self.readers[target] -= 1
            if self.readers[target] == 0:
                owner, leaf = owner_of(self.gm, target)
                owner._parameters.pop(leaf, None)
                owner._buffers.pop(leaf, None)


def _rewrite(q: _Quantizer, node: fx.Node) -> Optional[fx.Node]:
    """The replacement of ``node`` if it holds a weight to quantize, else None."""
    graph = q.gm.graph
    if node.target in _LINEARS:
        x, weight, bias = node.args[0], node.args[1], arg(node, 2, "bias")
        return q.linear(node, x, weight, bias) if q.quantizable(weight) else None
    if node.target == ad.torch_fused_swiglu_mlp.default:
        x, w_gu, w_d = node.args[:3]
        if not (q.quantizable(w_gu) or q.quantizable(w_d)):
            return None
        gate_up = q.linear(node, x, w_gu, arg(node, 3, "gate_up_bias"))
        with graph.inserting_before(node):
            act = graph.call_function(ad.torch_silu_and_mul.default, (gate_up,))
        return q.linear(node, act, w_d, arg(node, 4, "down_bias"))
    if node.target == ad.torch_swiglu_mlp.default:
        x, w_g, w_u, w_d = node.args[:4]
        if not any(q.quantizable(w) for w in (w_g, w_u, w_d)):
            return None
        gate = q.linear(node, x, w_g, arg(node, 4, "gate_bias"))
        up = q.linear(node, x, w_u, arg(node, 5, "up_bias"))
        with graph.inserting_before(node):
            act = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.silu.default, (gate,)), up))
        return q.linear(node, act, w_d, arg(node, 6, "down_bias"))
    return None


@TransformRegistry.register("quantize_weights")
class QuantizeWeights(BaseTransform):
    config_class = QuantizeWeightsConfig
    run_after = ("fuse_gemms", "fuse_gemms_mixed_children", "fuse_swiglu", "fuse_silu_mul")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: QuantizeWeightsConfig = self.config  # type: ignore[assignment]
        if cfg.method is None:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason="opt-in: quantization is not set")
        q = _Quantizer(gm, cfg.method, cfg.group_size, cfg.exclude)
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            new = _rewrite(q, node)
            if new is None:
                continue
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            node.replace_all_uses_with(new)
            weights = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
            gm.graph.erase_node(node)
            q.release(weights)  # the float tensors this node read, freed if it was their last reader
        _report(q.stats, cfg)
        if q.stats.weights:
            # the float tensors left (embedding, norms) are views of the memory-mapped checkpoint and would
            # keep it, and every page quantizing read, resident (`small`, int8: RSS 1026 MiB instead of 798)
            _copy_out_of_checkpoint_mapping(gm)
        gm.recompile()
        done = q.stats.linears > 0
        return TransformInfo(num_matches=q.stats.linears, is_clean=not done, has_valid_shapes=not done)


def _report(stats: _Stats, cfg: QuantizeWeightsConfig) -> None:
    if stats.left_float:
        more = len(stats.left_float) - 5
        shown = ", ".join(stats.left_float[:5]) + (f" and {more} more" if more > 0 else "")
        logger.warning("quantize_weights: %d weights stay float: no power-of-two int4 group >= %d divides their "
                       "input size: %s", len(stats.left_float), min(32, cfg.group_size), shown)
    fmt = f"int4 (group {cfg.group_size})" if cfg.method == "int4" else cfg.method
    logger.info("quantize_weights %s: %d linears over %d weights, %.1f MiB -> %.1f MiB", fmt, stats.linears,
                stats.weights, stats.bytes_before / 2**20, stats.bytes_after / 2**20)


def _int4_group(k: int, group_size: int) -> Optional[int]:
    """``group_size`` if it divides ``k``, else the largest smaller power of two >= min(32,
    group_size) that does, else None."""
    g, floor = group_size, min(32, group_size)
    while g >= floor:
        if k % g == 0:
            return g
        g //= 2
    return None


def _linear_paths(gm: fx.GraphModule, target: str) -> List[str]:
    """The names ``exclude`` patterns are matched against (see the module docstring)."""
    path = target[: -len(".weight")] if target.endswith(".weight") else target
    parent, _, leaf = path.rpartition(".")
    if not parent or not leaf.startswith("fused_"):
        return [path]
    try:
        children = [name for name, _ in gm.get_submodule(parent).named_children()]
    except AttributeError:
        return [path]
    parts = _split_fused(leaf[len("fused_"):], children) or []
    return [path] + [f"{parent}.{p}" for p in parts]


def _split_fused(joined: str, names: Sequence[str]) -> Optional[List[str]]:
    """``"q_proj_k_proj_v_proj"`` -> ``["q_proj", "k_proj", "v_proj"]`` given the module names,
    or None when ``joined`` is not such a sequence (``_gemm_fusion`` names fused weights so)."""
    for name in names:
        if joined == name:
            return [name]
        if joined.startswith(name + "_"):
            rest = _split_fused(joined[len(name) + 1:], names)
            if rest is not None:
                return [name] + rest
    return None

