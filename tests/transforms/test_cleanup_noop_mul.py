"""cleanup_noop_mul: ``x * 1`` / ``1 * x`` / ``x / 1`` that keep dtype and shape are dropped."""

import copy

import torch
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

aten = torch.ops.aten
KEY = "cleanup_noop_mul"


class MulOne(nn.Module):
    def forward(self, x, i):
        return (
            (x * 1) + 2,
            (1 * x) + 3,
            (x / 1) + 4,
            (x * 1.0) + 5,
            (i * 1) + 6,     # int * int 1 stays int64: still an identity
        )


class NotMulOne(nn.Module):
    def forward(self, x, i):
        return (
            x * 2,
            x / 2,
            i / 1,                                     # true division: int64 -> float32
            i * 1.0,                                   # int64 -> float32
            x // 1,                                    # floor division is not an identity
            x * torch.ones(3, 1, 1, x.shape[-1]),      # broadcasts to a bigger shape
        )


class MulOneThenMutate(nn.Module):
    def forward(self, x):
        h = x + 3
        z = h * 1
        h.add_(2)
        return z, h


class MulOneThenMutateThroughView(nn.Module):
    def forward(self, x):
        h = x + 3
        z = h * 1
        h.view(-1).add_(2)
        return z, h


class MulOneMakesContiguous(nn.Module):
    def forward(self, x):
        return (x[:, ::2] * 1).view(-1)


def _run(module, *args, **kw):
    gm = export_gm(module.eval(), *args, clean=False, **kw)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(KEY, gm)
    return reference, gm, record


def _int(*shape):
    return torch.randint(-5, 5, shape)


def test_mul_and_div_by_one_are_removed():
    reference, gm, record = _run(MulOne(), torch.randn(2, 3, 8), _int(2, 3, 8))
    assert count_op(reference, [aten.mul, aten.div]) == 5
    assert record.num_matches == 5
    assert count_op(gm, [aten.mul, aten.div]) == 0
    inputs = [(torch.randn(2, 3, 8), _int(2, 3, 8)), (torch.randn(4, 1, 8), _int(4, 1, 8))]
    assert_same_outputs(reference, gm, inputs)
    assert gm(*inputs[0])[4].dtype == torch.int64


def test_scaling_dtype_changing_and_floor_division_stay():
    reference, gm, record = _run(NotMulOne(), torch.randn(2, 3, 8) * 4, _int(2, 3, 8))
    n_ops = count_op(reference, [aten.mul, aten.div, aten.floor_divide])
    assert n_ops == 6
    assert record.num_matches == 0
    assert count_op(gm, [aten.mul, aten.div, aten.floor_divide]) == n_ops
    inputs = [(torch.randn(2, 3, 8) * 4, _int(2, 3, 8)), (torch.randn(5, 2, 8) * 4, _int(5, 2, 8))]
    assert_same_outputs(reference, gm, inputs)
    x, i = inputs[1]
    outs = gm(x, i)
    assert outs[2].dtype == torch.float32 and outs[3].dtype == torch.float32
    assert torch.equal(outs[4], torch.floor(x))
    assert outs[5].shape == (3, 5, 2, 8)


def test_mul_one_whose_source_is_mutated_later_stays():
    reference, gm, record = _run(MulOneThenMutate(), torch.randn(2, 3, 8))
    assert record.num_matches == 0
    assert count_op(gm, aten.mul) == 1
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8),), (torch.randn(3, 5, 8),)])


def test_mul_one_whose_source_is_mutated_through_a_view_stays():
    reference, gm, record = _run(MulOneThenMutateThroughView(), torch.randn(2, 3, 8))
    assert record.num_matches == 0
    assert count_op(gm, aten.mul) == 1
    assert gm.code == reference.code
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8),), (torch.randn(3, 5, 8),)])


def test_mul_one_that_makes_a_tensor_contiguous_is_left_alone():
    """Dropping the mul would hand ``.view`` a strided slice, which it cannot view: the mul stays."""
    reference, gm, record = _run(MulOneMakesContiguous(), torch.randn(2, 6, 8))
    assert record.num_matches == 0
    assert count_op(gm, aten.mul) == 1 and count_op(gm, aten.view) == 1
    assert gm.code == reference.code
    assert_same_outputs(reference, gm, [(torch.randn(2, 6, 8),), (torch.randn(3, 4, 8),)])
