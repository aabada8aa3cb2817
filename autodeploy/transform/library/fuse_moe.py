"""``fuse_moe`` (post_load_fusion): expert weights stacked once at load, a fused MoE implementation.

Before::

    y = autodeploy.torch_moe(x, top_k_index, top_k_weights, [g_0, ..], [u_0, ..], [d_0, ..], [], [], [], act)
    y = autodeploy.torch_moe_fused(x, top_k_index, top_k_weights, W_gu, W_d, b_gu, b_d, act, alpha, limit)
        # W_* parameters, or view/cat ops on parameters (a checkpoint layout that is not canonical)

After (``backend: auto`` / ``grouped``)::

    y = autodeploy.grouped_moe_fused(x, top_k_index, top_k_weights, W_gu, W_d, b_gu, b_d, act, alpha, limit,
                                     bmm_max_pairs)
        # W_gu = stack([cat([g_e, u_e])]) [E, 2I, H] and W_d = stack([d_e]) [E, H, I]: new parameters

Why: the reference ops loop over every expert and gather its rows with ``where``; the fused
implementation runs one GEMM for gate+up and one for down per expert that received tokens, on
contiguous weights, and needs the weights stacked. Stacking (and folding any layout ops such as
GPT-OSS's transpose and gate/up de-interleave) happens here, once, after loading: nothing is
stacked or re-laid-out per forward. Stacked parameters the op already reads directly are kept
as they are. Layers are processed one at a time and the per-expert parameters are freed as soon
as their stack exists, so peak memory is the model plus one layer's experts.

The two strategies of ``grouped_moe_fused``, measured on this project's 2-core AVX2 CPU (fp32,
2 threads, quiet machine, min of 25 interleaved rounds, all four in one process).
ms per MoE layer:

    E=8, H=512, I=1024, K=2
    tokens (pairs)  torch_moe (ref)  torch_moe_fused (ref)  grouped: sorted GEMMs  bmm: gathered weights
      1   (2)         1.83             1.49                   1.54                  29.4
      4   (8)         4.51             4.66                   4.27                  28.6
     32  (64)         9.19             8.80                   8.24                 267
    512 (1024)       34.8             36.1                   35.7               13778
    E=32, H=256, I=256, K=4
      1   (4)         0.86             0.70                   0.47                   1.26
      8  (32)         5.51             5.15                   3.72                  10.2
    128 (512)         7.96             7.89                   6.58                 343
    512 (2048)       16.0             17.6                   15.1                 2184

Sorted per-expert GEMMs beat gathered weights at every size, decode included: gathering each
pair's weights copies them (``[P, 2I, H]``) before a batched matrix-vector product, 2.5-400x
slower. So ``bmm_max_pairs`` defaults to 0 (never); the gathered strategy stays for devices where
a host sync is worse than the copy (it needs none, so it can be captured in a CUDA graph). The
gain of the sorted path over the references is modest on CPU (one GEMM for gate+up, one sort
instead of a ``where`` per expert): up to 30% with many small experts, within noise with few
large ones. Decode is bound by reading the experts' weights (1.5 ms for 12 MB above: MKL's fp32
GEMV). On CUDA the same torch code runs (no Triton kernel in this version: none could be tested
here).
"""

from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import torch
from pydantic import Field
from torch import fx, nn

from ...utils.logging import get_logger
from ..graph_utils import arg, get_attr_value, is_op, weight_expression
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._gemm_fusion import release_unused

ad = torch.ops.autodeploy
logger = get_logger(__name__)

# (token, expert) pairs up to which the gathered-weight strategy is used: never on CPU (see docstring)
BMM_MAX_PAIRS = 0


class FuseMoEConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # per-expert weights freed as their stacks appear (net ~0)
    backend: Literal["auto", "grouped", "torch"] = Field(
        default="auto",
        description="Fused implementation: 'grouped' (grouped_moe_fused: sorted per-expert GEMMs, or gathered-weight "
        "bmm up to bmm_max_pairs), 'torch' (the torch_moe_fused reference over the stacked weights); 'auto' is "
        "grouped on every device (no Triton kernel yet).",
    )
    bmm_max_pairs: int = Field(
        default=BMM_MAX_PAIRS, ge=0,
        description="grouped backend: up to this many (token, expert) pairs per call, gather the weights and bmm.",
    )


def _evaluate(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    nodes = weight_expression(node)
    assert nodes is not None
    env: Dict[fx.Node, Any] = {}
    with torch.no_grad():
        for n in nodes:
            if n.op == "get_attr":
                env[n] = get_attr_value(gm, n)
            else:
                load = lambda a: fx.node.map_arg(a, lambda m: env[m])  # noqa: E731
                env[n] = n.target(*load(n.args), **load(n.kwargs))
    return env[node]


def _common_owner(gm: fx.GraphModule, targets: Sequence[str]) -> str:
    paths = [t.split(".")[:-1] for t in targets]
    common: List[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _register(gm: fx.GraphModule, owner_path: str, leaf: str, tensor: torch.Tensor) -> str:
    owner = gm.get_submodule(owner_path) if owner_path else gm
    name, i = leaf, 0
    while hasattr(owner, name):
        i += 1
        name = f"{leaf}_{i}"
    owner.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    return f"{owner_path}.{name}" if owner_path else name


def _leaves(nodes: Sequence[Optional[fx.Node]]) -> List[fx.Node]:
    out: Dict[fx.Node, None] = {}
    for node in nodes:
        for n in weight_expression(node) or []:
            if n.op == "get_attr":
                out[n] = None
    return list(out)


def _release(gm: fx.GraphModule, roots: Sequence[Optional[fx.Node]]) -> None:
    """Erase the weight expressions nothing reads any more and free their parameters."""
    exprs = [n for root in roots for n in (weight_expression(root) or [])]
    leaves = _leaves(roots)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(set(exprs), key=lambda n: -order[n]):
        if node.op == "call_function" and not node.users:
            gm.graph.erase_node(node)
    release_unused(gm, leaves)


Stacked = Tuple[str, str, Optional[str], Optional[str], List[fx.Node]]


def _stack_per_expert(gm: fx.GraphModule, node: fx.Node) -> Optional[Stacked]:
    """New stacked parameters for a ``torch_moe`` node (None when a weight is not a parameter):
    names of gate_up, down, gate_up bias, down bias, and the per-expert nodes to release."""
    slots = ((3, "gate_weights"), (4, "up_weights"), (5, "down_weights"))
    gates, ups, downs = (list(arg(node, i, n)) for i, n in slots)
    biases = [list(arg(node, i, n, []) or []) for i, n in ((6, "gate_biases"), (7, "up_biases"), (8, "down_biases"))]
    everything = gates + ups + downs + [b for bs in biases for b in bs]
    if any(weight_expression(n) is None for n in everything):
        return None
    if bool(biases[0]) != bool(biases[1]):
        return None  # a bias on only one of gate/up has no stacked form
    targets = [str(n.target) for n in _leaves(everything)]
    owner = _common_owner(gm, targets)
    with torch.no_grad():
        gate_up = torch.stack([torch.cat([_evaluate(gm, g), _evaluate(gm, u)], dim=0) for g, u in zip(gates, ups)])
        down = torch.stack([_evaluate(gm, d) for d in downs])
        names = [_register(gm, owner, "moe_gate_up_weight", gate_up), _register(gm, owner, "moe_down_weight", down)]
        del gate_up, down
        gate_up_bias = down_bias = None
        if biases[0]:
            stacked = torch.stack([torch.cat([_evaluate(gm, g), _evaluate(gm, u)]) for g, u in zip(*biases[:2])])
            gate_up_bias = _register(gm, owner, "moe_gate_up_bias", stacked)
        if biases[2]:
            down_bias = _register(gm, owner, "moe_down_bias", torch.stack([_evaluate(gm, d) for d in biases[2]]))
    return names[0], names[1], gate_up_bias, down_bias, everything


def _fold_stacked(gm: fx.GraphModule, node: fx.Node) -> Optional[Tuple[List[Any], List[fx.Node]]]:
    """Weights of a ``torch_moe_fused`` node as parameters: kept when they are parameters, folded
    into new ones when they are ops on parameters. None when one depends on the inputs."""
    slots = [arg(node, 3, "gate_up_weight"), arg(node, 4, "down_weight"), arg(node, 5, "gate_up_bias"),
             arg(node, 6, "down_bias")]
    if any(s is not None and weight_expression(s) is None for s in slots):
        return None
    out: List[Any] = []
    folded: List[fx.Node] = []
    leaf_names = ("moe_gate_up_weight", "moe_down_weight", "moe_gate_up_bias", "moe_down_bias")
    for slot, leaf in zip(slots, leaf_names):
        if slot is None or slot.op == "get_attr":
            out.append(slot)
            continue
        with torch.no_grad():
            tensor = _evaluate(gm, slot).contiguous().clone()
        owner = _common_owner(gm, [str(n.target) for n in _leaves([slot])])
        out.append(_register(gm, owner, leaf, tensor))
        folded.append(slot)
    return out, folded


@TransformRegistry.register("fuse_moe")
class FuseMoE(BaseTransform):
    config_class = FuseMoEConfig
    requires = ("load_weights",)
    run_after = ("match_moe_pattern", "fuse_mxfp4_moe")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: FuseMoEConfig = self.config  # type: ignore[assignment]
        graph = gm.graph
        count = 0
        for node in list(graph.nodes):
            if is_op(node, ad.torch_moe):
                stacked = _stack_per_expert(gm, node)
                if stacked is None:
                    continue
                gate_up, down, gate_up_bias, down_bias, released = stacked
                act_args = [arg(node, 9, "act", "silu"), arg(node, 10, "alpha", 1.0), arg(node, 11, "limit", 0.0)]
            elif is_op(node, ad.torch_moe_fused):
                folded = _fold_stacked(gm, node)
                if folded is None:
                    continue
                (gate_up, down, gate_up_bias, down_bias), released = folded
                act_args = [arg(node, 7, "act", "silu"), arg(node, 8, "alpha", 1.0), arg(node, 9, "limit", 0.0)]
            else:
                continue
            with graph.inserting_before(node):
                weights = [graph.get_attr(w) if isinstance(w, str) else w
                           for w in (gate_up, down, gate_up_bias, down_bias)]
                args = [node.args[0], node.args[1], node.args[2], *weights, *act_args]
                if cfg.backend == "torch":
                    fused = graph.call_function(ad.torch_moe_fused.default, tuple(args))
                else:
                    fused = graph.call_function(ad.grouped_moe_fused.default, tuple(args + [cfg.bmm_max_pairs]))
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            _release(gm, released)
            count += 1
        if count:
            logger.info("fuse_moe: %d MoE layers on stacked weights (%s)", count, cfg.backend)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
