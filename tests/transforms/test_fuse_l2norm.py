"""fuse_l2norm (post_load_fusion): backend ``native`` swaps the reference L2 norm for autodeploy's
CPU kernel, ``auto`` (the default) picks native on CPU when the kernels are available and torch
otherwise; backend ``torch`` changes nothing; unknown backends are config errors."""

import copy

import pytest
import torch
from torch import nn

from autodeploy.config import load_deploy_config
from autodeploy.ops import native
from autodeploy.utils.errors import ConfigError
from helpers import apply_transform, assert_same_outputs, count_op, export_gm

ad = torch.ops.autodeploy
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


class QKNorms(nn.Module):
    """q and k L2-normalised over the head dim (k is a strided slice of a fused projection)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, x):
        q = self.q(x).view(*x.shape[:-1], 4, 8)
        k = self.kv(x).view(*x.shape[:-1], 4, 16)[..., :8]
        return ad.torch_l2norm(q, 1e-6), ad.torch_l2norm(k, 1e-3)


def _graph():
    return export_gm(QKNorms().eval(), torch.randn(2, 5, 32))


INPUTS = [(torch.randn(2, 5, 32),), (torch.randn(3, 1, 32),)]


@needs_native
def test_native_backend_swaps_every_norm_and_keeps_numerics():
    gm = _graph()
    reference = copy.deepcopy(gm)
    assert count_op(reference, ad.torch_l2norm) == 2
    gm, record = apply_transform("fuse_l2norm", gm, backend="native")
    assert record.status == "ok" and record.num_matches == 2
    assert count_op(gm, ad.torch_l2norm) == 0
    assert count_op(gm, ad.native_l2norm) == 2
    nodes = gm.graph.find_nodes(op="call_function", target=ad.native_l2norm.default)
    assert sorted(n.args[1] if len(n.args) > 1 else 1e-6 for n in nodes) == [1e-6, 1e-3]  # 1e-6: the default
    assert_same_outputs(reference, gm, INPUTS, tol=1e-6)
    with native.disabled():  # the op's fallback (the reference inside it) gives the same
        assert_same_outputs(reference, gm, INPUTS, tol=1e-7)


@needs_native
def test_native_op_matches_the_reference_and_falls_back_where_the_kernel_cannot_run():
    for shape, eps in (((1, 1, 16, 128), 1e-6), ((3, 7, 4, 8), 1e-2)):
        x = torch.randn(shape) * 0.05  # small rows: eps weighs in, so a wrongly scaled eps shows
        torch.testing.assert_close(ad.native_l2norm(x, eps), ad.torch_l2norm(x, eps), rtol=1e-6, atol=1e-6)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ad.native_l2norm(x.transpose(0, 1), 1e-6), ad.torch_l2norm(x.transpose(0, 1), 1e-6),
                               rtol=1e-6, atol=1e-6)  # strided: made contiguous for the kernel
    xb = x.bfloat16()  # not float32: the reference inside the op, bit for bit
    torch.testing.assert_close(ad.native_l2norm(xb, 1e-6), ad.torch_l2norm(xb, 1e-6), rtol=0, atol=0)
    assert ad.native_l2norm(xb, 1e-6).dtype == torch.bfloat16
    empty = torch.randn(0, 16)
    assert ad.native_l2norm(empty, 1e-6).shape == (0, 16)


def test_torch_backend_changes_nothing():
    gm = _graph()
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_l2norm", gm, backend="torch")
    assert record.status == "skipped" and record.num_matches == 0
    assert count_op(gm, ad.native_l2norm) == 0
    assert count_op(gm, ad.torch_l2norm) == 2
    assert gm.code == reference.code
    assert_same_outputs(reference, gm, INPUTS, tol=1e-7)


@needs_native
def test_default_backend_is_native_on_cpu_when_the_kernels_load_else_torch():
    gm, record = apply_transform("fuse_l2norm", _graph())
    assert record.status == "ok" and count_op(gm, ad.native_l2norm) == 2 and count_op(gm, ad.torch_l2norm) == 0
    with native.disabled():  # as without a compiler: auto keeps the reference
        gm, record = apply_transform("fuse_l2norm", _graph())
    assert record.status == "skipped"
    assert count_op(gm, ad.native_l2norm) == 0 and count_op(gm, ad.torch_l2norm) == 2


def test_graph_without_l2_norms_is_a_zero_match():
    """Near miss: RMSNorm and F.normalize are other functions; nothing to swap."""

    class Other(nn.Module):
        def forward(self, x):
            return ad.torch_rmsnorm(x, torch.ones(x.shape[-1]), 1e-6), torch.nn.functional.normalize(x, dim=-1)

    gm = export_gm(Other().eval(), torch.randn(2, 5, 16))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_l2norm", gm, backend="native")
    assert record.num_matches == 0
    assert gm.code == reference.code


def test_invalid_backend_is_a_config_error():
    with pytest.raises(ConfigError, match=r"fuse_l2norm\.backend"):
        load_deploy_config(transforms={"fuse_l2norm": {"backend": "nope"}})
    cfg = load_deploy_config(transforms={"fuse_l2norm": {"backend": "native"}})  # positive control
    assert cfg.transforms["fuse_l2norm"]["backend"] == "native"
