"""``fold_constants`` (post_load_fusion): arithmetic on weights alone runs once, at load.

Models compute some tensors from their weights only, on every call: Gemma-style norms scale by
``1 + weight``, Mamba's ``A = -exp(A_log)``, RWKV's ``1 - time_mix``, RecurrentGemma's
``softplus`` of its gate parameter, the taps of an exported token shift. Once the weights are
loaded these are constants. Before (a Gemma norm weight, a Mamba decay)::

    w1 = aten.add(model.layers.0.input_layernorm.weight, 1.0)
    y  = autodeploy.torch_rmsnorm(x, w1, eps)
    A  = aten.neg(aten.exp(model.layers.0.mixer.A_log))
    s  = autodeploy.torch_ssm(..., A, ...)

After (each value computed here, with the graph's own ops on the loaded tensors, and stored as
a buffer beside its first weight; weights nothing else reads are dropped)::

    y = autodeploy.torch_rmsnorm(x, model.layers.0.input_layernorm.weight_folded, eps)
    s = autodeploy.torch_ssm(..., model.layers.0.mixer.A_log_folded, ...)

A node is constant when it is an ``aten`` op (or ``getitem``) that neither mutates nor draws
random numbers, and every input is a weight/buffer or another constant node; factory ops with
literal arguments (``ones``, ``arange(4)``) count, ``empty`` does not (its values are undefined).
A weight some op of the graph mutates is not constant. What is folded is each constant whose
value a non-constant node reads (a tensor; a value the reader mutates is not folded): the same
ops on the same tensors, so the outputs are bit-identical. The buffers are kept only while the
weights they add, less the weights they free, stay under ``max_growth_mib``; past that those
that add the most are left unfolded (a cast of every weight to another dtype would otherwise double the
model). Runs after the fusions that read such chains as patterns (``fuse_gdn_gating``'s
``-exp(A_log)``) and before the element-wise fusion and the linear backends.
"""

import operator
from typing import Any, Dict, List, Set, Tuple

import torch
from pydantic import Field
from torch import fx
from torch._ops import OpOverload

from ...utils.logging import get_logger
from ..graph_utils import eliminate_dead_code, get_attr_value
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)
aten = torch.ops.aten


class FoldConstantsConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    max_growth_mib: float = Field(
        default=64.0, ge=0.0,
        description="Most memory the folded buffers may add beyond the weights they free (MiB); the largest "
                    "constants past it stay computed per call.")


def _foldable_op(node: fx.Node) -> bool:
    """A pure, deterministic op whose value may be computed once: aten (not ``empty*``, not
    random, not mutating, not impure) or ``operator.getitem``."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags or node.is_impure():
        return False
    return not target._schema.name.split("::")[-1].lstrip("_").startswith(("empty", "new_empty"))


def _mutated_inputs(node: fx.Node) -> List[fx.Node]:
    """The input nodes ``node``'s op writes to (by its schema)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    written: List[fx.Node] = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        fx.node.map_arg(value, written.append)
    return written


def _written_attrs(graph: fx.Graph) -> Set[str]:
    """Targets of the weights/buffers some op may write to: everything upstream of a mutated input
    (views included), so a mutated weight is never taken for a constant."""
    written: Set[str] = set()
    stack = [n for node in graph.nodes for n in _mutated_inputs(node)]
    seen: Set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            written.add(str(n.target))
        stack.extend(n.all_input_nodes)
    return written


def constant_nodes(graph: fx.Graph) -> Set[fx.Node]:
    """Every node whose value depends on weights and literals only (``get_attr`` nodes included)."""
    written = _written_attrs(graph)
    const: Set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            if str(node.target) not in written:
                const.add(node)
        elif _foldable_op(node) and all(i in const for i in node.all_input_nodes):
            const.add(node)
    return const


def _reads_mutably(user: fx.Node, node: fx.Node) -> bool:
    return any(m is node for m in _mutated_inputs(user))


def fold_frontier(graph: fx.Graph, const: Set[fx.Node]) -> List[fx.Node]:
    """The computed constants a non-constant node reads (and does not write)."""
    return [n for n in graph.nodes if n in const and n.op == "call_function"
            and any(u not in const for u in n.users) and not any(_reads_mutably(u, n) for u in n.users)]


def _evaluate(gm: fx.GraphModule, const: Set[fx.Node], wanted: List[fx.Node]) -> Dict[fx.Node, torch.Tensor]:
    """The values of ``wanted`` (only tensors), computed with the graph's ops on the loaded weights."""
    values: Dict[fx.Node, Any] = {}
    failed: Set[fx.Node] = set()
    needed: Set[fx.Node] = set()
    stack = list(wanted)
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node not in needed or node not in const:
                continue
            if any(i in failed for i in node.all_input_nodes):
                failed.add(node)
                continue
            try:
                if node.op == "get_attr":
                    values[node] = get_attr_value(gm, node)
                    if isinstance(values[node], torch.Tensor) and values[node].is_meta:
                        failed.add(node)  # not loaded: nothing to compute with
                    continue
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: values[a])
                values[node] = node.target(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - an op that cannot run here stays in the graph
                logger.debug("fold_constants: %s not folded: %s", node.name, exc)
                failed.add(node)
    return {n: values[n] for n in wanted if n not in failed and isinstance(values.get(n), torch.Tensor)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _freed_bytes(gm: fx.GraphModule, const: Set[fx.Node], folded: Set[fx.Node]) -> int:
    """Bytes of the weights nothing reads once ``folded`` are buffers."""
    live: Set[fx.Node] = set()
    stack = [i for n in gm.graph.nodes if n not in const for i in n.all_input_nodes if i not in folded]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        if n in const:
            stack.extend(i for i in n.all_input_nodes if i not in folded)
    live_targets = {str(n.target) for n in live if n.op == "get_attr"}
    dead = {str(n.target): n for n in const if n.op == "get_attr" and str(n.target) not in live_targets}
    values = [get_attr_value(gm, node) for node in dead.values()]
    return sum(_nbytes(v) for v in values if isinstance(v, torch.Tensor))


def _within_budget(gm: fx.GraphModule, const: Set[fx.Node], values: Dict[fx.Node, torch.Tensor],
                   limit: int) -> Dict[fx.Node, torch.Tensor]:
    """``values`` less those that add the most memory, while the buffers would add more than
    ``limit`` bytes beyond the weights they free."""
    def growth(chosen: Dict[fx.Node, torch.Tensor]) -> int:
        return sum(_nbytes(v) for v in chosen.values()) - _freed_bytes(gm, const, set(chosen))

    chosen = dict(values)
    total = growth(chosen)
    if total <= limit:
        return chosen
    # what each one adds on its own (its size, less what folding it frees), largest first
    adds = {n: total - growth({m: v for m, v in chosen.items() if m is not n}) for n in chosen}
    for node in sorted(chosen, key=lambda n: -adds[n]):
        logger.info("fold_constants: %s (%s, %.2f MiB) left computed per call: the folded buffers would add "
                    "%.2f MiB (max_growth_mib %g)", node.name, tuple(chosen[node].shape),
                    _nbytes(chosen[node]) / 2**20, total / 2**20, limit / 2**20)
        del chosen[node]
        total = growth(chosen)
        if total <= limit:
            break
    return chosen


def _store(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor) -> str:
    """Register ``value`` as a buffer beside the first weight ``node`` is computed from."""
    sources = [n for n in _ancestors(node) if n.op == "get_attr"]
    path, _, leaf = str(sources[0].target).rpartition(".") if sources else ("", "", node.name)
    owner = gm.get_submodule(path) if path else gm
    name, i = f"{leaf}_folded", 0
    while hasattr(owner, name):
        i += 1
        name = f"{leaf}_folded_{i}"
    owner.register_buffer(name, value.detach().clone(), persistent=False)
    return f"{path}.{name}" if path else name


def _ancestors(node: fx.Node) -> List[fx.Node]:
    order, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        stack.extend(reversed(n.all_input_nodes))
    return order


def _drop_unread_attrs(gm: fx.GraphModule, targets: Set[str]) -> None:
    """Free the weights among ``targets`` that no ``get_attr`` node reads any more."""
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets - read:
        path, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(path) if path else gm
        owner._parameters.pop(leaf, None)
        owner._buffers.pop(leaf, None)


@TransformRegistry.register("fold_constants")
class FoldConstants(BaseTransform):
    config_class = FoldConstantsConfig
    # after the fusions that match chains on weights (they compute such values themselves)
    run_after = ("load_weights", "fuse_gdn_gating", "fuse_add_rms_norm", "fuse_rmsnorm", "fuse_l2norm",
                 "optimize_rope", "quantize_weights", "fuse_int4_linear", "fuse_int8_linear", "fuse_fp8_linear",
                 "fuse_finegrained_fp8_linear", "fuse_nvfp4_linear")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        graph = gm.graph
        const = constant_nodes(graph)
        frontier = fold_frontier(graph, const)
        if not frontier:
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        values = _within_budget(gm, const, _evaluate(gm, const, frontier), int(self.config.max_growth_mib * 2**20))
        sources = {str(n.target) for n in const if n.op == "get_attr"}
        for node, value in values.items():
            with graph.inserting_before(node):
                buffer = graph.get_attr(_store(gm, node, value))
            buffer.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(buffer)
        eliminate_dead_code(gm)  # the computed chains and the get_attr nodes only they read
        _drop_unread_attrs(gm, sources)
        gm.recompile()
        return TransformInfo(num_matches=len(values), is_clean=not values, has_valid_shapes=True)
