"""mlir_elementwise_fusion's Triton backend, run on CPU in Triton's interpreter (``TRITON_INTERPRET=1``).

The generated source is the one a GPU compiles; the interpreter executes it with numpy, so
these tests check the emitter, the access patterns, the launch and the half-precision rounding
without a GPU (``tests/gpu/test_mlir_triton_gpu.py`` runs the same kernels on CUDA). They need
``triton`` and ``xdsl`` importable (the dev install brings both on Linux x86-64).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install triton)")

from autodeploy.compile.mlir import kernels  # noqa: E402
from autodeploy.transform.interface import PipelineContext  # noqa: E402
from autodeploy.transform.optimizer import build_transform  # noqa: E402
from helpers import apply_transform, assert_same_outputs, count_op, export_gm  # noqa: E402

ad = torch.ops.autodeploy
aten = torch.ops.aten
FUSED = ad.triton_fused_elementwise
D = 32


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("triton-kernels"))


def _shapes(n_inputs, dtype=torch.float32, rows=((2, 5), (3, 1))):
    return [tuple(torch.randn(b, s, D).to(dtype) for _ in range(n_inputs)) for b, s in rows]


def _run(module, inputs, kernel_dir, **config):
    gm = export_gm(module.eval(), *inputs)
    reference = copy.deepcopy(gm)
    config.setdefault("min_ops", 2)  # the mechanics on 2-op subgraphs too
    gm, record = apply_transform("mlir_elementwise_fusion", gm, backend="triton", cache_dir=kernel_dir, **config)
    return reference, gm, record


def _fused(gm):
    return gm.graph.find_nodes(op="call_function", target=FUSED.default)


class SiluGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        return x * torch.sigmoid(x) * y * self.w + 1.0


def test_float32_chain_with_a_row_broadcast(kernel_dir):
    reference, gm, record = _run(SiluGate(), _shapes(2)[0], kernel_dir)
    assert record.num_matches == 1 and count_op(gm, FUSED) == 1
    assert count_op(gm, [aten.sigmoid, aten.mul, aten.add]) == 0
    assert count_op(gm, ad.cpu_fused_elementwise) == 0
    (node,) = _fused(gm)
    assert [n.name for n in node.args[0]] == ["x", "y", "w"] and node.args[2] == "float32"
    assert_same_outputs(reference, gm, _shapes(2))


class GeluTanhChain(nn.Module):
    def forward(self, x, g):
        h = F.gelu(x * 0.5 - 0.25, approximate="tanh") * torch.tanh(g) + F.gelu(g)
        return torch.clamp(h, -3.0, 3.0).pow(2) / 2.0 - torch.relu(-x) * torch.exp(-g.abs()) + torch.sqrt(g.abs())


def test_math_functions(kernel_dir):
    """tanh (written out), erf, exp, sqrt, clamp, relu over their whole range."""
    inputs = [(x * 4, g * 4) for x, g in _shapes(2)]
    reference, gm, record = _run(GeluTanhChain(), inputs[0], kernel_dir)
    assert record.num_matches == 1 and count_op(gm, FUSED) == 1
    assert count_op(gm, [aten.gelu, aten.tanh, aten.clamp, aten.pow, aten.relu, aten.exp, aten.abs, aten.sqrt]) == 0
    assert_same_outputs(reference, gm, inputs)


class Bf16Norm(nn.Module):
    """A bf16 RMSNorm written out as HF writes it: widen, normalise in float32, narrow, scale."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D).to(torch.bfloat16))

    def forward(self, x):
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + 1e-6)
        return self.w * h.to(torch.bfloat16)


def test_bfloat16_with_casts(kernel_dir):
    """Three subgraphs around the mean: [cast, pow] (two outputs), [add, rsqrt] (a column), and
    [mul, cast, mul] reading the column and the bf16 weight; the bf16 result equals aten's."""
    inputs = _shapes(1, torch.bfloat16)
    reference, gm, record = _run(Bf16Norm(), inputs[0], kernel_dir)
    assert record.num_matches == 3 and count_op(gm, FUSED) == 3
    assert count_op(gm, [aten.rsqrt, aten.mul, aten.add, aten._to_copy, aten.pow]) == 0
    assert count_op(gm, aten.mean) == 1
    assert sorted(n.args[2] for n in _fused(gm)) == ["bfloat16", "float32", "float32,float32"]
    for args in inputs:
        a, b = reference(*args), gm(*args)
        assert b.dtype == torch.bfloat16 and a.shape == b.shape
        assert torch.equal(a, b)


class Bf16Arithmetic(nn.Module):
    """bf16 all the way: each op rounds to bf16 in aten, so the fused kernel must round too.

    Python scalars are float32 in the kernels, as in aten's CUDA kernels and CPU ``mul``/``div``;
    CPU ``add`` rounds its scalar to bf16 first, so this module adds tensors only."""

    def forward(self, x, y):
        return (x * torch.sigmoid(y) + y) * 0.3 - x / 3.0


def test_bfloat16_rounds_after_every_op(kernel_dir):
    inputs = _shapes(2, torch.bfloat16)
    reference, gm, record = _run(Bf16Arithmetic(), inputs[0], kernel_dir)
    assert record.num_matches == 1
    (node,) = _fused(gm)
    assert node.args[2] == "bfloat16"
    for args in inputs:
        a, b = reference(*args), gm(*args)
        assert b.dtype == torch.bfloat16
        # equal but for the odd element where exp differs in its last float32 bit and that
        # lands on a bf16 rounding boundary: rounding only at the end would differ in ~10%
        assert (a != b).float().mean().item() < 0.01
        assert (a.float() - b.float()).abs().max().item() <= 2 ** -6 * a.float().abs().max().item()


class WhereTwoOutputs(nn.Module):
    def forward(self, x, y):
        h = x + y
        return h, torch.where(x > 0, h * 2.0, torch.sigmoid(y))


def test_bool_condition_and_two_outputs(kernel_dir):
    reference, gm, record = _run(WhereTwoOutputs(), _shapes(2)[0], kernel_dir)
    assert record.num_matches == 1
    (node,) = _fused(gm)
    assert node.args[2] == "float32,float32"
    assert [n.meta["val"].dtype for n in node.args[0]] == [torch.float32, torch.float32, torch.bool]
    assert count_op(gm, aten.gt) == 1 and count_op(gm, [aten.where, aten.add, aten.sigmoid]) == 0
    assert_same_outputs(reference, gm, _shapes(2))


class GeneralPow(nn.Module):
    def forward(self, x):
        return (x.abs() * 2.0).pow(2.5) + 1.0


def test_near_misses(kernel_dir):
    """A general pow has no Triton emitter: the subgraph stays as it was (the C++ backend fuses it)."""
    reference, gm, record = _run(GeneralPow(), _shapes(1)[0], kernel_dir)
    assert record.num_matches == 0 and count_op(gm, FUSED) == 0
    assert count_op(gm, [aten.abs, aten.mul, aten.pow, aten.add]) == 4
    assert_same_outputs(reference, gm, _shapes(1))


def test_kernel_checks_its_inputs(kernel_dir):
    _, gm, _ = _run(SiluGate(), _shapes(2)[0], kernel_dir)
    (node,) = _fused(gm)
    x = torch.randn(2, 3, D)
    with pytest.raises(ValueError, match="does not fit the kernel's 'row' access of torch.float32"):
        FUSED([x, x, torch.randn(2, 3, D)], node.args[1], "float32")
    with pytest.raises(ValueError, match="'full' access of torch.float32"):
        FUSED([x.bfloat16(), x, torch.randn(D)], node.args[1], "float32")


def test_second_build_finds_the_source(kernel_dir):
    _run(SiluGate(), _shapes(2)[0], kernel_dir)
    before = dict(kernels.STATS)
    _, _, record = _run(SiluGate(), _shapes(2)[0], kernel_dir)
    assert record.num_matches == 1
    assert kernels.STATS["compiles"] == before["compiles"] and kernels.STATS["cache_hits"] == before["cache_hits"] + 1


def test_triton_on_cpu_needs_the_interpreter(kernel_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gm = export_gm(SiluGate(), *_shapes(2)[0])
    gm, record = apply_transform("mlir_elementwise_fusion", gm, backend="triton", cache_dir=kernel_dir)
    assert record.status == "skipped" and "TRITON_INTERPRET=1" in record.error
    assert count_op(gm, FUSED) == 0 and count_op(gm, aten.sigmoid) == 1


def test_auto_is_cpp_on_cpu(kernel_dir):
    gm = export_gm(SiluGate(), *_shapes(2)[0])
    ctx = PipelineContext(device="cpu")
    gm = build_transform("mlir_elementwise_fusion", {"cache_dir": kernel_dir})(gm, ctx)
    assert count_op(gm, ad.cpu_fused_elementwise) == 1 and count_op(gm, FUSED) == 0


@pytest.mark.slow  # ~20 s on 2 cores: two bf16 builds, the interpreter running every kernel in numpy
def test_llama_bf16_build_in_the_interpreter(kernel_dir):
    """A whole bf16 Llama build with the norm/SwiGLU patterns off (so the norms' element-wise
    chains are left to this transform): 15 Triton subgraphs, and the logits of a prefill and
    three decode steps equal the build without them bit for bit."""
    from helpers import build, family_checkpoint, prefill_then_decode

    ckpt = family_checkpoint("llama")
    no_patterns = {"match_rmsnorm_pattern": {"enabled": False}, "match_swiglu_pattern": {"enabled": False}}
    off = build(ckpt, dtype="bfloat16", overrides={**no_patterns, "mlir_elementwise_fusion": {"enabled": False}})
    on = build(ckpt, dtype="bfloat16", overrides={**no_patterns, "mlir_elementwise_fusion": {
        "enabled": True, "backend": "triton", "cache_dir": kernel_dir, "min_ops": 2}})
    record = next(r for r in on.context.history if r.key == "mlir_elementwise_fusion")
    assert record.status == "ok" and record.num_matches == 15
    assert count_op(on.graph_module, FUSED) == 15
    seqs, lengths = [[3, 7, 11, 2, 9, 4, 8], [5, 1, 6, 2, 7]], [4, 2]
    assert torch.equal(prefill_then_decode(off, seqs, lengths), prefill_then_decode(on, seqs, lengths))
