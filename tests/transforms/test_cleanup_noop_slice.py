"""cleanup_noop_slice: slices covering a whole dim are dropped; partial or strided ones stay."""

import copy

import torch
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

aten = torch.ops.aten
KEY = "cleanup_noop_slice"


class FullSlices(nn.Module):
    def forward(self, x):
        a = x[:, :] * 2                      # slice(dim 0, 0, INT64_MAX), slice(dim 1, 0, INT64_MAX)
        b = x[:, : x.shape[1]] * 3           # slice(dim 1, None, s): ends at the (dynamic) size
        c = aten.slice.Tensor(x, 2, 0, 8) * 4  # static last dim, explicit end == size
        return a, b, c


class PartialSlices(nn.Module):
    """Each slice drops part of its dim (aten.slice called directly so no full-dim slices mix in)."""

    def forward(self, x):
        return (
            aten.slice.Tensor(x, 1, 1),                 # start > 0 on a dynamic dim
            aten.slice.Tensor(x, 1, 0, -1),             # end < size on a dynamic dim
            aten.slice.Tensor(x, 1, 0, 2**63 - 1, 2),   # step 2
            aten.slice.Tensor(x, 2, 0, 3),              # end < static size
            aten.slice.Tensor(x, 2, 1, 8),              # start > 0 on the static dim
            aten.slice.Tensor(x, 2, 0, 8, 2),           # whole static dim, but step 2
        )


class SliceToOtherTensorsLength(nn.Module):
    """``x[:, :y.shape[1]]``: a full slice only when the two dynamic lengths agree."""

    def forward(self, x, y):
        return x[:, : y.shape[1]] * 2


def _run(module, *args, **kw):
    gm = export_gm(module.eval(), *args, clean=False, **kw)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(KEY, gm)
    return reference, gm, record


def test_full_slices_are_removed():
    reference, gm, record = _run(FullSlices(), torch.randn(2, 3, 8))
    n_slices = count_op(reference, aten.slice)
    assert n_slices == 4
    assert record.num_matches == n_slices
    assert count_op(gm, aten.slice) == 0
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8),), (torch.randn(5, 7, 8),)])


def test_partial_and_strided_slices_stay():
    reference, gm, record = _run(PartialSlices(), torch.randn(2, 6, 8))
    assert count_op(reference, aten.slice) == 6
    assert record.num_matches == 0
    assert count_op(gm, aten.slice) == 6
    inputs = [(torch.randn(2, 6, 8),), (torch.randn(3, 9, 8),)]
    assert_same_outputs(reference, gm, inputs)
    x = inputs[1][0]
    expected = [x[:, 1:], x[:, :-1], x[:, ::2], x[..., :3], x[..., 1:], x[..., ::2]]
    assert all(torch.equal(a, b) for a, b in zip(gm(x), expected))


def test_slice_bounded_by_another_dynamic_length_stays():
    x, y = torch.randn(2, 6, 8), torch.randn(2, 4, 8)
    reference, gm, record = _run(SliceToOtherTensorsLength(), x, y)
    assert record.num_matches == 0
    assert count_op(gm, aten.slice) == count_op(reference, aten.slice)
    inputs = [(torch.randn(2, 6, 8), torch.randn(2, 4, 8)), (torch.randn(3, 9, 8), torch.randn(3, 2, 8))]
    assert_same_outputs(reference, gm, inputs)
    assert gm(*inputs[1]).shape == (3, 2, 8)
