"""fuse_rmsnorm (post_load_fusion): backend ``compile`` swaps the reference RMSNorm ops for the
inductor-generated ones; backend ``torch`` changes nothing; unknown backends are config errors."""

import copy

import pytest
import torch
from torch import nn

from autodeploy.config import load_deploy_config
from autodeploy.utils.errors import ConfigError
from helpers import apply_transform, assert_same_outputs, count_op, export_gm

ad = torch.ops.autodeploy
D = 32
REFERENCE_OPS = [ad.torch_rmsnorm, ad.torch_fused_add_rmsnorm]
COMPILED_OPS = [ad.compiled_rmsnorm, ad.compiled_fused_add_rmsnorm]


class Norms(nn.Module):
    """One plain norm, two fused add+norms (the second reads the first's sum)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(D)) for _ in range(3))
        self.lin = nn.Linear(D, D)

    def forward(self, x, r):
        y0 = ad.torch_rmsnorm(x, self.w1, 1e-6)
        y1, s1 = ad.torch_fused_add_rmsnorm(self.lin(y0), r, self.w2, 1e-6)
        y2, s2 = ad.torch_fused_add_rmsnorm(s1, self.lin(y1), self.w3, 1e-5)
        return y0, y2, s2


def _graph():
    return export_gm(Norms().eval(), torch.randn(2, 5, D), torch.randn(2, 5, D))


INPUTS = [(torch.randn(2, 5, D), torch.randn(2, 5, D)), (torch.randn(3, 7, D), torch.randn(3, 7, D))]


def test_compile_backend_swaps_every_norm_and_keeps_numerics():
    gm = _graph()
    reference = copy.deepcopy(gm)
    assert count_op(reference, ad.torch_rmsnorm) == 1 and count_op(reference, ad.torch_fused_add_rmsnorm) == 2
    gm, record = apply_transform("fuse_rmsnorm", gm, backend="compile")
    assert record.status == "ok" and record.num_matches == 3
    assert count_op(gm, REFERENCE_OPS) == 0
    assert count_op(gm, ad.compiled_rmsnorm) == 1
    assert count_op(gm, ad.compiled_fused_add_rmsnorm) == 2
    assert_same_outputs(reference, gm, INPUTS, tol=1e-5)
    for x, r in INPUTS:  # the sum output is a fresh tensor, not one of the inputs
        with torch.no_grad():
            _, s1 = ad.compiled_fused_add_rmsnorm(x, r, torch.ones(D), 1e-6)
        assert s1.data_ptr() not in (x.data_ptr(), r.data_ptr())
        torch.testing.assert_close(s1, x + r)


def test_torch_backend_changes_nothing():
    gm = _graph()
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_rmsnorm", gm, backend="torch")
    assert record.status == "skipped" and record.num_matches == 0
    assert count_op(gm, COMPILED_OPS) == 0
    assert count_op(gm, REFERENCE_OPS) == 3
    assert gm.code == reference.code
    assert_same_outputs(reference, gm, INPUTS, tol=1e-7)


def test_default_backend_is_torch():
    gm = _graph()
    gm, record = apply_transform("fuse_rmsnorm", gm)
    assert record.status == "skipped"
    assert count_op(gm, COMPILED_OPS) == 0


def test_graph_without_norms_is_a_zero_match():
    gm = export_gm(nn.Linear(D, D).eval(), torch.randn(2, 5, D))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_rmsnorm", gm, backend="compile")
    assert record.num_matches == 0
    assert gm.code == reference.code


def test_invalid_backend_is_a_config_error():
    with pytest.raises(ConfigError, match=r"fuse_rmsnorm\.backend"):
        load_deploy_config(transforms={"fuse_rmsnorm": {"backend": "nope"}})
    cfg = load_deploy_config(transforms={"fuse_rmsnorm": {"backend": "compile"}})  # positive control
    assert cfg.transforms["fuse_rmsnorm"]["backend"] == "compile"
