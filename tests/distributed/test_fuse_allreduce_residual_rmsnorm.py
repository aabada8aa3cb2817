"""fuse_allreduce_residual_rmsnorm (post_load_fusion): all-reduce -> (residual add ->) RMSNorm -> one op.

One process (world size 1, the all-reduce is the identity): every fused op (float, static FP8,
NVFP4, per-group FP8) equals the unfused ops it replaces bit for bit (the (add +) norm, then the
activation quantization) and its fake kernel gives the same shapes and dtypes; small hand-written
graphs fuse (plain norm whose sum has another reader, a Gemma norm ``w + 1`` of matching dtypes,
norms already fused with each quantization) and the near misses are left alone (a float32 norm
over bfloat16 activations, float or quantized; an all-reduce read elsewhere).

Two real gloo ranks: the ops sum over ranks (the scratch buffer reused across shapes), and a tiny
Llama built at world size 2 passes the four checks: 2 matches per layer, every all-reduce folded
into the fused op, logits equal the same ranks' unfused graph exactly and HF at two shapes, and an
all-reduce given another reader is left alone.
"""

import copy
import functools
import os
from typing import Any, Dict, Tuple

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autodeploy.transform.interface import Stage
from helpers import TINY, apply_transform, assert_matches_hf, build, count_op, export_gm, family_checkpoint, graph_logits
from test_collectives import _run_ranks

# the rank processes are spawned: they import this module, not conftest.py, so they take the no-op
# mutation of the pytest process that started them here (see tests/noop_mutation.py)
if os.environ.get("_AUTODEPLOY_NOOP_ACTIVE"):
    import noop_mutation

    noop_mutation.install(noop_mutation.parse_keys(os.environ["_AUTODEPLOY_NOOP_ACTIVE"]))

ad = torch.ops.autodeploy
KEY = "fuse_allreduce_residual_rmsnorm"
D = 32
EPS = 1e-6
GROUP = 16  # per-group FP8 in two groups of D (the models' 128 would be one partial group here)
FORMATS = ("fp8", "nvfp4", "fp8_group")
FUSED_OPS = (ad.torch_dist_all_reduce_fused_add_rmsnorm, ad.native_dist_all_reduce_fused_add_rmsnorm,
             ad.torch_dist_all_reduce_rmsnorm, ad.native_dist_all_reduce_rmsnorm,
             *(getattr(ad, f"{backend}_dist_all_reduce_{norm}_quant_{fmt}") for fmt in FORMATS
               for backend in ("torch", "native") for norm in ("fused_add_rmsnorm", "rmsnorm")))
# the activation quantization each fused op's output went through before the fusions
ACTIVATION = {"fp8": ad.torch_quant_fp8_activation, "nvfp4": ad.torch_quant_nvfp4_activation,
              "fp8_group": ad.torch_quant_fp8_group_activation}


def _short(op) -> str:
    """``torch.ops.autodeploy.x`` -> ``x``."""
    return op._qualified_op_name.split("::")[1]


def _format(name: str) -> str:
    """The quantization format in an op's name, or "" for a float norm."""
    return name.partition("_quant_")[2]


def _inputs(rows: int = 5, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x, r, w = (torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g), torch.randn(D, generator=g))
    return x.to(dtype), r.to(dtype), w.to(dtype), torch.tensor(0.05)


def _last_arg(name: str, scale):
    """The fused op's argument after ``eps``: the static scale, the group size, or none."""
    fmt = _format(name)
    return [] if not fmt else [GROUP] if fmt == "fp8_group" else [scale]


def _unfused(fused_op, x, r, w, scale):
    """What the graph computed before any fusion, for ``x`` already reduced: the (add +) norm
    op, then the activation quantization of its normed output."""
    name = _short(fused_op).replace("_dist_all_reduce", "")
    fmt = _format(name)
    norm = getattr(ad, name.partition("_quant_")[0])
    normed, summed = norm(x, r, w, EPS) if "fused_add" in name else (norm(x, w, EPS), x)
    if fmt:
        normed = ACTIVATION[fmt](normed, *_last_arg(name, scale))
    return normed, summed


def _call(fused_op, x, r, w, scale):
    name = _short(fused_op)
    extra = _last_arg(name, scale)
    return fused_op(x, r, w, EPS, *extra) if "fused_add" in name else fused_op(x, w, EPS, *extra)


# ---- ops at world size 1 -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op", FUSED_OPS, ids=lambda op: _short(op))
def test_op_at_world_size_one_is_the_unfused_add_norm(op, dtype):
    """Bit-equal to the unfused (add +) norm and activation quantization; bfloat16 takes the native
    ops' reference path (the C kernel is float32 only)."""
    x, r, w, scale = _inputs(dtype=dtype)
    before = x.clone()
    got, want = _call(op, x, r, w, scale), _unfused(op, x, r, w, scale)
    assert len(got) == 2
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert a.data_ptr() != x.data_ptr()  # a fresh output, never the input
    assert torch.equal(x, before)  # the input is read, not reduced in place
    with FakeTensorMode() as mode:
        fake = _call(op, *(mode.from_tensor(t) for t in (x, r, w, scale)))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in got]


# ---- small graphs at world size 1 --------------------------------------------------------------
class Block(nn.Module):
    """A row-parallel output (all-reduced), added to the residual and normalised; the plain
    pattern (an all-reduce normalised directly, its sum also read by the add) after it."""

    def __init__(self, gemma: bool = False, weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gemma = gemma
        self.w1 = nn.Parameter(torch.randn(D, dtype=weight_dtype))
        self.w2 = nn.Parameter(torch.randn(D, dtype=weight_dtype))
        self.proj = nn.Linear(D, D)

    def forward(self, partial, residual):
        w1 = self.w1 + 1.0 if self.gemma else self.w1
        h = ad.torch_dist_all_reduce(partial) + residual     # residual add of the reduced output
        y = ad.torch_rmsnorm(h, w1, EPS)
        r2 = ad.torch_dist_all_reduce(self.proj(y).to(partial.dtype))
        y2 = ad.torch_rmsnorm(r2, self.w2, EPS)              # plain pattern; r2 also read below
        return y2 + r2, h


def _graph(module: nn.Module, dtype: torch.dtype = torch.float32):
    x, r = torch.randn(2, 3, D, dtype=dtype), torch.randn(2, 3, D, dtype=dtype)
    gm = export_gm(module, x, r)
    gm, _ = apply_transform("match_rmsnorm_pattern", gm)
    gm, _ = apply_transform("fuse_add_rms_norm", gm)
    return gm, (x, r)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama-norm", "gemma-norm-same-dtype"])
def test_small_graph_fuses_both_patterns_and_keeps_its_outputs(gemma, backend):
    """The fused op keeps the backend ``fuse_rmsnorm`` chose for the norm it replaces."""
    gm, _ = _graph(Block(gemma=gemma).eval())
    gm, _ = apply_transform("fuse_rmsnorm", gm, backend=backend)
    ref = copy.deepcopy(gm)
    add_norm, norm = getattr(ad, f"{backend}_fused_add_rmsnorm"), getattr(ad, f"{backend}_rmsnorm")
    assert count_op(gm, ad.torch_dist_all_reduce) == 2 and count_op(gm, add_norm) == 1 and count_op(gm, norm) == 1
    gm, info = apply_transform(KEY, gm)
    assert info.num_matches == 2
    assert count_op(gm, getattr(ad, f"{backend}_dist_all_reduce_fused_add_rmsnorm")) == 1
    assert count_op(gm, getattr(ad, f"{backend}_dist_all_reduce_rmsnorm")) == 1
    assert count_op(gm, (ad.torch_dist_all_reduce, add_norm, norm)) == 0
    for rows in (1, 4):
        args = (torch.randn(rows, 3, D), torch.randn(rows, 3, D))
        with torch.no_grad():
            for a, b in zip(ref(*args), gm(*args)):
                assert torch.equal(a, b)


class QuantBlock(nn.Module):
    """What ``fuse_rmsnorm_quant_fp8`` / ``fuse_rmsnorm_quant_nvfp4`` leave before quantized
    linears: norms that emit quantized values (static FP8, NVFP4 or per-group FP8)."""

    def __init__(self, backend: str, fmt: str = "fp8", weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.backend, self.fmt = backend, fmt
        self.w1 = nn.Parameter(torch.randn(D, dtype=weight_dtype))
        self.w2 = nn.Parameter(torch.randn(D, dtype=weight_dtype))
        self.register_buffer("scale", torch.tensor(0.03))

    def forward(self, partial, residual):
        add_norm = getattr(ad, f"{self.backend}_fused_add_rmsnorm_quant_{self.fmt}")
        norm = getattr(ad, f"{self.backend}_rmsnorm_quant_{self.fmt}")
        last = GROUP if self.fmt == "fp8_group" else self.scale
        y, h = add_norm(ad.torch_dist_all_reduce(partial), residual, self.w1, EPS, last)
        r2 = ad.torch_dist_all_reduce((y * 0.5).to(partial.dtype))
        return norm(r2, self.w2, EPS, last), h, r2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_quantized_norms_fuse_with_the_all_reduce(backend, fmt):
    x, r = torch.randn(2, 3, D), torch.randn(2, 3, D)
    gm = export_gm(QuantBlock(backend, fmt).eval(), x, r)
    ref = copy.deepcopy(gm)
    add_norm = getattr(ad, f"{backend}_fused_add_rmsnorm_quant_{fmt}")
    norm = getattr(ad, f"{backend}_rmsnorm_quant_{fmt}")
    assert count_op(gm, ad.torch_dist_all_reduce) == 2 and count_op(gm, (add_norm, norm)) == 2
    gm, info = apply_transform(KEY, gm)
    assert info.num_matches == 2
    assert count_op(gm, getattr(ad, f"{backend}_dist_all_reduce_fused_add_rmsnorm_quant_{fmt}")) == 1
    assert count_op(gm, getattr(ad, f"{backend}_dist_all_reduce_rmsnorm_quant_{fmt}")) == 1
    assert count_op(gm, (ad.torch_dist_all_reduce, add_norm, norm)) == 0
    fused = next(n for n in gm.graph.nodes if n.op == "call_function" and "dist_all_reduce_rmsnorm" in str(n.target))
    if fmt == "fp8_group":
        assert fused.args[-1] == GROUP  # the group size passed on
    for rows in (1, 4):
        args = (torch.randn(rows, 3, D), torch.randn(rows, 3, D))
        with torch.no_grad():
            for a, b in zip(ref(*args), gm(*args)):
                assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_norm_in_another_dtype_is_left_alone(fmt):
    """Near miss (the Gemma/vLLM exclusion) for the quantized norms: float32 norm weights over
    bfloat16 activations."""
    x, r = torch.randn(2, 3, D, dtype=torch.bfloat16), torch.randn(2, 3, D, dtype=torch.bfloat16)
    gm = export_gm(QuantBlock("native", fmt).eval(), x, r)
    before = sorted(str(n.target) for n in gm.graph.nodes)
    gm, info = apply_transform(KEY, gm)
    assert info.num_matches == 0
    assert sorted(str(n.target) for n in gm.graph.nodes) == before
    assert count_op(gm, ad.torch_dist_all_reduce) == 2
    # control: the same block with bfloat16 norm weights fuses, so the dtype alone kept it apart
    same = export_gm(QuantBlock("native", fmt, weight_dtype=torch.bfloat16).eval(), x, r)
    assert apply_transform(KEY, same)[1].num_matches == 2


def test_compiled_norms_are_left_alone():
    """Near miss: the ``compile`` backend's norms have no all-reduce twin."""
    gm, _ = _graph(Block().eval())
    gm, _ = apply_transform("fuse_rmsnorm", gm, backend="compile")
    gm, info = apply_transform(KEY, gm)
    assert info.num_matches == 0 and count_op(gm, ad.torch_dist_all_reduce) == 2


def test_norm_in_another_dtype_is_left_alone():
    """Near miss (the Gemma/vLLM exclusion): float32 norm weights over bfloat16 activations."""
    gm, (x, r) = _graph(Block(weight_dtype=torch.float32).eval(), dtype=torch.bfloat16)
    norms = count_op(gm, (ad.torch_fused_add_rmsnorm, ad.torch_rmsnorm))
    gm, info = apply_transform(KEY, gm)
    assert info.num_matches == 0
    assert count_op(gm, ad.torch_dist_all_reduce) == 2
    assert count_op(gm, (ad.torch_fused_add_rmsnorm, ad.torch_rmsnorm)) == norms


def test_an_all_reduce_read_elsewhere_is_not_folded_into_the_add_norm():
    """Near miss: the sum before the residual add has another reader, which needs it unnormalised
    and not added; the fused add+norm op does not return it, so the pair stays as it was."""
    class ReadTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(D))

        def forward(self, partial, residual):
            p = ad.torch_dist_all_reduce(partial)
            y = ad.torch_rmsnorm(p + residual, self.w, EPS)
            return y, p * 2.0

    gm, _ = _graph(ReadTwice().eval())
    gm, info = apply_transform(KEY, gm)
    assert info.num_matches == 0
    assert count_op(gm, ad.torch_dist_all_reduce) == 1 and count_op(gm, ad.torch_fused_add_rmsnorm) == 1


def test_plain_norm_whose_sum_is_read_before_it_is_left_alone():
    """Near miss: the fused op would sit where the norm is, after a reader of the reduced sum."""
    class ReadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(D))

        def forward(self, partial, residual):
            r = ad.torch_dist_all_reduce(partial)
            z = r * residual
            return ad.torch_rmsnorm(r, self.w, EPS) + 1.0, z

    gm, _ = _graph(ReadFirst().eval())
    gm, info = apply_transform(KEY, gm)
    assert info.num_matches == 0
    assert count_op(gm, ad.torch_dist_all_reduce) == 1 and count_op(gm, ad.torch_rmsnorm) == 1


def test_world_size_one_pipeline_has_no_all_reduce_and_skips():
    result = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION, overrides={KEY: {"enabled": True}})
    record = {r.key: r for r in result.context.history}[KEY]
    assert record.status.startswith("skipped") and record.num_matches == 0


# ---- two ranks ---------------------------------------------------------------------------------
def _ops_job(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for i, rows in enumerate((5, 2, 7)):  # grow, reuse a prefix, grow again: the scratch buffer
        x, r, w, scale = _inputs(rows, seed=10 + i)
        mine = x * (rank + 1)  # rank 0 holds x, rank 1 holds 2x: the sum is 3x
        for op in FUSED_OPS:
            got = _call(op, mine, r, w, scale)
            want = _unfused(op, x * 3, r, w, scale)
            out[f"{_short(op)}/{rows}"] = all(torch.equal(a, b) for a, b in zip(got, want))
        out[f"input_kept/{rows}"] = torch.equal(mine, x * (rank + 1))
    return out


@pytest.mark.distributed
def test_two_ranks_ops_sum_then_norm():
    for r in _run_ranks(_ops_job):
        assert "error" not in r, r.get("error")
        assert all(r.values()), [k for k, v in r.items() if not v]


def _layer0_attention_reduce(gm):
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_dist_all_reduce.default)


def _graph_job(rank: int, family: str = "llama") -> Dict[str, Any]:
    checkpoint = family_checkpoint(family)
    # the embedding kept whole: its all-reduce (vocab-parallel lookup) is not a layer's; the counts
    # below are one per attention and MLP
    whole_table = {"detect_sharding": {"shard_embedding": False}}
    fused = build(checkpoint, up_to=Stage.POST_LOAD_FUSION, world_size=2,
                  overrides={KEY: {"enabled": True}, **whole_table})
    unfused = build(checkpoint, up_to=Stage.POST_LOAD_FUSION, world_size=2,
                    overrides={KEY: {"enabled": False}, **whole_table})
    fgm, ugm = fused.graph_module, unfused.graph_module
    record = {r.key: r for r in fused.context.history}[KEY]
    torch.manual_seed(0)  # every rank feeds the same tokens
    same = []
    for b, s in ((1, 5), (3, 2)):
        ids = torch.randint(0, TINY["vocab_size"], (b, s))
        same.append(torch.equal(graph_logits(fgm, ids), graph_logits(ugm, ids)))
    torch.manual_seed(1)
    assert_matches_hf(fgm, checkpoint, shapes=((1, 5), (3, 2)))

    counts = {
        "matches": record.num_matches,
        "fused_add": count_op(fgm, ad.native_dist_all_reduce_fused_add_rmsnorm)
        + count_op(fgm, ad.torch_dist_all_reduce_fused_add_rmsnorm),
        "left": count_op(fgm, ad.torch_dist_all_reduce),
        "left_add_norm": count_op(fgm, (ad.native_fused_add_rmsnorm, ad.torch_fused_add_rmsnorm)),
        # Gemma's norm weight is computed (1 + w) when the fusion runs; fold_constants, later in the
        # stage, turns it into a buffer computed once
        "folded_weights": sum("_folded" in str(n.args[2].target) for n in fgm.graph.nodes if n.op == "call_function"
                              and n.target in (ad.native_dist_all_reduce_fused_add_rmsnorm.default,
                                               ad.torch_dist_all_reduce_fused_add_rmsnorm.default)),
        "computed_before_folding": sum(
            n.args[2].op == "call_function" for n in build(
                checkpoint, up_to=Stage.POST_LOAD_FUSION, world_size=2,
                overrides={KEY: {"enabled": True}, "fold_constants": {"enabled": False}, **whole_table}
            ).graph_module.graph.nodes
            if n.op == "call_function" and n.target in (ad.native_dist_all_reduce_fused_add_rmsnorm.default,
                                                        ad.torch_dist_all_reduce_fused_add_rmsnorm.default)),
        "unfused_all_reduce": count_op(ugm, ad.torch_dist_all_reduce),
        "unfused_add_norm": count_op(ugm, (ad.native_fused_add_rmsnorm, ad.torch_fused_add_rmsnorm)),
        "same_logits": same,
    }

    # near miss, on the unfused graph itself (its packed weights cannot be deep-copied)
    near, reduce, gm = _near_miss(ugm)
    return {**counts, **near, "near_kept": reduce in gm.graph.nodes and len(reduce.users) == 2}


def _near_miss(ugm) -> Tuple[Dict[str, Any], Any, Any]:
    """Layer 0's attention all-reduce also read by an extra graph output, then the transform:
    ``(its matches, the all-reduces left, whether the logits stayed the same; that all-reduce; the
    transformed graph)``."""
    ids = torch.randint(0, TINY["vocab_size"], (2, 4))
    before = graph_logits(ugm, ids)
    reduce = _layer0_attention_reduce(ugm)
    output = next(n for n in ugm.graph.nodes if n.op == "output")
    with ugm.graph.inserting_before(output):
        extra = ugm.graph.call_function(torch.ops.aten.sum.default, (reduce,))
    logits_node = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    output.args = ((logits_node, extra),)
    ugm.recompile()
    near, near_info = apply_transform(KEY, ugm)
    return {"near_matches": near_info.num_matches, "near_all_reduce": count_op(near, ad.torch_dist_all_reduce),
            "near_same": torch.equal(graph_logits(near, ids), before)}, reduce, near


@pytest.mark.slow  # ~20 s each on 2 shared cores: each rank builds the tiny model twice and runs HF
@pytest.mark.distributed
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_two_rank_model_fuses_every_all_reduce_and_keeps_its_logits(family):
    """Llama: an all-reduce after each attention and each MLP. Gemma: its ``1 + w`` norms (weight
    computed in the graph, one dtype) fuse; detect_sharding splits its GeGLU MLP too (``plan_mlp``),
    so it also has an all-reduce after each attention and each MLP."""
    layers = TINY["num_hidden_layers"]
    expected = 2 * layers
    for rank, r in enumerate(_run_ranks(functools.partial(_graph_job, family=family))):
        assert "error" not in r, r.get("error")
        # (a) one match per all-reduce: after attention (-> post-attention norm), after the MLP (-> next norm)
        assert r["unfused_all_reduce"] == expected and r["unfused_add_norm"] == 2 * layers
        assert r["matches"] == expected
        # (b) every all-reduce and the add+norm it fed folded into the fused op
        assert r["fused_add"] == expected and r["left"] == 0
        assert r["left_add_norm"] == 2 * layers - expected
        assert r["computed_before_folding"] == (expected if family == "gemma" else 0)
        assert r["folded_weights"] == (expected if family == "gemma" else 0)
        # (c) logits equal the same ranks' unfused graph (exactly) at two shapes; HF checked in the job
        assert r["same_logits"] == [True, True], f"rank {rank}"
        # (d) near miss: an all-reduce with another reader stays, the others fuse
        assert r["near_matches"] == expected - 1 and r["near_all_reduce"] == 1 and r["near_kept"]
        assert r["near_same"]


def _nvfp4_graph_job(rank: int) -> Dict[str, Any]:
    """An NVFP4 Llama at world size 2: ``detect_sharding`` splits the quantized linears, so the
    all-reduce after each row-parallel projection feeds a norm that ``fuse_rmsnorm_quant_nvfp4``
    fused with the next layer's NVFP4 activation quantization."""
    import quant_checkpoints as qc
    from helpers import rel_rmse

    checkpoint = qc.quantized_checkpoint("llama", "nvfp4")
    kw = dict(up_to=Stage.POST_LOAD_FUSION, world_size=2, max_seq_len=64, max_batch_size=2)
    whole_table = {"detect_sharding": {"shard_embedding": False}}  # one all-reduce per attention and MLP
    fused = build(checkpoint, overrides={KEY: {"enabled": True}, **whole_table}, **kw)
    unfused = build(checkpoint, overrides={KEY: {"enabled": False}, **whole_table}, **kw)
    fgm, ugm = fused.graph_module, unfused.graph_module
    reference = qc.reference_model("llama", "nvfp4")
    torch.manual_seed(0)  # every rank feeds the same tokens
    same, off_reference = [], []
    for b, s in ((1, 5), (2, 3)):
        ids = torch.randint(0, TINY["vocab_size"], (b, s))
        out = graph_logits(fgm, ids)
        same.append(torch.equal(out, graph_logits(ugm, ids)))
        with torch.no_grad():
            off_reference.append(rel_rmse(out, reference(ids).logits))
    nvfp4_add = (ad.native_fused_add_rmsnorm_quant_nvfp4, ad.torch_fused_add_rmsnorm_quant_nvfp4)
    counts = {
        "matches": {r.key: r for r in fused.context.history}[KEY].num_matches,
        "fused_nvfp4": count_op(fgm, (ad.native_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4,
                                      ad.torch_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4)),
        "fused_float": count_op(fgm, (ad.native_dist_all_reduce_fused_add_rmsnorm,
                                      ad.torch_dist_all_reduce_fused_add_rmsnorm)),
        "left": count_op(fgm, ad.torch_dist_all_reduce),
        "left_nvfp4_add_norm": count_op(fgm, nvfp4_add),
        "unfused_all_reduce": count_op(ugm, ad.torch_dist_all_reduce),
        "unfused_nvfp4_add_norm": count_op(ugm, nvfp4_add),
        "same_logits": same,
        "off_reference": off_reference,
    }
    # near miss: layer 0's attention all-reduce (feeding the NVFP4 post-attention norm) also read
    # by an extra graph output
    near, reduce, gm = _near_miss(ugm)
    return {**counts, **near, "near_kept": reduce in gm.graph.nodes and len(reduce.users) == 2
            and any(u.target in (op.default for op in nvfp4_add) for u in reduce.users)}


@pytest.mark.slow  # ~30 s on 2 shared cores: each rank builds the tiny NVFP4 model twice and runs HF
@pytest.mark.distributed
def test_two_rank_nvfp4_model_fuses_the_all_reduce_into_the_quantized_norms():
    """Per layer two all-reduces (after o_proj, after down_proj): three feed a norm that emits
    NVFP4 (layer 0's post-attention norm, layer 1's two), the last the float final norm."""
    layers = TINY["num_hidden_layers"]
    for rank, r in enumerate(_run_ranks(_nvfp4_graph_job, timeout=300)):
        assert "error" not in r, r.get("error")
        # (a) one match per all-reduce
        assert r["unfused_all_reduce"] == 2 * layers and r["unfused_nvfp4_add_norm"] == 2 * layers - 1
        assert r["matches"] == 2 * layers
        # (b) the NVFP4 add+norms took their all-reduce in; none left
        assert r["fused_nvfp4"] == 2 * layers - 1 and r["fused_float"] == 1
        assert r["left"] == 0 and r["left_nvfp4_add_norm"] == 0
        # (c) logits equal the same ranks' unfused graph exactly at two shapes, and the float reference
        assert r["same_logits"] == [True, True], f"rank {rank}"
        assert max(r["off_reference"]) < 1e-5, r["off_reference"]
        # (d) near miss: the all-reduce with another reader stays (with its NVFP4 norm), the others fuse
        assert r["near_matches"] == 2 * layers - 1 and r["near_all_reduce"] == 1 and r["near_kept"]
        assert r["near_same"]
