"""optimize_rope (post_load_fusion): cos/sin tables computed once, RoPE in bsnd layout.

The tiny llama is built twice through cache_init (the stages after post_load_fusion do not
touch RoPE), with and without the transform: structure of the RoPE ops, the tables, and the
cached graph's logits on a prefill and a decode step. Small hand-written graphs cover the
near misses (tables that depend on another input, outputs used in bnsd layout).
"""

import copy
import random

import pytest
import torch
from torch import nn
from torch.export import Dim

from autodeploy.cache import build_sequence_info
from autodeploy.transform.graph_utils import arg
from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_same_outputs, build, count_op, export_gm, family_checkpoint, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
ROPE = ad.torch_rope_with_explicit_cos_sin
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
HEAD_DIM = 16
NUM_LAYERS = 2


def _build(enabled: bool):
    return build(family_checkpoint("llama"), up_to=Stage.CACHE_INIT,
                 overrides={"resize_kv_cache": {"enabled": False}, "optimize_rope": {"enabled": enabled},
                            # the RoPE node this test looks at stays in front of the cached attention
                            "fuse_rope_into_trtllm_attention": {"enabled": False}}, **LIMITS)


@pytest.fixture(scope="module")
def with_opt():
    return _build(True)


@pytest.fixture(scope="module")
def without_opt():
    return _build(False)


def _rope_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == ROPE.default]


def _udim(node):
    return arg(node, 4, "unsqueeze_dim", 1)  # export drops the default


def test_record_and_structure(with_opt, without_opt):
    record = next(r for r in with_opt.context.history if r.key == "optimize_rope")
    # one shared (cos, sin) pair turned into tables + one layout change per layer
    assert record.status == "ok" and record.num_matches == 1 + NUM_LAYERS
    gm, base = with_opt.graph, without_opt.graph
    # the reference graph really has what the transform removes
    assert [_udim(n) for n in _rope_nodes(base)] == [1] * NUM_LAYERS
    assert count_op(base, [aten.cos, aten.sin]) == 2
    assert count_op(base, aten.transpose) >= 4 * NUM_LAYERS
    # with it: bsnd RoPE, no trig, no transposes
    ropes = _rope_nodes(gm)
    assert len(ropes) == NUM_LAYERS
    assert [_udim(n) for n in ropes] == [2] * NUM_LAYERS
    assert count_op(gm, [aten.cos, aten.sin]) == 0
    assert count_op(gm, aten.transpose) == 0
    # cos/sin are lookups of the position ids into the tables
    for node in ropes:
        for table_read, kind in zip(node.args[2:4], ("cos", "sin")):
            assert table_read.target == aten.embedding.default
            table, ids = table_read.args
            assert table.op == "get_attr" and table.target.startswith(f"rope_{kind}_table")
            assert ids.op == "placeholder" and ids.name == "position_ids"


def test_tables_are_buffers_of_max_seq_len_by_head_dim(with_opt):
    gm = with_opt.graph
    buffers = dict(gm.named_buffers())
    cos, sin = buffers["rope_cos_table_0"], buffers["rope_sin_table_0"]
    assert cos.shape == sin.shape == (LIMITS["max_seq_len"], HEAD_DIM)
    assert "rope_cos_table_0" not in gm.state_dict()  # derived data, not a checkpoint tensor
    # the values: the model's own rotary embedding (default llama RoPE, theta 10000)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.arange(LIMITS["max_seq_len"], dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    torch.testing.assert_close(cos, emb.cos(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, emb.sin(), rtol=1e-5, atol=1e-5)


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def _run_steps(res):
    """Two prefills of different lengths, then a decode of both (with a new cache per build)."""
    res.cache.allocate(res.cache.num_pages)
    free = list(range(res.cache.num_pages))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(3)], [free.pop() for _ in range(2)]]
    a, b = _ids(9, 1), _ids(5, 2)
    outs = []
    with torch.no_grad():
        for tokens, starts in (([a, b], [0, 0]), ([[7], [300]], [9, 5])):
            info = build_sequence_info(tokens, starts, tables)
            outs.append(res.graph(*res.cache.graph_args(info)).clone())
    return outs


def test_cached_graph_logits_unchanged(with_opt, without_opt):
    """The reference is the same build with the transform off; the two graphs really differ."""
    assert count_op(with_opt.graph, [aten.cos, aten.sin]) == 0 and count_op(without_opt.graph, [aten.cos, aten.sin]) == 2
    assert count_op(with_opt.graph, aten.embedding) == 1 + 2  # token embedding + the cos and sin lookups
    for got, ref in zip(_run_steps(with_opt), _run_steps(without_opt)):
        assert got.shape == ref.shape
        assert rel_rmse(got, ref) < 1e-5


# ---- small graphs -------------------------------------------------------------------------------
class Rope(nn.Module):
    """HF-style rotary embedding from ``position_ids`` (optionally scaled by another input)
    applied in bnsd layout, outputs transposed back to bsnd (or not)."""

    def __init__(self, transpose_back=True, with_param=True):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8)))
        self.gain = nn.Parameter(torch.full((8,), 1.5)) if with_param else None
        self.transpose_back = transpose_back

    def _tables(self, position_ids, scale=None):
        freqs = position_ids[..., None].float() * self.inv_freq
        if scale is not None:
            freqs = freqs * scale
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()

    def _apply(self, q, k, cos, sin):
        q2, k2 = ad.torch_rope_with_explicit_cos_sin(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
        if self.transpose_back:
            q2, k2 = q2.transpose(1, 2), k2.transpose(1, 2)
        return (q2 * self.gain, k2 * self.gain) if self.gain is not None else (q2 + 0.5, k2 + 0.5)

    def forward(self, q, k, position_ids):
        return self._apply(q, k, *self._tables(position_ids))


class ScaledRope(Rope):
    def forward(self, q, k, position_ids, scale):
        return self._apply(q, k, *self._tables(position_ids, scale))


def _qk(b, s):
    return torch.randn(b, s, 2, 8), torch.randn(b, s, 2, 8)


def _pos(b, s, offset=0):
    return (torch.arange(s)[None] + offset).expand(b, s).contiguous()


def _export(module, *extra):
    q, k = _qk(2, 6)
    dyn = [{0: Dim.DYNAMIC, 1: Dim.DYNAMIC}] * 3 + [{} for _ in extra]
    gm = export_gm(module.eval(), q, k, _pos(2, 6), *extra, dynamic=dyn)
    return gm, copy.deepcopy(gm)


def test_small_rope_positive_control():
    gm, reference = _export(Rope())
    assert count_op(reference, [aten.cos, aten.sin]) == 2
    gm, record = apply_transform("optimize_rope", gm, max_position=64)
    assert record.num_matches == 2  # tables + layout
    assert count_op(gm, [aten.cos, aten.sin]) == 0 and count_op(gm, aten.transpose) == 0
    assert [_udim(n) for n in _rope_nodes(gm)] == [2]
    assert dict(gm.named_buffers())["rope_cos_table_0"].shape == (64, 8)
    assert_same_outputs(reference, gm, [(*_qk(2, 6), _pos(2, 6)), (*_qk(3, 11), _pos(3, 11, offset=40))])


def test_tables_that_depend_on_another_input_are_left_alone():
    scale = torch.tensor(0.5)
    gm, reference = _export(ScaledRope(), scale)
    gm, record = apply_transform("optimize_rope", gm, max_position=64)
    assert record.num_matches == 1  # only the layout change
    assert count_op(gm, [aten.cos, aten.sin]) == 2  # the rotary subgraph stays
    assert not any(name.startswith("rope_") for name, _ in gm.named_buffers())
    assert count_op(gm, aten.embedding) == 0
    assert [_udim(n) for n in _rope_nodes(gm)] == [2]
    assert_same_outputs(reference, gm, [(*_qk(2, 6), _pos(2, 6), torch.tensor(0.5)),
                                        (*_qk(1, 9), _pos(1, 9, offset=3), torch.tensor(2.0))])


def test_outputs_used_in_bnsd_layout_keep_the_layout():
    gm, reference = _export(Rope(transpose_back=False))
    gm, record = apply_transform("optimize_rope", gm, max_position=64)
    assert record.num_matches == 1  # only the tables
    assert [_udim(n) for n in _rope_nodes(gm)] == [1]
    assert count_op(gm, aten.transpose) == 2
    assert count_op(gm, [aten.cos, aten.sin]) == 0
    assert_same_outputs(reference, gm, [(*_qk(2, 6), _pos(2, 6)), (*_qk(3, 4), _pos(3, 4, offset=20))])


def test_graph_without_parameters():
    """Weights may all be buffers (e.g. quantized checkpoints); the table device must not come
    from ``next(gm.parameters())``."""
    gm, reference = _export(Rope(with_param=False))
    gm, record = apply_transform("optimize_rope", gm, max_position=64)
    assert record.num_matches == 2
    assert count_op(gm, [aten.cos, aten.sin]) == 0
    assert_same_outputs(reference, gm, [(*_qk(2, 6), _pos(2, 6)), (*_qk(3, 11), _pos(3, 11, offset=40))])
