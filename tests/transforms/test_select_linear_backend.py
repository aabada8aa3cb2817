"""select_linear_backend: "onednn" (the CPU default) packs float32 weights for oneDNN's linear;
"blas" -> autodeploy.blas_linear for float32 parameter linears; "torch" changes nothing."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform
from helpers import (FAMILIES, _cached_checkpoint, apply_transform, assert_same_outputs, build, count_op, export_gm,
                     family_checkpoint, rel_rmse)

ad = torch.ops.autodeploy
aten = torch.ops.aten
WARNING = "OMP_WAIT_POLICY=PASSIVE"


class TwoLinears(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Linear(32, 48, bias=True).to(dtype)
        self.b = nn.Linear(48, 16, bias=False).to(dtype)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class MixedDtypes(nn.Module):
    """An fp32 linear and a bf16 one (with casts around it)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(48, 16).to(torch.bfloat16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).to(torch.bfloat16)).float()


class ComputedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32))

    def forward(self, x):
        return F.linear(x, self.w * 2)


@pytest.fixture
def propagate_autodeploy_logs(monkeypatch):
    monkeypatch.setattr(logging.getLogger("autodeploy"), "propagate", True)


def _run(module, dtype=torch.float32, **cfg):
    gm = export_gm(module.eval(), torch.randn(2, 5, 32, dtype=dtype))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("select_linear_backend", gm, **cfg)
    return reference, gm, record


def test_blas_swaps_fp32_linears(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    reference, gm, record = _run(TwoLinears(), backend="blas")
    assert record.num_matches == 2
    assert count_op(gm, ad.blas_linear) == 2
    assert count_op(gm, aten.linear) == 0
    with_bias = [n for n in gm.graph.nodes if n.target == ad.blas_linear.default and len(n.args) > 2 and n.args[2] is not None]
    assert len(with_bias) == 1
    assert "blas_linear" in gm.code and "aten.linear" not in gm.code
    for shape in ((2, 5, 32), (3, 1, 32), (7, 32)):
        x = torch.randn(*shape)
        with torch.no_grad():
            ref, out = reference(x), gm(x)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert rel_rmse(out, ref) < 1e-5


def test_torch_backend_changes_nothing(monkeypatch, caplog, propagate_autodeploy_logs):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        reference, gm, record = _run(TwoLinears(), backend="torch")
    assert record.status == "skipped" and record.num_matches == 0
    assert gm.code == reference.code
    assert count_op(gm, aten.linear) == 2 and count_op(gm, ad.blas_linear) == 0
    assert not any(WARNING in r.getMessage() for r in caplog.records)


ONEDNN = torch.ops.mkldnn._linear_pointwise


class TiedHead(nn.Module):
    """An embedding whose table is also the output projection (tied word embeddings)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.proj = nn.Linear(32, 32)

    def forward(self, ids):
        return F.linear(self.proj(self.emb(ids)), self.emb.weight)


class FusedSwiglu(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(96, 32) / 6)
        self.down = nn.Parameter(torch.randn(32, 48) / 7)

    def forward(self, x):
        return ad.torch_fused_swiglu_mlp(x, self.gate_up, self.down)


def _packed_attrs(gm):
    return {n: t for n, t in gm.named_buffers() if t.is_mkldnn}


def test_default_backend_on_cpu_is_onednn():
    reference, gm, record = _run(TwoLinears())
    assert record.num_matches == 2
    assert count_op(gm, ONEDNN) == 2 and count_op(gm, aten.linear) == 0
    assert set(_packed_attrs(gm)) == {"a.weight", "b.weight"}
    assert "a.weight" not in dict(gm.named_parameters())  # packed in place: no second copy
    assert "_linear_pointwise" in gm.code and "aten.linear" not in gm.code
    for shape in ((2, 5, 32), (3, 1, 32), (7, 32), (1, 0, 32)):
        x = torch.randn(*shape)
        with torch.no_grad():
            ref, out = reference(x), gm(x)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_onednn_with_non_contiguous_input():
    reference, gm, record = _run(TwoLinears(), backend="onednn")
    assert record.num_matches == 2 and count_op(gm, ONEDNN) == 2 and count_op(gm, aten.linear) == 0
    for x in (torch.randn(5, 2, 32).transpose(0, 1), torch.randn(3, 32, 4).transpose(1, 2)):
        assert not x.is_contiguous()
        with torch.no_grad():
            torch.testing.assert_close(gm(x), reference(x), rtol=1e-5, atol=1e-5)


def test_onednn_tied_weight_stays_shared():
    """The embedding gathers rows of the plain table, so packing the tied head would keep a second
    copy: by default the head's linear keeps the one shared tensor (torch's GEMM)."""
    gm = export_gm(TiedHead().eval(), torch.randint(0, 40, (2, 5)))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("select_linear_backend", gm, backend="onednn")
    assert record.num_matches == 1 and count_op(gm, ONEDNN) == 1 and count_op(gm, aten.linear) == 1
    assert set(_packed_attrs(gm)) == {"proj.weight"}
    assert not any(name.endswith("_onednn") for name, _ in gm.named_buffers())
    head = gm.graph.find_nodes(op="call_function", target=aten.linear.default)[0]
    assert str(head.args[1].target) == "emb.weight"
    assert record.mem_delta_mb == 0.0
    assert_same_outputs(reference, gm, [(torch.randint(0, 40, (2, 5)),), (torch.randint(0, 40, (1, 9)),)])


def test_onednn_pack_shared_weights_packs_a_declared_copy(caplog, propagate_autodeploy_logs):
    gm = export_gm(TiedHead().eval(), torch.randint(0, 40, (2, 5)))
    reference = copy.deepcopy(gm)
    loaded_ptr = dict(gm.named_parameters())["emb.weight"].data_ptr()
    config = build_transform("select_linear_backend", {"backend": "onednn", "pack_shared_weights": True}).config
    assert config.expect_mem_change  # the copy is the point: no "two copies" warning
    gm, record = apply_transform("select_linear_backend", gm, backend="onednn", pack_shared_weights=True)
    assert record.num_matches == 2 and count_op(gm, ONEDNN) == 2
    assert set(_packed_attrs(gm)) == {"proj.weight", "emb.weight_onednn"}
    emb = dict(gm.named_parameters())["emb.weight"]
    assert not emb.is_mkldnn  # the embedding still reads it
    # copied out of the (checkpoint) memory it was loaded into, so that memory can be released
    assert emb.data_ptr() != loaded_ptr and torch.equal(emb, reference.emb.weight)
    assert_same_outputs(reference, gm, [(torch.randint(0, 40, (2, 5)),), (torch.randint(0, 40, (1, 9)),)])


# a tied Llama whose embedding table (4096 x 128 float32, 2 MiB) is over the 1 MiB threshold of
# the memory check, as demo's (4 MiB) is: the tiny families' tables (128 KiB) are under it
TIED_LLAMA = {**FAMILIES["llama"], "hidden_size": 128, "head_dim": 32, "vocab_size": 4096,
              "tie_word_embeddings": True}


def test_tied_model_build_keeps_one_table(caplog, propagate_autodeploy_logs):
    """Building a tied model (as ``LLM("demo")`` does) packs the other linears but neither grows
    the model's memory nor warns that a fusion keeps two copies."""
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        result = build(_cached_checkpoint("llama-tied-4k-vocab", TIED_LLAMA), up_to=Stage.POST_LOAD_FUSION)
    record = next(r for r in result.context.history if r.key == "select_linear_backend")
    assert record.status == "ok" and record.num_matches == 3 * 2  # qkv, o_proj, MLP per layer
    assert record.mem_delta_mb <= 0.0
    assert not [r.getMessage() for r in caplog.records if "without expect_mem_change" in r.getMessage()]
    gm = result.graph
    assert count_op(gm, aten.linear) == 1 and count_op(gm, ONEDNN) == 2 * 2
    tables = {t.untyped_storage().data_ptr() for t in gm.parameters() if t.shape == (4096, 128)}
    assert len(tables) == 1 and not any(n.endswith("_onednn") for n, _ in gm.named_buffers())


def test_onednn_packs_fused_swiglu_weights():
    gm = export_gm(FusedSwiglu().eval(), torch.randn(2, 5, 32))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("select_linear_backend", gm, backend="onednn")
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_fused_swiglu_mlp) == 1
    assert set(_packed_attrs(gm)) == {"gate_up", "down"}
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(1, 3, 32),)])


def test_onednn_leaves_computed_weights_and_unsupported_bf16_alone(monkeypatch):
    """A CPU without native bf16 (AVX2: oneDNN would emulate it, slower than torch) keeps bf16
    linears as they are; so does a weight computed in the graph."""
    from autodeploy.transform.library import select_linear_backend as module

    monkeypatch.setattr(module, "onednn_dtypes", lambda: (torch.float32,))
    for model, dtype in ((TwoLinears(torch.bfloat16), torch.bfloat16), (ComputedWeight(), torch.float32)):
        reference, gm, record = _run(model, dtype=dtype, backend="onednn")
        assert record.num_matches == 0 and count_op(gm, ONEDNN) == 0
        assert gm.code == reference.code


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no native bf16")
def test_onednn_packs_bf16_weights_where_the_cpu_computes_bf16():
    reference, gm, record = _run(TwoLinears(torch.bfloat16), dtype=torch.bfloat16, backend="onednn")
    assert record.num_matches == 2
    assert count_op(gm, ONEDNN) == 2 and count_op(gm, aten.linear) == 0
    assert set(_packed_attrs(gm)) == {"a.weight", "b.weight"}
    for shape in ((2, 5, 32), (1, 1, 32), (7, 32)):
        x = torch.randn(*shape, dtype=torch.bfloat16)
        with torch.no_grad():
            ref, out = reference(x), gm(x)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        assert rel_rmse(out.float(), ref.float()) < 1e-2  # both accumulate in fp32; outputs rounded to bf16


def test_auto_uses_the_custom_op_for_torch_compile():
    """inductor cannot lower mkldnn's op, so graphs for torch-compile get the opaque custom op."""
    gm = export_gm(TwoLinears().eval(), torch.randn(2, 5, 32))
    reference = copy.deepcopy(gm)
    ctx = PipelineContext(compile_backend="torch-compile")
    gm = build_transform("select_linear_backend", {})(gm, ctx)
    assert ctx.history[-1].status == "ok" and ctx.history[-1].num_matches == 2
    assert count_op(gm, ad.onednn_linear) == 2 and count_op(gm, ONEDNN) == 0 and count_op(gm, aten.linear) == 0
    compiled = torch.compile(gm, dynamic=True, fullgraph=True)
    assert_same_outputs(reference, compiled, [(torch.randn(2, 5, 32),), (torch.randn(1, 3, 32),)])


def test_llama_pipeline_default_packs_every_linear():
    result = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION)
    record = next(r for r in result.context.history if r.key == "select_linear_backend")
    # per layer the fused qkv, o_proj and the fused swiglu MLP; plus lm_head
    assert record.status == "ok" and record.num_matches == 3 * 2 + 1
    gm = result.graph
    assert count_op(gm, aten.linear) == 0 and count_op(gm, ONEDNN) == 2 * 2 + 1
    reference = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION,
                      overrides={"select_linear_backend": {"backend": "torch"}}).graph
    for b, s in ((1, 6), (3, 2)):
        ids = torch.randint(0, 512, (b, s))
        pos = torch.arange(s).expand(b, s)
        with torch.no_grad():
            assert rel_rmse(gm(ids, pos), reference(ids, pos)) < 1e-5


def test_bf16_weights_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    reference, gm, record = _run(TwoLinears(torch.bfloat16), dtype=torch.bfloat16, backend="blas")
    assert record.num_matches == 0
    assert count_op(gm, aten.linear) == 2 and count_op(gm, ad.blas_linear) == 0
    assert gm.code == reference.code
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(gm(x), reference(x))


def test_only_the_fp32_linear_of_a_mixed_model(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    reference, gm, record = _run(MixedDtypes(), backend="blas")
    assert record.num_matches == 1
    assert count_op(gm, ad.blas_linear) == 1 and count_op(gm, aten.linear) == 1
    blas = gm.graph.find_nodes(op="call_function", target=ad.blas_linear.default)[0]
    assert str(blas.args[1].target) == "a.weight"
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(1, 3, 32),)], tol=1e-2)


def test_computed_weight_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    reference, gm, record = _run(ComputedWeight(), backend="blas")
    assert record.num_matches == 0
    assert count_op(gm, aten.linear) == 1 and count_op(gm, ad.blas_linear) == 0
    assert gm.code == reference.code


@pytest.mark.parametrize("policy,warns", [(None, True), ("ACTIVE", True), ("PASSIVE", False), ("passive", False)])
def test_warns_without_passive_wait_policy(monkeypatch, caplog, propagate_autodeploy_logs, policy, warns):
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        _, gm, record = _run(TwoLinears(), backend="blas")
    assert record.num_matches == 2
    hits = [r for r in caplog.records if WARNING in r.getMessage()]
    assert len(hits) == (1 if warns else 0)
    assert all(r.levelno == logging.WARNING and r.name.startswith("autodeploy") for r in hits)


def test_llama_pipeline_with_blas(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    result = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION,
                   overrides={"select_linear_backend": {"backend": "blas"}})
    record = next(r for r in result.context.history if r.key == "select_linear_backend")
    # per layer the fused qkv and o_proj (the MLP is one fused swiglu op), plus lm_head
    assert record.status == "ok" and record.num_matches == 5
    gm = result.graph
    assert count_op(gm, ad.blas_linear) == 5 and count_op(gm, aten.linear) == 0
    # the reference is the same build without the transform's rewrite (not this graph edited back)
    reference = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION,
                      overrides={"select_linear_backend": {"backend": "torch"}}).graph
    assert count_op(reference, ad.blas_linear) == 0 and count_op(reference, aten.linear) == 5
    for b, s in ((1, 6), (3, 2)):
        ids = torch.randint(0, 512, (b, s))
        pos = torch.arange(s).expand(b, s)
        with torch.no_grad():
            out, ref = gm(ids, pos), reference(ids, pos)
        assert rel_rmse(out, ref) < 1e-5
