"""Tensor parallelism for state layers: Mamba2, Mamba and LFM2's gated short convolution
(``_sharding_mamba``), OLMo-Hybrid's and Kimi-Linear's Gated DeltaNet layouts (``_sharding_state``;
Qwen3.5's and Qwen3-Next's are in ``test_sharding_layouts``) and MiniMax's linear attention.

One process: the plans of tiny real checkpoints (Bamba: Mamba2 with one group and a gated norm over
all features; Mamba2 with two groups; Falcon-H1's ``mup_vector``; Mamba's ``x_proj``/``dt_proj``;
LFM2; OLMo-Hybrid's separate q/k/v projections; Kimi's per-channel decay; MiniMax's sliced decay),
their executed shard shapes, and near misses (a second reader, groups a norm would split); synthetic
Mamba2 and short-conv layers whose ranks' partial outputs, each rank's graph loaded with its slices,
add up to the layer's output at two shapes. Two real gloo ranks (``-m slow``, ``test_sharding_layouts``'
job): greedy tokens and log-probabilities equal HF eager.
"""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.coverage.configs import tiny_config
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import ColumnShard, FeatureMeanShard, RowShard
from autodeploy.transform.library._sharding_state import LAYOUT
from autodeploy.transform.library.detect_sharding import detect
from autodeploy.transform.library.sharding_transform_executor import execute
from helpers import _cached_checkpoint, build, coverage_checkpoint, export_gm
from test_sharding_layouts import _sum_over_ranks, assert_two_ranks_match_hf

ad = torch.ops.autodeploy
aten = torch.ops.aten


def _graph(model_type: str, **overrides):
    """The pattern-matched graph of the coverage sweep's tiny config, with ``overrides``."""
    if not overrides:
        return build(coverage_checkpoint(model_type)[0], up_to=Stage.PATTERN_MATCHER).graph_module
    config = {**tiny_config(model_type, "a"), **overrides}
    name = f"tp-{model_type}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    return build(_cached_checkpoint(name, config), up_to=Stage.PATTERN_MATCHER).graph_module


def _layer(plan, prefix: str) -> set:
    """(kind, tensor under ``prefix``, blocks, dim) of the decisions on layer 0's tensors."""
    return {(type(d).__name__, d.weight.split(prefix)[1], getattr(d, "blocks", ()), getattr(d, "dim", 0))
            for d in plan.decisions if prefix in getattr(d, "weight", "")}


def _read_outside(gm, node) -> None:
    """A reader of ``node`` outside its layer (a graph output): the near miss every planner refuses."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(aten.sum.default, (node,))
    output.args = ((output.args[0][0] if isinstance(output.args[0], tuple) else output.args[0], extra),)


def test_a_mamba2_layer_with_one_group_splits_its_heads_and_averages_its_norm_over_ranks():
    """Bamba (8 heads of 16, one group of 16 states, a gated norm over all 128 features): rank 1 of 2
    takes its halves of z, x and dt in ``in_proj`` and of x in the conv, B and C whole (the one group
    on both ranks), its heads of ``A_log``, ``D``, ``dt_bias``, its half of the norm weight, whose mean
    of squares becomes the ranks' means averaged (an all-reduce and a division after the mean)."""
    gm = _graph("bamba")
    plan = detect(gm, world_size=2, rank=1)
    mine, group = (128, 2, 1), (16, 1, 0)
    assert _layer(plan, "layers.0.mamba.") == {
        ("ColumnShard", "in_proj.weight", (mine, mine, group, group, (8, 2, 1)), 0),
        ("ColumnShard", "conv1d.weight", (mine, group, group), 0),
        ("HeadWeightShard", "A_log", (), 0), ("HeadWeightShard", "D", (), 0), ("HeadWeightShard", "dt_bias", (), 0),
        ("HeadWeightShard", "norm.weight", (), 0), ("RowShard", "out_proj.weight", (), 0)}
    assert sum(isinstance(d, FeatureMeanShard) for d in plan.decisions) == 2  # one per Mamba2 layer
    assert plan.arg_fixes["split_with_sizes"] == {1: [64, 96, 4]}  # z, x | B | C, dt
    assert plan.arg_fixes["split_with_sizes_1"] == {1: [64, 16, 16]}
    nodes = {n.name: n for n in gm.graph.nodes}
    views = {name: fixes for name, fixes in plan.layout_fixes.items() if name in ("view", "view_1", "view_3")}
    assert views == {"view": {2: 2}, "view_3": {3: 2}}  # x's 8 heads; the norm's one group of 128 features
    assert list(nodes["view_1"].args[1])[2:] == [1, 16]  # B: the one group, not divided
    shards = execute(gm, plan)
    layer = "model.layers.0.mamba."
    assert {n: tuple(gm.get_parameter(layer + n).shape) for n in ("in_proj.weight", "conv1d.weight", "A_log",
                                                                 "norm.weight", "out_proj.weight")} == {
        "in_proj.weight": (164, 64), "conv1d.weight": (96, 1, 4), "A_log": (4,), "norm.weight": (64,),
        "out_proj.weight": (64, 64)}
    assert shards[layer + "in_proj.weight"].blocks[2] == group
    mean = next(n for n in gm.graph.nodes if n.target == aten.mean.dim)
    (reduced,) = mean.users
    assert reduced.target == ad.torch_dist_all_reduce.default
    assert [u.target for u in reduced.users] == [aten.div.Scalar]


def test_mamba2_groups_split_with_their_heads_and_a_norm_over_straddled_groups_stays_whole():
    """Mamba2 with two groups at two ranks: each rank its group of B and C and its group of the norm
    (no all-reduce in the norm, the view's group count halved). At four ranks two ranks would share
    each norm group: the layer stays whole on every rank, with that reason."""
    gm = _graph("mamba2", n_groups=2)
    plan = detect(gm, world_size=2, rank=1)
    mine, group = (128, 2, 1), (32, 2, 1)
    decisions = _layer(plan, "layers.0.mixer.")
    assert ("ColumnShard", "in_proj.weight", (mine, mine, group, group, (8, 2, 1)), 0) in decisions
    assert ("ColumnShard", "conv1d.weight", (mine, group, group), 0) in decisions
    assert not any(isinstance(d, FeatureMeanShard) for d in plan.decisions)
    nodes = {n.name: n for n in gm.graph.nodes}
    groups_view = next(n for n in gm.graph.nodes if n.target == aten.pow.Tensor_Scalar).args[0]
    assert list(nodes[groups_view.name].args[1])[2:] == [2, 64] and plan.layout_fixes[groups_view.name] == {2: 2}
    plan4 = detect(_graph("mamba2", n_groups=2), world_size=4, rank=1)
    assert _layer(plan4, "layers.0.mixer.") == set()
    assert set(plan4.whole_layers.values()) == {"its gated norm's 2 groups would straddle ranks at world size 4"}


def test_falcon_h1s_mup_vector_splits_with_the_in_projections_blocks():
    """Falcon-H1 scales ``in_proj``'s output by a built ``[1, 1, features]`` buffer: it is cut by the
    same five blocks along its last dim (the loader takes the slice of the built value too: the slow
    two-rank test runs it)."""
    gm = _graph("falcon_h1")
    plan = detect(gm, world_size=2, rank=0)
    mine, group = (128, 2, 0), (16, 1, 0)
    blocks = (mine, mine, group, group, (8, 2, 0))
    decisions = _layer(plan, "layers.0.mamba.")
    assert {("ColumnShard", "in_proj.weight", blocks, 0), ("HeadWeightShard", "mup_vector", blocks, -1)} <= decisions
    execute(gm, plan)
    assert tuple(gm.get_buffer("model.layers.0.mamba.mup_vector").shape) == (1, 1, 164)  # 64 + 64 + 16 + 16 + 4


def test_a_mamba_layer_splits_by_channels_with_x_proj_summed_over_ranks():
    """Mamba (128 channels): rank 1 of 2 takes its channels of both ``in_proj`` blocks, the conv,
    ``dt_proj``'s rows and bias, ``A_log`` and ``D``; ``x_proj`` and ``out_proj`` by columns (two
    all-reduces: dt, B and C whole on each rank). Near miss: another reader of the conv's output."""
    gm = _graph("mamba")
    plan = detect(gm, world_size=2, rank=1)
    assert _layer(plan, "layers.0.mixer.") == {
        ("ColumnShard", "in_proj.weight", ((128, 2, 1),) * 2, 0), ("ColumnShard", "conv1d.weight", (), 0),
        ("RowShard", "x_proj.weight", (), 0), ("HeadWeightShard", "dt_proj.weight", (), 0),
        ("HeadWeightShard", "dt_proj.bias", (), 0), ("HeadWeightShard", "A_log", (), 0),
        ("HeadWeightShard", "D", (), 0), ("RowShard", "out_proj.weight", (), 0)}
    execute(gm, plan)
    layer = "backbone.layers.0.mixer."
    assert {n: tuple(gm.get_parameter(layer + n).shape) for n in ("in_proj.weight", "x_proj.weight", "dt_proj.weight",
                                                                 "A_log")} == {
        "in_proj.weight": (128, 64), "x_proj.weight": (40, 64), "dt_proj.weight": (64, 8), "A_log": (64, 16)}
    assert count_op(gm, ad.torch_dist_all_reduce) >= 4  # x_proj and out_proj of both layers
    gm = _graph("mamba")
    _read_outside(gm, next(n for n in gm.graph.nodes if n.target == ad.torch_causal_conv1d.default))
    plan = detect(gm, world_size=2, rank=1)
    assert _layer(plan, "layers.0.mixer.") == set() and plan.whole_layers["torch_ssm_mamba1"] == LAYOUT


def test_lfm2s_short_convolution_splits_by_channels():
    """LFM2 (64 channels): ``in_proj`` by its three blocks (B, C, x), the conv by channels,
    ``out_proj`` by columns. Near miss: a part of ``in_proj`` also read outside the layer."""
    gm = _graph("lfm2")
    plan = detect(gm, world_size=2, rank=1)
    assert _layer(plan, "layers.0.conv.") == {("ColumnShard", "in_proj.weight", ((64, 2, 1),) * 3, 0),
                                              ("ColumnShard", "conv.weight", (), 0),
                                              ("RowShard", "out_proj.weight", (), 0)}
    gm = _graph("lfm2")
    chunk = next(n for n in gm.graph.nodes if n.target == aten.chunk.default)
    _read_outside(gm, next(u for u in chunk.users if u.args[1] == 1))
    assert _layer(detect(gm, world_size=2, rank=1), "layers.0.conv.") == set()


def test_olmo_hybrids_gated_deltanet_splits_its_separate_projections_by_heads():
    """OLMo-Hybrid feeds the convolution ``cat([q, k, v])`` of three projections and cuts its output to
    the last positions (transposes and a slice of the positions) before the split: q, k and v split by
    their own heads, the conv by the three blocks. Near miss: the projections concatenated in an order
    whose widths are not the split's blocks (``[v | q | k]`` cut ``[32, 32, 64]``: a block across two
    projections)."""
    gm = _graph("olmo_hybrid")
    plan = detect(gm, world_size=2, rank=1)
    blocks = ((32, 2, 1), (32, 2, 1), (64, 2, 1))
    assert _layer(plan, "layers.0.linear_attn.") == {
        ("ColumnShard", "q_proj.weight", (), 0), ("ColumnShard", "k_proj.weight", (), 0),
        ("ColumnShard", "v_proj.weight", (), 0), ("ColumnShard", "conv1d.weight", blocks, 0),
        ("ColumnShard", "a_proj.weight", (), 0), ("ColumnShard", "b_proj.weight", (), 0),
        ("ColumnShard", "g_proj.weight", (), 0), ("HeadWeightShard", "A_log", (), 0),
        ("HeadWeightShard", "dt_bias", (), 0), ("RowShard", "o_proj.weight", (), 0)}
    assert plan.whole_layers == {}
    gm = _graph("olmo_hybrid")
    cat = next(n for n in gm.graph.nodes if n.target == aten.cat.default and len(n.args[0]) == 3)
    q, k, v = cat.args[0]
    cat.args = ([v, q, k], *cat.args[1:])
    plan = detect(gm, world_size=2, rank=1)
    assert plan.whole_layers["torch_gated_delta_rule"] == LAYOUT
    assert _layer(plan, "layers.0.linear_attn.") == set()


def test_kimis_channelwise_gated_deltanet_splits_its_per_channel_gate_by_heads():
    """Kimi-Linear's KDA: the decay is per key channel (``[b, s, heads, d]``, from a low-rank
    ``f_b_proj(f_a_proj(x))`` plus a flat ``dt_bias`` viewed by heads, times ``-exp(A_log)`` stored
    ``[1, 1, heads, 1]``), the output gate a sigmoid: ``f_b_proj``, ``g_b_proj`` and ``b_proj`` by
    heads (their low-rank inputs whole), ``dt_bias`` along dim 0 and ``A_log`` along its heads dim 2.
    Near miss: the decay's pre-activation also read outside the layer."""
    gm = _graph("kimi_linear")
    plan = detect(gm, world_size=2, rank=1)
    blocks = ((64, 2, 1),) * 3
    assert _layer(plan, "layers.0.self_attn.") == {
        ("ColumnShard", "q_proj.weight", (), 0), ("ColumnShard", "k_proj.weight", (), 0),
        ("ColumnShard", "v_proj.weight", (), 0), ("ColumnShard", "conv1d.weight", blocks, 0),
        ("ColumnShard", "f_b_proj.weight", (), 0), ("ColumnShard", "g_b_proj.weight", (), 0),
        ("ColumnShard", "b_proj.weight", (), 0), ("HeadWeightShard", "dt_bias", (), 0),
        ("HeadWeightShard", "A_log", (), 2), ("RowShard", "o_proj.weight", (), 0)}
    execute(gm, plan)
    assert tuple(gm.get_parameter("model.layers.0.self_attn.A_log").shape) == (1, 1, 2, 1)
    gm = _graph("kimi_linear")
    rule = next(n for n in gm.graph.nodes if n.target == ad.torch_gated_delta_rule_channelwise.default)
    _read_outside(gm, next(n for n in rule.args[3].all_input_nodes if n.target == aten.where.self))
    plan = detect(gm, world_size=2, rank=1)
    assert plan.whole_layers[rule.name] == LAYOUT


def test_minimaxs_linear_attention_splits_like_attention_with_its_decay_sliced():
    """MiniMax's linear attention (``torch_linear_attention``) goes through the attention planner:
    ``qkv_proj`` laid out head by head (``silu``, a ``[heads, 3d]`` view split per head) by heads, the
    norm over all heads' features as ``torch_dist_rmsnorm``, the sigmoid output gate by columns,
    ``out_proj`` by rows, and the per-head decay (computed from the stored slopes) sliced to the
    rank's heads before the op."""
    from autodeploy.transform.library._sharding import HeadSlice

    gm = _graph("minimax")
    plan = detect(gm, world_size=2, rank=1)
    assert plan.whole_layers == {}
    assert _layer(plan, "layers.1.self_attn.") == {
        ("ColumnShard", "qkv_proj.weight", (), 0), ("ColumnShard", "output_gate.weight", (), 0),
        ("NormShard", "norm.weight", (), 0), ("RowShard", "out_proj.weight", (), 0)}
    assert [(d.index, d.name, d.dim) for d in plan.decisions if isinstance(d, HeadSlice)] == [(3, "g", 2)]
    assert plan.layout_fixes == {"reshape_3": {2: 2}, "reshape_5": {2: 2}}  # [b, s, 4, 48] and [b, s, 64]
    execute(gm, plan)
    op = next(n for n in gm.graph.nodes if n.target == ad.torch_linear_attention.default)
    assert op.args[3].target == aten.slice.Tensor and op.args[3].args[1:] == (2, 2, 4)


class _Mamba2(nn.Module):
    """A Mamba2 mixer as HF writes it (``in_proj`` cut into z, xBC, dt; the conv; the scan; the gated
    norm over each group), 32 wide: 4 heads of 8 in 2 groups of 4 states."""

    def __init__(self, heads: int = 4, head_dim: int = 8, groups: int = 2, state: int = 4, norm: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shape, self.use_norm = (heads, head_dim, groups, state), norm
        width, conv = heads * head_dim, heads * head_dim + 2 * groups * state
        self.in_proj = nn.Linear(32, width + conv + heads, bias=False)
        self.conv = nn.Parameter(torch.randn(conv, 1, 3) * 0.5)
        self.conv_bias = nn.Parameter(torch.randn(conv) * 0.1)
        self.A_log = nn.Parameter(torch.randn(heads) * 0.3)
        self.D = nn.Parameter(torch.randn(heads))
        self.dt_bias = nn.Parameter(torch.randn(heads) * 0.3)
        self.norm = nn.Parameter(1 + 0.2 * torch.randn(width))
        self.out_proj = nn.Linear(width, 32, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        (b, s, _), (heads, head_dim, groups, state) = h.shape, self.shape
        width, gn = heads * head_dim, groups * state
        z, xbc, dt = torch.split(self.in_proj(h), [width, width + 2 * gn, heads], dim=-1)
        xbc = ad.torch_causal_conv1d(xbc, self.conv.squeeze(1), self.conv_bias, "silu")
        x, B, C = torch.split(xbc, [width, gn, gn], dim=-1)
        y = ad.torch_ssm(x.view(b, s, heads, head_dim), dt, -torch.exp(self.A_log), B.view(b, s, groups, state),
                         C.view(b, s, groups, state), self.D, self.dt_bias)
        g = y.reshape(b, s, -1) * F.silu(z)
        if self.use_norm:
            g = g.view(b, s, groups, width // groups)
            g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)).view(b, s, width) * self.norm
        return self.out_proj(g)


class _ShortConv(nn.Module):
    """LFM2's gated short convolution, 16 channels (``outside``: the near miss multiplying by the
    layer's input instead of a part of ``in_proj``)."""

    def __init__(self, outside: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.outside = outside
        self.in_proj = nn.Linear(32, 48, bias=False)
        self.conv = nn.Parameter(torch.randn(16, 1, 3) * 0.5)
        self.out_proj = nn.Linear(16, 32, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj(h).transpose(-1, -2).chunk(3, dim=-2)
        gated = (b * (h[..., :16].transpose(-1, -2) if self.outside else x)).transpose(1, 2)
        y = ad.torch_causal_conv1d(gated, self.conv.squeeze(1)).transpose(1, 2)
        return self.out_proj((c * y).transpose(-1, -2))


@pytest.mark.parametrize("world", [2, 4], ids=["a group a rank, norm per group", "a group on two ranks"])
def test_a_mamba2_layers_ranks_add_up_to_the_layer(world):
    """Each rank's graph loaded with its slices (two groups: at 2 ranks one each with its group of the
    norm; at 4 ranks, without a norm, two ranks share each group's B and C): their outputs sum to the
    layer's at two shapes."""
    module = _Mamba2(norm=world == 2)
    gm = export_gm(module, torch.randn(2, 5, 32))
    plan = detect(gm, world_size=world, rank=world - 1, lm_head=False, embedding=False)
    assert sum(isinstance(d, ColumnShard) for d in plan.decisions) == 2 and not plan.whole_layers
    for shape in ((2, 5, 32), (1, 9, 32)):
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(_sum_over_ranks(module, world, x), module(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("outside", [False, True], ids=["short conv", "product with the layer input"])
def test_a_short_convolutions_ranks_add_up_to_the_layer(outside):
    module = _ShortConv(outside)
    gm = export_gm(module, torch.randn(2, 5, 32))
    plan = detect(gm, world_size=2, rank=1, lm_head=False, embedding=False)
    split = {d.weight for d in plan.decisions if isinstance(d, (ColumnShard, RowShard))}
    assert split == (set() if outside else {"in_proj.weight", "conv", "out_proj.weight"})
    if outside:
        return
    for shape in ((2, 5, 32), (1, 9, 32)):
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(_sum_over_ranks(module, 2, x), module(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # ~30 s each on 2 cores: both ranks build the engine
@pytest.mark.distributed
@pytest.mark.parametrize("model_type", ["bamba", "falcon_h1", "mamba", "jamba", "lfm2", "olmo_hybrid", "kimi_linear",
                                        "minimax"])
def test_two_ranks_of_each_state_layout_give_hfs_tokens_and_logprobs(model_type):
    """Bamba: Mamba2, one group, its norm averaged over ranks; Falcon-H1: ``mup_vector`` cut by blocks;
    Mamba: ``x_proj`` all-reduced; Jamba: Mamba with norms on dt, B and C, beside attention and MoE;
    LFM2: the gated short convolution; OLMo-Hybrid: Gated DeltaNet from separate q, k, v projections;
    Kimi-Linear: the per-channel decay; MiniMax: linear attention, its decay sliced per rank.
    Every state layer split (none whole), tokens and log-probabilities equal HF eager's."""
    assert_two_ranks_match_hf(model_type)
