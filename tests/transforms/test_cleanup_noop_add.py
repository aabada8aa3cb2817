"""cleanup_noop_add: ``x + 0`` / ``x - 0`` / ``0 + x`` that keep dtype and shape are dropped."""

import copy

import torch
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

aten = torch.ops.aten
KEY = "cleanup_noop_add"


class AddZero(nn.Module):
    def forward(self, x, i):
        return (
            (x + 0) * 2,
            (x - 0) * 3,
            (0 + x) * 4,
            (x + 0.0) * 5,
            (i + 0) * 6,     # int + int 0 stays int64: still an identity
        )


class NotAddZero(nn.Module):
    def forward(self, x, i, m):
        return (
            i + 0.0,                                     # int64 -> float32
            m + 0,                                       # bool -> int64
            x + torch.zeros(3, 1, 1, x.shape[-1]),       # broadcasts to a bigger shape
            x + 1,
            x - 1,
            torch.add(x, 1, alpha=0),                    # x + 0 * 1 with alpha: not a plain scalar 0
        )


class AddZeroThenMutate(nn.Module):
    def forward(self, x):
        h = x * 3
        z = h + 0
        h.mul_(2)            # writes into the add's source after the add
        return z, h


class AddZeroThenMutateThroughView(nn.Module):
    def forward(self, x):
        h = x * 3
        z = h + 0
        h.view(-1).mul_(2)   # writes into the source through an alias
        return z, h


class AddZeroMakesContiguous(nn.Module):
    """``x[:, ::2] + 0`` is a fresh contiguous tensor; ``.view`` relies on that."""

    def forward(self, x):
        return (x[:, ::2] + 0).view(-1)


def _run(module, *args, **kw):
    gm = export_gm(module.eval(), *args, clean=False, **kw)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(KEY, gm)
    return reference, gm, record


def _int(*shape):
    return torch.randint(-5, 5, shape)


def test_add_zero_is_removed():
    reference, gm, record = _run(AddZero(), torch.randn(2, 3, 8), _int(2, 3, 8))
    assert count_op(reference, [aten.add, aten.sub]) == 5
    assert record.num_matches == 5
    assert count_op(gm, [aten.add, aten.sub]) == 0
    inputs = [(torch.randn(2, 3, 8), _int(2, 3, 8)), (torch.randn(4, 1, 8), _int(4, 1, 8))]
    assert_same_outputs(reference, gm, inputs)
    assert gm(*inputs[0])[4].dtype == torch.int64


def test_dtype_or_shape_changing_adds_stay():
    args = (torch.randn(2, 3, 8), _int(2, 3, 8), torch.rand(2, 3, 8) > 0.5)
    reference, gm, record = _run(NotAddZero(), *args)
    n_adds = count_op(reference, [aten.add, aten.sub])
    assert n_adds == 6
    assert record.num_matches == 0
    assert count_op(gm, [aten.add, aten.sub]) == n_adds
    inputs = [args, (torch.randn(5, 2, 8), _int(5, 2, 8), torch.rand(5, 2, 8) > 0.5)]
    assert_same_outputs(reference, gm, inputs)
    outs = gm(*inputs[1])
    assert outs[0].dtype == torch.float32 and outs[1].dtype == torch.int64
    assert outs[2].shape == (3, 5, 2, 8)


def test_add_zero_whose_source_is_mutated_later_stays():
    reference, gm, record = _run(AddZeroThenMutate(), torch.randn(2, 3, 8))
    assert record.num_matches == 0
    assert count_op(gm, aten.add) == 1
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8),), (torch.randn(3, 5, 8),)])


def test_add_zero_whose_source_is_mutated_through_a_view_stays():
    reference, gm, record = _run(AddZeroThenMutateThroughView(), torch.randn(2, 3, 8))
    assert record.num_matches == 0
    assert count_op(gm, aten.add) == 1
    assert gm.code == reference.code
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8),), (torch.randn(3, 5, 8),)])


def test_add_zero_that_makes_a_tensor_contiguous_is_left_alone():
    """Dropping the add would hand ``.view`` a strided slice, which it cannot view: the add stays."""
    reference, gm, record = _run(AddZeroMakesContiguous(), torch.randn(2, 6, 8))
    assert record.num_matches == 0
    assert count_op(gm, aten.add) == 1 and count_op(gm, aten.view) == 1
    assert gm.code == reference.code
    assert_same_outputs(reference, gm, [(torch.randn(2, 6, 8),), (torch.randn(3, 4, 8),)])
