"""The FP8 GEMM backends that keep weights in e4m3, on CPU: ``fuse_finegrained_fp8_linear`` with
``backend: scaled_mm`` (``scaled_mm_fp8_block_linear``: block-scaled FP8 GEMMs on CUDA) and
``fuse_fp8_moe`` with ``backend: scaled_mm`` (``scaled_grouped_mm_fp8_moe``: grouped FP8 GEMMs on
CUDA). On a CPU both ops compute the reference's arithmetic from the e4m3 tensors they keep, so
these tests check the rewrite itself exactly: the match count, the ops and tensors in the graph,
logits equal to the float reference at two shapes, a near miss left alone, and that ``auto``
keeps the decoded path on CPU. ``tests/gpu/test_fp8_cuda.py`` runs the CUDA kernels."""

import copy
import re

import pytest
import torch

import quant_checkpoints as qc
import quant_expert_checkpoints as qe
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import Stage
from helpers import apply_transform, build, graph_logits, rel_rmse

ad = torch.ops.autodeploy
SHAPES = [(1, 7), (3, 4)]
_BUILDS = {}


def _loaded(checkpoint: str):
    """The graph after weight loading (canonical quantized ops), built once per checkpoint."""
    if checkpoint not in _BUILDS:
        _BUILDS[checkpoint] = build(checkpoint, up_to=Stage.WEIGHT_LOAD, max_seq_len=64, max_batch_size=2,
                                    dtype="float32")
    return _BUILDS[checkpoint]


def _assert_matches(gm, reference, tol):
    g = torch.Generator().manual_seed(0)
    for b, s in SHAPES:
        ids = torch.randint(0, 512, (b, s), generator=g)
        with torch.no_grad():
            expected = reference(ids).logits
        assert rel_rmse(graph_logits(gm, ids), expected) < tol, (b, s)


def test_block_scaled_fp8_linear_keeps_e4m3_weights():
    gm = copy.deepcopy(_loaded(qc.quantized_checkpoint("llama", "fp8_block")).graph)
    gm, record = apply_transform("fuse_finegrained_fp8_linear", gm, backend="scaled_mm")
    n = len(qc.QUANTIZED_LINEARS["llama"])
    assert record.num_matches == n  # (a)
    assert count_op(gm, ad.scaled_mm_fp8_block_linear) == n  # (b)
    assert count_op(gm, ad.torch_quant_finegrained_fp8_linear) == count_op(gm, ad.torch_quant_fp8_group_activation) == 0
    node = next(iter(gm.graph.find_nodes(op="call_function", target=ad.scaled_mm_fp8_block_linear.default)))
    weight = dict(gm.named_parameters(), **dict(gm.named_buffers()))[str(node.args[1].target)]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[0] % 128 == 0 and weight.shape[1] % 512 == 0
    assert node.args[4] < weight.shape[0] or weight.shape[0] == node.args[4]  # N before padding
    # (c) the padded e4m3 weights give the reference's numbers (the CPU path decodes them per call)
    _assert_matches(gm, qc.reference_model("llama", "fp8_block"), tol=1e-5)


def test_block_scaled_fp8_linear_near_miss_and_auto_on_cpu():
    # (d) a per-tensor FP8 checkpoint has no fine-grained linear to take
    gm = copy.deepcopy(_loaded(qc.quantized_checkpoint("llama", "fp8")).graph)
    before = gm.code
    gm, record = apply_transform("fuse_finegrained_fp8_linear", gm, backend="scaled_mm")
    assert record.num_matches == 0 and gm.code == before
    # auto on a CPU decodes (no block-scaled FP8 GEMM there)
    gm = copy.deepcopy(_loaded(qc.quantized_checkpoint("llama", "fp8_block")).graph)
    gm, record = apply_transform("fuse_finegrained_fp8_linear", gm)
    assert count_op(gm, ad.scaled_mm_fp8_block_linear) == 0
    assert count_op(gm, ad.torch_quant_fp8_group_activation) == record.num_matches > 0


def test_grouped_fp8_experts_stay_e4m3():
    gm = copy.deepcopy(_loaded(qe.quantized_checkpoint("qwen3_moe", "fp8")).graph)
    gm, record = apply_transform("fuse_fp8_moe", gm, backend="scaled_mm")
    layers = qe.MOE_LAYERS["qwen3_moe"]
    assert record.num_matches == layers  # (a)
    assert count_op(gm, ad.scaled_grouped_mm_fp8_moe) == layers  # (b)
    assert count_op(gm, ad.torch_quant_fp8_moe) == count_op(gm, ad.grouped_quant_moe_fused) == 0
    tensors = dict(gm.named_parameters(), **dict(gm.named_buffers()))
    stacked = [t for name, t in tensors.items() if name.endswith("moe_gate_up_weight_fp8")]
    assert len(stacked) == layers and all(t.dtype == torch.float8_e4m3fn and t.dim() == 3 for t in stacked)
    # the quantized experts' tensors (stacked per kind and projection, as exported) are freed
    assert not any(re.search(r"\.experts\.(\d+\.|(gate|up|down)_)", name) for name in tensors)
    _assert_matches(gm, qe.reference_model("qwen3_moe", "fp8"), tol=1e-5)  # (c)
    # auto on a CPU: the decoded experts (grouped float GEMMs), not the FP8 op
    gm, record = apply_transform("fuse_fp8_moe", copy.deepcopy(_loaded(qe.quantized_checkpoint("qwen3_moe", "fp8")).graph))
    assert record.num_matches == layers and count_op(gm, ad.scaled_grouped_mm_fp8_moe) == 0
    assert count_op(gm, ad.grouped_quant_moe_fused) == layers


def test_grouped_fp8_experts_near_miss():
    # (d) fine-grained FP8 experts are another op: fuse_fp8_moe leaves them
    gm = copy.deepcopy(_loaded(qe.quantized_checkpoint("qwen3_moe", "fp8_block")).graph)
    before = gm.code
    gm, record = apply_transform("fuse_fp8_moe", gm, backend="scaled_mm")
    assert record.num_matches == 0 and gm.code == before
    assert count_op(gm, ad.torch_quant_finegrained_fp8_moe_stacked) == qe.MOE_LAYERS["qwen3_moe"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_fp8_op_equals_the_per_expert_op(dtype):
    """The op alone against ``torch_quant_fp8_moe`` on the same e4m3 tensors, an expert without
    rows included: exact in float32, one bfloat16 step in bfloat16 (the routing sum's rounding)."""
    from autodeploy.ops.quant import formats

    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 4, 64, 32, 9

    def q(shape):
        w = torch.randn(*shape, generator=g)
        scale = (w.abs().amax() / 448).reshape(())
        return formats.fp8_encode(w / scale), scale

    gate, up, down = ([q(s) for _ in range(experts)] for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    in_gu = [torch.tensor(0.01 + 0.001 * e) for e in range(experts)]
    in_dn = [torch.tensor(0.02 + 0.002 * e) for e in range(experts)]
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    sel = torch.randint(0, experts - 1, (tokens, 2), generator=g)
    rw = torch.rand(tokens, 2, generator=g).to(dtype)
    expected = ad.torch_quant_fp8_moe(x, sel, rw, *([w for w, _ in p] for p in (gate, up, down)), in_gu, in_gu, in_dn,
                                      *([s for _, s in p] for p in (gate, up, down)))
    got = ad.scaled_grouped_mm_fp8_moe(
        x, sel, rw, torch.stack([torch.cat([gate[e][0], up[e][0]]) for e in range(experts)]),
        torch.stack([w for w, _ in down]), torch.stack(in_gu), torch.stack(in_dn),
        torch.stack([torch.cat([gate[e][1].expand(inter), up[e][1].expand(inter)]) for e in range(experts)]),
        torch.stack([s.expand(hidden) for _, s in down]))
    if dtype == torch.float32:
        assert torch.equal(got, expected)
    else:
        step = expected.float().abs().max() * 2 ** -7
        assert (got.float() - expected.float()).abs().max() <= step
