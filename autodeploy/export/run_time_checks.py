"""Exporting with the named sequence dim when torch cannot prove a shape guard that holds anyway.

With ``Dim("seq", min=1)`` torch.export checks every guard the trace recorded against the whole
range of the dim and rejects the dim ("Constraints violated (seq)") when its solver cannot prove
one, although many such guards hold for every length. Seen in the coverage sweep:

* Aria's MoE block views its flattened input back to ``[batch, seq, hidden]``; the stride torch
  derives for the flattened rows is ``Min(64, 64*seq)`` (seq may be 1), and the view's contiguity
  check becomes ``Eq(seq*Min(64, 64*seq), 64*seq)``: true for every seq >= 1.
* HunYuan-V4's router takes ``topk(k=min(2048, seq))`` and the meta kernel guards
  ``Min(2048, seq) <= seq``: true for every seq.

The value-range solver bounds each side of such an expression separately and loses the
correlation, so it cannot prove them. Exported again with
``prefer_deferred_runtime_asserts_over_guards``, the same guards become ``aten._assert_scalar``
nodes in the graph instead of constraints, and the graph is right for exactly the shapes at which
they hold (every decision the trace took is one of them). So the export is taken when every
such check holds at each batch and sequence length of a grid over the exported ranges (every
length up to 256, and around each power of two up to the maximum), and the checks stay in the
graph, so a shape the grid missed fails loudly at run time instead of computing something else.
A check over other symbols (data-dependent sizes) or false anywhere on the grid rejects the export.
"""

from typing import Callable, Dict, List, Optional

import sympy
import torch
from torch import fx

from ..utils.errors import ExportError
from ..utils.logging import get_logger

logger = get_logger(__name__)

def _grid(maximum: int, dense: int) -> List[int]:
    """Every value up to ``dense``, then each power of two and its neighbours, and ``maximum``."""
    values = set(range(1, min(maximum, dense) + 1)) | {maximum}
    power = 2
    while power <= maximum:
        values |= {v for v in (power - 1, power, power + 1) if 1 <= v <= maximum}
        power *= 2
    return sorted(values)


def _dim_symbols(graph: fx.Graph) -> Dict[sympy.Symbol, int]:
    """The symbols of the inputs' batch (0) and sequence (1) dims: symbol -> which dim. Only the
    token inputs have symbolic sizes (parameters and buffers are static)."""
    symbols: Dict[sympy.Symbol, int] = {}
    for node in graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for dim, size in enumerate(node.meta["val"].shape[:2]):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                symbols[size.node.expr] = dim
    return symbols


def run_time_checks(graph: fx.Graph) -> List[sympy.Basic]:
    """The conditions of the graph's ``_assert_scalar`` nodes as sympy expressions (a plain
    ``True`` left out, any other constant as ``sympy.false``)."""
    conditions = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default:
            continue
        value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else node.args[0]
        if isinstance(value, torch.SymBool):
            conditions.append(value.node.expr)
        elif value is not True:
            conditions.append(sympy.false)
    return conditions


def failing_check(graph: fx.Graph, max_batch: int, max_seq: int) -> Optional[str]:
    """The first run-time check that does not hold on the grid (or cannot be evaluated there), as
    text, or None when all hold."""
    symbols = _dim_symbols(graph)
    batches, seqs = _grid(max_batch, 4), _grid(max_seq, 256)
    for condition in run_time_checks(graph):
        if condition is sympy.true:
            continue
        unknown = condition.free_symbols - set(symbols)
        if unknown:
            return f"{condition} (depends on {', '.join(sorted(map(str, unknown)))})"
        for b in batches:
            for s in seqs:
                values = {symbol: (b, s)[dim] for symbol, dim in symbols.items()}
                if condition.xreplace(values) is not sympy.true:
                    return f"{condition} (false at batch {b}, sequence length {s})"
    return None


def export_with_run_time_checks(run: Callable[..., torch.export.ExportedProgram], example_seq: int, seq_dim: object,
                                max_batch: int, max_seq: int) -> Optional[torch.export.ExportedProgram]:
    """``run(example_seq, seq_dim, deferred=True)`` when every check it defers holds on the grid,
    else None (the caller falls back to a graph that only runs in recompute mode)."""
    try:
        ep = run(example_seq, seq_dim, deferred=True)
    except ExportError as exc:
        logger.debug("export with the checks at run time failed too: %s", exc)
        return None
    failing = failing_check(ep.graph, max(max_batch, 2), max(max_seq, 2))
    if failing is not None:
        logger.info("the named sequence dim needs a shape check that does not always hold: %s", failing)
        return None
    checks = [str(c) for c in run_time_checks(ep.graph) if c is not sympy.true]
    logger.info(
        "exported with the named dynamic sequence dim after all: torch could not prove %d shape check(s) (%s%s); "
        "each holds at every batch and sequence length tried up to %d x %d, and they stay in the graph as run-time "
        "asserts", len(checks), "; ".join(checks[:3]), "; ..." if len(checks) > 3 else "", max_batch, max_seq,
    )
    return ep
