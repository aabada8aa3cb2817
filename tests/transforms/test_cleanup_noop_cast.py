"""cleanup_noop_cast: casts to the dtype a tensor already has are dropped; real casts stay."""

import copy

import torch
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

aten = torch.ops.aten
KEY = "cleanup_noop_cast"
CASTS = [aten.to, aten._to_copy, aten.type_as, torch.ops.prims.convert_element_type]


class IdentityCasts(nn.Module):
    def forward(self, x, other):
        a = x.to(torch.float32) * 2
        b = x.float() + 1
        c = x.type_as(other) - 3      # other is float32 too
        return a, b, c


class RealCasts(nn.Module):
    def forward(self, x, idx):
        a = x.to(torch.float16)                     # changes dtype
        b = x.to(torch.float32, copy=True)          # asks for a fresh tensor
        c = x.type_as(idx)                          # float -> int64
        d = x.double()
        return a, b, c, d


class Bf16Casts(nn.Module):
    def forward(self, x):
        same = x.to(torch.bfloat16) * 2   # identity on a bf16 input
        up = x.float() * 2                # bf16 -> fp32: a real cast
        return same, up


def _run(module, *args):
    gm = export_gm(module.eval(), *args, clean=False)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(KEY, gm)
    return reference, gm, record


def test_identity_casts_are_removed():
    x, other = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    reference, gm, record = _run(IdentityCasts(), x, other)
    assert count_op(reference, CASTS) == 3
    assert record.num_matches == 3
    assert count_op(gm, CASTS) == 0
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8), torch.randn(2, 3, 8)),
                                        (torch.randn(4, 1, 8), torch.randn(4, 1, 8))])


def test_dtype_changing_and_copying_casts_stay():
    x, idx = torch.randn(2, 3, 8) * 10, torch.randint(0, 9, (2, 3, 8))
    reference, gm, record = _run(RealCasts(), x, idx)
    assert record.num_matches == 0
    assert count_op(gm, CASTS) == count_op(reference, CASTS) == 4
    inputs = [(torch.randn(2, 3, 8) * 10, torch.randint(0, 9, (2, 3, 8))),
              (torch.randn(3, 5, 8) * 10, torch.randint(0, 9, (3, 5, 8)))]
    assert_same_outputs(reference, gm, inputs)
    for args in inputs:
        outs = gm(*args)
        assert [o.dtype for o in outs] == [torch.float16, torch.float32, torch.int64, torch.float64]
        # copy=True must still give a fresh tensor, not the input itself
        assert outs[1].data_ptr() != args[0].data_ptr()


def test_bf16_only_the_identity_cast_goes():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    reference, gm, record = _run(Bf16Casts(), x)
    assert record.num_matches == 1
    remaining = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (aten.to.dtype,)]
    assert [n.args[1] for n in remaining] == [torch.float32]
    inputs = [(torch.randn(2, 3, 8, dtype=torch.bfloat16),), (torch.randn(5, 2, 8, dtype=torch.bfloat16),)]
    assert_same_outputs(reference, gm, inputs, tol=1e-7)
    for args in inputs:  # removing an identity cast is bit-exact
        assert all(torch.equal(a, b) for a, b in zip(reference(*args), gm(*args)))
    assert [o.dtype for o in gm(*inputs[0])] == [torch.bfloat16, torch.float32]
