"""match_repeat_kv: the GQA k/v expansion in front of torch_attention is dropped (the op is GQA-native)."""

import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager
from transformers.models.llama.modeling_llama import repeat_kv

from autodeploy.transform.graph_utils import run_shape_prop
from helpers import apply_transform, assert_same_outputs, count_op, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten

HIDDEN = 32
N, N_KV, D = 6, 2, 8
REP = N // N_KV


def _tile_bnsd(x, r):
    """``repeat`` (tiling) order on a bnsd tensor: head h of the result is kv head h % n_kv."""
    b, n_kv, s, d = x.shape
    return x[:, None].expand(b, r, n_kv, s, d).reshape(b, r * n_kv, s, d)


def _interleave_bsnd(x, r):
    """``repeat_interleave`` order on a bsnd tensor (unsqueeze right after the head dim)."""
    b, s, n_kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, n_kv, r, d).reshape(b, s, n_kv * r, d)


class Attn(nn.Module):
    """Projections, k/v expanded to all heads, then the canonical op in bsnd."""

    def __init__(self, k_mode="repeat_kv", v_mode="repeat_kv"):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, N * D)
        self.k_proj = nn.Linear(HIDDEN, N_KV * D)
        self.v_proj = nn.Linear(HIDDEN, (N if v_mode == "full" else N_KV) * D)
        self.o_proj = nn.Linear(N * D, HIDDEN)
        self.k_mode, self.v_mode = k_mode, v_mode

    def _expand(self, x, mode, b, s):
        if mode == "full":  # already one head per query head: nothing to expand
            return x.view(b, s, N, D)
        if mode == "bsnd":
            return _interleave_bsnd(x.view(b, s, N_KV, D), REP)
        bnsd = x.view(b, s, N_KV, D).transpose(1, 2)
        expanded = repeat_kv(bnsd, REP) if mode == "repeat_kv" else _tile_bnsd(bnsd, REP)
        return expanded.transpose(1, 2)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, N, D)
        k = self._expand(self.k_proj(x), self.k_mode, b, s)
        v = self._expand(self.v_proj(x), self.v_mode, b, s)
        o = ad.torch_attention(q, k, v, None, 0.0, True, None)
        return self.o_proj(o.reshape(b, s, N * D))


def _run(module, key="match_repeat_kv", gm=None):
    x = torch.randn(2, 6, HIDDEN)
    gm = export_gm(module.eval(), x) if gm is None else gm
    reference = copy.deepcopy(gm)
    n_expand = count_op(gm, aten.expand)
    gm, record = apply_transform(key, gm)
    return reference, gm, record, n_expand


def _kv_heads(gm):
    run_shape_prop(gm)
    (node,) = [n for n in gm.graph.nodes if n.target == ad.torch_attention.default]
    return node.args[0].meta["val"].shape[2], node.args[1].meta["val"].shape[2], node.args[2].meta["val"].shape[2]


def _xs(*shapes):
    return [(torch.randn(*shape, HIDDEN),) for shape in shapes]


@pytest.mark.parametrize("mode", ["repeat_kv", "bsnd"])
def test_expansion_removed(mode):
    reference, gm, record, n_expand = _run(Attn(mode, mode))
    assert n_expand == 2
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_attention) == 1
    assert count_op(gm, aten.expand) == 0
    assert count_op(gm, aten.unsqueeze) == 0
    assert _kv_heads(gm) == (N, N_KV, N_KV)
    assert_same_outputs(reference, gm, _xs((2, 6), (3, 9), (1, 1)))


def test_after_eager_matcher_on_hf_gqa():
    """HF's eager GQA: match_eager_attention leaves repeat_kv, match_repeat_kv removes it."""

    class HFEager(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_key_value_groups, self.training = REP, False
            self.q_proj, self.k_proj = nn.Linear(HIDDEN, N * D), nn.Linear(HIDDEN, N_KV * D)
            self.v_proj, self.o_proj = nn.Linear(HIDDEN, N_KV * D), nn.Linear(N * D, HIDDEN)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, N, D).transpose(1, 2)
            k = self.k_proj(x).view(b, s, N_KV, D).transpose(1, 2)
            v = self.v_proj(x).view(b, s, N_KV, D).transpose(1, 2)
            mask = ad.torch_causal_mask(b, s, s, None, x.dtype, x.device)
            o, _ = llama_eager(self, q, k, v, mask, D ** -0.5)
            return self.o_proj(o.reshape(b, s, -1))

    gm = export_gm(HFEager().eval(), torch.randn(2, 6, HIDDEN))
    original = copy.deepcopy(gm)
    gm, eager_record = apply_transform("match_eager_attention", gm)
    assert eager_record.num_matches == 1
    _, gm, record, n_expand = _run(None, gm=gm)
    assert n_expand == 2
    assert record.num_matches == 1
    assert count_op(gm, aten.expand) == 0
    assert _kv_heads(gm) == (N, N_KV, N_KV)
    assert_same_outputs(original, gm, _xs((2, 6), (3, 4)))


@pytest.mark.parametrize("k_mode,v_mode", [("tile", "tile"), ("repeat_kv", "full"), ("repeat_kv", "tile")])
def test_near_misses_are_left_alone(k_mode, v_mode):
    reference, gm, record, n_expand = _run(Attn(k_mode, v_mode))
    assert record.num_matches == 0
    assert count_op(gm, aten.expand) == n_expand > 0
    assert _kv_heads(gm)[1] == N
    assert_same_outputs(reference, gm, _xs((2, 6), (3, 4)))


def test_tiling_is_really_a_different_head_assignment():
    """Guard for the near miss above: dropping a tiling expansion would change the result."""
    torch.manual_seed(0)
    tiled, interleaved = Attn("tile", "tile").eval(), Attn("repeat_kv", "repeat_kv").eval()
    interleaved.load_state_dict(tiled.state_dict())
    x = torch.randn(2, 5, HIDDEN)
    with torch.no_grad():
        assert not torch.allclose(tiled(x), interleaved(x), atol=1e-4)
