"""mlir_elementwise_fusion: maximal element-wise float32 subgraphs -> one generated C++ kernel each.

Kernels compile into one session-scoped directory, so each distinct kernel source is built once
per test session (``kernels.STATS`` counts compiles and cache hits).
"""

import copy
import logging
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from autodeploy.compile.mlir import kernels
from autodeploy.compile.mlir.partition import Access, find_groups
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.library import mlir_elementwise_fusion as mlir_module
from autodeploy.transform.optimizer import build_transform
from helpers import apply_transform, assert_matches_hf, assert_same_outputs, build, count_op, export_gm, family_checkpoint

ad = torch.ops.autodeploy
aten = torch.ops.aten
FUSED = ad.cpu_fused_elementwise
D = 32


@pytest.fixture(scope="session")
def kernel_dir(tmp_path_factory):
    """The kernel cache of the tests that fuse (xdsl is a dependency: no skip without it)."""
    return str(tmp_path_factory.mktemp("mlir-kernels"))


def _shapes(n_inputs, rows=((2, 5), (3, 1))):
    """Inputs at two (batch, seq) shapes, the second a decode-like seq of 1."""
    return [tuple(torch.randn(b, s, D) for _ in range(n_inputs)) for b, s in rows]


def _run(module, n_inputs, kernel_dir, **config):
    config.setdefault("min_ops", 2)  # these small modules check the mechanics on 2-op subgraphs too
    gm = export_gm(module.eval(), *_shapes(n_inputs)[0])
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("mlir_elementwise_fusion", gm, cache_dir=kernel_dir, **config)
    return reference, gm, record


def _fused_nodes(gm):
    return gm.graph.find_nodes(op="call_function", target=FUSED.default)


class SiluGate(nn.Module):
    """``x * sigmoid(x) * y * w + 1`` with ``w`` a ``[D]`` weight broadcast along leading dims."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        return x * torch.sigmoid(x) * y * self.w + 1.0


def test_silu_gate_with_row_broadcast(kernel_dir):
    reference, gm, record = _run(SiluGate(), 2, kernel_dir)
    assert record.num_matches == 1
    assert count_op(gm, FUSED) == 1
    assert count_op(gm, [aten.sigmoid, aten.mul, aten.add]) == 0
    (node,) = _fused_nodes(gm)
    inputs, _, num_outputs = node.args
    assert [n.name for n in inputs] == ["x", "y", "w"] and num_outputs == 1
    assert kernels._load(node.args[1]).access == (Access.FULL, Access.FULL, Access.ROW)
    assert_same_outputs(reference, gm, _shapes(2))


class GeluTanhChain(nn.Module):
    """An MLP activation tail: gelu (tanh form) of a scaled, shifted input times a gate, clamped."""

    def forward(self, x, g):
        h = F.gelu(x * 0.5 - 0.25, approximate="tanh") * torch.tanh(g) + F.gelu(g)
        return torch.clamp(h, -3.0, 3.0).pow(2) / 2.0 - torch.relu(-x) * torch.exp(-g.abs())


def test_gelu_tanh_chain(kernel_dir):
    reference, gm, record = _run(GeluTanhChain(), 2, kernel_dir)
    assert record.num_matches == 1
    assert count_op(gm, FUSED) == 1
    assert count_op(gm, [aten.gelu, aten.tanh, aten.clamp, aten.pow, aten.relu, aten.exp, aten.abs, aten.mul,
                         aten.add, aten.sub, aten.div, aten.neg]) == 0
    inputs = [(x * 4, g * 4) for x, g in _shapes(2)]  # tanh, clamp and exp over their whole range
    assert_same_outputs(reference, gm, inputs)


class RawRMSNorm(nn.Module):
    """RMSNorm written out: ``add(mean, eps) -> rsqrt`` is a ``[B, S, 1]`` column subgraph; the
    normalisation ``x * rstd * w`` reads it broadcast along the last dim and ``w`` along rows."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) * self.w


def test_rmsnorm_column_and_row_broadcasts(kernel_dir):
    reference, gm, record = _run(RawRMSNorm(), 1, kernel_dir)
    assert record.num_matches == 2
    assert count_op(gm, FUSED) == 2
    assert count_op(gm, [aten.rsqrt, aten.mul, aten.add]) == 0
    assert count_op(gm, aten.pow) == 1 and count_op(gm, aten.mean) == 1  # one op alone, and a reduction
    access = {kernels._load(n.args[1]).access for n in _fused_nodes(gm)}
    assert access == {(Access.FULL,), (Access.FULL, Access.COL, Access.ROW)}  # the column group reads the mean whole
    assert_same_outputs(reference, gm, _shapes(1))


class Residual(nn.Module):
    """One subgraph, two outputs: the residual sum is returned and also scaled."""

    def forward(self, x, y):
        h = x + y
        return h, torch.sigmoid(h) * 2.0


def test_two_outputs(kernel_dir):
    reference, gm, record = _run(Residual(), 2, kernel_dir)
    assert record.num_matches == 1
    (node,) = _fused_nodes(gm)
    assert node.args[2] == 2
    assert count_op(gm, [aten.add, aten.sigmoid, aten.mul]) == 0
    assert_same_outputs(reference, gm, _shapes(2))


class ThroughReduction(nn.Module):
    """``a = (x + 1) * 2`` then ``a * sum(a)``: fusing the product into ``a``'s subgraph would
    make a cycle through the reduction, so it starts a second subgraph."""

    def forward(self, x):
        a = (x + 1.0) * 2.0
        c = a * a.sum(-1, keepdim=True)
        return c - 1.0


def test_no_cycle_through_a_reduction(kernel_dir):
    reference, gm, record = _run(ThroughReduction(), 1, kernel_dir)
    assert record.num_matches == 2
    assert count_op(gm, FUSED) == 2 and count_op(gm, aten.sum) == 1
    assert count_op(gm, [aten.add, aten.mul, aten.sub]) == 0
    assert_same_outputs(reference, gm, _shapes(1))


class MiddleBroadcast(nn.Module):
    """``z`` is ``[B, 1, D]`` against ``[B, S, D]``: a broadcast the kernels do not index."""

    def forward(self, x, z):
        return (x * z).sigmoid() + torch.tanh(z)


class Half(nn.Module):
    def forward(self, x, y):
        return (x.to(torch.bfloat16) * torch.sigmoid(y.to(torch.bfloat16)) + 1.0).float()


class Single(nn.Module):
    def forward(self, x, y):
        return torch.matmul(x.sigmoid(), y.transpose(-1, -2))


def test_near_misses_left_alone(kernel_dir):
    x, z = torch.randn(2, 5, D), torch.randn(2, 1, D)
    dyn = ({0: Dim("b"), 1: Dim("s")}, {0: Dim("b")})
    gm = export_gm(MiddleBroadcast(), x, z, dynamic=dyn)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("mlir_elementwise_fusion", gm, cache_dir=kernel_dir, min_ops=2)
    # mul(x, z) is not a candidate; sigmoid(mul) + tanh(z) would be, but tanh(z) has another
    # shape and sigmoid alone is one op: nothing reaches two ops
    assert record.num_matches == 0 and count_op(gm, FUSED) == 0
    assert count_op(gm, [aten.mul, aten.sigmoid, aten.add, aten.tanh]) == 4
    assert_same_outputs(reference, gm, [(x, z), (torch.randn(3, 2, D), torch.randn(3, 1, D))])
    # bf16 arithmetic (not supported yet) and a lone element-wise op (min_ops 2)
    for module, ops in ((Half(), [aten.mul, aten.sigmoid, aten.add]), (Single(), [aten.sigmoid])):
        reference, gm, record = _run(module, 2, kernel_dir)
        assert record.num_matches == 0 and count_op(gm, FUSED) == 0
        assert count_op(gm, ops) == len(ops)
        assert_same_outputs(reference, gm, _shapes(2), tol=1e-2)


def test_min_ops_leaves_short_subgraphs(kernel_dir):
    """``min_ops: 3`` (the default): the rmsnorm's two-op subgraphs are left alone."""
    reference, gm, record = _run(RawRMSNorm(), 1, kernel_dir, min_ops=3)
    assert record.num_matches == 0 and count_op(gm, aten.rsqrt) == 1


def test_second_build_hits_the_kernel_cache(kernel_dir, tmp_path):
    _run(SiluGate(), 2, kernel_dir)  # built (or already cached by another test)
    before = dict(kernels.STATS)
    _, gm, record = _run(SiluGate(), 2, kernel_dir)
    assert record.num_matches == 1
    assert kernels.STATS["compiles"] == before["compiles"]
    assert kernels.STATS["cache_hits"] == before["cache_hits"] + 1
    # another cache directory compiles again
    _run(SiluGate(), 2, str(tmp_path))
    assert kernels.STATS["compiles"] == before["compiles"] + 1


def test_skips_without_xdsl(tmp_path, monkeypatch, caplog):
    """With xdsl not importable: skipped, graph unchanged, one log line however often it runs."""
    monkeypatch.setattr(logging.getLogger("autodeploy"), "propagate", True)
    monkeypatch.setitem(sys.modules, "xdsl.dialects.linalg", None)  # makes ``import`` raise ImportError
    monkeypatch.setattr(mlir_module, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        for _ in range(2):
            gm = export_gm(SiluGate(), *_shapes(2)[0])
            gm, record = apply_transform("mlir_elementwise_fusion", gm, cache_dir=str(tmp_path))
            assert record.status == "skipped" and "xdsl is not installed" in record.error
            assert count_op(gm, FUSED) == 0 and count_op(gm, aten.sigmoid) == 1
    # distinct records: in a long test process the same record can reach caplog twice (a handler
    # left on the "autodeploy" logger by another test, and the root's)
    lines = {id(r) for r in caplog.records if "mlir_elementwise_fusion skipped" in r.getMessage()}
    assert len(lines) == 1


def test_cpp_backend_skips_on_cuda_with_a_reason(tmp_path):
    """The C++ kernels are CPU code: asked for on a CUDA model, skipped naming the backends that
    fit (``auto`` picks Triton there: tests/transforms/test_mlir_triton.py)."""
    gm = export_gm(SiluGate(), *_shapes(2)[0])
    ctx = PipelineContext(device="cuda")
    build_transform("mlir_elementwise_fusion", {"cache_dir": str(tmp_path), "backend": "cpp"})(gm, ctx)
    record = ctx.history[-1]
    assert record.status == "skipped" and "generates CPU kernels" in record.error
    assert count_op(gm, FUSED) == 0


def test_auto_leaves_cuda_models_alone(tmp_path, monkeypatch, caplog):
    """``backend: auto`` (the default) does not fuse on CUDA until the Triton kernels have run on
    a GPU: skipped with one info line saying how to opt in."""
    monkeypatch.setattr(logging.getLogger("autodeploy"), "propagate", True)
    monkeypatch.setattr(mlir_module, "_warned", set())
    gm = export_gm(SiluGate(), *_shapes(2)[0])
    ctx = PipelineContext(device="cuda")
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        build_transform("mlir_elementwise_fusion", {"cache_dir": str(tmp_path)})(gm, ctx)
    record = ctx.history[-1]
    assert record.status == "skipped" and "backend: triton" in record.error
    assert count_op(gm, FUSED) == 0 and count_op(gm, aten.sigmoid) == 1
    lines = [r for r in caplog.records if "mlir_elementwise_fusion skipped" in r.getMessage()]
    assert lines and all(r.levelno == logging.INFO for r in lines)


def test_a_kernel_the_compiler_refuses_stays_unfused(tmp_path, monkeypatch, caplog):
    """A compiler that fails (here ``false``): the build goes on with the subgraph as aten ops,
    numerics unchanged, one warning naming the failure."""
    monkeypatch.setattr(logging.getLogger("autodeploy"), "propagate", True)
    monkeypatch.setattr(mlir_module, "_warned", set())
    monkeypatch.setenv("CXX", "false")
    module = SiluGate().eval()
    gm = export_gm(module, *_shapes(2)[0])
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        gm, record = apply_transform("mlir_elementwise_fusion", gm, cache_dir=str(tmp_path))
    assert record.status == "ok" and record.num_matches == 0
    assert count_op(gm, FUSED) == 0 and count_op(gm, aten.sigmoid) == 1
    assert_same_outputs(module, gm, _shapes(2))
    assert any("did not compile" in r.getMessage() for r in caplog.records)


def test_kernel_checks_its_inputs(kernel_dir):
    _, gm, _ = _run(SiluGate(), 2, kernel_dir)
    (node,) = _fused_nodes(gm)
    x = torch.randn(2, 3, D)
    with pytest.raises(ValueError, match="does not fit the kernel's 'row' access"):
        FUSED([x, x, torch.randn(2, 3, D)], node.args[1], 1)  # broadcasts, but the kernel reads a row


NO_PATTERNS = {"match_rmsnorm_pattern": {"enabled": False}, "match_swiglu_pattern": {"enabled": False}}


@pytest.mark.slow  # ~6-16 s on 2 cores (a build plus HF); the hand-written graphs above cover the four checks
def test_llama_without_norm_patterns_matches_hf(kernel_dir):
    """Llama with the RMSNorm/SwiGLU matchers off: per layer the residual add + pow, the
    ``add(mean, eps) -> rsqrt`` column and ``x * rstd * w`` of each norm fuse (final norm too)."""
    ckpt = family_checkpoint("llama")
    result = build(ckpt, up_to=Stage.POST_LOAD_FUSION,
                   overrides={**NO_PATTERNS, "mlir_elementwise_fusion": {"enabled": True, "cache_dir": kernel_dir,
                                                                       "min_ops": 2}})
    record = next(r for r in result.context.history if r.key == "mlir_elementwise_fusion")
    assert record.status == "ok" and record.num_matches == 14
    assert count_op(result.graph, FUSED) == 14
    assert count_op(result.graph, [aten.rsqrt, aten.mul, aten.add]) == 0
    assert count_op(result.graph, aten.pow) == 1  # the first norm's pow reads the embedding alone
    assert_matches_hf(result.graph, ckpt)


@pytest.mark.slow
def test_llama_cached_decode_equals_the_build_without(kernel_dir):
    """Whole builds (cached graph, default pipeline and without the norm patterns): the logits of
    a prefill and three decode steps equal the build without the transform."""
    from helpers import prefill_then_decode

    ckpt = family_checkpoint("llama")
    seqs, lengths = [[3, 7, 11, 2, 9, 4, 8], [5, 1, 6, 2, 7]], [4, 2]
    for base, matches in (({}, 0), (NO_PATTERNS, 14)):
        off = build(ckpt, overrides={**base, "mlir_elementwise_fusion": {"enabled": False}})
        on = build(ckpt, overrides={**base, "mlir_elementwise_fusion": {"enabled": True, "cache_dir": kernel_dir,
                                                                       "min_ops": 2}})
        record = next(r for r in on.context.history if r.key == "mlir_elementwise_fusion")
        assert record.num_matches == matches
        a, b = prefill_then_decode(off, seqs, lengths), prefill_then_decode(on, seqs, lengths)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_partition_alone_needs_no_xdsl():
    """The partition step reads only the FX graph (what the transform logs before compiling)."""
    gm = export_gm(RawRMSNorm(), torch.randn(2, 5, D))
    groups = find_groups(gm.graph)
    assert [len(g.nodes) for g in groups] == [2, 2]
    assert [g.access for g in groups] == [[Access.FULL], [Access.FULL, Access.COL, Access.ROW]]


NO_XDSL_SCRIPT = r"""
import sys
sys.modules["xdsl"] = None  # ``import xdsl...`` raises ImportError from here on
import torch
from helpers import apply_transform, export_gm
class Chain(torch.nn.Module):  # three element-wise ops: one group to fuse
    def forward(self, x):
        return torch.sigmoid(x) * x + 1.0
gm = export_gm(Chain(), torch.randn(2, 5, 32))
gm, record = apply_transform("mlir_elementwise_fusion", gm, cache_dir=sys.argv[1])
print("STATUS", record.status, record.error)
"""


@pytest.mark.slow
def test_package_imports_and_skips_without_xdsl(tmp_path):
    """A fresh process where xdsl cannot be imported at all: autodeploy's transforms (this one
    included) still import, and the transform skips naming the missing package."""
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here)])}
    done = subprocess.run([sys.executable, "-c", NO_XDSL_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STATUS skipped xdsl is not installed" in done.stdout
