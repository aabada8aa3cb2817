"""fuse_rmsnorm (post_load_fusion): backend ``compile`` swaps the reference RMSNorm ops for the
inductor-generated ones, ``native`` for autodeploy's C kernel, ``auto`` (the default) picks
native on CPU when the kernels are available and torch otherwise; backend ``torch`` changes
nothing; unknown backends are config errors."""

import copy

import pytest
import torch
from torch import nn

from autodeploy.config import load_deploy_config
from autodeploy.ops import native
from autodeploy.utils.errors import ConfigError
from helpers import apply_transform, assert_same_outputs, count_op, export_gm

ad = torch.ops.autodeploy
D = 32
REFERENCE_OPS = [ad.torch_rmsnorm, ad.torch_fused_add_rmsnorm]
COMPILED_OPS = [ad.compiled_rmsnorm, ad.compiled_fused_add_rmsnorm]
NATIVE_OPS = [ad.native_rmsnorm, ad.native_fused_add_rmsnorm]
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


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


@needs_native
def test_native_backend_swaps_every_norm_and_keeps_numerics():
    gm = _graph()
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_rmsnorm", gm, backend="native")
    assert record.status == "ok" and record.num_matches == 3
    assert count_op(gm, REFERENCE_OPS) == 0
    assert count_op(gm, ad.native_rmsnorm) == 1 and count_op(gm, ad.native_fused_add_rmsnorm) == 2
    assert_same_outputs(reference, gm, INPUTS, tol=1e-5)
    with native.disabled():  # the op's fallback (the reference inside it) means the same
        assert_same_outputs(reference, gm, INPUTS, tol=1e-6)


@needs_native
def test_native_kernel_matches_the_reference_and_declines_what_it_cannot_take():
    w = torch.randn(D)
    for shape in ((1, 1, D), (3, 7, D)):
        x, r = torch.randn(shape), torch.randn(shape)
        y, s = ad.native_fused_add_rmsnorm(x, r, w, 1e-6)
        y_ref, s_ref = ad.torch_fused_add_rmsnorm(x, r, w, 1e-6)
        torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
        assert s.data_ptr() not in (x.data_ptr(), r.data_ptr())
        torch.testing.assert_close(ad.native_rmsnorm(x, w, 1e-5), ad.torch_rmsnorm(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    x = torch.randn(2, 3, D)
    # near misses the kernel declines (the op then runs the reference): mixed dtypes, float16, strided rows
    assert native.rmsnorm(x.bfloat16(), w, 1e-6) is None
    assert native.rmsnorm(x.half(), w.half(), 1e-6) is None
    assert native.rmsnorm(x.transpose(0, 1), w, 1e-6) is None
    assert native.rmsnorm(x, w, 1e-6, residual=torch.randn(3, D)) is None
    assert native.rmsnorm(x, w, 1e-6) is not None  # positive control


@needs_native
def test_native_bf16_kernel_rounds_where_the_reference_does():
    """bfloat16 rows (a bf16 model's norms): the residual sum exactly the reference's, the output
    the reference's but for the rare element a different summation order of the mean moves across
    a rounding boundary (none in these draws: measured bit-identical)."""
    gen = torch.Generator().manual_seed(0)
    for rows, hidden in ((1, 768), (3, 2048), (5, 37)):
        x, r = (torch.randn(rows, hidden, generator=gen).bfloat16() * 3 for _ in range(2))
        w = torch.randn(hidden, generator=gen).bfloat16()
        assert native.rmsnorm(x, w, 1e-6, residual=r) is not None  # the kernel, not the fallback
        y, s = ad.native_fused_add_rmsnorm(x, r, w, 1e-6)
        y_ref, s_ref = ad.torch_fused_add_rmsnorm(x, r, w, 1e-6)
        assert y.dtype == torch.bfloat16 and torch.equal(s, s_ref)
        assert (y != y_ref).float().mean() <= 0.01
        torch.testing.assert_close(y, y_ref, rtol=2 ** -7, atol=1e-6)
        plain, plain_ref = ad.native_rmsnorm(x, w, 1e-5), ad.torch_rmsnorm(x, w, 1e-5)
        assert (plain != plain_ref).float().mean() <= 0.01
        torch.testing.assert_close(plain, plain_ref, rtol=2 ** -7, atol=1e-6)


@needs_native
def test_default_backend_is_native_on_cpu_when_the_kernels_load_else_torch():
    gm, record = apply_transform("fuse_rmsnorm", _graph())
    assert record.status == "ok" and count_op(gm, NATIVE_OPS) == 3 and count_op(gm, REFERENCE_OPS) == 0
    with native.disabled():  # as without a compiler: auto keeps the reference
        gm, record = apply_transform("fuse_rmsnorm", _graph())
    assert record.status == "skipped"
    assert count_op(gm, NATIVE_OPS + COMPILED_OPS) == 0 and count_op(gm, REFERENCE_OPS) == 3


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
