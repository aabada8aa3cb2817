"""``mlir_elementwise_fusion`` (post_load_fusion): maximal element-wise subgraphs -> one generated kernel each.

Before (float32, CPU; ``w`` a ``[D]`` weight, ``y`` the same shape as ``x``)::

    s = aten.sigmoid(x)
    m = aten.mul(x, s)
    p = aten.mul(m, y)
    q = aten.mul(p, w)          # w broadcast along the leading dims
    r = aten.add(q, 1.0)        # r and q both used later

After (CPU; on CUDA ``autodeploy.triton_fused_elementwise([x, y, w], "<cache>/kernels/triton-<key>",
"float32,float32")``)::

    f = autodeploy.cpu_fused_elementwise([x, y, w], "<cache>/kernels/<key>", 2)
    q = getitem(f, 0);  r = getitem(f, 1)

How (``autodeploy/compile/mlir/``): ``partition`` finds the maximal connected subgraphs of
supported element-wise float32 ops with one output shape (inputs may broadcast: a ``[D]`` row
along leading dims, a ``[..., 1]`` column along the last dim, a scalar), refusing merges that
would make a cycle; ``lower`` writes each as an xDSL module, one ``linalg.generic`` whose body
is arith/math primitives (sigmoid, silu, gelu, relu, pow, ... decomposed); ``cpp`` emits an
OpenMP ``parallel for`` + ``simd`` C++ kernel from that module; ``kernels`` compiles it with
g++ once per source into an on-disk cache and registers the op that calls it. Subgraphs of
fewer than ``min_ops`` nodes are left alone, and so are, on CPU, values that are not float32
(the C++ kernels have no bf16/fp16 arithmetic), other broadcasts (``[B, 1, D]`` against ``[B, S, D]``) and
symbolic scalars.

On CUDA (``backend: triton``; ``auto`` leaves CUDA models alone until these kernels have run
on a GPU) the same module is emitted as a Triton kernel
(``triton_emit``; ``triton_kernels`` keeps the source on disk and launches it), and the
subgraphs may also be bfloat16/float16: computed in float32 and rounded after each op where
aten rounds, casts between float dtypes fused too. A subgraph Triton has no emitter for (a
general ``pow``) stays unfused.

Needs xDSL (a dependency of autodeploy) and a C++ compiler (CPU) or Triton (CUDA); without
them it skips with one log line (xDSL is imported only when there is a subgraph to fuse), and a kernel the compiler refuses leaves its subgraph unfused
(one warning): the transform never fails a build.

On by default (CPU), fusing subgraphs of 3 or more ops. Measured (benchmarks/RESULTS.md): one
fused chain is 1.4-4.3x faster than its aten ops (2 to 7 ops, ``bench_mlir_chain_length.py``);
end to end, ``small-gpt2``'s 7-op tanh-GELU chains fused make a 256-token prefill 4-7% faster,
batch-1 decode within the runs' noise; the 74 two-op chains of ``small`` without its norm
patterns gave no measurable gain (the coverage sweep was run with ``min_ops: 3``: 136 of 137
types equal HF as without the transform). On Llama-style models as shipped the pattern fusions
leave nothing for it (0 matches). ``backend: triton`` on a CPU device runs only in
Triton's interpreter (``TRITON_INTERPRET=1``): the tests' way to check the Triton kernels
without a GPU.
"""

import logging
import operator
from typing import Any, Dict, List, Literal, Optional, Tuple

import torch
from pydantic import Field
from torch import fx

from ...compile.mlir import xdsl_missing
from ...compile.mlir.kernels import STATS, KernelBuildError, build_kernel, compiler
from ...compile.mlir.partition import CPP_TARGET, TRITON_DTYPES, Group, Target, find_groups
from ...compile.mlir.triton_kernels import build_triton_kernel, dtype_name, interpreting, triton_missing
from ...utils.logging import get_logger
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)
_warned: set = set()


class MlirElementwiseFusionConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    requires_shape_prop: bool = True
    min_ops: int = Field(3, ge=2, description="Fuse a subgraph only when it has at least this many aten ops (2-op "
                         "subgraphs gave no measurable end-to-end gain; 3 is what the coverage sweep ran with).")
    backend: Literal["auto", "cpp", "triton"] = Field(
        "auto", description="Kernel generator: 'cpp' (OpenMP C++, CPU), 'triton' (CUDA; on CPU only under "
        "TRITON_INTERPRET=1), 'auto' = cpp on CPU; on CUDA the transform skips under 'auto' until the Triton "
        "kernels have been run and timed on a GPU ('triton' opts in).")
    cache_dir: Optional[str] = Field(
        None, description="Where compiled kernels are kept (default $AUTODEPLOY_KERNEL_CACHE, else "
        "$AUTODEPLOY_CACHE/kernels, i.e. ~/.cache/autodeploy/kernels).")


# Why ``auto`` leaves CUDA models alone: the Triton kernels are checked in Triton's interpreter on
# CPU only (tests/transforms/test_mlir_triton.py); tests/gpu/test_mlir_triton_gpu.py has not run.
AUTO_CUDA_OFF = ("backend 'auto' does not fuse on CUDA yet: the Triton kernels have not been run and timed on a "
                 "GPU; set backend: triton to use them")


def _skip_once(reason: str) -> TransformInfo:
    """Skipped, with one log line per reason and process: a warning for what the user can fix,
    info for ``auto``'s own choice on CUDA (the transform is on by default)."""
    if reason not in _warned:
        _warned.add(reason)
        level = logging.INFO if reason == AUTO_CUDA_OFF else logging.WARNING
        logger.log(level, "mlir_elementwise_fusion skipped: %s", reason)
    return TransformInfo(skipped=True, reason=reason, is_clean=True, has_valid_shapes=True)


def _compile_failed_once(err: RuntimeError) -> None:
    """A kernel the C++ compiler refused: the subgraph stays as aten ops (the model is built
    anyway, as without the transform); one warning per process says why."""
    if "compile" not in _warned:
        _warned.add("compile")
        logger.warning("mlir_elementwise_fusion: a generated kernel did not compile, its subgraph is left unfused "
                       "(set transforms.mlir_elementwise_fusion.enabled: false to skip the attempt): %s", err)


def _replace(graph: fx.Graph, group: Group, op: Any, args: Tuple[Any, ...], renamed: Dict[fx.Node, fx.Node]) -> None:
    """One fused ``op(*args)`` node (and a getitem per output) in place of ``group``;
    ``renamed`` learns each erased output's getitem (a later group may read it)."""
    members = set(group.nodes)
    with graph.inserting_after(group.nodes[-1]):
        fused = graph.call_function(op, args)
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


def _cpp_kernel(group: Group, cache_dir: Optional[str]) -> Tuple[Any, Tuple[Any, ...]]:
    from ...compile.mlir.cpp import emit_cpp
    from ...compile.mlir.lower import lower_group

    kernel_dir = build_kernel(emit_cpp(lower_group(group)), group.access, len(group.outputs), cache_dir)
    return torch.ops.autodeploy.cpu_fused_elementwise.default, (list(group.inputs), kernel_dir, len(group.outputs))


def _triton_kernel(group: Group, cache_dir: Optional[str]) -> Tuple[Any, Tuple[Any, ...]]:
    from ...compile.mlir.lower import lower_group
    from ...compile.mlir.triton_emit import emit_triton

    source = emit_triton(lower_group(group))  # NotImplementedError: the caller leaves the group
    in_dtypes = [p.meta["val"].dtype for p in group.inputs]
    out_dtypes = [n.meta["val"].dtype for n in group.outputs]
    kernel_dir = build_triton_kernel(source, group.access, in_dtypes, out_dtypes, cache_dir or "")
    return (torch.ops.autodeploy.triton_fused_elementwise.default,
            (list(group.inputs), kernel_dir, ",".join(dtype_name(d) for d in out_dtypes)))


@TransformRegistry.register("mlir_elementwise_fusion")
class MlirElementwiseFusion(BaseTransform):
    config_class = MlirElementwiseFusionConfig
    # after the pattern fusions: they turn known element-wise chains into hand-written kernels
    run_after = ("fuse_silu_mul", "fuse_swiglu", "fuse_add_rms_norm", "fuse_rmsnorm", "fuse_l2norm",
                 "fuse_gdn_gating", "optimize_rope")

    def _target(self, device: str) -> Tuple[str, Optional[Target], str]:
        """(backend, the kernels' target, why not) for a model on ``device``."""
        backend = self.config.backend
        if backend == "auto":
            if device == "cuda":
                return "triton", None, AUTO_CUDA_OFF
            backend = "cpp"
        if backend == "triton":
            missing = triton_missing()
            if missing:
                return backend, None, missing
            if device != "cuda" and not interpreting():
                return backend, None, ("backend 'triton' on CPU runs only in Triton's interpreter (TRITON_INTERPRET=1); "
                                       "use backend 'cpp' or 'auto'")
            return backend, Target(device, TRITON_DTYPES), ""
        if device != "cpu":
            return backend, None, f"backend 'cpp' generates CPU kernels, the model is on {device}; use 'auto' or 'triton'"
        if compiler() is None:
            return backend, None, "no C++ compiler found (install g++ or set CXX)"
        return backend, CPP_TARGET, ""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        backend, target, why_not = self._target(torch.device(ctx.device).type)
        if target is None:
            return _skip_once(why_not)
        groups: List[Group] = find_groups(gm.graph, self.config.min_ops, target)
        if not groups:
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        missing = xdsl_missing()  # only now: importing xDSL takes ~0.25 s of a build with nothing to fuse
        if missing is not None:
            return _skip_once(missing)
        before = dict(STATS)
        renamed: Dict[fx.Node, fx.Node] = {}
        fused = []
        for group in groups:
            group.inputs = [renamed.get(p, p) for p in group.inputs]
            try:
                op, args = (_triton_kernel if backend == "triton" else _cpp_kernel)(group, self.config.cache_dir)
            except NotImplementedError as err:
                logger.info("mlir_elementwise_fusion: a subgraph of %d ops left unfused: %s", len(group.nodes), err)
                continue
            except KernelBuildError as err:
                _compile_failed_once(err)
                continue
            _replace(gm.graph, group, op, args, renamed)
            fused.append(group)
        if not fused:
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(gm.graph)  # a member's outside user may come before the last member
        gm.graph.lint()
        gm.recompile()
        logger.info("mlir_elementwise_fusion: %d subgraphs (%d aten ops) -> generated %s kernels (%d new, %d cached)",
                    len(fused), sum(len(g.nodes) for g in fused), backend, STATS["compiles"] - before["compiles"],
                    STATS["cache_hits"] - before["cache_hits"])
        return TransformInfo(num_matches=len(fused), is_clean=False, has_valid_shapes=False)
