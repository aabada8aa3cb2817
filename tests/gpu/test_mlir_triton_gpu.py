"""mlir_elementwise_fusion's Triton kernels on a GPU (``make test-gpu``; skipped without CUDA).

``tests/transforms/test_mlir_triton.py`` checks the generated source in Triton's interpreter on
CPU; here the same kernels are compiled for the GPU and compared with aten's CUDA kernels:
float32 chains (tanh, erf, exp, sqrt, clamp, where), bf16 with casts (an RMSNorm written out),
bf16 rounded after every op, under CUDA-graph capture, and a tiny Llama in bf16 with the
RMSNorm/SwiGLU patterns off (so the element-wise chains are left to this transform) whose
logits and greedy tokens equal the same build without it. Prints each case's median time
before/after (no assertion on timing).
"""

import copy
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]
pytest.importorskip("xdsl", reason="mlir_elementwise_fusion needs xdsl (pip install xdsl==0.74.0)")
pytest.importorskip("triton", reason="needs triton (it comes with torch's CUDA wheels)")

from helpers import count_op, export_gm  # noqa: E402

ad = torch.ops.autodeploy
aten = torch.ops.aten
D = 256


def _fuse(module, inputs, tmp_path):
    from autodeploy.transform.interface import PipelineContext
    from autodeploy.transform.optimizer import build_transform

    gm = export_gm(module.eval(), *inputs)
    reference = copy.deepcopy(gm)
    ctx = PipelineContext(device="cuda")
    gm = build_transform("mlir_elementwise_fusion", {"enabled": True, "backend": "triton", "min_ops": 2,
                                                    "cache_dir": str(tmp_path)})(gm, ctx)
    record = ctx.history[-1]
    assert record.status == "ok", record
    return reference, gm, record.num_matches


def _median_us(fn, *args) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _inputs(n, dtype, rows=((4, 33), (1, 1))):
    return [tuple(torch.randn(b, s, D, device="cuda").to(dtype) for _ in range(n)) for b, s in rows]


class Chain(nn.Module):
    def forward(self, x, g):
        h = F.gelu(x * 0.5 - 0.25, approximate="tanh") * torch.tanh(g) + F.gelu(g)
        out = torch.clamp(h, -3.0, 3.0).pow(2) / 2.0 - torch.relu(-x) * torch.exp(-g.abs()) + torch.sqrt(g.abs())
        return torch.where(x > 0, out, torch.sigmoid(out))


class Bf16Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D).to(torch.bfloat16))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.w * h.to(torch.bfloat16)


class Bf16Arithmetic(nn.Module):
    def forward(self, x, y):
        return (x * torch.sigmoid(y) + 0.3) * y - x / 3.0


def test_float32_chain_on_cuda(tmp_path):
    inputs = [(x * 4, g * 4) for x, g in _inputs(2, torch.float32)]
    reference, gm, matches = _fuse(Chain(), inputs[0], tmp_path)
    assert matches == 1 and count_op(gm, ad.triton_fused_elementwise) == 1
    for args in inputs:
        a, b = reference(*args), gm(*args)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    print(f"\nfloat32 chain: {_median_us(reference, *inputs[0]):.1f} -> {_median_us(gm, *inputs[0]):.1f} us")


def test_bfloat16_norm_and_arithmetic_on_cuda(tmp_path):
    inputs = _inputs(1, torch.bfloat16)
    reference, gm, matches = _fuse(Bf16Norm().cuda(), inputs[0], tmp_path)
    assert matches == 3
    for args in inputs:
        a, b = reference(*args), gm(*args)
        assert b.dtype == torch.bfloat16
        # rsqrt: Triton's and CUDA's approximate instructions may differ in the last float32 bit
        assert (a != b).float().mean().item() < 0.01
    inputs = _inputs(2, torch.bfloat16)
    reference, gm, matches = _fuse(Bf16Arithmetic(), inputs[0], tmp_path)
    assert matches == 1
    for args in inputs:
        a, b = reference(*args), gm(*args)
        # rounding only at the end would differ in ~50% of the elements
        assert (a != b).float().mean().item() < 0.01, (a != b).float().mean()
    print(f"\nbf16 arithmetic: {_median_us(reference, *inputs[0]):.1f} -> {_median_us(gm, *inputs[0]):.1f} us")


def test_captured_in_a_cuda_graph(tmp_path):
    inputs = _inputs(2, torch.float32)[0]
    _, gm, _ = _fuse(Chain(), inputs, tmp_path)
    expected = gm(*inputs)
    static = [t.clone() for t in inputs]
    gm(*static)  # warm: the Triton compile happens outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gm(*static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_llama_bf16_without_norm_patterns(tmp_path):
    """Whole builds on CUDA in bf16 (torch-cudagraph): the element-wise chains of the norms fuse
    into Triton kernels and the logits of a prefill and three decode steps stay within bf16's
    rounding of the build without them; greedy tokens through the engine are equal."""
    from helpers import build, family_checkpoint, prefill_then_decode

    ckpt = family_checkpoint("llama")
    no_patterns = {"match_rmsnorm_pattern": {"enabled": False}, "match_swiglu_pattern": {"enabled": False}}
    common = dict(device="cuda", dtype="bfloat16", max_seq_len=64, max_batch_size=2)
    off = build(ckpt, overrides={**no_patterns, "mlir_elementwise_fusion": {"enabled": False}}, **common)
    on = build(ckpt, overrides={**no_patterns, "mlir_elementwise_fusion": {"enabled": True, "backend": "triton",
                                                                           "min_ops": 2, "cache_dir": str(tmp_path)}}, **common)
    record = next(r for r in on.context.history if r.key == "mlir_elementwise_fusion")
    assert record.status == "ok" and record.num_matches > 0, record
    seqs, lengths = [[3, 7, 11, 2, 9, 4, 8], [5, 1, 6, 2, 7]], [4, 2]
    a, b = prefill_then_decode(off, seqs, lengths).float(), prefill_then_decode(on, seqs, lengths).float()
    rel = ((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt()).item()
    print(f"\nllama bf16: {record.num_matches} fused subgraphs, logits rel. RMSE {rel:.2e}")
    assert rel < 2e-2
    assert torch.equal(a.argmax(-1), b.argmax(-1))
