"""match_eager_attention: HF's eager attention math (Llama, Gemma-2 soft-capping) -> torch_attention."""

import copy

import pytest
import torch
from torch import nn
from torch.export import Dim
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager
from transformers.models.llama.modeling_llama import repeat_kv

from helpers import Nested, apply_transform, assert_same_outputs, attention_sources, count_op, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten

HIDDEN = 32


def _eager_softmax_dim_minus2(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Llama's eager attention, except that the softmax normalises over the queries (dim -2)."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-2, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class EagerBlock(nn.Module):
    """An HF attention layer calling the real eager_attention_forward of a model family."""

    def __init__(self, n=4, n_kv=4, d=8, mask="causal_op", window=None, softcap=None, fn=None,
                 return_probs=False, scaling=None):
        super().__init__()
        self.n, self.n_kv, self.head_dim = n, n_kv, d
        self.num_key_value_groups = n // n_kv
        self.scaling = d ** -0.5 if scaling is None else scaling
        self.q_proj = nn.Linear(HIDDEN, n * d)
        self.k_proj = nn.Linear(HIDDEN, n_kv * d)
        self.v_proj = nn.Linear(HIDDEN, n_kv * d)
        self.o_proj = nn.Linear(n * d, HIDDEN)
        self.mask, self.window, self.softcap, self.return_probs = mask, window, softcap, return_probs
        self.fn = fn or (gemma2_eager if softcap is not None else llama_eager)

    def forward(self, x, attention_mask=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if self.mask == "causal_op":
            attention_mask = ad.torch_causal_mask(b, s, s, self.window, x.dtype, x.device)
        if self.fn is gemma2_eager:
            o, probs = self.fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, softcap=self.softcap)
        else:
            o, probs = self.fn(self, q, k, v, attention_mask, self.scaling, dropout=0.0)
        out = self.o_proj(o.reshape(b, s, -1))
        return (out, probs) if self.return_probs else out


def _run(module, *args, dynamic=None):
    gm = export_gm(module.eval(), *args, dynamic=dynamic)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_eager_attention", gm)
    return reference, gm, record


def _attn_params(gm):
    nodes = [n for n in gm.graph.nodes if n.target == ad.torch_attention.default]
    assert len(nodes) == 1
    names = ["q", "k", "v", "attn_mask", "dropout_p", "is_causal", "scale", "sinks", "sliding_window", "logit_cap"]
    params = dict(zip(names, [None, None, None, None, 0.0, False, None, None, None, None]))
    params.update(zip(names, nodes[0].args))
    params.update(nodes[0].kwargs)
    return params


def _assert_eager_gone(gm, record):
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_attention) == 1
    assert count_op(gm, [aten.softmax, aten._softmax, aten.matmul, aten.bmm, aten.tanh]) == 0


def _xs(*shapes):
    return [(torch.randn(*shape, HIDDEN),) for shape in shapes]


@pytest.mark.parametrize("window,scaling", [(None, 1.0), (3, None)])
def test_llama_causal_mask_op_becomes_is_causal(window, scaling):
    """scaling=1.0: the ``* 1.0`` is cleaned away before matching, the scale must still be 1."""
    ref, gm, record = _run(EagerBlock(window=window, scaling=scaling), torch.randn(2, 6, HIDDEN))
    _assert_eager_gone(gm, record)
    p = _attn_params(gm)
    assert p["is_causal"] is True and p["sliding_window"] == window
    assert p["attn_mask"] is None
    assert count_op(gm, ad.torch_causal_mask) == 0
    assert p["scale"] == pytest.approx(8 ** -0.5 if scaling is None else scaling)
    assert p["logit_cap"] is None
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 9), (1, 4)))


def test_the_attention_keeps_the_module_it_came_from():
    """The new nodes take the replaced node's ``nn_module_stack`` (cached attention reads it)."""
    ref, gm, record = _run(Nested(EagerBlock()), torch.randn(2, 6, HIDDEN))
    _assert_eager_gone(gm, record)
    assert attention_sources(gm) == [("layers.0", "EagerBlock")]
    assert_same_outputs(ref, gm, _xs((2, 6), (1, 4)))


def test_explicit_additive_mask_stays_explicit():
    b, s = Dim("b"), Dim("s", min=2)
    x, mask = torch.randn(2, 6, HIDDEN), torch.randn(2, 1, 6, 6)
    ref, gm, record = _run(EagerBlock(mask="input"), x, mask, dynamic=[{0: b, 1: s}, {0: b, 2: s, 3: s}])
    _assert_eager_gone(gm, record)
    p = _attn_params(gm)
    assert p["is_causal"] is False and p["sliding_window"] is None
    assert isinstance(p["attn_mask"], torch.fx.Node) and p["attn_mask"].op == "placeholder"
    assert_same_outputs(ref, gm, [(torch.randn(2, 6, HIDDEN), torch.randn(2, 1, 6, 6)),
                                  (torch.randn(3, 4, HIDDEN), torch.randn(3, 1, 4, 4))])


def test_gqa_numerics():
    ref, gm, record = _run(EagerBlock(n=4, n_kv=2), torch.randn(2, 6, HIDDEN))
    _assert_eager_gone(gm, record)
    assert _attn_params(gm)["is_causal"] is True
    # the repeat_kv expansion is left for match_repeat_kv
    assert count_op(gm, aten.expand) == 2
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 5)))


def test_gemma2_softcap_becomes_logit_cap():
    module = EagerBlock(n=4, n_kv=2, softcap=0.5, window=4)
    ref, gm, record = _run(module, torch.randn(2, 6, HIDDEN))
    _assert_eager_gone(gm, record)
    p = _attn_params(gm)
    assert p["logit_cap"] == pytest.approx(0.5)
    assert p["is_causal"] is True and p["sliding_window"] == 4
    assert p["scale"] == pytest.approx(8 ** -0.5)
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 8)))


def test_softmax_over_queries_is_left_alone():
    ref, gm, record = _run(EagerBlock(fn=_eager_softmax_dim_minus2), torch.randn(2, 6, HIDDEN))
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_attention) == 0
    assert count_op(gm, aten.softmax) + count_op(gm, aten._softmax) == 1
    assert count_op(gm, aten.matmul) == 2
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 4)))


def test_returned_probabilities_keep_the_eager_math():
    ref, gm, record = _run(EagerBlock(return_probs=True), torch.randn(2, 6, HIDDEN))
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_attention) == 0
    assert count_op(gm, aten.softmax) + count_op(gm, aten._softmax) == 1
    assert count_op(gm, aten.matmul) == 2
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 4)))


def _eager_div_scale(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Older HF style: ``scores / sqrt(d)`` (scaling given as its reciprocal divisor)."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) / (1.0 / scaling)
    attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    return torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous(), attn_weights


def _eager_q_prescaled(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Scale applied to q before the product (as some models do)."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query * scaling, key_states.transpose(2, 3))
    attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous(), attn_weights


def _eager_inplace_div(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Falcon style: ``scores /= sqrt(d)`` in place."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(-1, -2))
    attn_weights /= 1.0 / scaling
    attn_weights = nn.functional.softmax(attn_weights + attention_mask, dim=-1, dtype=torch.float32)
    return torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous(), attn_weights


def _eager_inplace_div_scores_reused(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Near miss: the raw scores are read again after the in-place division."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    raw = torch.matmul(query, key_states.transpose(-1, -2))
    scaled = raw.div_(1.0 / scaling)
    attn_weights = nn.functional.softmax(scaled + attention_mask, dim=-1)
    out = torch.matmul(attn_weights, value_states) + raw.mean()
    return out.transpose(1, 2).contiguous(), attn_weights


def test_inplace_scaled_scores_read_again_keep_the_eager_math():
    ref, gm, record = _run(EagerBlock(n=4, n_kv=2, fn=_eager_inplace_div_scores_reused, scaling=0.2),
                           torch.randn(2, 6, HIDDEN))
    assert record.num_matches == 0 and count_op(gm, ad.torch_attention) == 0
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 5)))


@pytest.mark.parametrize("fn", [_eager_div_scale, _eager_q_prescaled, _eager_inplace_div])
def test_scale_variants(fn):
    ref, gm, record = _run(EagerBlock(n=4, n_kv=2, fn=fn, scaling=0.2), torch.randn(2, 6, HIDDEN))
    _assert_eager_gone(gm, record)
    p = _attn_params(gm)
    assert p["scale"] == pytest.approx(0.2)
    assert p["is_causal"] is True
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 5)))


class HeadlessAttention(nn.Module):
    """Single-head attention on 3-D [b, s, d] tensors: same math, but no head dim to swap."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(HIDDEN, 16), nn.Linear(HIDDEN, 16), nn.Linear(HIDDEN, 16)

    def forward(self, x):
        scores = torch.matmul(self.q(x), self.k(x).transpose(1, 2)) * 0.25
        return torch.matmul(torch.softmax(scores, dim=-1), self.v(x))


def test_rank3_attention_is_left_alone():
    """torch_attention takes [b, s, heads, d]; the matcher rewrites only 4-D q/k/v (its documented
    contract), so headless 3-D attention keeps its eager math."""
    ref, gm, record = _run(HeadlessAttention(), torch.randn(2, 6, HIDDEN))
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_attention) == 0
    assert count_op(gm, aten.softmax) + count_op(gm, aten._softmax) == 1
    assert count_op(gm, aten.matmul) == 2
    assert gm.code == ref.code
    assert_same_outputs(ref, gm, _xs((2, 6), (3, 4)))
