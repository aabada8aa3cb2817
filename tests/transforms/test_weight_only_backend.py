"""``fuse_int4_linear`` / ``fuse_int8_linear``: weight-only quantized linears onto torch's packed
CPU kernels or decoded once, checked against the canonical (reference) ops they replace."""

import copy

import pytest
import torch
from torch import nn

from autodeploy.llm import LLM
from autodeploy.ops.quant import cpu_kernels
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import Stage

from helpers import apply_transform, build, export_gm, family_checkpoint, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
CANONICAL = {"int4": ad.torch_quant_int4_linear.default, "int8": ad.torch_quant_int8_linear.default}
PACKED = {"int4": ad.cpu_int4pack_linear.default, "int8": ad.cpu_int8pack_linear.default}
_GRAPHS = {}
# tiny llama after fuse_gemms / fuse_swiglu: fused qkv, o_proj, fused gate/up, down_proj per layer (2), LM head
LINEARS = 9


def _canonical_graph(kind: str):
    """Tiny llama quantized by ``quantize_weights`` with the backends off: canonical ops only."""
    if kind not in _GRAPHS:
        result = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION, quantization=kind,
                       overrides={"fuse_int4_linear": {"enabled": False}, "fuse_int8_linear": {"enabled": False},
                                  "select_linear_backend": {"enabled": False}})
        _GRAPHS[kind] = result.graph
    return copy.deepcopy(_GRAPHS[kind])


def _logits(gm, b: int, s: int, seed: int = 0):
    ids = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = gm(input_ids=ids, position_ids=torch.arange(s).expand(b, s))
    out = out[0] if isinstance(out, (tuple, list)) else out
    return getattr(out, "logits", out)


needs_kernels = pytest.mark.skipif(
    not (cpu_kernels.kernel_available("int4") and cpu_kernels.kernel_available("int8")),
    reason="torch's packed CPU kernels are not available on this machine",
)


@needs_kernels
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_packed_backend(kind):
    ref = _canonical_graph(kind)
    assert count_op(ref, CANONICAL[kind]) == LINEARS
    gm, record = apply_transform(f"fuse_{kind}_linear", copy.deepcopy(ref), backend="packed")
    assert record.num_matches == LINEARS  # (a)
    assert count_op(gm, PACKED[kind]) == LINEARS and count_op(gm, CANONICAL[kind]) == 0  # (b)
    # (c) bfloat16 activations: within bf16 rounding of the reference at two shapes, not equal to it
    for shape in ((1, 5), (3, 2)):
        expected, out = _logits(ref, *shape), _logits(gm, *shape)
        assert 0 < rel_rmse(out, expected) < 1e-2, rel_rmse(out, expected)
    # (d) the other kind's transform leaves these ops alone
    other = "int8" if kind == "int4" else "int4"
    assert apply_transform(f"fuse_{other}_linear", copy.deepcopy(ref), backend="packed")[1].num_matches == 0


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_dequantized_backend_is_exact(kind):
    ref = _canonical_graph(kind)
    gm, record = apply_transform(f"fuse_{kind}_linear", copy.deepcopy(ref), backend="dequantized")
    assert record.num_matches == LINEARS
    assert count_op(gm, aten.linear) == LINEARS and count_op(gm, CANONICAL[kind]) == 0
    assert not any(b.dtype in (torch.uint8, torch.int8) for b in gm.buffers())  # the quantized tensors are freed
    for shape in ((1, 5), (3, 2)):
        assert rel_rmse(_logits(gm, *shape), _logits(ref, *shape)) < 1e-6


def test_reference_backend_is_a_no_op():
    ref = _canonical_graph("int4")
    gm, record = apply_transform("fuse_int4_linear", copy.deepcopy(ref), backend="reference")
    assert record.num_matches == 0 and count_op(gm, CANONICAL["int4"]) == LINEARS


@needs_kernels
def test_shape_the_kernel_refuses_is_decoded_instead():
    """N = 24 is not a multiple of the int4 kernel's 16: that linear falls back to a float one."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 24), nn.Linear(24, 32)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    module = Two().eval()
    gm = export_gm(module, torch.randn(2, 3, 64))
    gm, _ = apply_transform("quantize_weights", gm, method="int4", group_size=32)
    # b has K = 24: no int4 group divides it, so quantize_weights left it float; a is int4 with N = 24
    assert count_op(gm, CANONICAL["int4"]) == 1
    ref = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_int4_linear", gm, backend="packed")
    assert record.num_matches == 1 and count_op(gm, PACKED["int4"]) == 0 and count_op(gm, aten.linear) == 2
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert rel_rmse(gm(x), ref(x)) < 1e-6


def test_auto_backend_builds_and_generates():
    """``auto`` measures per shape; whatever it picks, the engine runs and uses no reference op."""
    llm = LLM(family_checkpoint("llama"), quantization="int4", max_seq_len=64, max_batch_size=2)
    gm = llm.build.graph_module
    assert count_op(gm, CANONICAL["int4"]) == 0
    assert count_op(gm, PACKED["int4"]) + count_op(gm, torch.ops.mkldnn._linear_pointwise) >= LINEARS
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
