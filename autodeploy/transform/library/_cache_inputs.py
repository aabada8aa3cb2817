"""The inputs every ``insert_cached_*`` transform adds to the graph, in one place.

The first cache transform that changes the graph turns its ``(input_ids, position_ids)`` into the
flattened-step signature: it keeps a copy of the uncached graph (``recompute_fallback``'s way
back), creates the ``CachedSequenceInterface`` and appends the step metadata placeholders
(``autodeploy.cache.sequence_info.METADATA_NAMES``). Every cache transform then appends its
cache placeholders after the last one and registers their handlers in the same order, which is
the order ``CachedSequenceInterface.graph_args`` passes them in.
"""

from typing import Dict, Union

import torch
from torch import fx

from ...cache import CachedSequenceInterface
from ...cache.resources import ResourceHandler, StateHandler, TokenBufferHandler
from ...cache.sequence_info import METADATA_NAMES, example_metadata
from ...utils.fx import copy_graph_module
from ..interface import PipelineContext

_TOKEN_INPUTS = ["input_ids", "position_ids"]


def _placeholders(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def step_inputs(gm: fx.GraphModule, ctx: PipelineContext) -> Dict[str, fx.Node]:
    """The graph's metadata placeholders by name, added (with the cache interface) on first use."""
    placeholders = _placeholders(gm)
    names = [p.name for p in placeholders]
    expected = _TOKEN_INPUTS + list(METADATA_NAMES)
    if names[: len(expected)] == expected:
        return {p.name: p for p in placeholders}
    if names != _TOKEN_INPUTS:
        raise RuntimeError(f"cache transforms expect graph inputs (input_ids, position_ids), got {names}")
    device = torch.device(ctx.device)
    ctx.uncached_graph = copy_graph_module(gm)
    if ctx.cache is None:
        ctx.cache = CachedSequenceInterface(
            page_size=ctx.page_size, max_batch_size=ctx.max_batch_size, max_seq_len=ctx.max_seq_len,
            max_num_tokens=ctx.max_num_tokens, device=device,
        )
    fake_mode = placeholders[0].meta["val"].fake_mode
    inputs = {p.name: p for p in placeholders}
    last = placeholders[-1]
    for name in METADATA_NAMES:
        with gm.graph.inserting_after(last):
            last = inputs[name] = gm.graph.placeholder(name)
        last.meta["val"] = fake_mode.from_tensor(example_metadata(name, ctx.max_batch_size, device))
    return inputs


def add_cache_input(gm: fx.GraphModule, ctx: PipelineContext, name: str,
                    handler: Union[ResourceHandler, StateHandler, TokenBufferHandler]) -> fx.Node:
    """Register ``handler`` under ``name`` and append its placeholder (after ``step_inputs``)."""
    cache: CachedSequenceInterface = ctx.cache  # type: ignore[assignment]
    cache.add_cache(name, handler)
    placeholders = _placeholders(gm)
    with gm.graph.inserting_after(placeholders[-1]):
        node = gm.graph.placeholder(name)
    device = torch.device(ctx.device)
    # one page / one slot / one token row: only the dtype, rank and trailing sizes matter downstream
    example = (handler.allocate(1, cache.page_size, device) if isinstance(handler, ResourceHandler)
               else handler.allocate(1, device))
    node.meta["val"] = placeholders[0].meta["val"].fake_mode.from_tensor(example)
    return node
