"""Shared by ``fuse_rmsnorm_quant_fp8``, ``fuse_rmsnorm_quant_nvfp4`` and ``fuse_relu2_quant_nvfp4``:
find an op whose output feeds only activation-quantization ops of one format with equal scales (or,
for fine-grained FP8's dynamic per-group quantization, equal group sizes), and replace the op and
those quantizations by one fused op (see ``fuse_rmsnorm_quant_fp8`` for the graphs).
"""


import operator
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import fx

from ...ops.quant import fused  # noqa: F401  (registers the fused ops)
from ...utils.logging import get_logger
from ..graph_utils import OpLike, arg, get_attr_value, is_op

logger = get_logger(__name__)
ad = torch.ops.autodeploy

# the norm op -> its fused twin (same backend); plain norms return one tensor, add+norms two
PLAIN_FP8 = {ad.torch_rmsnorm.default: ad.torch_rmsnorm_quant_fp8.default,
             ad.native_rmsnorm.default: ad.native_rmsnorm_quant_fp8.default}
ADD_FP8 = {ad.torch_fused_add_rmsnorm.default: ad.torch_fused_add_rmsnorm_quant_fp8.default,
           ad.native_fused_add_rmsnorm.default: ad.native_fused_add_rmsnorm_quant_fp8.default}
# the same with fine-grained FP8's dynamic per-group activation quantization (the group size passed on)
PLAIN_FP8_GROUP = {ad.torch_rmsnorm.default: ad.torch_rmsnorm_quant_fp8_group.default,
                   ad.native_rmsnorm.default: ad.native_rmsnorm_quant_fp8_group.default}
ADD_FP8_GROUP = {ad.torch_fused_add_rmsnorm.default: ad.torch_fused_add_rmsnorm_quant_fp8_group.default,
                 ad.native_fused_add_rmsnorm.default: ad.native_fused_add_rmsnorm_quant_fp8_group.default}
_GROUP_ACT = ad.torch_quant_fp8_group_activation
_DEFAULT_GROUP = _GROUP_ACT.default._schema.arguments[1].default_value  # what a call without the size uses
_COMPILED = (ad.compiled_rmsnorm.default, ad.compiled_fused_add_rmsnorm.default)


# ---- shared with fuse_rmsnorm_quant_nvfp4 and fuse_relu2_quant_nvfp4 -------------------------


def _same_scale(gm: fx.GraphModule, a: fx.Node, b: fx.Node) -> bool:
    """Two input-scale arguments hold the same value (module attributes compared by value)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "get_attr"):
        return False
    va, vb = get_attr_value(gm, a), get_attr_value(gm, b)
    return va.dtype == vb.dtype and va.shape == vb.shape and bool(torch.equal(va, vb))


def shared_quant_scale(gm: fx.GraphModule, value: fx.Node, act_op: OpLike) -> Optional[Tuple[List[fx.Node], fx.Node]]:
    """``(quant users, scale)`` when every user of ``value`` is ``act_op`` quantizing it with an
    equal scale held in a module attribute; None otherwise (a near miss: left alone)."""
    users = list(value.users)
    if not users or any(not is_op(u, act_op) or u.args[0] is not value or len(u.args) + len(u.kwargs) != 2
                        for u in users):
        return None
    scale = arg(users[0], 1, "input_scale")
    if not isinstance(scale, fx.Node) or scale.op != "get_attr":
        return None
    if not all(_same_scale(gm, scale, arg(u, 1, "input_scale")) for u in users[1:]):
        logger.debug("%s: its quantized users have different input scales; left unfused", value.name)
        return None
    return users, scale


def shared_group_size(value: fx.Node) -> Optional[Tuple[List[fx.Node], int]]:
    """``(quant users, group size)`` when every user of ``value`` is
    ``torch_quant_fp8_group_activation`` of it with one and the same constant group size; None
    otherwise. No scale to compare: the quantization is dynamic (scales from the values), so equal
    group sizes mean every user computed the very same tensor."""
    users = list(value.users)
    if not users or any(not is_op(u, _GROUP_ACT) or u.args[0] is not value or len(u.args) + len(u.kwargs) > 2
                        for u in users):
        return None
    sizes = {arg(u, 1, "group_size", _DEFAULT_GROUP) for u in users}
    if len(sizes) != 1 or not isinstance(next(iter(sizes)), int):
        logger.debug("%s: its per-group quantized users have group sizes %s; left unfused", value.name, sizes)
        return None
    return users, sizes.pop()


def scale_before(gm: fx.GraphModule, scale: fx.Node, anchor: fx.Node) -> fx.Node:
    """A ``get_attr`` of ``scale``'s attribute placed before ``anchor`` (the fused op's position)."""
    with gm.graph.inserting_before(anchor):
        return gm.graph.get_attr(str(scale.target))


def retire_quant_users(gm: fx.GraphModule, users: List[fx.Node], replacement: fx.Node) -> None:
    """Point the quant users' consumers at ``replacement``, erase them, and drop the scale
    attributes that nothing reads any more (the other linears' copies of the shared value)."""
    scales = {s for s in (arg(u, 1, "input_scale") for u in users) if isinstance(s, fx.Node)}  # none per group
    for user in users:
        user.replace_all_uses_with(replacement)
        gm.graph.erase_node(user)
    targets_in_use = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    for scale in scales:
        if scale.users:
            continue
        target = str(scale.target)
        gm.graph.erase_node(scale)
        if target not in targets_in_use:
            path, _, leaf = target.rpartition(".")
            owner = gm.get_submodule(path) if path else gm
            owner._buffers.pop(leaf, None)
            owner._parameters.pop(leaf, None)


# ---- the norm fusion (both formats) ---------------------------------------------------------


def _normed_output(norm: fx.Node) -> Optional[fx.Node]:
    """A fused add+norm's one ``getitem(norm, 0)``, or None (no such node, several, or a user of
    the op that is no getitem)."""
    if any(not is_op(u, operator.getitem) for u in norm.users):
        return None
    normed = [u for u in norm.users if u.args[1] == 0]
    return normed[0] if len(normed) == 1 else None


def _quantized_users(gm: fx.GraphModule, value: fx.Node, act_op: OpLike, anchor: fx.Node
                     ) -> Optional[Tuple[List[fx.Node], Union[fx.Node, int]]]:
    """``(quant users, the fused op's last argument)`` when ``value`` feeds only ``act_op``: the
    shared input scale (a ``get_attr`` placed before ``anchor``) or, per group, the group size."""
    if act_op in (_GROUP_ACT, _GROUP_ACT.default):
        return shared_group_size(value)
    found = shared_quant_scale(gm, value, act_op)
    return None if found is None else (found[0], scale_before(gm, found[1], anchor))


def _fuse_one(gm: fx.GraphModule, norm: fx.Node, act_op: OpLike, plain: Dict, add: Dict) -> bool:
    """Rewrite ``norm`` in place into its fused twin when its normed output only feeds ``act_op``."""
    is_add = norm.target in add
    value = _normed_output(norm) if is_add else norm
    found = _quantized_users(gm, value, act_op, norm) if value is not None else None
    if found is None:
        return False
    users, last = found
    names = ("x", "residual", "weight", "eps") if is_add else ("x", "weight", "eps")
    args = tuple(arg(norm, i, name) for i, name in enumerate(names))
    norm.args, norm.kwargs = (*args, last), {}
    norm.target = (add if is_add else plain)[norm.target]
    retire_quant_users(gm, users, value)
    return True


def fuse_norm_quant(gm: fx.GraphModule, act_op: OpLike, plain: Dict, add: Dict, key: str,
                    report_compiled: bool = True) -> int:
    """Fuse every norm of ``plain`` / ``add`` whose normed output feeds only ``act_op`` (see the
    module docstring); returns the number fused. ``report_compiled=False`` for a second call on
    the same graph (another format), which would log the same compiled norms again."""
    count = compiled = 0
    for norm in list(gm.graph.nodes):
        if norm.op != "call_function":
            continue
        if norm.target in _COMPILED:
            compiled += 1
        elif norm.target in plain or norm.target in add:
            count += _fuse_one(gm, norm, act_op, plain, add)
    if compiled and report_compiled:
        logger.info("%s: %d norms use fuse_rmsnorm's compile backend, which has no fused twin; left alone", key,
                    compiled)
    if count:
        logger.info("%s: %d norms emit their quantized output directly", key, count)
        gm.graph.lint()
    return count
