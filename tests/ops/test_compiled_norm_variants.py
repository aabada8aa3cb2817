"""The inductor RMSNorm kernels (``autodeploy.ops.compiled``) are compiled once per process and
shared by every model built in it. Dynamo compiles one code object at most ``recompile_limit``
(8) times, and with ``fullgraph=True`` the next variant is an error; a later model's
``torch.compile`` then failed with "Attempt to trace generator" (issue 21: the KV-cache
consistency check was skipped for torch-compile because of it).

The calls reach dynamo uniform: a 3-D hidden state, a 4-D per-head q/k norm, ``Parameter`` or
plain weights of any hidden size are one compiled variant (one more for a single row, which
dynamo specialises). Before, each of those was a variant of its own and this sweep (16 calls)
ran past the limit."""

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from autodeploy.ops.compiled import _add_rmsnorm
from autodeploy.ops.normalization import torch_rmsnorm_impl

ad = torch.ops.autodeploy

# (shape of x, weight as a Parameter?) : every rank a model feeds a norm, several hidden sizes
SHAPES = [(1, 7, 32), (1, 1, 32), (1, 9, 4, 16), (1, 1, 4, 16), (1, 5, 48), (5, 64), (1, 1, 64), (2, 3, 2, 24)]
CASES = [(shape, as_param) for shape in SHAPES for as_param in (True, False)]


def _entries(fn):
    return len(_debug_get_cache_entry_list(fn.__code__))


def _weight(hidden, as_param):
    w = torch.randn(hidden)
    return nn.Parameter(w, requires_grad=False) if as_param else w


def test_compiled_rmsnorm_variants_stay_few_and_exact():
    before = _entries(torch_rmsnorm_impl)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for shape, as_param in CASES:
            x = torch.randn(*shape, generator=gen)
            w = _weight(shape[-1], as_param)
            out = ad.compiled_rmsnorm(x, w, 1e-6)
            assert out.shape == x.shape
            torch.testing.assert_close(out, ad.torch_rmsnorm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    # one variant for many rows, one for a single row (dynamo's 0/1 specialisation), at most
    assert _entries(torch_rmsnorm_impl) - before <= 2


def test_compiled_fused_add_rmsnorm_variants_stay_few_and_exact():
    before = _entries(_add_rmsnorm)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for shape, as_param in CASES:
            x, r = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
            w = _weight(shape[-1], as_param)
            normed, summed = ad.compiled_fused_add_rmsnorm(x, r, w, 1e-6)
            ref_normed, ref_summed = ad.torch_fused_add_rmsnorm(x, r, w, 1e-6)
            assert normed.shape == summed.shape == x.shape
            torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(summed, ref_summed)
            assert summed.data_ptr() not in (x.data_ptr(), r.data_ptr())
    assert _entries(_add_rmsnorm) - before <= 2


@pytest.mark.parametrize("x_shape, r_shape", [((2, 5, 32), (1, 5, 32))])
def test_compiled_fused_add_rmsnorm_broadcasting_inputs(x_shape, r_shape):
    """Inputs of different shapes (a broadcast residual) are not flattened: still exact."""
    x, r, w = torch.randn(*x_shape), torch.randn(*r_shape), torch.randn(x_shape[-1])
    with torch.no_grad():
        normed, summed = ad.compiled_fused_add_rmsnorm(x, r, w, 1e-6)
        ref_normed, ref_summed = ad.torch_fused_add_rmsnorm(x, r, w, 1e-6)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(summed, ref_summed)
