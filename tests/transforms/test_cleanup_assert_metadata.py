"""cleanup_assert_metadata: drop export's ``aten._assert_tensor_metadata`` checks, nothing else."""

import copy

import torch
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

aten = torch.ops.aten
KEY = "cleanup_assert_metadata"


class Casts(nn.Module):
    """``.to(dtype)`` makes export emit one metadata assert per cast."""

    def forward(self, x):
        h = x.to(torch.float32) * 2          # identity cast
        lo = (x * 3).to(torch.float16)       # real cast
        return h + lo.to(torch.float32)


class NoCasts(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2 + 1).view(-1, x.shape[-1])


def _run(module, *args):
    gm = export_gm(module.eval(), *args, clean=False)
    reference = copy.deepcopy(gm)
    before = {n.name: n.target for n in gm.graph.nodes}
    gm, record = apply_transform(KEY, gm)
    return reference, gm, record, before


def test_asserts_removed_and_everything_else_kept():
    x = torch.randn(2, 3, 8)
    reference, gm, record, before = _run(Casts(), x)
    n_asserts = count_op(reference, aten._assert_tensor_metadata)
    assert n_asserts >= 3  # one per .to() call
    assert record.num_matches == n_asserts
    assert count_op(gm, aten._assert_tensor_metadata) == 0
    # Only the asserts went away: every cast (identity ones included) stays for the cast cleanup.
    assert count_op(gm, aten.to) == count_op(reference, aten.to) == 3
    after = {n.name: n.target for n in gm.graph.nodes}
    removed = {name for name in before if name not in after}
    assert removed and all(before[name] == aten._assert_tensor_metadata.default for name in removed)
    assert set(after) <= set(before)
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8),), (torch.randn(5, 1, 8),)])


def test_graph_without_asserts_is_left_alone():
    x = torch.randn(2, 3, 8)
    reference, gm, record, before = _run(NoCasts(), x)
    assert count_op(reference, aten._assert_tensor_metadata) == 0
    assert record.num_matches == 0
    assert {n.name: n.target for n in gm.graph.nodes} == before
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8),), (torch.randn(4, 6, 8),)])


def test_second_application_finds_nothing():
    x = torch.randn(2, 3, 8)
    reference, gm, record, _ = _run(Casts(), x)
    assert record.num_matches == count_op(reference, aten._assert_tensor_metadata) >= 3
    code = gm.code
    gm, record2 = apply_transform(KEY, gm)
    assert record2.num_matches == 0
    assert gm.code == code
