"""``multi_stream_mla_attn`` (compile, before ``compile_model``; off by default): MLA's two latent
projections run on two CUDA streams.

Multi-head latent attention (DeepSeek-V2/V3) projects the hidden states twice before attending:
the query through a low-rank latent (``q_a_proj`` -> RMSNorm -> ``q_b_proj``) and the key/value
latent plus the shared RoPE key (``kv_a_proj_with_mqa`` -> split -> RMSNorm). The two depend only
on the hidden states. Before::

    q = aten.linear(rmsnorm(aten.linear(h, W_qa)), W_qb) ... -> q_nope, q_pe
    kv = aten.linear(h, W_kva); ckv, kpe = split(kv); ckv = rmsnorm(ckv)
    o = autodeploy.<mla op>(q_nope, q_pe, ckv, kpe, W_kvb, ...)

After (the key/value branch, the lighter one, on the aux stream)::

    autodeploy.fork_to_aux([h])
    kv = aten.linear(h, W_kva); ckv, kpe = split(kv); ckv = rmsnorm(ckv)     # aux stream
    autodeploy.end_aux([ckv, kpe])
    q = aten.linear(rmsnorm(aten.linear(h, W_qa)), W_qb) ...                # main stream
    autodeploy.join_from_aux([ckv, kpe])
    o = autodeploy.<mla op>(q_nope, q_pe, ckv, kpe, W_kvb, ...)

With ``fuse_gemms`` on (the default) ``q_a_proj`` and ``kv_a_proj_with_mqa`` are already one GEMM;
the branch is then the key/value half after the split (its RMSNorm), overlapping the query's
RMSNorm and ``q_b_proj``. The branch is what only the MLA op's ``compressed_kv`` / ``kpe`` inputs
read (``exclusive_branch``); a branch of view ops alone is not worth a region. On a non-CUDA device and
for the retracing compile backends it is a documented no-op (``_multi_stream.skip_reason``).
"""

from typing import List, Optional, Set, Tuple

import torch
from torch import fx

from ...ops.linear import linear_forms
from ..graph_utils import is_op, val
from ..interface import BaseTransform, PipelineContext, TransformInfo, TransformRegistry
from ._multi_stream import MultiStreamConfig, exclusive_branch, insert_aux_region, launches_kernel, skip_reason


aten = torch.ops.aten


class MultiStreamMlaAttnConfig(MultiStreamConfig):
    pass


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(val(node), torch.Tensor)


def mla_ops() -> Tuple[object, ...]:
    """MLA ops, uncached and cached: ``(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, ...)``."""
    ad = torch.ops.autodeploy
    names = ("torch_mla", "torch_cached_mla_with_cache", "sdpa_cached_mla_with_cache")
    return tuple(getattr(ad, n).default for n in names if hasattr(ad, n))


def _kv_split(ckv: fx.Node) -> Optional[fx.Node]:
    """The split of the kv latent projection into (compressed kv, rope key): walking up from the MLA
    op's ``compressed_kv`` through its norm and views."""
    node = ckv
    for _ in range(16):
        if is_op(node, aten.split_with_sizes):
            return node
        inputs = [i for i in node.all_input_nodes if i.op == "call_function" and not is_op(i, aten.sym_size)
                  and not isinstance(val(i), (int, torch.SymInt))]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def _ancestors(node: fx.Node) -> Set[fx.Node]:
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _latent_branch(mla: fx.Node, start: fx.Node) -> List[fx.Node]:
    """``start`` and what is computed from it alone (with weights, graph inputs, sizes and what
    ``start`` itself reads) before the MLA op: the kv latent branch, up to where it meets the query
    side (the MLA op, or a RoPE op applied to the query and the rope key together)."""
    before = _ancestors(start)
    branch = {start}
    order = list(start.graph.nodes)
    for node in order[order.index(start) + 1:order.index(mla)]:
        inputs = node.all_input_nodes
        if node.op != "call_function" or not any(i in branch for i in inputs):
            continue
        if all(i in branch or i in before or i.op in ("get_attr", "placeholder") or not _is_tensor(i) for i in inputs):
            branch.add(node)
    return [n for n in order if n in branch]


def find_mla_latent_branches(gm: fx.GraphModule) -> List[Tuple[fx.Node, List[fx.Node]]]:
    """``(mla op, kv latent branch)`` for every MLA op whose ``compressed_kv`` comes from a split
    of the kv latent projection; the branch in graph order. It starts at the projection
    (``kv_a_proj_with_mqa``) when that is its own linear, or at the split when ``fuse_gemms``
    made it one GEMM with ``q_a_proj`` (the GEMM is then shared with the query side)."""
    found = []
    for mla in [n for n in gm.graph.nodes if is_op(n, mla_ops())]:
        if len(mla.args) < 4 or not all(isinstance(a, fx.Node) for a in mla.args[:4]):
            continue
        split = _kv_split(mla.args[2])
        if split is None:
            continue
        projection = split.args[0]
        start = projection if is_op(projection, linear_forms()) and len(projection.users) == 1 else split
        branch = _latent_branch(mla, start)  # reads nothing of the query side, by construction
        if any(launches_kernel(n) for n in branch):
            found.append((mla, branch))
    return found


@TransformRegistry.register("multi_stream_mla_attn")
class MultiStreamMlaAttn(BaseTransform):
    config_class = MultiStreamMlaAttnConfig
    run_after = ("cleanup_identity_dtype_cast", "fuse_causal_conv_activation", "multi_stream_moe")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        reason = skip_reason(ctx, gm)
        if reason is not None:
            return TransformInfo(skipped=True, reason=reason, is_clean=True, has_valid_shapes=True)
        count = sum(insert_aux_region(gm, branch) for _, branch in find_mla_latent_branches(gm))
        if count:
            gm.graph.lint()
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
