"""``insert_cached_residual_add`` (cache_init): copy chosen decoder layers' outputs into token buffers.

Every step, the residual stream leaving each chosen decoder layer is written into a per-step
token buffer, from which requests read their hidden states (what Eagle-style speculative
decoding feeds its drafter).

Opt-in: ``layers`` (decoder layer indices, negative ones count from the end) is empty by default
and the transform then does nothing.

Before (decoder layer ``i`` of a pre-norm model, after ``fuse_add_rms_norm``; the residual add
that ends layer ``i`` is fused with the next layer's input norm, or with the final norm)::

    normed, h = autodeploy.torch_fused_add_rmsnorm(mlp_out_i, s_i, w_norm, eps)   # h = s_i + mlp_out_i
    ... layer i + 1 reads normed and h ...

After (one buffer input per chosen layer, after the other cache inputs)::

    graph(input_ids, position_ids, <step metadata>, <caches>, ..., hidden_states_<i>)
    normed, h = autodeploy.torch_fused_add_rmsnorm(mlp_out_i, s_i, w_norm, eps)
    autodeploy.torch_capture_hidden_states(h, hidden_states_<i>)   # hidden_states_<i>[:T] = h[0]
    ... layer i + 1 reads normed and h ...

(an unfused graph has ``h = aten.add(s_i, mlp_out_i)`` instead; for a sum fused with the final
norm that nothing else reads, the transform adds the ``getitem(fused, 1)`` it captures.)

``hidden_states_<i>`` is a ``TokenBufferHandler`` buffer ``[max_num_tokens, hidden]`` in the
residual stream's dtype: the third kind of cache input, rewritten by every step (rows
``0..T-1``, one per token of the flattened step) and read by the runtime right after the graph
call (``ModelRunner``), which hands each sequence its rows (``RequestOutput.hidden_states``).
The op mutates only the buffer and returns nothing; its mutable schema keeps it through dead-code
elimination (see ``autodeploy.ops.hidden_states``). The layer -> buffer map is
``cache.captured_layers``.

Finding the value a layer hands on, robustly against the fusions that ran before (fused nodes
carry no ``nn_module_stack``): the residual stream is the chain of *residual adds*, sums
``r + d`` whose operand ``r`` is an ancestor of ``d`` (``d = f(r)``: an attention, MLP, mixer or
convolution branch; ``aten.add`` or a fused add+RMSNorm). The chain is walked back from the LM
head: the last such sum before it is the stream entering the final norm, and each sum's residual
operand leads to the one before. Each sum is attributed to the decoder layer its branch ``d``
was computed in, read from the ``nn_module_stack`` of the branch's nodes and the names of its
weights (``model.layers.<i>....``; the layer container is the shallowest module list in the
graph). Layer ``i``'s output is the last sum attributed to it: what the next layer (or the
final norm) reads, i.e. HF's ``output_hidden_states`` entry ``i + 1`` (whose last entry is
taken after the final norm instead). A post-norm layer (``norm(r + d)`` inside the layer) would
be captured before that norm. A graph whose chain cannot be attributed to every layer is an
error naming the layers not found, never a silent wrong capture.

The graph must already take the flattened step (an ``insert_cached_*`` transform ran): a model
served in recompute mode has no per-step rows to capture, and the transform skips it with a
warning; a request asking for hidden states is then refused with that fix.
"""

import heapq
import operator
import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from pydantic import Field
from torch import fx

from ...cache.resources import TokenBufferHandler
from ...cache.sequence_info import METADATA_NAMES
from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._cache_inputs import add_cache_input
from .gather_logits_before_lm_head import find_lm_head

logger = get_logger(__name__)
aten = torch.ops.aten
BUFFER_PREFIX = "hidden_states"


def _fused_add_norms() -> Tuple:
    ops = torch.ops.autodeploy
    return (ops.torch_fused_add_rmsnorm, ops.native_fused_add_rmsnorm, ops.compiled_fused_add_rmsnorm)


class InsertCachedResidualAddConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True
    layers: List[int] = Field(
        default_factory=list,
        description="Decoder layers whose output hidden state (the residual stream leaving the layer) is captured "
        "every step and returned with SamplingParams(return_hidden_states=True), in this order; negative indices "
        "count from the end (-1 is the last layer). Empty (default): nothing is captured.",
    )


# ---- module paths ---------------------------------------------------------------------------------
def _normalize_path(path: str) -> str:
    """``L['self'].model.layers[0]`` / ``model.layers.0`` -> ``model.layers.0``."""
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _node_paths(node: fx.Node) -> List[str]:
    """Module paths a node is attributed to: its ``nn_module_stack`` entries, or a weight's name."""
    if node.op == "get_attr":
        return [str(node.target)]
    stack = node.meta.get("nn_module_stack") or {}
    return [_normalize_path(v[0]) for v in stack.values() if isinstance(v, (tuple, list)) and v]


def layer_container(gm: fx.GraphModule) -> Tuple[Optional[str], int]:
    """``(prefix, num_layers)`` of the decoder layer list: among the module paths ``<prefix>.<int>``
    of the graph's nodes (of its weights' names when no node has an ``nn_module_stack``), the
    shallowest prefix (ties: the one with most indices); ``(None, 0)`` when there is none."""
    for weights in (False, True):
        found: Dict[str, set] = {}
        for node in gm.graph.nodes:
            if (node.op == "get_attr") != weights:
                continue
            for path in _node_paths(node):
                parts = path.split(".")
                for j, part in enumerate(parts):
                    if part.isdigit() and j > 0:
                        found.setdefault(".".join(parts[:j]), set()).add(int(part))
                        break  # the outermost list on this path
        if found:
            prefix = min(found, key=lambda p: (p.count("."), -len(found[p])))
            # a layer whose nodes all lost their stack still has its weights
            indices = [_layer_index(n, prefix) for n in gm.graph.nodes if n.op == "get_attr"]
            return prefix, max([*found[prefix], *(i for i in indices if i is not None)]) + 1
    return None, 0


def _layer_index(node: fx.Node, prefix: str) -> Optional[int]:
    best = None
    head = prefix + "."
    for path in _node_paths(node):
        if path.startswith(head):
            part = path[len(head):].split(".", 1)[0]
            if part.isdigit():
                best = max(best if best is not None else -1, int(part))
    return best


# ---- the residual chain ---------------------------------------------------------------------------
class _Sum:
    """A residual add: ``op`` (``aten.add`` or a fused add+norm), its residual operand and branch."""

    def __init__(self, op: fx.Node, residual: fx.Node, branch: fx.Node):
        self.op, self.residual, self.branch = op, residual, branch
        self.layer: Optional[int] = None

    def value(self, graph: fx.Graph) -> fx.Node:
        """The node holding the sum (a fused op's second output; made if nothing reads it)."""
        if not is_op(self.op, _fused_add_norms()):
            return self.op
        for user in self.op.users:
            if user.target is operator.getitem and user.args[1] == 1:
                return user
        with graph.inserting_after(self.op):
            node = graph.call_function(operator.getitem, (self.op, 1))
        val = self.op.meta.get("val")
        node.meta["val"] = val[1] if isinstance(val, (tuple, list)) else None
        return node


class _Chain:
    def __init__(self, gm: fx.GraphModule):
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def is_ancestor(self, a: fx.Node, b: fx.Node) -> bool:
        """``a`` is computed before ``b`` and ``b`` reads it (through any number of nodes). The sum
        output of a fused add+norm counts as read where its normed output is: the branch reads
        ``normed`` and the residual is its sibling ``sum``, both from one op."""
        if a.target is operator.getitem and is_op(a.args[0], _fused_add_norms()):
            a = a.args[0]
        if self.order[a] >= self.order[b]:
            return False
        stack, seen = [b], {b}
        while stack:
            for x in stack.pop().all_input_nodes:
                if x is a:
                    return True
                if x not in seen and self.order[x] > self.order[a]:
                    seen.add(x)
                    stack.append(x)
        return False

    def as_sum(self, node: fx.Node) -> Optional[_Sum]:
        if is_op(node, aten.add.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
            a, b = node.args
        elif is_op(node, _fused_add_norms()):
            a, b = node.args[:2]
        else:
            return None
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node) or a is b:
            return None
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape != vb.shape:
            return None  # a broadcast (a bias, a scale), not the stream
        if self.is_ancestor(a, b):
            return _Sum(node, a, b)
        if self.is_ancestor(b, a):
            return _Sum(node, b, a)
        return None

    def last_sum(self, start: fx.Node) -> Optional[_Sum]:
        """The latest residual add among ``start`` and its ancestors."""
        heap = [(-self.order[start], start)]
        seen = {start}
        while heap:
            _, node = heapq.heappop(heap)
            found = self.as_sum(node)
            if found is not None:
                return found
            for x in node.all_input_nodes:
                if x not in seen and x.op == "call_function":
                    seen.add(x)
                    heapq.heappush(heap, (-self.order[x], x))
        return None

    def attribute(self, s: _Sum, prefix: str) -> Optional[int]:
        """The decoder layer the branch of ``s`` was computed in (the latest one its nodes and
        weights name; nodes before the residual operand belong to earlier work)."""
        floor = self.order[s.residual]
        layer = None
        stack, seen = [s.branch], {s.branch}
        while stack:
            node = stack.pop()
            found = _layer_index(node, prefix)
            if found is not None:
                layer = found if layer is None else max(layer, found)
            for x in node.all_input_nodes:
                if x in seen:
                    continue
                seen.add(x)
                if x.op == "get_attr":
                    found = _layer_index(x, prefix)
                    if found is not None:
                        layer = found if layer is None else max(layer, found)
                elif self.order[x] > floor:
                    stack.append(x)
        return layer


def residual_stream(gm: fx.GraphModule) -> Tuple[int, Dict[int, _Sum]]:
    """``(num_layers, {layer: the residual add that ends it})`` for the layers found."""
    prefix, num_layers = layer_container(gm)
    if prefix is None:
        return 0, {}
    head = find_lm_head(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    start = head.args[0] if head is not None else output.args[0]
    if not isinstance(start, fx.Node):
        return num_layers, {}
    chain = _Chain(gm)
    sums: List[_Sum] = []
    current = chain.last_sum(start)
    while current is not None:
        sums.append(current)
        current = chain.last_sum(current.residual)
    ends: Dict[int, _Sum] = {}
    for s in reversed(sums):  # first layer first: a later sum of the same layer replaces an earlier one
        s.layer = chain.attribute(s, prefix)
        if s.layer is not None:
            ends[s.layer] = s
    return num_layers, ends


def resolve_layers(layers: Iterable[int], num_layers: int) -> List[int]:
    """Config indices -> layer numbers (negative from the end), or a ConfigError naming the range."""
    out: List[int] = []
    for layer in layers:
        if not -num_layers <= layer < num_layers:
            raise ConfigError(
                f"transforms.insert_cached_residual_add.layers: layer {layer} is out of range; this model has "
                f"{num_layers} decoder layers, so valid indices are 0..{num_layers - 1} (or -{num_layers}..-1 from the "
                "end)"
            )
        resolved = layer % num_layers
        if resolved in out:
            raise ConfigError(f"transforms.insert_cached_residual_add.layers: layer {resolved} is named twice")
        out.append(resolved)
    return out


def _takes_the_step(gm: fx.GraphModule) -> bool:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    expected = ["input_ids", "position_ids", *METADATA_NAMES]
    return names[: len(expected)] == expected


@TransformRegistry.register("insert_cached_residual_add")
class InsertCachedResidualAdd(BaseTransform):
    config_class = InsertCachedResidualAddConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention", "insert_cached_causal_conv", "insert_cached_ssm_attention",
                 "insert_cached_delta_rule", "insert_cached_gated_delta_rule",
                 "insert_cached_linear_attention", "insert_cached_diagonal_recurrence", "insert_cached_wkv",
                 "insert_cached_mlstm", "insert_cached_cca_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: InsertCachedResidualAddConfig = self.config  # type: ignore[assignment]
        if not cfg.layers:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason="opt-in: no layers to capture (layers: [...])")
        num_layers, ends = residual_stream(gm)
        if num_layers == 0:
            raise RuntimeError("insert_cached_residual_add: no decoder layer list (modules named <prefix>.<i>) "
                               "found in the graph, so there is no layer output to capture")
        layers = resolve_layers(cfg.layers, num_layers)
        if ctx.cache is None or ctx.uncached_reason or not _takes_the_step(gm):
            logger.warning("insert_cached_residual_add: the graph was not cached (%s), so no hidden states are "
                           "captured", ctx.uncached_reason or "no insert_cached_* transform changed it")
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason="the graph is not cached")
        missing = [i for i in layers if i not in ends]
        if missing:
            raise RuntimeError(
                f"insert_cached_residual_add: could not find the residual add ending decoder layer(s) {missing} in the "
                f"graph (found layers {sorted(ends)}); this architecture's residual stream is not one the transform "
                "recognises"
            )
        graph = gm.graph
        for layer in layers:
            value = ends[layer].value(graph)
            fake = value.meta.get("val")
            if not isinstance(fake, torch.Tensor):
                raise RuntimeError(f"insert_cached_residual_add: layer {layer}'s output {value.name} has no shape")
            name = f"{BUFFER_PREFIX}_{layer}"
            buffer = add_cache_input(gm, ctx, name, TokenBufferHandler(int(fake.shape[-1]), fake.dtype))
            with graph.inserting_after(value):
                capture = graph.call_function(torch.ops.autodeploy.torch_capture_hidden_states.default,
                                              (value, buffer))
            capture.meta["val"] = None
            ctx.cache.captured_layers[layer] = name
        return TransformInfo(num_matches=len(layers), is_clean=False, has_valid_shapes=False)
