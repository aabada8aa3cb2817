"""Shared by ``fuse_gemms`` and ``fuse_gemms_mixed_children``: linears that read the same input
become one linear over concatenated weights, whose output is split back.

Memory: groups are fused one at a time and each group's original parameters are deleted from
the module as soon as its concatenated weight exists, so peak memory stays at the model plus
the largest group, never two copies of the model.
"""

import operator
from typing import Dict, List, Optional, Tuple

import torch
from torch import fx, nn

from ..graph_utils import get_attr_value, is_op

aten = torch.ops.aten


def _linear_parts(node: fx.Node) -> Optional[Tuple[fx.Node, Optional[fx.Node]]]:
    """(weight get_attr, bias get_attr or None) of a plain ``aten.linear`` on parameters."""
    if not is_op(node, aten.linear):
        return None
    weight = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    if bias is not None and (not isinstance(bias, fx.Node) or bias.op != "get_attr"):
        return None
    return weight, bias


def linear_groups(gm: fx.GraphModule, mixed: bool) -> List[Tuple[fx.Node, List[fx.Node]]]:
    """``(parent, [linears])`` where 2+ fusable linears read ``parent``. ``mixed`` selects parents
    that also have other users; otherwise every user must be such a linear."""
    groups = []
    for node in gm.graph.nodes:
        users = list(node.users)
        linears = [u for u in users if _linear_parts(u) is not None and u.args[0] is node]
        if len(linears) < 2:
            continue
        if (len(linears) < len(users)) != mixed:
            continue
        weights = [get_attr_value(gm, _linear_parts(u)[0]) for u in linears]
        if len({(w.dtype, w.device, w.shape[1:]) for w in weights}) != 1:
            continue
        if len({_linear_parts(u)[1] is None for u in linears}) != 1:
            continue  # all with bias or all without
        groups.append((node, linears))
    return groups


def _owner(gm: nn.Module, target: str) -> Tuple[nn.Module, str]:
    path, _, leaf = target.rpartition(".")
    return (gm.get_submodule(path) if path else gm), leaf


def _fused_name(gm: fx.GraphModule, targets: List[str]) -> str:
    prefix = targets[0].rpartition(".")[0]
    common = prefix.rpartition(".")[0]  # e.g. model.layers.0.self_attn
    # q_proj_k_proj_v_proj (the owning modules' names; parameter names for root parameters)
    leaves = "_".join((t.split(".")[-2] if "." in t else t) for t in targets)
    base = f"fused_{leaves}".replace(".", "_")
    name, i = base, 0
    owner = gm.get_submodule(common) if common else gm
    while hasattr(owner, name):
        i += 1
        name = f"{base}_{i}"
    return f"{common}.{name}" if common else name


FusedNames = Dict[Tuple[str, ...], str]


def _concat_params(gm: fx.GraphModule, nodes: List[fx.Node], made: Optional[FusedNames] = None) -> str:
    """Concatenate the parameters behind ``nodes`` into a new one (the originals stay until
    ``release_unused`` sees nothing reads them any more).

    ``made`` (one dict per transform application) remembers the concatenations made so far: the
    same parameters in the same order again (weights shared by two groups, e.g. one layer applied
    twice) reuse that parameter instead of a second copy of the same values.
    """
    targets = [str(n.target) for n in nodes]
    key = tuple(targets)
    if made is not None and key in made:
        owner, leaf = _owner(gm, made[key])
        if leaf in owner._parameters:
            return made[key]
    tensors = [get_attr_value(gm, n) for n in nodes]
    fused = nn.Parameter(torch.cat([t.detach() for t in tensors], dim=0), requires_grad=False)
    name = _fused_name(gm, targets)
    owner, leaf = _owner(gm, name)
    owner.register_parameter(leaf, fused)
    if made is not None:
        made[key] = name
    return name


def release_unused(gm: fx.GraphModule, nodes: List[Optional[fx.Node]]) -> None:
    """Erase ``get_attr`` nodes nothing uses and free their tensors unless another node still
    reads them (a weight shared with another linear stays)."""
    readers: Dict[str, int] = {}  # get_attr nodes per target, counted once (not a graph walk per node)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            readers[str(n.target)] = readers.get(str(n.target), 0) + 1
    for node in nodes:
        if node is None or node.users or node._erased:  # a node listed twice is erased once
            continue
        target = str(node.target)
        gm.graph.erase_node(node)
        readers[target] -= 1
        if readers[target]:
            continue
        owner, leaf = _owner(gm, target)
        if leaf in owner._parameters:
            del owner._parameters[leaf]
        elif leaf in owner._buffers:
            del owner._buffers[leaf]


def fuse_group(gm: fx.GraphModule, parent: fx.Node, linears: List[fx.Node], narrow: bool,
               made: Optional[FusedNames] = None) -> None:
    """Replace ``linears`` (all reading ``parent``) by one linear and a split of its output."""
    graph = gm.graph
    parts = [_linear_parts(n) for n in linears]
    sizes = [int(get_attr_value(gm, w).shape[0]) for w, _ in parts]
    weight_name = _concat_params(gm, [w for w, _ in parts], made)
    bias_name = _concat_params(gm, [b for _, b in parts], made) if parts[0][1] is not None else None
    first = min(linears, key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_before(first):
        w = graph.get_attr(weight_name)
        b = graph.get_attr(bias_name) if bias_name else None
        fused = graph.call_function(aten.linear.default, (parent, w, b) if b is not None else (parent, w))
        outs: Dict[fx.Node, fx.Node] = {}
        if narrow:
            offset = 0
            for lin, size in zip(linears, sizes):
                outs[lin] = graph.call_function(aten.narrow.default, (fused, -1, offset, size))
                offset += size
        else:
            split = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
            for i, lin in enumerate(linears):
                outs[lin] = graph.call_function(operator.getitem, (split, i))
    for lin, out in outs.items():
        # a view of a split output may merge the split dim, which needs a copy: reshape does it
        for user in list(lin.users):
            if is_op(user, (aten.view, aten._unsafe_view)):
                user.target = aten.reshape.default
        lin.replace_all_uses_with(out)
        graph.erase_node(lin)
    release_unused(gm, [n for wb in parts for n in wb])


def fuse_all_groups(gm: fx.GraphModule, mixed: bool) -> int:
    """Fuse groups one at a time, looking again after each: fusing one group can change
    another's input (a fused linear that feeds a second group)."""
    count = 0
    made: FusedNames = {}
    while True:
        groups = linear_groups(gm, mixed)
        if not groups:
            return count
        parent, linears = groups[0]
        fuse_group(gm, parent, linears, narrow=mixed, made=made)
        count += 1
