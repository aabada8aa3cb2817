"""``match_moe_pattern`` (pattern_matcher): gathered-weight expert GEMMs -> ``torch_moe`` / ``torch_moe_fused``.

Where MoE graphs come from. With the default ``experts_implementation: autodeploy`` the export
route (``export/hf_moe.py``) already emits the canonical op for HF's MoE blocks (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS), as the attention route emits
``torch_attention``; this matcher then finds nothing. It canonicalises the graphs of the other
route: transformers' own exportable ``batched_mm`` experts implementation (export with
``experts_implementation: batched_mm``, or a module whose gate function the route did not
recognise), and the same computation written by hand in custom models. Routing, shared experts
and their gates are not touched: they are plain ops before and after (shared experts become
``torch_swiglu_mlp`` through ``match_swiglu_pattern``).

Before (one MoE layer; ``ids = top_k_index.reshape(-1)``, ``rows = x.repeat_interleave(K, 0)``)::

    gu = squeeze(bmm(index(W_gu, [ids]), unsqueeze(rows, -1)), -1) [+ index(b_gu, [ids])]  # add or add_
    h  = gate(gu)                                     # silu(gu[:, :I]) * gu[:, I:]  or GPT-OSS's
    y  = squeeze(bmm(index(W_d, [ids]), unsqueeze(h, -1)), -1) [+ index(b_d, [ids])]
    out = sum(view(y * unsqueeze(top_k_weights.reshape(-1), -1), [T, K, H]), 1)

(or the transposed form ``bmm(unsqueeze(rows, 1), index(W, [ids]))`` with ``[E, in, out]``
weights). After::

    out = autodeploy.torch_moe(x, top_k_index, top_k_weights, [g_0..], [u_0..], [d_0..], [], [], [], act)
        # when W_gu = stack([cat([g_e, u_e]) ...]) and W_d = stack([d_e ...]) (per-expert weights)
    out = autodeploy.torch_moe_fused(x, top_k_index, top_k_weights, W_gu', W_d', b_gu', b_d, act, alpha, limit)
        # otherwise; W' is W in the canonical layout ([E, 2I, H] gate rows first, [E, H, I]):
        # transpose / de-interleave ops on the weights, folded into parameters by fuse_moe

The gate function is identified by value, not by spelling: the subgraph between the two GEMMs
must depend on the gate/up product alone, and it is run on a probe and compared with each
canonical activation (``silu`` on concatenated or interleaved halves; GPT-OSS's clamped
``swiglu_oai`` with the ``alpha``/``limit`` constants found in it). Another activation (GeLU,
ReLU), a combination other than the weighted sum over ``k``, or routing weights applied before
the down GEMM is left alone.
"""

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx

from ...ops.moe import expert_activation
from ...utils.logging import get_logger
from ..graph_utils import is_op, val
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten
ad = torch.ops.autodeploy
logger = get_logger(__name__)

_VIEWS = (aten.view, aten.reshape, aten._unsafe_view)
_CASTS = (aten._to_copy, aten.to)


@dataclass
class _Proj:
    """One gathered-weight GEMM: ``rows`` times the weights ``weight[ids]`` (+ ``bias[ids]``)."""

    rows: fx.Node
    weight: fx.Node
    ids: fx.Node
    transposed: bool
    bias: Optional[fx.Node] = None
    node: Optional[fx.Node] = None  # the node computing the projection (its bias add, if any)


def _dim(node: fx.Node, d: int) -> Optional[int]:
    v = val(node)
    if not isinstance(v, torch.Tensor):
        return None
    return d % v.dim() if -v.dim() <= d < v.dim() else None


def _squeezed_dim(node: fx.Node) -> Optional[int]:
    if is_op(node, aten.squeeze.dim):
        return node.args[1]
    if is_op(node, aten.squeeze.dims) and len(node.args[1]) == 1:
        return node.args[1][0]
    return None


def _gathered(node: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(weight, ids)`` of ``aten.index(weight, [ids])``."""
    if not is_op(node, aten.index.Tensor):
        return None
    indices = node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    return node.args[0], indices[0]


def _match_gemm(node: fx.Node) -> Optional[_Proj]:
    sq = _squeezed_dim(node)
    if sq is None or not is_op(node.args[0], aten.bmm):
        return None
    bmm = node.args[0]
    sq = _dim(bmm, sq)
    a, b = bmm.args[:2]
    # [P, out, in] @ [P, in, 1] -> [P, out]
    if sq == 2 and _gathered(a) and is_op(b, aten.unsqueeze) and _dim(b, b.args[1]) == 2:
        weight, ids = _gathered(a)
        return _Proj(b.args[0], weight, ids, transposed=False)
    # [P, 1, in] @ [P, in, out] -> [P, out]
    if sq == 1 and _gathered(b) and is_op(a, aten.unsqueeze) and _dim(a, a.args[1]) == 1:
        weight, ids = _gathered(b)
        return _Proj(a.args[0], weight, ids, transposed=True)
    return None


def _match_proj(node: fx.Node) -> Optional[_Proj]:
    proj = _match_proj_parts(node)
    if proj is not None:
        proj.node = node
    return proj


def _match_proj_parts(node: fx.Node) -> Optional[_Proj]:
    if is_op(node, aten.add_.Tensor) and all(isinstance(a, fx.Node) for a in node.args[:2]):
        # transformers adds the bias in place (``out.add_(bias)``); export keeps the mutation
        out, bias = node.args[:2]
        proj, gathered = _match_gemm(out), _gathered(bias)
        if proj is not None and gathered is not None and gathered[1] is proj.ids and len(out.users) == 1:
            proj.bias = gathered[0]
            return proj
        return None
    if is_op(node, aten.add.Tensor) and all(isinstance(a, fx.Node) for a in node.args[:2]):
        for out, bias in (node.args[:2], node.args[1::-1]):
            proj, gathered = _match_gemm(out), _gathered(bias)
            if proj is not None and gathered is not None and gathered[1] is proj.ids:
                proj.bias = gathered[0]
                return proj
        return None
    return _match_gemm(node)


def _flat_source(node: fx.Node) -> Optional[fx.Node]:
    """``t`` when ``node`` is ``t.reshape(-1)`` of a 2-D ``t``."""
    if not is_op(node, _VIEWS):
        return None
    src = node.args[0]
    v = val(src)
    if not isinstance(v, torch.Tensor) or v.dim() != 2 or val(node) is None or val(node).dim() != 1:
        return None
    return src


def _repeat_source(node: fx.Node, k: int) -> Optional[fx.Node]:
    """``x`` when ``node`` is ``x.repeat_interleave(k, dim=0)`` of a 2-D ``x`` (any spelling export gives)."""
    if is_op(node, aten.repeat_interleave.self_int):
        x = node.args[0]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if node.args[1] == k and dim is not None and _dim(x, dim) == 0:
            return x
        return None
    # view(expand(unsqueeze(x, 1), [T, k, H]), [T*k, H]) (possibly with a clone)
    if not is_op(node, _VIEWS):
        return None
    inner = node.args[0]
    if is_op(inner, aten.clone):
        inner = inner.args[0]
    if not is_op(inner, aten.expand) or not is_op(inner.args[0], aten.unsqueeze):
        return None
    unsq = inner.args[0]
    if _dim(unsq, unsq.args[1]) != 1 or val(inner) is None or val(inner).shape[1] != k:
        return None
    return unsq.args[0]


def _between(src: fx.Node, dst: fx.Node) -> Optional[List[fx.Node]]:
    """The nodes computing ``dst`` from ``src`` alone (``dst`` included), in graph order; None when
    another tensor enters or an intermediate value is used elsewhere."""
    found: Dict[fx.Node, None] = {}
    stack = [dst]
    while stack:
        node = stack.pop()
        if node in found or node is src:
            continue
        if node.op != "call_function":
            return None
        found[node] = None
        inputs = node.all_input_nodes
        if not inputs:
            return None
        stack.extend(inputs)
    for node in found:
        if node is not dst and any(u not in found for u in node.users):
            return None
    order = {n: i for i, n in enumerate(dst.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _run_subgraph(src: fx.Node, nodes: Sequence[fx.Node], probe: torch.Tensor) -> Optional[torch.Tensor]:
    env: Dict[fx.Node, object] = {src: probe}

    def load(a):
        return fx.node.map_arg(a, lambda n: env[n])

    try:
        with torch.no_grad():
            for node in nodes:
                env[node] = node.target(*load(node.args), **load(node.kwargs))
    except Exception:  # noqa: BLE001 - a subgraph that cannot run on a probe is not a gate function
        return None
    out = env[nodes[-1]]
    return out if isinstance(out, torch.Tensor) else None


def _scalars(nodes: Sequence[fx.Node], ops) -> List[float]:
    out = []
    for node in nodes:
        if is_op(node, ops):
            out += [float(a) for a in list(node.args[1:]) + list(node.kwargs.values())
                    if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return out


def identify_gate(src: fx.Node, dst: fx.Node, inter: int) -> Optional[Tuple[str, bool, float, float]]:
    """``(act, interleaved, alpha, limit)`` when the subgraph ``src -> dst`` is a canonical gate."""
    nodes = _between(src, dst)
    if not nodes or len(nodes) > 32:
        return None
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(16, 2 * inter, generator=gen) * 6.0
    dtype = val(src).dtype if isinstance(val(src), torch.Tensor) else torch.float32
    got = _run_subgraph(src, nodes, probe.to(dtype))
    if got is None or tuple(got.shape) != (16, inter):
        return None
    limits = sorted({abs(v) for v in _scalars(nodes, (aten.clamp, aten.clamp_min, aten.clamp_max))})
    alphas = sorted(set(_scalars(nodes, aten.mul)))
    candidates = [("silu", 1.0, 0.0)] + [("swiglu_oai", a, lim) for a, lim in itertools.product(alphas, limits)]
    for (act, alpha, limit), interleaved in itertools.product(candidates, (False, True)):
        gate, up = (probe[:, 0::2], probe[:, 1::2]) if interleaved else (probe[:, :inter], probe[:, inter:])
        ref = expert_activation(gate.to(dtype), up.to(dtype), act, alpha, limit)
        if torch.allclose(got.float(), ref.float(), rtol=1e-5, atol=1e-5):
            return act, interleaved, alpha, limit
    return None


def _per_expert(node: fx.Node, parts: int) -> Optional[List[List[fx.Node]]]:
    """``stack([cat([a_e, b_e]) ...])`` -> ``[[a_0..], [b_0..]]`` (``parts`` 2) or
    ``stack([d_e ...])`` -> ``[[d_0..]]`` (``parts`` 1), all along dim 0."""
    if not is_op(node, aten.stack) or (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) != 0:
        return None
    items = node.args[0]
    if parts == 1:
        return [list(items)] if all(isinstance(i, fx.Node) for i in items) else None
    out: List[List[fx.Node]] = [[] for _ in range(parts)]
    for item in items:
        if not is_op(item, aten.cat):
            return None
        dim = item.args[1] if len(item.args) > 1 else item.kwargs.get("dim", 0)
        if dim != 0 or len(item.args[0]) != parts:
            return None
        for i, piece in enumerate(item.args[0]):
            out[i].append(piece)
    return out


class _Match:
    def __init__(self, output: fx.Node, x: fx.Node, top_k_index: fx.Node, top_k_weights: fx.Node, up: _Proj,
                 down: _Proj, gate: Tuple[str, bool, float, float]):
        self.output, self.x, self.top_k_index, self.top_k_weights = output, x, top_k_index, top_k_weights
        self.up, self.down, self.gate = up, down, gate


def match_moe(sum_node: fx.Node) -> Optional[_Match]:
    """The MoE computation ending in ``sum_node`` (see the module docstring), or None."""
    if not is_op(sum_node, aten.sum.dim_IntList) or len(sum_node.args) < 2:
        return None
    keepdim = sum_node.args[2] if len(sum_node.args) > 2 else sum_node.kwargs.get("keepdim", False)
    if keepdim or sum_node.kwargs.get("dtype") is not None:
        return None
    dims = sum_node.args[1]
    view = sum_node.args[0]
    if len(dims) != 1 or not is_op(view, _VIEWS) or val(view) is None or val(view).dim() != 3:
        return None
    if _dim(view, dims[0]) != 1:
        return None
    mul = view.args[0]
    if not is_op(mul, aten.mul.Tensor) or not all(isinstance(a, fx.Node) for a in mul.args[:2]):
        return None
    for y, w in (mul.args[:2], mul.args[1::-1]):
        if not is_op(w, aten.unsqueeze) or _dim(w, w.args[1]) != 1:
            continue
        top_k_weights = _flat_source(w.args[0])
        down = _match_proj(y)
        if top_k_weights is None or down is None:
            continue
        # the gate subgraph ends at down.rows; its input is the nearest gathered-weight GEMM
        up_node = _find_up_proj(down.rows)
        if up_node is None:
            continue
        up = _match_proj(up_node)
        if up is None or up.ids is not down.ids or up.transposed != down.transposed:
            continue
        top_k_index = _flat_source(up.ids)
        if top_k_index is None:
            continue
        k = val(top_k_index).shape[1]
        if not isinstance(k, int) or val(view).shape[1] != k or val(top_k_weights).shape[1] != k:
            continue
        x = _repeat_source(up.rows, k)
        if x is None or val(x) is None or val(x).dim() != 2:
            continue
        inter2 = val(up_node).shape[-1]
        if not isinstance(inter2, int) or inter2 % 2:
            continue
        gate = identify_gate(up_node, down.rows, inter2 // 2)
        if gate is None:
            logger.info("MoE-like computation at %s left alone: its gate function is not canonical", sum_node.name)
            continue
        return _Match(sum_node, x, top_k_index, top_k_weights, up, down, gate)
    return None


def _find_up_proj(gate_out: fx.Node) -> Optional[fx.Node]:
    """The gate/up GEMM the gate subgraph ending at ``gate_out`` reads (the nearest ancestor that
    is a gathered-weight GEMM)."""
    seen, stack = set(), [gate_out]
    while stack:
        node = stack.pop()
        if node in seen or not isinstance(node, fx.Node):
            continue
        seen.add(node)
        if _match_proj(node) is not None:
            return node
        if node.op == "call_function" and len(seen) < 64:
            stack.extend(node.all_input_nodes)
    return None


def _canonical_weights(graph: fx.Graph, m: _Match) -> Tuple[fx.Node, fx.Node, Optional[fx.Node], Optional[fx.Node]]:
    """Stacked weights in the canonical layout, as (view) ops on the matched weight expressions."""
    _, interleaved, _, _ = m.gate
    gate_up, down, gate_up_bias, down_bias = m.up.weight, m.down.weight, m.up.bias, m.down.bias
    call = graph.call_function
    if m.up.transposed:
        gate_up = call(aten.transpose.int, (gate_up, 1, 2))
        down = call(aten.transpose.int, (down, 1, 2))
    if interleaved:
        gate_up = call(aten.cat.default, ([call(aten.slice.Tensor, (gate_up, 1, 0, None, 2)),
                                           call(aten.slice.Tensor, (gate_up, 1, 1, None, 2))], 1))
        if gate_up_bias is not None:
            gate_up_bias = call(aten.cat.default, ([call(aten.slice.Tensor, (gate_up_bias, 1, 0, None, 2)),
                                                    call(aten.slice.Tensor, (gate_up_bias, 1, 1, None, 2))], 1))
    return gate_up, down, gate_up_bias, down_bias


def replace_moe(gm: fx.GraphModule, m: _Match) -> bool:
    graph = gm.graph
    act, interleaved, alpha, limit = m.gate
    target = m.output
    x_dtype = val(m.x).dtype
    if val(target).dtype != x_dtype:
        users = list(target.users)
        if len(users) != 1 or not is_op(users[0], _CASTS) or val(users[0]) is None or val(users[0]).dtype != x_dtype:
            return False
        target = users[0]
    per_gu = _per_expert(m.up.weight, 2)
    per_d = _per_expert(m.down.weight, 1)
    per_expert = (per_gu is not None and per_d is not None and not m.up.transposed and not interleaved
                  and m.up.bias is None and m.down.bias is None and len(per_gu[0]) == len(per_d[0]))
    with graph.inserting_before(target):
        if per_expert:
            new = graph.call_function(ad.torch_moe.default, (
                m.x, m.top_k_index, m.top_k_weights, per_gu[0], per_gu[1], per_d[0], [], [], [], act, alpha, limit))
        else:
            gate_up, down, gate_up_bias, down_bias = _canonical_weights(graph, m)
            new = graph.call_function(ad.torch_moe_fused.default, (
                m.x, m.top_k_index, m.top_k_weights, gate_up, down, gate_up_bias, down_bias, act, alpha, limit))
    target.replace_all_uses_with(new)
    _erase_dead(graph, [target], mutations={m.up.node, m.down.node})
    return True


def _erase_dead(graph: fx.Graph, start: List[fx.Node], mutations: set) -> None:
    """Erase the replaced computation. Dead-code elimination keeps in-place ops (transformers adds
    expert biases with ``add_``); the matched ones only wrote into their own GEMM output."""
    erased: set = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op != "call_function":
            continue
        if node.is_impure() and node not in mutations:
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)


class MatchMoEConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_moe_pattern")
class MatchMoEPattern(BaseTransform):
    config_class = MatchMoEConfig
    run_after = ("cleanup_noop_cast", "cleanup_noop_view", "cleanup_assert_metadata")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = 0
        for node in list(gm.graph.nodes):
            if not is_op(node, aten.sum.dim_IntList):
                continue
            m = match_moe(node)
            if m is not None and replace_moe(gm, m):
                count += 1
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)

