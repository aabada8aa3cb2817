"""``fuse_fp8_linear`` with ``backend: scaled_mm``: the FP8 GEMM of ``torch._scaled_mm`` on the e4m3
weight. torch runs ``_scaled_mm`` on CPU too, so the op and the transform's rewrite are checked
here against the canonical op and the float reference; the CUDA choice (``auto`` on GPUs with FP8
tensor cores) needs a GPU and is not run here."""

import copy

import pytest
import torch

import quant_checkpoints as qc
from autodeploy.ops.quant import formats
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import Stage
from helpers import apply_transform, build, rel_rmse

ad = torch.ops.autodeploy
_GRAPH = {}


def _fp8(w: torch.Tensor, per_row: bool):
    scale = (w.abs().amax(dim=1) if per_row else w.abs().amax()) / formats.FP8_MAX
    q = formats.fp8_encode(w / (scale[:, None] if per_row else scale))
    return q, scale.float()


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_op_equals_the_canonical_op(per_row, bias):
    w, x = torch.randn(48, 64) * 0.1, torch.randn(2, 5, 64)
    q, w_scale = _fp8(w, per_row)
    b = torch.randn(48) if bias else None
    s_in = torch.tensor(x.abs().max().item() / formats.FP8_MAX)
    out = ad.scaled_mm_fp8_linear(x, q, b, s_in, w_scale)
    ref = ad.torch_quant_fp8_linear(x, q, b, s_in, w_scale)
    assert out.shape == (2, 5, 48) and rel_rmse(out, ref) < 1e-6


def test_fake_kernel():
    args = (torch.randn(3, 32), torch.zeros(16, 32, dtype=torch.float8_e4m3fn), None, torch.tensor(0.1),
            torch.tensor(0.2))
    torch.library.opcheck(ad.scaled_mm_fp8_linear.default, args, test_utils=("test_faketensor",))


def _loaded():
    if "g" not in _GRAPH:
        _GRAPH["g"] = build(qc.quantized_checkpoint("llama", "fp8"), up_to=Stage.WEIGHT_LOAD, max_seq_len=64,
                            max_batch_size=2).graph
    return copy.deepcopy(_GRAPH["g"])


def _assert_matches_reference(gm) -> None:
    ref = qc.reference_model("llama", "fp8")
    for b, s in ((1, 7), (3, 4)):
        ids = torch.randint(0, 512, (b, s))
        with torch.no_grad():
            out = gm(input_ids=ids, position_ids=torch.arange(s).expand(b, s))
            expected = ref(ids).logits
        out = out[0] if isinstance(out, (tuple, list)) else out
        assert rel_rmse(getattr(out, "logits", out), expected) < 1e-5


def test_scaled_mm_backend_keeps_the_fp8_weights():
    gm, record = apply_transform("fuse_fp8_linear", _loaded(), backend="scaled_mm")
    n = len(qc.QUANTIZED_LINEARS["llama"])
    assert record.num_matches == n  # (a)
    assert count_op(gm, ad.scaled_mm_fp8_linear) == n and count_op(gm, ad.torch_quant_fp8_linear) == 0  # (b)
    assert count_op(gm, ad.torch_quant_fp8_activation) == 0
    assert sum(b.dtype == torch.float8_e4m3fn for b in gm.buffers()) == n  # the weights stay one byte a value
    _assert_matches_reference(gm)  # (c)


def test_scaled_mm_after_gemm_fusion_uses_per_row_scales():
    gm, fused = apply_transform("fuse_fp8_gemms", _loaded())
    assert fused.num_matches == 4
    per_row = [b for name, b in gm.named_buffers() if name.endswith("weight_scale") and b.dim() == 1]
    assert per_row, "the tiny checkpoint's q/k/v scales differ: fusing must give per-row scales"
    gm, record = apply_transform("fuse_fp8_linear", gm, backend="scaled_mm")
    assert record.num_matches == count_op(gm, ad.scaled_mm_fp8_linear) == 14 - 2 * 3
    _assert_matches_reference(gm)


def test_auto_on_cpu_decodes():
    """(d) ``auto`` on a CPU takes the decoded path: no FP8 GEMM is chosen."""
    gm, record = apply_transform("fuse_fp8_linear", _loaded())
    assert record.num_matches == 14 and count_op(gm, ad.scaled_mm_fp8_linear) == 0
