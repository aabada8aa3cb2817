"""What the ``insert_cached_*`` transforms for per-sequence state share.

Every canonical state op (``torch_causal_conv1d``, ``torch_ssm``, ``torch_ssm_mamba1``, the delta
rules) has a cached variant with the same argument convention::

    cached(<the op's tensor inputs>, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
           <state cache>, <the op's remaining (non-tensor) arguments>)

so one routine replaces them all, given a ``StateOp``: the source and cached op, how many leading
arguments are the op's inputs, the cache input's name prefix and the state it needs (shape and
dtype read from the node's fake values). One cache input per op node, named ``<prefix>_<i>``
(numbered across transforms sharing a prefix).

The graph is only changed when a KV cache could serve it at all: a graph exported with a static
length, or one ``insert_cached_attention`` already declared uncacheable, is left alone (its
reason is already in ``ctx.uncached_reason``) for ``recompute_fallback``.
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Sequence

import torch
from torch import fx

from ...cache.resources import StateHandler
from ..graph_utils import is_op
from ..interface import PipelineContext, TransformInfo
from ._cache_inputs import add_cache_input, step_inputs
from .recompute_fallback import export_shape_problem

# The step metadata every cached state op takes, in this order.
STATE_METADATA = ("batch_info", "seq_len", "cu_seqlen", "slot_idx", "use_initial_state")


@dataclass(frozen=True)
class StateOp:
    source: Any  # OpOverloadPacket of the uncached op
    cached: Any  # OpOverload of the cached op
    num_inputs: int  # leading arguments that come before the metadata
    prefix: str  # cache input name prefix
    state: Callable[[fx.Node, torch.dtype], StateHandler]  # (source node, model dtype) -> its state


def normalized_args(node: fx.Node) -> List[Any]:
    """Every schema argument of an op node, positional or keyword, defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    out = []
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out.append(node.args[i])
        elif a.name in node.kwargs:
            out.append(node.kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise RuntimeError(f"{node.format_node()}: argument '{a.name}' missing")
    return out


def fake(node: fx.Node, index: int) -> torch.Tensor:
    value = node.args[index].meta.get("val") if isinstance(node.args[index], fx.Node) else None
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"{node.format_node()}: argument {index} has no shape (run shape propagation first)")
    return value


def insert_state_caches(gm: fx.GraphModule, ctx: PipelineContext, ops: Sequence[StateOp]) -> TransformInfo:
    """Replace every node of ``ops``' source ops by its cached op with a state cache of its own."""
    found = [(n, op) for n in gm.graph.nodes for op in ops if is_op(n, op.source)]
    problem = export_shape_problem(gm)
    if not found or problem is not None or ctx.uncached_reason:
        if problem is not None:
            ctx.uncached_reason = ctx.uncached_reason or problem
        why = "no such state op in the model" if not found else "the model runs in recompute mode"
        return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason=why)
    meta = step_inputs(gm, ctx)
    for node, op in found:
        index = sum(name.startswith(op.prefix + "_") for name in ctx.cache.handlers)  # type: ignore[union-attr]
        state = add_cache_input(gm, ctx, f"{op.prefix}_{index}", op.state(node, ctx.dtype))
        args = normalized_args(node)
        with gm.graph.inserting_before(node):
            cached = gm.graph.call_function(
                op.cached, (*args[: op.num_inputs], *(meta[m] for m in STATE_METADATA), state, *args[op.num_inputs:])
            )
        cached.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(cached)
        gm.graph.erase_node(node)
    return TransformInfo(num_matches=len(found), is_clean=False, has_valid_shapes=False)
