"""cleanup_noop_view: same-shape view/reshape/expand, alias, and contiguous of a contiguous tensor
are dropped; real reshapes and layout-changing contiguous calls stay."""

import copy

import torch
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

aten = torch.ops.aten
KEY = "cleanup_noop_view"
VIEWS = [aten.view, aten.reshape, aten._unsafe_view, aten.alias, aten.expand, aten.contiguous]


class SameShapeViews(nn.Module):
    def forward(self, x):
        return (
            x.view(x.shape) * 2,
            x.reshape(x.shape) * 3,
            x.expand(x.shape) * 4,
            x.expand(-1, -1, -1) * 5,
            aten.alias.default(x) * 6,
            aten.contiguous.default(x) * 7,   # x is contiguous
        )


class RealViews(nn.Module):
    def forward(self, x):
        return (
            x.view(-1, x.shape[-1]),
            x.reshape(-1),
            x.unsqueeze(0).expand(3, -1, -1, -1),
            x.view(torch.int32),                        # same shape, other dtype
        )


class ContiguousBeforeView(nn.Module):
    """The ``contiguous`` calls are what makes the ``view`` legal: they must stay."""

    def forward(self, x):
        a = x.transpose(0, 1).contiguous().view(-1)
        b = x[..., ::2].contiguous().view(-1)
        return a, b


class ViewThenInPlace(nn.Module):
    def forward(self, x):
        h = x * 2
        y = h.view(h.shape)
        y.add_(1)
        return y * 3, h


def _run(module, *args, **kw):
    gm = export_gm(module.eval(), *args, clean=False, **kw)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(KEY, gm)
    return reference, gm, record


def _exact(reference, gm, inputs):
    for args in inputs:
        a, b = reference(*args), gm(*args)
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_same_shape_views_are_removed():
    reference, gm, record = _run(SameShapeViews(), torch.randn(2, 3, 8))
    assert count_op(reference, VIEWS) == 6
    assert record.num_matches == 6
    assert count_op(gm, VIEWS) == 0
    inputs = [(torch.randn(2, 3, 8),), (torch.randn(5, 1, 8),)]
    assert_same_outputs(reference, gm, inputs)
    _exact(reference, gm, inputs)


def test_shape_or_dtype_changing_views_stay():
    reference, gm, record = _run(RealViews(), torch.randn(2, 3, 8))
    n_views = count_op(reference, VIEWS)
    assert n_views == 4
    assert record.num_matches == 0
    assert count_op(gm, VIEWS) == n_views
    inputs = [(torch.randn(2, 3, 8),), (torch.randn(4, 6, 8),)]
    _exact(reference, gm, inputs)
    outs = gm(*inputs[1])
    assert [o.shape for o in outs] == [(24, 8), (192,), (3, 4, 6, 8), (4, 6, 8)]
    assert outs[3].dtype == torch.int32


def test_contiguous_of_non_contiguous_tensor_stays_and_graph_runs():
    reference, gm, record = _run(ContiguousBeforeView(), torch.randn(2, 3, 8))
    assert count_op(reference, aten.contiguous) == 2
    assert record.num_matches == 0
    assert count_op(gm, aten.contiguous) == 2
    inputs = [(torch.randn(2, 3, 8),), (torch.randn(3, 5, 8),)]
    _exact(reference, gm, inputs)  # would raise in .view had a contiguous been dropped
    x = inputs[1][0]
    a, b = gm(x)
    assert torch.equal(a, x.transpose(0, 1).reshape(-1)) and torch.equal(b, x[..., ::2].reshape(-1))


def test_view_written_in_place_is_kept_and_numerics_hold():
    reference, gm, record = _run(ViewThenInPlace(), torch.randn(2, 3, 8))
    assert count_op(reference, aten.add_) == 1  # export keeps the in-place op in this IR
    assert record.num_matches == 0
    assert count_op(gm, aten.view) == count_op(reference, aten.view)
    inputs = [(torch.randn(2, 3, 8),), (torch.randn(3, 5, 8),)]
    _exact(reference, gm, inputs)
    x = inputs[0][0]
    y, h = gm(x)
    assert torch.allclose(h, x * 2 + 1) and torch.allclose(y, (x * 2 + 1) * 3)
