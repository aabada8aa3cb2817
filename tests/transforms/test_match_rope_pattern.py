"""match_rope_pattern: HF's RoPE functions -> one torch_rope_* node per (q, k) pair."""

import copy

import pytest
import torch
from torch import nn
from torch.export import Dim
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten
KEY = "match_rope_pattern"
ROPE_OPS = [ad.torch_rope_with_explicit_cos_sin, ad.torch_rope_with_qk_interleaving, ad.torch_rope_with_complex_freqs]
D = Dim.DYNAMIC


def tables(b, s, d, dtype=torch.float32):
    """Llama-style tables: cos/sin = cat(freqs, freqs) of [b, s, d]; freqs_cis [b, s, d/2] complex."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    positions = (torch.arange(s).float() + 3 * torch.arange(b).float()[:, None])  # [b, s], rows differ
    freqs = positions[..., None] * inv_freq                                       # [b, s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype), torch.polar(torch.ones_like(freqs), freqs)


def bnsd(b, s, nq=4, nk=2, d=16, dtype=torch.float32):
    cos, sin, _ = tables(b, s, d, dtype)
    return torch.randn(b, nq, s, d, dtype=dtype), torch.randn(b, nk, s, d, dtype=dtype), cos, sin


def bsnd(b, s, nq=4, nk=2, d=16):
    cos, sin, _ = tables(b, s, d)
    return torch.randn(b, s, nq, d), torch.randn(b, s, nk, d), cos, sin


def complex_inputs(b, s, nq=4, nk=2, d=16):
    _, _, freqs_cis = tables(b, s, d)
    return torch.randn(b, s, nq, d), torch.randn(b, s, nk, d), freqs_cis


class LlamaRope(nn.Module):
    def __init__(self, unsqueeze_dim=1):
        super().__init__()
        self.unsqueeze_dim = unsqueeze_dim

    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=self.unsqueeze_dim)


class DeepSeekRope(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb_interleave(q, k, cos, sin)


class Llama4Rope(nn.Module):
    def forward(self, q, k, freqs_cis):
        return apply_rotary_emb(q, k, freqs_cis)


class Llama4RopeSharedTable(nn.Module):
    """HF's Llama-4 code with the broadcast table computed once for q and k."""

    def forward(self, xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        f = freqs_cis[:, :, None, :]
        return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


class PartialRope(nn.Module):
    """phi / gpt-neox: only the first ``rot`` channels rotate; the rest pass through."""

    def __init__(self, rot):
        super().__init__()
        self.rot = rot

    def forward(self, q, k, cos, sin):
        q_rot, q_pass = q[..., : self.rot], q[..., self.rot :]
        k_rot, k_pass = k[..., : self.rot], k[..., self.rot :]
        q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
        return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)


class GqaKeysFirst(nn.Module):
    """GQA where k (fewer heads) is computed, and passed, before q."""

    def forward(self, k, q, cos, sin):
        k = k * 1.5
        q = q * 0.5
        q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
        return q_out, k_out


def _rotate_quarter(x):
    return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)  # split at d/4, not the middle


class OffCentreSplit(nn.Module):
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_quarter(q) * sin, k * cos + _rotate_quarter(k) * sin


class SeparateTables(nn.Module):
    """q rotated with (cos, sin), k with (cos_k, sin_k): not one RoPE of the pair."""

    def forward(self, q, k, cos, sin, cos_k, sin_k):
        q_out, _ = apply_rotary_pos_emb(q, q, cos, sin)
        _, k_out = apply_rotary_pos_emb(k, k, cos_k, sin_k)
        return q_out, k_out


def _run(module, *args, dynamic=None):
    gm = export_gm(module.eval(), *args, dynamic=dynamic)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(KEY, gm)
    return reference, gm, record


def _rope_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and any(n.target == op.default for op in ROPE_OPS)]


def _placeholders(gm):
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}


def test_llama_bnsd():
    reference, gm, record = _run(LlamaRope(), *bnsd(2, 5))
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.target == ad.torch_rope_with_explicit_cos_sin.default
    ph = _placeholders(gm)
    assert node.args[:4] == (ph["q"], ph["k"], ph["cos"], ph["sin"])
    assert node.args[4] == 1
    assert count_op(gm, [aten.neg, aten.cat, aten.unsqueeze, aten.slice]) == 0
    assert_same_outputs(reference, gm, [bnsd(2, 5), bnsd(3, 9)], tol=1e-6)


def test_llama_bsnd_carries_unsqueeze_dim_2():
    reference, gm, record = _run(LlamaRope(unsqueeze_dim=2), *bsnd(2, 5))
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.target == ad.torch_rope_with_explicit_cos_sin.default
    assert node.args[4] == 2
    assert count_op(gm, [aten.neg, aten.cat]) == 0
    assert_same_outputs(reference, gm, [bsnd(2, 5), bsnd(4, 3)], tol=1e-6)


def test_llama_bf16():
    reference, gm, record = _run(LlamaRope(), *bnsd(2, 5, dtype=torch.bfloat16))
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_rope_with_explicit_cos_sin) == 1
    assert_same_outputs(reference, gm, [bnsd(2, 5, dtype=torch.bfloat16), bnsd(3, 7, dtype=torch.bfloat16)], tol=1e-2)


def test_gqa_query_is_the_first_input():
    # Static head counts, as in a real model (the heads come from a view with constant sizes).
    dyn = [{0: D, 2: D}, {0: D, 2: D}, {0: D, 1: D}, {0: D, 1: D}]

    def inputs(b, s):
        q, k, cos, sin = bnsd(b, s, nq=4, nk=2)
        return k, q, cos, sin

    reference, gm, record = _run(GqaKeysFirst(), *inputs(2, 5), dynamic=dyn)
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.args[0].meta["val"].shape[1] == 4  # query heads
    assert node.args[1].meta["val"].shape[1] == 2  # key heads
    assert node.args[0].args[0].name == "q" and node.args[1].args[0].name == "k"
    assert_same_outputs(reference, gm, [inputs(2, 5), inputs(3, 8)], tol=1e-6)


def test_partial_rotary():
    def inputs(b, s):
        q, k, _, _ = bnsd(b, s, d=16)
        cos, sin, _ = tables(b, s, 8)
        return q, k, cos, sin

    reference, gm, record = _run(PartialRope(8), *inputs(2, 5))
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.target == ad.torch_rope_with_explicit_cos_sin.default
    assert node.args[0].meta["val"].shape[-1] == 8  # the rotary slice of q
    assert node.args[0].meta["val"].shape[1] == 4
    assert count_op(gm, aten.neg) == 0
    assert_same_outputs(reference, gm, [inputs(2, 5), inputs(3, 2)], tol=1e-6)


def test_deepseek_interleaved():
    reference, gm, record = _run(DeepSeekRope(), *bnsd(2, 5))
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.target == ad.torch_rope_with_qk_interleaving.default
    ph = _placeholders(gm)
    assert node.args[:2] == (ph["q"], ph["k"])
    # the op rotates by the half-width tables HF slices from cos/sin (cos[..., :d/2])
    for table, name in ((node.args[2], "cos"), (node.args[3], "sin")):
        assert table.target == aten.slice.Tensor and table.args[0] is ph[name]
    assert node.args[4] == 1
    assert count_op(gm, [aten.cat, aten.sub]) == 0
    assert_same_outputs(reference, gm, [bnsd(2, 5), bnsd(3, 9)], tol=1e-6)


def test_deepseek_interleaved_is_exact_for_any_table():
    """Random tables (not ``cat(freqs, freqs)``): HF reads only the first half of each, and so
    does the op; the rewrite must be exact without relying on the tables' structure."""

    def inputs(b, s):
        q, k, _, _ = bnsd(b, s)
        return q, k, torch.randn(b, s, 16), torch.randn(b, s, 16)

    reference, gm, record = _run(DeepSeekRope(), *inputs(2, 5))
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.target == ad.torch_rope_with_qk_interleaving.default
    ph = _placeholders(gm)
    assert node.args[:2] == (ph["q"], ph["k"])
    # the pair slices of q and k (x[..., 0::2], x[..., 1::2]) and the rotation arithmetic are gone;
    # the only slices left are the half-width tables the op reads
    assert count_op(gm, [aten.cat, aten.sub, aten.mul, aten.add, aten.unsqueeze]) == 0
    slices = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.slice.Tensor]
    assert sorted(n.args[0].name for n in slices) == ["cos", "sin"]
    assert list(node.args[2:4]) == sorted(slices, key=lambda n: n.args[0].name)
    assert_same_outputs(reference, gm, [inputs(2, 5), inputs(3, 9)], tol=1e-6)


def test_llama4_complex_hf_function():
    reference, gm, record = _run(Llama4Rope(), *complex_inputs(2, 5))
    assert_same_outputs(reference, gm, [complex_inputs(2, 5), complex_inputs(3, 9)], tol=1e-6)
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.target == ad.torch_rope_with_complex_freqs.default
    ph = _placeholders(gm)
    assert node.args[:3] == (ph["q"], ph["k"], ph["freqs_cis"])
    assert node.args[3] == 2


def test_llama4_complex_shared_table_combines_q_and_k():
    reference, gm, record = _run(Llama4RopeSharedTable(), *complex_inputs(2, 5))
    assert_same_outputs(reference, gm, [complex_inputs(2, 5), complex_inputs(3, 9)], tol=1e-6)
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.target == ad.torch_rope_with_complex_freqs.default
    ph = _placeholders(gm)
    assert node.args[:3] == (ph["xq"], ph["xk"], ph["freqs_cis"])
    assert count_op(gm, aten.view_as_complex) == 0


def test_off_centre_rotate_half_is_left_alone():
    reference, gm, record = _run(OffCentreSplit(), *bnsd(2, 5))
    assert record.num_matches == 0
    assert not _rope_nodes(gm)
    assert count_op(gm, aten.neg) == 2
    assert_same_outputs(reference, gm, [bnsd(2, 5), bnsd(3, 4)], tol=1e-6)


def test_q_and_k_with_different_tables_are_left_alone():
    def inputs(b, s):
        q, k, cos, sin = bnsd(b, s)
        cos_k, sin_k, _ = tables(b, s + 7, 16)
        return q, k, cos, sin, cos_k[:, 7:].contiguous(), sin_k[:, 7:].contiguous()

    reference, gm, record = _run(SeparateTables(), *inputs(2, 5))
    assert record.num_matches == 0
    assert not _rope_nodes(gm)
    inp = [inputs(2, 5), inputs(3, 6)]
    assert_same_outputs(reference, gm, inp, tol=1e-6)
    # the two tables really differ, so a combined op would have been wrong
    q, k, cos, sin, cos_k, sin_k = inp[0]
    assert not torch.allclose(apply_rotary_pos_emb(q, k, cos, sin)[1], gm(*inp[0])[1])


@pytest.mark.parametrize("b,s", [(2, 5), (3, 1)])
def test_rope_ops_equal_hf_functions(b, s):
    q, k, cos, sin = bnsd(b, s)
    half = cos.shape[-1] // 2
    for op, hf, tables in ((ad.torch_rope_with_explicit_cos_sin, apply_rotary_pos_emb, (cos, sin)),
                           (ad.torch_rope_with_qk_interleaving, apply_rotary_pos_emb_interleave,
                            (cos[..., :half], sin[..., :half]))):
        out, ref = op(q, k, *tables, 1), hf(q, k, cos, sin, unsqueeze_dim=1)
        for a, r in zip(out, ref):
            torch.testing.assert_close(a, r, rtol=0, atol=1e-6)
    q, k, freqs_cis = complex_inputs(b, s)
    for a, r in zip(ad.torch_rope_with_complex_freqs(q, k, freqs_cis, 2), apply_rotary_emb(q, k, freqs_cis)):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-6)


class GptOssRope(nn.Module):
    def forward(self, q, k, cos, sin):
        from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss_rope

        return gpt_oss_rope(q, k, cos, sin)


class HalvesWrongSign(nn.Module):
    """GPT-OSS's form with the second half's sign flipped: not a rotation."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        out = []
        for x in (q, k):
            x1, x2 = torch.chunk(x, 2, dim=-1)
            out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos - x1 * sin), dim=-1))
        return tuple(out)


def half_tables(b, s, d=16):
    q, k, cos, sin = bnsd(b, s, d=d)
    return q, k, cos[..., : d // 2].contiguous(), sin[..., : d // 2].contiguous()


def test_gpt_oss_halves_become_rotate_half_with_full_tables():
    """GPT-OSS's RoPE (half-width tables on the two halves of each head) -> one
    ``torch_rope_with_explicit_cos_sin`` on ``cat([t, t])`` tables; exact at two shapes."""
    reference, gm, record = _run(GptOssRope(), *half_tables(2, 5))
    assert record.num_matches == 1
    (node,) = _rope_nodes(gm)
    assert node.target == ad.torch_rope_with_explicit_cos_sin.default
    ph = _placeholders(gm)
    assert node.args[:2] == (ph["q"], ph["k"]) and node.args[4] == 1
    for table, name in ((node.args[2], "cos"), (node.args[3], "sin")):
        assert table.target == aten.cat.default and table.args[0] == [ph[name], ph[name]]
    assert count_op(gm, [aten.chunk, aten.sub, aten.mul]) == 0
    assert_same_outputs(reference, gm, [half_tables(2, 5), half_tables(3, 9)], tol=1e-6)


def test_halves_with_a_wrong_sign_are_left_alone():
    reference, gm, record = _run(HalvesWrongSign(), *half_tables(2, 5))
    assert record.num_matches == 0 and not _rope_nodes(gm)
    assert_same_outputs(reference, gm, [half_tables(2, 5), half_tables(3, 4)], tol=1e-6)
