"""``mlir_elementwise_fusion`` (post_load_fusion): maximal element-wise subgraphs -> one generated kernel each.

Before (float32, CPU; ``w`` a ``[D]`` weight, ``y`` the same shape as ``x``)::

    s = aten.sigmoid(x)
    m = aten.mul(x, s)
    p = aten.mul(m, y)
    q = aten.mul(p, w)          # w broadcast along the leading dims
    r = aten.add(q, 1.0)        # r and q both used later

After::

    f = autodeploy.cpu_fused_elementwise([x, y, w], "<cache>/kernels/<key>", 2)
    q = getitem(f, 0);  r = getitem(f, 1)

How (``autodeploy/compile/mlir/``): ``partition`` finds the maximal connected subgraphs of
supported element-wise float32 ops with one output shape (inputs may broadcast: a ``[D]`` row
along leading dims, a ``[..., 1]`` column along the last dim, a scalar), refusing merges that
would make a cycle; ``lower`` writes each as an xDSL module, one ``linalg.generic`` whose body
is arith/math primitives (sigmoid, silu, gelu, relu, pow, ... decomposed); ``cpp`` emits an
OpenMP ``parallel for`` + ``simd`` C++ kernel from that module; ``kernels`` compiles it with
g++ once per source into an on-disk cache and registers the op that calls it. Subgraphs of
fewer than ``min_ops`` nodes are left alone, and so are values that are not float32 (bf16/fp16
subgraphs: not supported yet), other broadcasts (``[B, 1, D]`` against ``[B, S, D]``) and
symbolic scalars.

Needs xDSL (``pip install 'autodeploy[mlir]'``) and a C++ compiler; without either it skips
with one log line. On CUDA it skips too: the Triton path is not built yet.
"""

import operator
from typing import Dict, List, Optional

import torch
from pydantic import Field
from torch import fx

from ...compile.mlir import xdsl_missing
from ...compile.mlir.kernels import STATS, build_kernel, compiler
from ...compile.mlir.partition import Group, find_groups
from ...utils.logging import get_logger
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)
_warned: set = set()


class MlirElementwiseFusionConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    requires_shape_prop: bool = True
    min_ops: int = Field(2, ge=2, description="Fuse a subgraph only when it has at least this many aten ops.")
    cache_dir: Optional[str] = Field(
        None, description="Where compiled kernels are kept (default $AUTODEPLOY_KERNEL_CACHE, else "
        "$AUTODEPLOY_CACHE/kernels, i.e. ~/.cache/autodeploy/kernels).")


def _skip_once(reason: str) -> TransformInfo:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("mlir_elementwise_fusion skipped: %s", reason)
    return TransformInfo(skipped=True, reason=reason, is_clean=True, has_valid_shapes=True)


def _replace(graph: fx.Graph, group: Group, kernel_dir: str, renamed: Dict[fx.Node, fx.Node]) -> None:
    """One ``cpu_fused_elementwise`` node (and a getitem per output) in place of ``group``;
    ``renamed`` learns each erased output's getitem (a later group may read it)."""
    members = set(group.nodes)
    with graph.inserting_after(group.nodes[-1]):
        fused = graph.call_function(torch.ops.autodeploy.cpu_fused_elementwise.default,
                                    (list(group.inputs), kernel_dir, len(group.outputs)))
    fused.meta["val"] = [n.meta["val"] for n in group.outputs]
    anchor = fused
    for k, out in enumerate(group.outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (fused, k))
        item.meta["val"] = out.meta["val"]
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        renamed[out] = anchor = item
    for node in reversed(group.nodes):
        graph.erase_node(node)


@TransformRegistry.register("mlir_elementwise_fusion")
class MlirElementwiseFusion(BaseTransform):
    config_class = MlirElementwiseFusionConfig
    # after the pattern fusions: they turn known element-wise chains into hand-written kernels
    run_after = ("fuse_silu_mul", "fuse_swiglu", "fuse_add_rms_norm", "fuse_rmsnorm", "fuse_l2norm",
                 "fuse_gdn_gating", "optimize_rope")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        if torch.device(ctx.device).type == "cuda":
            return _skip_once("on CUDA the kernels would be generated as Triton: the Triton path is not built yet")
        missing = xdsl_missing()
        if missing is not None:
            return _skip_once(missing)
        if compiler() is None:
            return _skip_once("no C++ compiler found (install g++ or set CXX)")
        from ...compile.mlir.cpp import emit_cpp
        from ...compile.mlir.lower import lower_group

        groups: List[Group] = find_groups(gm.graph, self.config.min_ops)
        if not groups:
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        before = dict(STATS)
        renamed: Dict[fx.Node, fx.Node] = {}
        for group in groups:
            group.inputs = [renamed.get(p, p) for p in group.inputs]
            source = emit_cpp(lower_group(group))
            kernel_dir = build_kernel(source, group.access, len(group.outputs), self.config.cache_dir)
            _replace(gm.graph, group, kernel_dir, renamed)
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(gm.graph)  # a member's outside user may come before the last member
        gm.graph.lint()
        gm.recompile()
        logger.info("mlir_elementwise_fusion: %d subgraphs (%d aten ops) -> generated kernels (%d compiled, %d cached)",
                    len(groups), sum(len(g.nodes) for g in groups), STATS["compiles"] - before["compiles"],
                    STATS["cache_hits"] - before["cache_hits"])
        return TransformInfo(num_matches=len(groups), is_clean=False, has_valid_shapes=False)
