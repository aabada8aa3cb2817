"""cleanup_identity_dtype_cast (compile): casts that change nothing go; real casts and copies stay.

Same rule as cleanup_noop_cast (post_export): both transforms must leave the same graph.
"""

import copy

import torch
from torch import nn

from autodeploy.transform.graph_utils import is_op
from autodeploy.transform.interface import Stage
from autodeploy.transform.optimizer import build_transform
from helpers import apply_transform, assert_same_outputs, count_op, export_gm

aten = torch.ops.aten
KEY = "cleanup_identity_dtype_cast"
CASTS = [aten.to, aten._to_copy, aten.type_as, torch.ops.prims.convert_element_type]


class Mixed(nn.Module):
    """Three identity casts, three real ones and a copying one."""

    def forward(self, x, other, idx):
        a = x.to(torch.float32) * 2          # identity
        b = x.float() + 1                    # identity
        c = x.type_as(other) - 3             # identity (other is fp32 too)
        d = x.to(torch.float16)              # changes dtype
        e = x.to(torch.float32, copy=True)   # asks for a fresh tensor
        f = x.type_as(idx)                   # float -> int64
        g = (x * 4).double()                 # changes dtype
        return a, b, c, d, e, f, g


def _inputs(b, s):
    return torch.randn(b, s, 8) * 10, torch.randn(b, s, 8), torch.randint(0, 9, (b, s, 8))


def _graph():
    return export_gm(Mixed().eval(), *_inputs(2, 3), clean=False)


def test_stage_is_compile():
    assert build_transform(KEY, {}).config.stage == Stage.COMPILE
    assert build_transform("cleanup_noop_cast", {}).config.stage == Stage.POST_EXPORT


def test_identity_casts_go_real_casts_and_copies_stay():
    gm = _graph()
    reference = copy.deepcopy(gm)
    assert count_op(reference, CASTS) == 7
    gm, record = apply_transform(KEY, gm)
    assert record.status == "ok" and record.num_matches == 3
    assert count_op(gm, CASTS) == 4
    kept = [n for n in gm.graph.nodes if is_op(n, CASTS)]
    assert len(kept) == 4
    # the copying cast is the only surviving cast to float32, and it keeps its copy flag
    to_fp32 = [n for n in kept if torch.float32 in n.args[1:2] or n.kwargs.get("dtype") == torch.float32]
    assert len(to_fp32) == 1
    assert to_fp32[0].kwargs.get("copy") is True or to_fp32[0].args[3:4] == (True,)
    inputs = [_inputs(2, 3), _inputs(4, 5)]
    assert_same_outputs(reference, gm, inputs)
    for args in inputs:
        with torch.no_grad():
            ref, outs = reference(*args), gm(*args)
        assert all(torch.equal(r, o) for r, o in zip(ref, outs))  # removing identities is bit-exact
        assert [o.dtype for o in outs] == [torch.float32] * 3 + [torch.float16, torch.float32, torch.int64,
                                                                  torch.float64]
        assert outs[4].data_ptr() != args[0].data_ptr()  # copy=True still copies


def test_nothing_to_remove_is_a_zero_match():
    gm = export_gm(nn.Linear(8, 8).eval(), torch.randn(2, 3, 8), clean=False)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(KEY, gm)
    assert record.num_matches == 0
    assert gm.code == reference.code


def test_same_rule_as_cleanup_noop_cast():
    a, rec_a = apply_transform(KEY, _graph())
    b, rec_b = apply_transform("cleanup_noop_cast", _graph())
    assert rec_a.num_matches == rec_b.num_matches == 3
    assert a.code == b.code
