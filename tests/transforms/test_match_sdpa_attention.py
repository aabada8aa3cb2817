"""match_sdpa_attention: F.scaled_dot_product_attention (bnsd, HF's sdpa route) -> torch_attention (bsnd)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim
from transformers import masking_utils as mu

from helpers import Nested, apply_transform, assert_same_outputs, attention_sources, count_op, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten

HIDDEN = 32


class SdpaBlock(nn.Module):
    """HF-style: project, view to heads, transpose to bnsd, SDPA, transpose back, reshape, project."""

    def __init__(self, n=4, n_kv=4, d=8, mask="none", window=None, scale=None, dropout_p=0.0):
        super().__init__()
        self.n, self.n_kv, self.d = n, n_kv, d
        self.q_proj = nn.Linear(HIDDEN, n * d)
        self.k_proj = nn.Linear(HIDDEN, n_kv * d)
        self.v_proj = nn.Linear(HIDDEN, n_kv * d)
        self.o_proj = nn.Linear(n * d, HIDDEN)
        self.mask, self.window, self.scale, self.dropout_p = mask, window, scale, dropout_p

    def forward(self, x, attn_mask=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.d).transpose(1, 2)
        is_causal = False
        if self.mask == "is_causal":
            is_causal = True
        elif self.mask == "causal_op":
            attn_mask = ad.torch_causal_mask(b, s, s, self.window, torch.bool, x.device)
        elif self.mask in ("hf_ones_padding", "hf_input_padding"):
            # BioGPT: HF's index-built causal & padding mask, the padding the model's own ones
            # (or, the near miss, a real padding mask from the caller)
            pad = torch.ones(b, s, device=x.device) if self.mask == "hf_ones_padding" else attn_mask
            attn_mask = mu.sdpa_mask(b, s, s, mask_function=mu.causal_mask_function, attention_mask=pad.bool(),
                                     allow_is_causal_skip=False, device=x.device)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout_p, is_causal=is_causal, scale=self.scale,
            enable_gqa=self.n != self.n_kv,
        )
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


def _run(module, *args, dynamic=None):
    gm = export_gm(module.eval(), *args, dynamic=dynamic)
    reference = copy.deepcopy(gm)
    n_transpose = count_op(gm, aten.transpose)
    gm, record = apply_transform("match_sdpa_attention", gm)
    return reference, gm, record, n_transpose


def _attn_node(gm):
    nodes = [n for n in gm.graph.nodes if n.target == ad.torch_attention.default]
    assert len(nodes) == 1
    node = nodes[0]
    names = ["q", "k", "v", "attn_mask", "dropout_p", "is_causal", "scale", "sinks", "sliding_window", "logit_cap"]
    params = dict(zip(names, [None, None, None, None, 0.0, False, None, None, None, None]))
    params.update(zip(names, node.args))
    params.update(node.kwargs)
    return node, params


def _assert_matched(gm, record, n_transpose_before):
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_attention) == 1
    assert count_op(gm, aten.scaled_dot_product_attention) == 0
    # q, k, v transposes to bnsd and the output transpose back cancel: all four are gone
    assert n_transpose_before == 4
    assert count_op(gm, aten.transpose) == 0


def _xs(*shapes):
    return [(torch.randn(*shape, HIDDEN),) for shape in shapes]


def test_is_causal():
    ref, gm, record, n_t = _run(SdpaBlock(mask="is_causal"), torch.randn(2, 6, HIDDEN))
    _assert_matched(gm, record, n_t)
    _, p = _attn_node(gm)
    assert p["is_causal"] is True
    assert p["attn_mask"] is None and p["sliding_window"] is None
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 9), (1, 2)))


def test_the_attention_keeps_the_module_it_came_from():
    """The new nodes take the SDPA node's ``nn_module_stack``: cached attention names the layer in
    its errors and finds an FP8 checkpoint's per-layer KV-cache scales by it."""
    ref, gm, record, n_t = _run(Nested(SdpaBlock(mask="is_causal")), torch.randn(2, 6, HIDDEN))
    _assert_matched(gm, record, n_t)
    assert attention_sources(gm) == [("layers.0", "SdpaBlock")]
    assert_same_outputs(ref, gm, _xs((2, 6), (1, 3)))


@pytest.mark.parametrize("window", [None, 3])
def test_causal_mask_op_becomes_is_causal_and_window(window):
    ref, gm, record, n_t = _run(SdpaBlock(mask="causal_op", window=window), torch.randn(2, 6, HIDDEN))
    _assert_matched(gm, record, n_t)
    _, p = _attn_node(gm)
    assert p["is_causal"] is True
    assert p["sliding_window"] == window
    assert p["attn_mask"] is None
    assert count_op(gm, ad.torch_causal_mask) == 0  # the explicit mask is dropped
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 9), (1, 5)))


def test_hf_index_mask_over_ones_padding_is_causal():
    ref, gm, record, n_t = _run(SdpaBlock(mask="hf_ones_padding"), torch.randn(2, 6, HIDDEN))
    _assert_matched(gm, record, n_t)
    _, p = _attn_node(gm)
    assert p["is_causal"] is True and p["attn_mask"] is None and p["sliding_window"] is None
    assert count_op(gm, aten.index) == 0  # the mask subgraph is gone
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 9)))


def test_hf_index_mask_over_real_padding_stays_explicit():
    b, s = Dim("b"), Dim("s", min=2)
    x, pad = torch.randn(2, 6, HIDDEN), torch.ones(2, 6)
    ref, gm, record, n_t = _run(SdpaBlock(mask="hf_input_padding"), x, pad, dynamic=[{0: b, 1: s}, {0: b, 1: s}])
    _assert_matched(gm, record, n_t)
    _, p = _attn_node(gm)
    assert p["is_causal"] is False and isinstance(p["attn_mask"], torch.fx.Node)
    pads = [torch.ones(2, 6), torch.tensor([[1.0] * 4 + [0.0] * 2] * 2)]  # right padding: no empty row
    assert_same_outputs(ref, gm, [(torch.randn(2, 6, HIDDEN), pad) for pad in pads])


def test_explicit_float_mask_stays_explicit():
    b, s = Dim("b"), Dim("s", min=2)
    x, mask = torch.randn(2, 6, HIDDEN), torch.randn(2, 1, 6, 6)
    ref, gm, record, n_t = _run(SdpaBlock(), x, mask, dynamic=[{0: b, 1: s}, {0: b, 2: s, 3: s}])
    _assert_matched(gm, record, n_t)
    node, p = _attn_node(gm)
    assert p["is_causal"] is False and p["sliding_window"] is None
    assert isinstance(p["attn_mask"], torch.fx.Node) and p["attn_mask"].op == "placeholder"
    assert_same_outputs(ref, gm, [(torch.randn(2, 6, HIDDEN), torch.randn(2, 1, 6, 6)),
                                  (torch.randn(3, 4, HIDDEN), torch.randn(3, 1, 4, 4))])


def test_gqa_with_enable_gqa():
    ref, gm, record, n_t = _run(SdpaBlock(n=4, n_kv=2, mask="causal_op"), torch.randn(2, 6, HIDDEN))
    _assert_matched(gm, record, n_t)
    node, p = _attn_node(gm)
    assert p["k"].meta["val"].shape[2] == 2 and p["v"].meta["val"].shape[2] == 2  # k/v stay unexpanded
    assert p["q"].meta["val"].shape[2] == 4
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 7)))


def test_custom_scale():
    ref, gm, record, n_t = _run(SdpaBlock(mask="is_causal", scale=0.05), torch.randn(2, 6, HIDDEN))
    _assert_matched(gm, record, n_t)
    _, p = _attn_node(gm)
    assert p["scale"] == pytest.approx(0.05)
    assert_same_outputs(ref, gm, _xs((2, 6), (1, 8)))


def test_dropout_is_left_alone():
    module = SdpaBlock(mask="causal_op", dropout_p=0.5)
    ref, gm, record, n_t = _run(module, torch.randn(2, 6, HIDDEN))
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_attention) == 0
    (sdpa,) = [n for n in gm.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    dropout_p = sdpa.args[4] if len(sdpa.args) > 4 else sdpa.kwargs.get("dropout_p")
    assert dropout_p == 0.5  # the export kept the dropout, and the matcher respected it
    assert count_op(gm, aten.transpose) == n_t
    for shape in ((2, 6), (3, 4)):
        x = torch.randn(*shape, HIDDEN)
        torch.manual_seed(1)
        expected = ref(x)
        torch.manual_seed(1)
        got = gm(x)
        torch.testing.assert_close(got, expected)


class CrossLengthCausal(nn.Module):
    """is_causal=True with more keys than queries: SDPA aligns the causal mask top-left."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _assert_sdpa_left_alone(ref, gm, record):
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_attention) == 0
    assert count_op(gm, aten.scaled_dot_product_attention) == 1
    assert gm.code == ref.code


def test_is_causal_with_different_query_and_key_lengths_is_left_alone():
    """torch_attention's causal mask is bottom-right aligned (the cached-decode convention), SDPA's
    top-left; with query and key lengths that may differ the op cannot express SDPA's mask, so the
    node must stay SDPA."""
    b, s_q, s_kv = Dim("b"), Dim("s_q", min=2), Dim("s_kv", min=2)
    q, k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    ref, gm, record, _ = _run(CrossLengthCausal(), q, k, v,
                              dynamic=[{0: b, 2: s_q}, {0: b, 2: s_kv}, {0: b, 2: s_kv}])
    _assert_sdpa_left_alone(ref, gm, record)
    inputs = [(q, k, v), (torch.randn(1, 2, 2, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8))]
    assert_same_outputs(ref, gm, inputs)
    # the near miss is real: the canonical op's causal attention differs on these inputs
    with torch.no_grad():
        bsnd = [t.transpose(1, 2) for t in inputs[0]]
        ours = ad.torch_attention(*bsnd, None, 0.0, True, None, None, None, None).transpose(1, 2)
    assert not torch.allclose(ours, gm(*inputs[0]), atol=1e-3)


class HeadlessSdpa(nn.Module):
    """SDPA on 3-D [b, s, d] tensors (allowed by SDPA: no head dim)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(HIDDEN, 16), nn.Linear(HIDDEN, 16), nn.Linear(HIDDEN, 16)

    def forward(self, x):
        return F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x), is_causal=True)


def test_rank3_sdpa_is_left_alone():
    """torch_attention takes [b, s, heads, d]; the matcher rewrites only 4-D q/k/v (its documented
    contract), so a headless 3-D SDPA keeps its node."""
    ref, gm, record, _ = _run(HeadlessSdpa(), torch.randn(2, 6, HIDDEN))
    _assert_sdpa_left_alone(ref, gm, record)
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 4)))
