"""Deliberate breakages, to check that the coverage check catches them (a mutation test of the
sweep itself).

A check that passes whatever the pipeline computes is worth nothing; these switches break one
transform on purpose, in the child process of one check only (``python -m autodeploy.coverage
TYPE --mutate NAME`` / ``autodeploy coverage --mutate NAME``), and the sweep must then report
failures. They are never applied unless asked for by name.

* ``rope_sign``: RoPE rotates the wrong way (``sin`` negated, or the complex frequencies
  conjugated) in every ``torch_rope_*`` op that ``match_rope_pattern`` inserts.
* ``noop:<transform key>``: the transform runs but finds nothing (the graph is left as it was
  and no match is reported), e.g. ``noop:insert_cached_attention``.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import fx

from ..utils.logging import get_logger

logger = get_logger(__name__)


def _negate_rope_rotation(gm: fx.GraphModule) -> int:
    """Flip the rotation of every canonical RoPE op in ``gm``; the number flipped."""
    ops = torch.ops.autodeploy
    aten = torch.ops.aten
    # op -> (index of the argument to flip, how)
    flips = {ops.torch_rope_with_explicit_cos_sin.default: (3, aten.neg.default),
             ops.torch_rope_with_qk_interleaving.default: (3, aten.neg.default),
             ops.torch_rope_with_complex_freqs.default: (2, aten.conj_physical.default)}
    flipped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in flips:
            continue
        index, flip = flips[node.target]
        table = node.args[index]
        with gm.graph.inserting_before(node):
            wrong = gm.graph.call_function(flip, (table,))
        if isinstance(table, fx.Node) and "val" in table.meta:
            wrong.meta["val"] = table.meta["val"]
        node.update_arg(index, wrong)
        flipped += 1
    gm.recompile()
    return flipped


def _mutate_rope_sign() -> None:
    from ..transform.library.match_rope_pattern import MatchRopePattern

    real = MatchRopePattern._apply

    def wrong_sign(self, gm, ctx):
        info = real(self, gm, ctx)
        logger.warning("mutation rope_sign: flipped the rotation of %d RoPE op(s)", _negate_rope_rotation(gm))
        return info

    MatchRopePattern._apply = wrong_sign


def _mutate_noop(key: str) -> None:
    from ..transform import library  # noqa: F401  (registers the transforms)
    from ..transform.interface import TransformInfo, TransformRegistry

    cls = TransformRegistry.get(key)  # raises for an unknown key

    def finds_nothing(self, mod, ctx):
        logger.warning("mutation noop:%s: the transform found nothing", key)
        return mod, TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)

    cls._run = finds_nothing


MUTATIONS: Dict[str, Callable[[], None]] = {"rope_sign": _mutate_rope_sign}


def validate_mutation(name: str) -> None:
    """Raise ``ValueError`` naming the choices unless ``name`` is a known mutation."""
    if name.startswith("noop:"):
        from ..transform import library  # noqa: F401  (registers the transforms)
        from ..transform.interface import TransformRegistry

        key = name.split(":", 1)[1]
        if not TransformRegistry.has(key):
            raise ValueError(f"mutation '{name}': no transform is registered under '{key}'")
    elif name not in MUTATIONS:
        raise ValueError(f"unknown mutation '{name}'; choose one of {', '.join(MUTATIONS)} or noop:<transform key>")


def apply_mutation(name: str) -> None:
    """Break the pipeline as ``name`` says (see the module docstring); raises for an unknown one."""
    validate_mutation(name)
    if name.startswith("noop:"):
        _mutate_noop(name.split(":", 1)[1])
    else:
        MUTATIONS[name]()


__all__ = ["MUTATIONS", "apply_mutation", "validate_mutation"]
