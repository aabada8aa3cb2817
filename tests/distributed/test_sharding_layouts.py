"""Tensor parallelism through the many ways models lay out their attention: what ``detect_sharding``
proves head-local and splits, and the near misses it must leave whole.

One process: the plans on synthetic modules (one per layout, each with a near miss) and on tiny
real checkpoints (Phi-3's fused ``qkv_proj``, GPT-NeoX's per-head fused projection), and the loader's
block slices. Two real gloo ranks (``-m slow``): greedy tokens and log-probabilities equal HF eager
for one model of each layout.
"""

import operator
from functools import partial
from typing import Any, Dict

import pytest
import torch

from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import ColumnShard, NormShard, RowShard, WeightShard, literal_dims
from autodeploy.transform.library.detect_sharding import detect
from helpers import build, coverage_checkpoint, export_gm, family_checkpoint, hf_model
from test_collectives import _run_ranks

ad = torch.ops.autodeploy
QUERY_WHOLE = "the query is not one projection's heads through ops that keep each head's values to its head"


def _plan(module: torch.nn.Module, rank: int = 1):
    gm = export_gm(module, torch.randn(2, 5, 32))
    return detect(gm, world_size=2, rank=rank, lm_head=False, embedding=False)


def _split(plan) -> set:
    return {d.weight for d in plan.decisions if isinstance(d, (ColumnShard, RowShard))}


class _WrittenOutAttention(torch.nn.Module):
    """Attention whose query passes ops the planner must prove head-local, by ``variant``: an RMSNorm
    over all heads' features (OLMo-2), RoPE written out with ``rotate_half`` and cos/sin tables
    shared by the heads, a norm written out per head (``q * rsqrt(mean(q * q, -1) + eps)``); and the
    near misses: a LayerNorm over all heads, a per-head scale (a ``[heads, 1]`` parameter), and a
    scale computed from all heads' values."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))
        self.norm = torch.nn.Parameter(torch.rand(32) + 0.5)
        self.scale = torch.nn.Parameter(torch.rand(4, 1) + 0.5)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x)
        if self.variant == "all-heads rmsnorm":
            q = ad.torch_rmsnorm(q, self.norm, 1e-6)
        elif self.variant == "all-heads layernorm":
            q = torch.nn.functional.layer_norm(q, (32,), self.norm)
        q = q.view(b, s, 4, 8)
        if self.variant == "written-out rope":
            angles = torch.arange(s, dtype=x.dtype)[:, None] * torch.linspace(0.1, 1.0, 8)
            rotated = torch.cat([-q[..., 4:], q[..., :4]], dim=-1)
            q = q * angles.cos()[None, :, None, :] + rotated * angles.sin()[None, :, None, :]
        elif self.variant == "written-out per-head norm":
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
        elif self.variant == "per-head scale":
            q = q * self.scale
        elif self.variant == "scale from all heads":
            q = q / q.flatten(2).abs().amax(-1)[:, :, None, None]
        k, v = (p(x).view(b, s, 4, 8) for p in (self.k, self.v))
        out = ad.torch_attention(q, k, v, None, 0.0, True, None, None, None, None)
        return self.o(out.reshape(b, s, -1))


@pytest.mark.parametrize("variant", ["all-heads rmsnorm", "written-out rope", "written-out per-head norm",
                                     "all-heads layernorm", "per-head scale", "scale from all heads"])
def test_ops_between_projection_and_attention_split_only_when_they_keep_heads_apart(variant):
    plan = _plan(_WrittenOutAttention(variant))
    split = _split(plan)
    norms = [d for d in plan.decisions if isinstance(d, NormShard)]
    if variant in ("all-heads layernorm", "per-head scale", "scale from all heads"):  # near misses: whole
        assert split == set() and norms == []
        assert plan.whole_layers == {"torch_attention": QUERY_WHOLE}
        return
    assert split == {"q.weight", "k.weight", "v.weight", "o.weight"} and plan.whole_layers == {}
    # the norm's weight splits with the query's heads (rank 1: the second half), its squares summed
    assert [(d.weight, d.parts, d.index) for d in norms] == ([("norm", None, None)] if variant == "all-heads rmsnorm"
                                                             else [])




def _sum_over_ranks(module: torch.nn.Module, world: int, x: torch.Tensor) -> torch.Tensor:
    """Every rank's graph, one after another in this process, each with its slices of the module's
    own weights (``WeightShard.take``, as the loader cuts them): with no process group the
    all-reduce after the output projection is the identity, so each graph returns its partial sum,
    and the ranks' partial sums add up to the whole layer's output when the split is right (for
    modules whose row-split projections have no bias: every rank adds that after its all-reduce)."""
    from autodeploy.transform.library.sharding_transform_executor import execute

    state = module.state_dict()
    total = torch.zeros(())
    for rank in range(world):
        gm = export_gm(module, torch.randn(2, 5, 32))
        shards = execute(gm, detect(gm, world_size=world, rank=rank, lm_head=False, embedding=False))
        for name, shard in shards.items():
            *path, leaf = name.split(".")
            owner = gm.get_submodule(".".join(path)) if path else gm
            setattr(owner, leaf, torch.nn.Parameter(shard.take(state[name]), requires_grad=False))
        out = gm(x)
        total = total + (out[0] if isinstance(out, (tuple, list)) else out)
    return total


class _FusedAttention(torch.nn.Module):
    """q (4 heads of 8), k and v (2 heads each) from one projection ``qkv``, by ``layout``: sliced
    into ``[q | k | v]`` on its flat features (Phi-3), clamped and split by sizes (DBRX), or viewed head
    by head as ``[heads, 3 * d]`` and chunked (GPT-NeoX; 4 key/value heads), or unsqueezed and split
    into 4 query heads and one key/value head (GPT-BigCode's multi-query). Near misses: blocks that
    overlap (k reads part of q), and a fused output with another reader."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.qkv = torch.nn.Linear(32, {"per-head chunks": 96, "multi-query split": 48}.get(layout, 64))
        self.o = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        heads = lambda t, n: t.reshape(b, s, n, 8)  # noqa: E731
        if self.layout == "per-head chunks":
            q, k, v = qkv.view(b, s, 4, 24).chunk(3, dim=-1)
        elif self.layout == "multi-query split":
            q, k, v = qkv.unsqueeze(1).split((32, 8, 8), dim=3)
            q, k, v = heads(q, 4), heads(k, 1), heads(v, 1)
        elif self.layout == "clamped split":
            q, k, v = qkv.clamp(-8.0, 8.0).split([32, 16, 16], dim=-1)
            q, k, v = heads(q, 4), heads(k, 2), heads(v, 2)
        else:
            k_start = 24 if self.layout == "overlapping blocks" else 32
            q, k, v = heads(qkv[..., :32], 4), heads(qkv[..., k_start:k_start + 16], 2), heads(qkv[..., 48:], 2)
        out = self.o(ad.torch_attention(q, k, v, None, 0.0, True, None, None, None, None).reshape(b, s, -1))
        return out + qkv.mean() if self.layout == "another reader" else out


@pytest.mark.parametrize("layout", ["sliced", "clamped split", "per-head chunks", "multi-query split",
                                    "overlapping blocks", "another reader"])
def test_a_fused_qkv_projection_splits_block_by_block(layout):
    torch.manual_seed(0)
    module = _FusedAttention(layout).eval()
    plan = _plan(module)
    if layout in ("overlapping blocks", "another reader"):
        assert _split(plan) == set() and plan.arg_fixes == {}
        assert plan.whole_layers == {"torch_attention": QUERY_WHOLE}
        return
    (qkv,) = [d for d in plan.decisions if isinstance(d, ColumnShard)]
    assert (qkv.weight, qkv.bias) == ("qkv.weight", "qkv.bias") and _split(plan) == {"qkv.weight", "o.weight"}
    if layout == "per-head chunks":  # whole heads of q, k and v together: one plain split
        assert qkv.blocks == () and plan.arg_fixes == {} and list(plan.layout_fixes.values()) == [{2: 2}]
    elif layout == "multi-query split":  # half of q; the one key/value head on every rank
        assert qkv.blocks == ((32, 2, 1), (8, 1, 0), (8, 1, 0))
        assert list(map(str, plan.arg_fixes.values())) == ["{1: [16, 8, 8]}"]
    else:  # rank 1 of 2: the second half of each block; the cuts' bounds follow the smaller blocks
        assert qkv.blocks == ((32, 2, 1), (16, 2, 1), (16, 2, 1))
        fixes = sorted(map(str, plan.arg_fixes.values()))
        assert fixes == (["{1: [16, 8, 8]}"] if layout == "clamped split" else
                         ["{2: 0, 3: 16}", "{2: 16, 3: 24}", "{2: 24, 3: 32}"])
    with torch.no_grad():  # the ranks' partial outputs add up to the layer's, at two shapes
        for shape in ((2, 5, 32), (1, 3, 32)):
            x = torch.randn(shape)
            assert torch.allclose(_sum_over_ranks(module, 2, x), module(x), atol=1e-5)


class _QuantizedFusedAttention(torch.nn.Module):
    """Phi-3's sliced ``[q | k | v]`` from an FP8 projection: its blocks with their scales are not
    split yet, so the layer stays whole, and says so."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.randn(64, 32).to(torch.float8_e4m3fn), requires_grad=False)
        self.scales = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.o = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = ad.torch_quant_fp8_linear(x, self.qkv, None, self.scales[0], self.scales[1])
        q, k, v = (qkv[..., :32].reshape(b, s, 4, 8), qkv[..., 32:48].reshape(b, s, 2, 8),
                   qkv[..., 48:].reshape(b, s, 2, 8))
        return self.o(ad.torch_attention(q, k, v, None, 0.0, True, None, None, None, None).reshape(b, s, -1))


def test_a_quantized_fused_projection_stays_whole_and_says_why():
    plan = _plan(_QuantizedFusedAttention())
    assert _split(plan) == set() and plan.arg_fixes == {}
    assert plan.whole_layers == {
        "torch_attention": "a quantized fused q/k/v projection (its blocks with their scales are not split yet)"}


def test_key_value_blocks_of_a_fused_projection_are_replicated_past_their_head_count():
    """Four ranks, two key/value heads: each rank holds its quarter of q and the one k/v head its
    query heads read (ranks 0-1 head 0, ranks 2-3 head 1); the sum over the four ranks is exact."""
    torch.manual_seed(0)
    module = _FusedAttention("sliced").eval()
    gm = export_gm(module, torch.randn(2, 5, 32))
    (qkv,) = [d for d in detect(gm, world_size=4, rank=3, lm_head=False, embedding=False).decisions
              if isinstance(d, ColumnShard)]
    assert qkv.blocks == ((32, 4, 3), (16, 2, 1), (16, 2, 1))
    with torch.no_grad():
        x = torch.randn(2, 5, 32)
        assert torch.allclose(_sum_over_ranks(module, 4, x), module(x), atol=1e-5)


class _FusedMLP(torch.nn.Module):
    """A gated MLP whose gate and up are one projection chunked into ``[gate | up]`` (Phi-3's
    ``gate_up_proj``, GLM's). Near miss: the fused output has another reader."""

    def __init__(self, another_reader: bool = False):
        super().__init__()
        self.another_reader = another_reader
        # no bias on down: each rank adds it after its all-reduce, which ``_sum_over_ranks`` would count twice
        self.gate_up, self.down = torch.nn.Linear(32, 128), torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        fused = self.gate_up(x)
        gate, up = fused.chunk(2, dim=-1)
        out = self.down(torch.nn.functional.silu(gate) * up)
        return out + fused.mean() if self.another_reader else out


@pytest.mark.parametrize("another_reader", [False, True], ids=["chunked", "another reader"])
def test_a_fused_gate_up_projection_splits_block_by_block(another_reader):
    torch.manual_seed(0)
    module = _FusedMLP(another_reader).eval()
    plan = _plan(module)
    if another_reader:
        assert plan.decisions == []
        return
    (column,) = [d for d in plan.decisions if isinstance(d, ColumnShard)]
    assert (column.weight, column.bias, column.blocks) == ("gate_up.weight", "gate_up.bias", ((64, 2, 1), (64, 2, 1)))
    assert _split(plan) == {"gate_up.weight", "down.weight"} and plan.arg_fixes == {}  # chunk(2) of equal halves
    with torch.no_grad():
        for shape in ((2, 5, 32), (1, 3, 32)):
            x = torch.randn(shape)
            assert torch.allclose(_sum_over_ranks(module, 2, x), module(x), atol=1e-5)


class _ScaledMLP(torch.nn.Module):
    """``down(f(up(x)))`` with ``f``: GELU and (eval) dropout (BioGPT, XGLM); an activation with
    scalars computed from its parameters (Apertus's xIELU); a norm over all hidden features
    (BitNet's ``ffn_sub_norm``). Near miss: a scale computed from all hidden features."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32, bias=False)
        self.alpha = torch.nn.Parameter(torch.tensor([0.3]))
        self.norm = torch.nn.Parameter(torch.rand(64) + 0.5)

    def forward(self, x):
        h = self.up(x)
        if self.variant == "gelu and dropout":
            h = torch.nn.functional.dropout(torch.nn.functional.gelu(h), 0.1, training=False)
        elif self.variant == "computed scalars":
            alpha = 0.5 + torch.nn.functional.softplus(self.alpha)
            h = torch.where(h > 0, alpha * h * h, torch.expm1(torch.min(h, torch.tensor(0.0))) - alpha * h)
        elif self.variant == "norm over all features":
            h = ad.torch_rmsnorm(torch.relu(h).square(), self.norm, 1e-6)
        else:  # a scale from every hidden feature: each rank would see only its own
            h = h / h.abs().amax(-1, keepdim=True)
        return self.down(h)


@pytest.mark.parametrize("variant", ["gelu and dropout", "computed scalars", "norm over all features",
                                     "scale from all features"])
def test_mlps_split_only_when_their_activation_keeps_features_apart(variant):
    torch.manual_seed(0)
    module = _ScaledMLP(variant).eval()
    plan = _plan(module)
    norms = [(d.weight, d.parts) for d in plan.decisions if isinstance(d, NormShard)]
    if variant == "scale from all features":
        assert plan.decisions == []
        return
    assert _split(plan) == {"up.weight", "down.weight"}
    assert norms == ([("norm", None)] if variant == "norm over all features" else [])
    if variant != "norm over all features":  # that one sums squares over ranks: the 2-rank tests (BitNet)
        with torch.no_grad():
            for shape in ((2, 5, 32), (1, 3, 32)):
                x = torch.randn(shape)
                assert torch.allclose(_sum_over_ranks(module, 2, x), module(x), atol=1e-5)


class _GatedHeads(torch.nn.Module):
    """Attention output gated by one value per head, ``o * softplus(g(x))[..., None]`` (Laguna; LFM3
    and Bailing with sigmoid), or normed over all heads before the output projection (BitNet's
    ``attn_sub_norm``). Near miss: one gate value for all heads, ``[b, s, 1]``."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))
        self.g = torch.nn.Linear(32, 1 if variant == "one gate for all heads" else 4, bias=False)
        self.norm = torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 8) for p in (self.q, self.k, self.v))
        out = ad.torch_attention(q, k, v, None, 0.0, True, None, None, None, None)
        if self.variant == "output norm":
            return self.o(ad.torch_rmsnorm(out.reshape(b, s, -1), self.norm, 1e-6))
        return self.o((out * torch.nn.functional.softplus(self.g(x))[..., None]).reshape(b, s, -1))


@pytest.mark.parametrize("variant", ["per-head gate", "output norm", "one gate for all heads"])
def test_gates_and_norms_after_the_attention_split_with_its_heads(variant):
    torch.manual_seed(0)
    module = _GatedHeads(variant).eval()
    plan = _plan(module)
    if variant == "one gate for all heads":
        assert _split(plan) == set()
        assert plan.whole_layers == {"torch_attention": "the output does not reach one output projection "
                                                           "through layout ops and per-head gates"}
        return
    norms = [(d.weight, d.parts) for d in plan.decisions if isinstance(d, NormShard)]
    if variant == "output norm":  # its weight with the heads, its squares summed over ranks (2-rank test)
        assert _split(plan) == {"q.weight", "k.weight", "v.weight", "o.weight"} and norms == [("norm", None)]
        return
    assert _split(plan) == {"q.weight", "k.weight", "v.weight", "g.weight", "o.weight"} and norms == []
    with torch.no_grad():
        for shape in ((2, 5, 32), (1, 3, 32)):
            x = torch.randn(shape)
            assert torch.allclose(_sum_over_ranks(module, 2, x), module(x), atol=1e-5)


class _PerHeadInputs(torch.nn.Module):
    """Attention with per-head inputs computed in the graph: ALiBi slopes ``[heads]`` (BLOOM, MPT)
    and a relative bias ``[b, s, heads, R]`` from a projection (Inkling's ``r_proj``)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))
        self.r = torch.nn.Linear(32, 4 * 3, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 8) for p in (self.q, self.k, self.v))
        slopes = torch.exp2(-torch.arange(1, 5, dtype=x.dtype) * (1.0 + x[0, 0, :1]))  # computed, not stored
        out = ad.torch_attention(q, k, v, None, 0.0, True, None, None, None, None, slopes, None, None,
                                 self.r(x).view(b, s, 4, 3))
        return self.o(out.reshape(b, s, -1))


def test_per_head_inputs_computed_in_the_graph_are_sliced_to_each_ranks_heads():
    from autodeploy.transform.library._sharding import HeadSlice

    torch.manual_seed(0)
    module = _PerHeadInputs().eval()
    plan = _plan(module)
    assert sorted((d.name, d.dim) for d in plan.decisions if isinstance(d, HeadSlice)) == [
        ("alibi_slopes", 0), ("rel_logits", 2)]
    assert _split(plan) == {"q.weight", "k.weight", "v.weight", "o.weight"} and plan.whole_layers == {}
    with torch.no_grad():  # each rank's heads read their own slopes and bias: the partial sums add up
        for shape in ((2, 5, 32), (1, 3, 32)):
            x = torch.randn(shape)
            assert torch.allclose(_sum_over_ranks(module, 2, x), module(x), atol=1e-5)


def test_block_slices_take_each_blocks_part_in_order():
    rows = torch.arange(12.0)
    assert WeightShard(0, 1, 2, blocks=((6, 2, 1), (4, 2, 1), (2, 2, 1))).take(rows).tolist() == [3, 4, 5, 8, 9, 11]
    assert WeightShard(0, 0, 4, blocks=((8, 4, 0), (4, 2, 0))).take(rows).tolist() == [0, 1, 8, 9]
    with pytest.raises(ValueError, match=r"cannot be cut into blocks \[6, 4\]"):
        WeightShard(0, 0, 2, blocks=((6, 2, 0), (4, 2, 0))).take(rows)


def test_only_the_heads_entry_of_a_view_into_heads_is_divided():
    """Llama-4's complex RoPE views the key ``[b, s, 2, -1, 2]``: with 2 key/value heads only the
    heads entry divides, not the pair; a per-head size equal to the head count stays; the merged
    features of ``[b, s, heads * d]`` divide."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    view = lambda shape: graph.call_function(torch.ops.aten.reshape.default, (x, shape))  # noqa: E731
    assert literal_dims(view([x, x, 2, -1, 2]), (2, 32)) == [2]
    assert literal_dims(view([x, x, 4, 4]), (4, 64)) == [2]
    assert literal_dims(view([x, x, 64]), (4, 64)) == [2]
    assert literal_dims(view([x, 4, x, 16]), (4, 64)) == [1]


def test_fused_projections_of_real_models_split():
    """Phi-3's ``qkv_proj`` (sliced into q, k and v) and ``gate_up_proj`` (chunked into gate and up),
    GPT-NeoX's ``query_key_value`` (per head): one column split each, the dense projection by rows."""
    gm = build(family_checkpoint("phi3"), up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=0)
    fused = [d for d in plan.decisions if isinstance(d, ColumnShard) and "qkv_proj" in d.weight]
    assert len(fused) == 2 and all(d.blocks == ((64, 2, 0), (32, 2, 0), (32, 2, 0)) for d in fused)
    gate_up = [d for d in plan.decisions if isinstance(d, ColumnShard) and "gate_up_proj" in d.weight]
    assert len(gate_up) == 2 and all(d.blocks == ((128, 2, 0), (128, 2, 0)) for d in gate_up)
    assert plan.whole_layers == {}
    gm = build(coverage_checkpoint("gpt_neox")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=0)
    attention = sorted((type(d).__name__, d.weight.rsplit(".", 2)[-2]) for d in plan.decisions
                       if ".attention." in getattr(d, "weight", ""))
    assert attention == [("ColumnShard", "query_key_value")] * 2 + [("RowShard", "dense")] * 2
    assert plan.whole_layers == {}


def test_query_and_key_norms_over_all_heads_share_one_all_reduce():
    """OLMo-2's q/k norms (over all heads) become one ``torch_dist_rmsnorm_pair`` a layer: one
    all-reduce for both sums of squares. Near miss: a query norm read before the key norm exists
    (moved ahead of it here) keeps the two apart."""
    from autodeploy.transform.graph_utils import count_op
    from autodeploy.transform.library.sharding_transform_executor import execute

    gm = build(coverage_checkpoint("olmo2")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=0)
    assert sorted(d.weight.rsplit(".", 2)[-2] for d in plan.decisions if isinstance(d, NormShard)) == [
        "k_norm", "k_norm", "q_norm", "q_norm"]
    execute(gm, plan)
    assert count_op(gm, ad.torch_dist_rmsnorm_pair) == 2 and count_op(gm, ad.torch_dist_rmsnorm) == 0
    gm = build(coverage_checkpoint("olmo2")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=0)
    norms = [n for n in gm.graph.nodes if n.target == ad.torch_rmsnorm.default and "q_norm" in str(n.args[1].target)]
    reader = next(iter(norms[0].users))
    k_norm = next(n for n in gm.graph.nodes
                  if n.target == ad.torch_rmsnorm.default and "k_norm" in str(n.args[1].target))
    assert list(gm.graph.nodes).index(reader) > list(gm.graph.nodes).index(k_norm)
    k_norm.prepend(reader)  # the query norm's reader now runs before the key norm
    execute(gm, plan)
    assert count_op(gm, ad.torch_dist_rmsnorm_pair) == 1 and count_op(gm, ad.torch_dist_rmsnorm) == 2


def _layout_job(rank: int, model_type: str) -> Dict[str, Any]:
    import random

    from autodeploy import LLM, SamplingParams

    path, vocab = coverage_checkpoint(model_type)
    llm = LLM(path, dtype="float32", world_size=2, max_seq_len=64, max_batch_size=4, max_num_tokens=64)
    plan = llm.build.context.sharding_plan
    whole = dict(plan.whole_layers) if plan is not None else None
    if not llm.is_driver:
        llm.follow()
        return {"whole": whole}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm.shutdown()
    return {"whole": whole, "prompts": prompts, "tokens": [list(o.token_ids) for o in outs],
            "logprobs": [[step[t] for step, t in zip(o.logprobs, o.token_ids)] for o in outs]}


def assert_two_ranks_match_hf(model_type: str) -> None:
    """Two gloo ranks of ``model_type``'s coverage checkpoint through ``LLM``: no layer left whole on
    any rank, greedy tokens equal to HF eager's (without its cache, which some of HF's state models
    cannot run from a plain forward), log-probabilities within 1e-4."""
    results = _run_ranks(partial(_layout_job, model_type=model_type), world=2, timeout=400)
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["whole"] == {}
    lead = results[0]
    model = hf_model(coverage_checkpoint(model_type)[0])
    for prompt, tokens, logprobs in zip(lead["prompts"], lead["tokens"], lead["logprobs"]):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]), use_cache=False).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        assert expected.argmax(-1).tolist() == tokens
        want = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-4), (logprobs, want.tolist())


@pytest.mark.slow  # ~30 s each on 2 cores: both ranks build the engine
@pytest.mark.distributed
@pytest.mark.parametrize("model_type", ["olmo2", "cohere", "llama4_text", "phi3", "dbrx", "gpt_neox", "laguna",
                                        "bitnet", "bloom", "gpt_bigcode", "qwen3_5_text"])
def test_two_ranks_of_each_layout_give_hfs_tokens_and_logprobs(model_type):
    """OLMo-2: q/k norms over all heads; Cohere: interleaved RoPE written out; Llama-4: complex RoPE
    views and a per-position query scale; Phi-3 and DBRX: fused q/k/v blocks (DBRX's clamped);
    GPT-NeoX: q/k/v per head; Laguna: a gate value per head; BitNet: a norm over all heads before
    the output projection; BLOOM: ALiBi slopes sliced per rank, q/k/v viewed ``[heads, 3, d]``;
    GPT-BigCode: multi-query blocks cut after an unsqueeze, the key/value head on both ranks;
    Qwen3.5: Gated DeltaNet layers by heads (their state and convolution channels per rank).
    Every attention is split (none left whole), and the tokens and their log-probabilities equal HF
    eager's."""
    assert_two_ranks_match_hf(model_type)


def _gdn_plan(graph_module, rank: int = 1):
    plan = detect(graph_module, world_size=2, rank=rank)
    return {(type(d).__name__, d.weight.split("linear_attn.")[1], getattr(d, "blocks", None)) for d in plan.decisions
            if "layers.0.linear_attn." in getattr(d, "weight", "")}, plan


def test_a_gated_deltanet_layer_splits_by_heads_with_its_convolution_and_state():
    """Qwen3.5's Gated DeltaNet (2 key heads, 4 value heads, 16 wide): rank 1 of 2 takes the second
    half of each of q, k and v in ``in_proj_qkv`` and the same channels of the short convolution
    (the split sizes halved), its rows of ``in_proj_a/b/z``, its heads of ``A_log`` and ``dt_bias``,
    its columns of ``out_proj``; executed, the rank's tensors have those shapes (the state caches are
    sized from them: the 2-rank test below runs them). Near miss: a second reader of the convolution's
    output leaves the layer replicated."""
    from autodeploy.transform.library.sharding_transform_executor import execute

    gm = build(coverage_checkpoint("qwen3_5_text")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    decisions, plan = _gdn_plan(gm)
    blocks = ((32, 2, 1), (32, 2, 1), (64, 2, 1))
    assert decisions == {("ColumnShard", "in_proj_qkv.weight", blocks), ("ColumnShard", "conv1d.weight", blocks),
                         ("ColumnShard", "in_proj_a.weight", ()), ("ColumnShard", "in_proj_b.weight", ()),
                         ("ColumnShard", "in_proj_z.weight", ()), ("HeadWeightShard", "dt_bias", ()),
                         ("HeadWeightShard", "A_log", ()), ("RowShard", "out_proj.weight", None)}
    assert sorted(map(str, plan.arg_fixes.values())) == ["{1: [16, 16, 32]}"] * 3
    execute(gm, plan)
    layer = "model.layers.0.linear_attn."
    shapes = {name: tuple(gm.get_parameter(layer + name).shape) for name in
              ("in_proj_qkv.weight", "conv1d.weight", "in_proj_a.weight", "A_log", "out_proj.weight")}
    assert shapes == {"in_proj_qkv.weight": (64, 64), "conv1d.weight": (64, 1, 4), "in_proj_a.weight": (2, 64),
                      "A_log": (2,), "out_proj.weight": (64, 32)}
    gm = build(coverage_checkpoint("qwen3_5_text")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    conv = next(n for n in gm.graph.nodes if n.target == ad.torch_causal_conv1d.default)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(torch.ops.aten.sum.default, (conv,))
    output.args = ((output.args[0][0] if isinstance(output.args[0], tuple) else output.args[0], extra),)
    assert _gdn_plan(gm)[0] == set()


def test_qwen3_next_gated_deltanet_splits_its_grouped_projections_by_whole_groups():
    """Qwen3-Next groups ``in_proj_qkvz`` and ``in_proj_ba`` by key head (``[b, s, nk, f]`` views
    split into each group's parts): split by rows, whole groups per rank, with the views' group and
    head counts divided; the convolution's channels (``[q | k | v]`` concatenated) by blocks as
    Qwen3.5's. (Two ranks of it give HF's tokens and log-probabilities with prefix caching:
    ``test_tp_greedy_tokens``, ``-m slow``.)"""
    gm = build(coverage_checkpoint("qwen3_next")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    decisions, plan = _gdn_plan(gm)
    blocks = ((32, 2, 1), (32, 2, 1), (64, 2, 1))
    assert decisions == {("ColumnShard", "conv1d.weight", blocks), ("ColumnShard", "in_proj_qkvz.weight", ()),
                         ("ColumnShard", "in_proj_ba.weight", ()), ("HeadWeightShard", "dt_bias", ()),
                         ("HeadWeightShard", "A_log", ()), ("RowShard", "out_proj.weight", None)}
    nodes = {n.name: n for n in gm.graph.nodes}
    layer0 = {name: (list(nodes[name].args[1])[2:], fixes) for name, fixes in plan.layout_fixes.items()
              if name in ("view", "view_1", "reshape_2", "reshape_12")}
    # 2 key-head groups of qkvz (96 wide) and of ba (4 wide), 4 value heads: each halved on rank 1
    assert layer0 == {"view": ([2, 96], {2: 2}), "view_1": ([2, 4], {2: 2}), "reshape_2": ([4], {2: 2}),
                      "reshape_12": ([4, 16], {2: 2})}
    # near miss: a part of the grouped projection also read outside the layer stays whole on every rank
    gm = build(coverage_checkpoint("qwen3_next")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    split = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.split_with_sizes.default)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        part = gm.graph.call_function(operator.getitem, (split, 3))
        extra = gm.graph.call_function(torch.ops.aten.sum.default, (part,))
    output.args = ((output.args[0][0] if isinstance(output.args[0], tuple) else output.args[0], extra),)
    assert _gdn_plan(gm)[0] == set()
