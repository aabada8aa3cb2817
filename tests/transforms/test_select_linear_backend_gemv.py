"""select_linear_backend with ``gemv_dtype``: every float32 linear becomes ``dual_linear``, which
reads a float16/bfloat16 copy of its weight for inputs of at most ``gemv_max_rows`` rows and the
(oneDNN-packed) float32 weight otherwise; fused SwiGLU MLPs are split so each GEMM gets a copy."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy import LLM, SamplingParams
from autodeploy.ops.linear import exact_linears
from autodeploy.transform.interface import PipelineContext
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.errors import ConfigError
from helpers import apply_transform, assert_same_outputs, build, count_op, export_gm, family_checkpoint, rel_rmse
from test_select_linear_backend import ONEDNN, ComputedWeight, FusedSwiglu, TwoLinears, _run

ad = torch.ops.autodeploy
aten = torch.ops.aten


class UnfusedSwiglu(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(48, 32) / 6)
        self.up = nn.Parameter(torch.randn(48, 32) / 6)
        self.down = nn.Parameter(torch.randn(32, 48) / 7)

    def forward(self, x):
        return ad.torch_swiglu_mlp(x, self.gate, self.up, self.down)


def _half_reference(module: TwoLinears, x, dtype):
    """What the narrow path computes: each GEMM on rounded inputs and weights, float32 bias."""
    h = F.linear(x.to(dtype), module.a.weight.to(dtype)).float() + module.a.bias
    return F.linear(torch.relu(h).to(dtype), module.b.weight.to(dtype)).float()


@pytest.mark.parametrize("backend", ["onednn", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linears_read_the_narrow_copy_for_one_row(backend, dtype):
    module = TwoLinears()
    reference, gm, record = _run(module, backend=backend, gemv_dtype=str(dtype)[6:])
    assert record.status == "ok" and record.num_matches == 2
    assert count_op(gm, ad.dual_linear) == 2 and count_op(gm, aten.linear) == 0 and count_op(gm, ONEDNN) == 0
    copies = {n: t for n, t in gm.named_buffers() if n.endswith("_gemv")}
    assert set(copies) == {"a.weight_gemv", "b.weight_gemv"} and all(t.dtype == dtype for t in copies.values())
    weights = {n: t for n, t in list(gm.named_parameters()) + list(gm.named_buffers()) if n in ("a.weight", "b.weight")}
    assert all(t.is_mkldnn == (backend == "onednn") for t in weights.values()) and len(weights) == 2
    with torch.no_grad():
        # several rows: the float32 weights, as without the option
        assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(7, 32),)])
        # one row: the narrow copy (so not float32's answer), within its rounding of float32's
        for x in (torch.randn(1, 1, 32), torch.randn(1, 32)):
            out, ref = gm(x), reference(x)
            assert out.shape == ref.shape and not torch.equal(out, ref)
            assert 0 < rel_rmse(out, ref) < (2e-3 if dtype == torch.float16 else 1.5e-2)
            torch.testing.assert_close(out, _half_reference(module, x, dtype), rtol=1e-3, atol=1e-3)
            with exact_linears():
                torch.testing.assert_close(gm(x), ref, rtol=1e-5, atol=1e-5)
        assert gm(torch.randn(1, 0, 32)).shape == (1, 0, 16)


def test_gemv_max_rows():
    reference, gm, _ = _run(TwoLinears(), gemv_dtype="float16", gemv_max_rows=2)
    assert {n.args[4] for n in gm.graph.find_nodes(op="call_function", target=ad.dual_linear.default)} == {2}
    with torch.no_grad():
        two, three = torch.randn(2, 32), torch.randn(3, 32)
        assert not torch.equal(gm(two), reference(two)) and rel_rmse(gm(two), reference(two)) < 2e-3
        torch.testing.assert_close(gm(three), reference(three), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module,linears", [(FusedSwiglu(), 2), (UnfusedSwiglu(), 3)], ids=["fused", "unfused"])
def test_swiglu_mlps_split_into_dual_linears(module, linears):
    reference, gm, record = _run(module, gemv_dtype="float16")
    assert record.num_matches == linears and count_op(gm, ad.dual_linear) == linears
    assert count_op(gm, ad.torch_fused_swiglu_mlp) == 0 and count_op(gm, ad.torch_swiglu_mlp) == 0
    assert all(t.is_mkldnn for n, t in gm.named_buffers() if not n.endswith("_gemv"))
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(1, 3, 32),)])
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        assert not torch.equal(gm(x), reference(x)) and rel_rmse(gm(x), reference(x)) < 2e-3


@pytest.mark.parametrize("module,dtype", [(TwoLinears(torch.bfloat16), torch.bfloat16), (ComputedWeight(), torch.float32)],
                         ids=["bf16-weights", "computed-weight"])
def test_near_misses_are_left_alone(module, dtype):
    reference, gm, record = _run(module, dtype=dtype, backend="torch", gemv_dtype="float16")
    assert record.num_matches == 0 and count_op(gm, ad.dual_linear) == 0
    assert not [n for n, _ in gm.named_buffers() if n.endswith("_gemv")]
    x = torch.randn(1, 1, 32, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(gm(x), reference(x))


def test_float16_overflow_is_computed_in_float32():
    w = torch.full((4, 8), 2.0)
    x = torch.full((1, 8), 1e4)  # 8e4 per output: beyond float16's 65504
    out = ad.dual_linear(x, w, w.half(), None, 1)
    assert torch.isfinite(out).all() and torch.equal(out, F.linear(x, w))
    small = ad.dual_linear(x / 1e4, w, w.half(), None, 1)
    assert torch.equal(small, torch.full((1, 4), 16.0))


def test_config_errors_and_memory_expectation():
    with pytest.raises(ConfigError, match="not blas"):
        build_transform("select_linear_backend", {"backend": "blas", "gemv_dtype": "float16"})
    with pytest.raises(ConfigError, match="gemv_dtype"):
        build_transform("select_linear_backend", {"gemv_dtype": "int8"})
    with pytest.raises(ConfigError, match="gemv_max_rows"):
        build_transform("select_linear_backend", {"gemv_dtype": "float16", "gemv_max_rows": 0})
    assert build_transform("select_linear_backend", {"gemv_dtype": "float16"}).config.expect_mem_change
    # auto may keep float32 copies: the memory change is declared; without copies it is not
    assert build_transform("select_linear_backend", {}).config.expect_mem_change
    assert not build_transform("select_linear_backend", {"gemv_dtype": None}).config.expect_mem_change
    # auto with blas: no copies (they were measured against oneDNN only), not an error
    build_transform("select_linear_backend", {"backend": "blas"})


def test_torch_compile_runs_the_dual_linear_as_an_opaque_op():
    gm = export_gm(TwoLinears().eval(), torch.randn(2, 5, 32))
    reference = copy.deepcopy(gm)
    ctx = PipelineContext(compile_backend="torch-compile")
    gm = build_transform("select_linear_backend", {"gemv_dtype": "float16"})(gm, ctx)
    assert ctx.history[-1].num_matches == 2 and count_op(gm, ad.dual_linear) == 2
    compiled = torch.compile(gm, dynamic=True, fullgraph=True)
    assert_same_outputs(reference, compiled, [(torch.randn(2, 5, 32),), (torch.randn(3, 2, 32),)])
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), gm(x), rtol=0, atol=0)


def test_llama_pipeline_keeps_the_kv_cache_and_gathers_the_head():
    """The consistency check compares schedules with exact linears, so the lossy one-row path
    does not push the build into recompute mode; the LM head is still found for gathering."""
    result = build(family_checkpoint("llama"), overrides={"select_linear_backend": {"gemv_dtype": "float16"}})
    history = {r.key: r for r in result.context.history}
    assert history["select_linear_backend"].num_matches == 2 * (1 + 1 + 2) + 1  # qkv, o, MLP's two; head
    assert history["gather_logits_before_lm_head"].num_matches == 1
    assert result.context.cache_mode == "paged_kv"
    assert count_op(result.graph_module, ad.dual_linear) == 9


def test_generation_close_to_the_exact_pipeline():
    """Batch-1 decode runs on the float16 copies; on the tiny llama the greedy tokens stay those
    of the float32 pipeline, and the chosen tokens' log-probabilities stay within 1e-2."""
    kwargs = dict(max_seq_len=64, max_batch_size=2, max_num_tokens=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    exact = LLM(family_checkpoint("llama"), **kwargs).generate(["The for statement"], params)[0]
    narrow = LLM(family_checkpoint("llama"), transforms={"select_linear_backend": {"gemv_dtype": "float16"}},
                 **kwargs).generate(["The for statement"], params)[0]
    assert narrow.token_ids == exact.token_ids
    chosen = [(next(iter(a.values())), next(iter(b.values()))) for a, b in zip(narrow.outputs[0].logprobs, exact.outputs[0].logprobs)]
    assert max(abs(a - b) for a, b in chosen[1:]) < 1e-2
    assert any(a != b for a, b in chosen[1:])  # decode steps did take the narrow path
