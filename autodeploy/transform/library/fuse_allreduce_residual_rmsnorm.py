"""``fuse_allreduce_residual_rmsnorm`` (post_load_fusion): all-reduce -> residual add -> RMSNorm
becomes one op with two outputs.

Before (a row-parallel ``o_proj`` / ``down_proj`` of a pre-norm layer, after ``fuse_add_rms_norm``
and ``fuse_rmsnorm``)::

    p = autodeploy.torch_dist_all_reduce(partial)               # read only by the add+norm
    y, s = autodeploy.native_fused_add_rmsnorm(p, residual, w, eps)

After::

    y, s = autodeploy.native_dist_all_reduce_fused_add_rmsnorm(partial, residual, w, eps)

Also the plain pattern (an all-reduce normalised with no residual add; the reduced value is the
op's second output, so the all-reduce may have other readers)::

    r = autodeploy.torch_dist_all_reduce(partial)
    y = autodeploy.torch_rmsnorm(r, w, eps)
    ->  y, r = autodeploy.torch_dist_all_reduce_rmsnorm(partial, w, eps)

and the same two whose norm the norm-quantization fusions already fused with the quantization of
its output, the last argument passed through: static FP8 (``*_rmsnorm_quant_fp8``, its scale) and
per-group FP8 (``*_rmsnorm_quant_fp8_group``, its group size), both from
``fuse_rmsnorm_quant_fp8``, and NVFP4 (``*_rmsnorm_quant_nvfp4``, its global scale) from
``fuse_rmsnorm_quant_nvfp4``. For example, a fine-grained FP8 layer::

    p = autodeploy.torch_dist_all_reduce(partial)
    y8, s = autodeploy.native_fused_add_rmsnorm_quant_fp8_group(p, residual, w, eps, 128)
    ->  y8, s = autodeploy.native_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group(partial, residual, w, eps, 128)

The fused op keeps the backend of the norm it replaces (``torch_`` or ``native_``; see
``ops/collective_fusions.py``); a norm on the ``compile`` backend is left alone (its inductor
kernel has no all-reduce twin).

Why after the norm fusions rather than matching ``add`` + ``torch_rmsnorm`` itself: one matcher
per concern. ``fuse_add_rms_norm`` already decides what an add+norm is (several readers of the sum,
``alpha``), ``fuse_rmsnorm`` which kernel runs it and ``fuse_rmsnorm_quant_fp8`` /
``fuse_rmsnorm_quant_nvfp4`` when and how its output is quantized; this transform only folds the
collective in front of what they produced.

Near misses, left alone:

* an all-reduce with another reader besides the add+norm (its value is not an output of the
  fused add+norm op, and that reader would need the unnormalised sum);
* a norm whose weight dtype differs from the activation dtype, or whose residual differs in dtype
  from the reduced value: a Gemma-style norm kept in float32 over bfloat16 activations. The fused
  op would compute the same promotions, but vLLM once fused this case into garbage output, so it
  is excluded on purpose until a model needs it and a test pins its numerics. (A Gemma norm of
  matching dtypes — ``torch_rmsnorm(x, w + 1, eps)`` after ``match_rmsnorm_pattern`` — is an
  ordinary norm with a computed weight and is fused.)
* dtypes unknown (no shape propagation value on a node): left alone rather than guessed.
"""

import operator
from typing import Dict, Optional

import torch
from torch import fx

from ...ops import collective_fusions  # noqa: F401  (registers the fused ops)
from ...ops.quant import fused  # noqa: F401  (registers the quantized norm ops matched here)
from ...utils.logging import get_logger
from ..graph_utils import get_attr_value, is_op, val
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)
ad = torch.ops.autodeploy

# add+norm op -> its all-reduce twin; both take (x, residual, weight, eps[, scale or group size]) -> (y, s)
ADD_NORM: Dict[object, object] = {
    ad.torch_fused_add_rmsnorm.default: ad.torch_dist_all_reduce_fused_add_rmsnorm.default,
    ad.native_fused_add_rmsnorm.default: ad.native_dist_all_reduce_fused_add_rmsnorm.default,
    ad.torch_fused_add_rmsnorm_quant_fp8.default: ad.torch_dist_all_reduce_fused_add_rmsnorm_quant_fp8.default,
    ad.native_fused_add_rmsnorm_quant_fp8.default: ad.native_dist_all_reduce_fused_add_rmsnorm_quant_fp8.default,
    ad.torch_fused_add_rmsnorm_quant_nvfp4.default: ad.torch_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4.default,
    ad.native_fused_add_rmsnorm_quant_nvfp4.default: ad.native_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4.default,
    ad.torch_fused_add_rmsnorm_quant_fp8_group.default:
        ad.torch_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group.default,
    ad.native_fused_add_rmsnorm_quant_fp8_group.default:
        ad.native_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group.default,
}
# plain norm op (x, weight, eps[, scale or group size]) -> y  ->  its twin returning (y, all_reduce(x))
PLAIN_NORM: Dict[object, object] = {
    ad.torch_rmsnorm.default: ad.torch_dist_all_reduce_rmsnorm.default,
    ad.native_rmsnorm.default: ad.native_dist_all_reduce_rmsnorm.default,
    ad.torch_rmsnorm_quant_fp8.default: ad.torch_dist_all_reduce_rmsnorm_quant_fp8.default,
    ad.native_rmsnorm_quant_fp8.default: ad.native_dist_all_reduce_rmsnorm_quant_fp8.default,
    ad.torch_rmsnorm_quant_nvfp4.default: ad.torch_dist_all_reduce_rmsnorm_quant_nvfp4.default,
    ad.native_rmsnorm_quant_nvfp4.default: ad.native_dist_all_reduce_rmsnorm_quant_nvfp4.default,
    ad.torch_rmsnorm_quant_fp8_group.default: ad.torch_dist_all_reduce_rmsnorm_quant_fp8_group.default,
    ad.native_rmsnorm_quant_fp8_group.default: ad.native_dist_all_reduce_rmsnorm_quant_fp8_group.default,
}
_ARITY = {op: 5 if "quant" in str(op) else 4 for op in ADD_NORM}
_ARITY.update({op: 4 if "quant" in str(op) else 3 for op in PLAIN_NORM})


class FuseAllReduceResidualRMSNormConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    requires_shape_prop: bool = True  # the dtype check reads the nodes' fake values


def _dtype(gm: fx.GraphModule, node: object) -> Optional[torch.dtype]:
    """The dtype of a node's value: its shape-propagation value, or the attribute it loads."""
    if not isinstance(node, fx.Node):
        return None
    v = val(node)
    if isinstance(v, torch.Tensor):
        return v.dtype
    if node.op == "get_attr":
        attr = get_attr_value(gm, node)
        return attr.dtype if isinstance(attr, torch.Tensor) else None
    return None


def _is_reduce(node: object) -> bool:
    """An all-reduce called the way the sharding executor inserts it: ``torch_dist_all_reduce(x)``."""
    return is_op(node, ad.torch_dist_all_reduce) and len(node.args) == 1 and not node.kwargs


def _only_reader(reduce: object, reader: fx.Node) -> bool:
    """``reduce`` is an all-reduce whose one reader is ``reader`` (reading it once)."""
    return (_is_reduce(reduce) and len(reduce.users) == 1 and reader in reduce.users
            and sum(a is reduce for a in reader.args) == 1)


def _dtypes_agree(gm: fx.GraphModule, norm: fx.Node, *values: object) -> bool:
    """The activation(s) and the norm weight share one dtype (the Gemma exclusion)."""
    dtypes = {_dtype(gm, v) for v in values}
    if None in dtypes:
        logger.debug("%s: a dtype is unknown (no shape propagation value); left unfused", norm.name)
        return False
    if len(dtypes) != 1:
        logger.debug("%s: dtypes %s differ (a norm kept in another precision); left unfused", norm.name,
                     sorted(str(d) for d in dtypes))
        return False
    return True


@TransformRegistry.register("fuse_allreduce_residual_rmsnorm")
class FuseAllReduceResidualRMSNorm(BaseTransform):
    config_class = FuseAllReduceResidualRMSNormConfig
    run_after = ("fuse_add_rms_norm", "fuse_rmsnorm", "fuse_rmsnorm_quant_fp8", "fuse_rmsnorm_quant_nvfp4")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        graph = gm.graph
        count = 0
        position = {n: i for i, n in enumerate(graph.nodes)}  # nodes added below are absent: "not after"
        for norm in list(graph.nodes):
            if norm.op != "call_function" or norm.kwargs or len(norm.args) != _ARITY.get(norm.target, -1):
                continue
            if norm.target in ADD_NORM:
                count += self._fuse_add_norm(gm, norm)
            elif norm.target in PLAIN_NORM:
                count += self._fuse_plain_norm(gm, norm, position)
        if not count and not any(is_op(n, ad.torch_dist_all_reduce) for n in graph.nodes):
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason="no all-reduce in the graph")
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)

    @staticmethod
    def _fuse_add_norm(gm: fx.GraphModule, norm: fx.Node) -> int:
        x, residual, weight, *rest = norm.args
        if not _only_reader(x, norm):
            if not _only_reader(residual, norm):
                return 0
            x, residual = residual, x  # the sum is commutative (IEEE addition too): reduce either operand
        if not _dtypes_agree(gm, norm, x, residual, weight):
            return 0
        with gm.graph.inserting_before(norm):
            fused = gm.graph.call_function(ADD_NORM[norm.target], (x.args[0], residual, weight, *rest))
        fused.meta.update({k: v for k, v in norm.meta.items() if k != "val"})
        norm.replace_all_uses_with(fused)  # the readers already take getitem 0 / 1 of a pair
        gm.graph.erase_node(norm)
        gm.graph.erase_node(x)
        return 1

    @staticmethod
    def _fuse_plain_norm(gm: fx.GraphModule, norm: fx.Node, position: Dict[fx.Node, int]) -> int:
        reduce, weight, *rest = norm.args
        if not _is_reduce(reduce) or sum(a is reduce for a in norm.args) != 1:
            return 0
        here = position.get(norm, -1)
        if any(position.get(u, -1) <= here for u in reduce.users if u is not norm):
            # the fused op sits where the norm is; a reader of the sum before it could not see it
            logger.debug("%s: the all-reduce has a reader before the norm; left unfused", norm.name)
            return 0
        if not _dtypes_agree(gm, norm, reduce, weight):
            return 0
        with gm.graph.inserting_before(norm):
            fused = gm.graph.call_function(PLAIN_NORM[norm.target], (reduce.args[0], weight, *rest))
            normed = gm.graph.call_function(operator.getitem, (fused, 0))
            reduced = gm.graph.call_function(operator.getitem, (fused, 1))
        norm.replace_all_uses_with(normed)
        gm.graph.erase_node(norm)
        reduce.replace_all_uses_with(reduced)  # every other reader of the sum takes the op's copy
        gm.graph.erase_node(reduce)
        return 1
