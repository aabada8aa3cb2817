"""Reference ops (RoPE x3, RMSNorm, linear) against the HF / torch code they stand for, their fake
kernels, and that each survives torch.export as one node."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

import autodeploy.ops  # noqa: F401

ad = torch.ops.autodeploy
SHAPES = [(2, 5), (3, 1)]  # (batch, seq)


def tables(b, s, d, dtype=torch.float32):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.arange(s).float() + 3 * torch.arange(b).float()[:, None]
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype), torch.polar(torch.ones_like(freqs), freqs)


def _close(out, ref, atol=1e-6):
    out = out if isinstance(out, (tuple, list)) else (out,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(out) == len(ref)
    for a, r in zip(out, ref):
        assert a.dtype == r.dtype and a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=0, atol=atol)


# ---- numerics -----------------------------------------------------------------------------


@pytest.mark.parametrize("b,s", SHAPES)
def test_explicit_cos_sin_equals_hf_llama(b, s):
    cos, sin, _ = tables(b, s, 16)
    q, k = torch.randn(b, 4, s, 16), torch.randn(b, 2, s, 16)
    _close(ad.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 1), apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1))
    qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    _close(ad.torch_rope_with_explicit_cos_sin(qt, kt, cos, sin, 2),
           apply_rotary_pos_emb(qt, kt, cos, sin, unsqueeze_dim=2))


@pytest.mark.parametrize("b,s", SHAPES)
def test_qk_interleaving_equals_hf_deepseek(b, s):
    cos, sin, _ = tables(b, s, 16)
    q, k = torch.randn(b, 4, s, 16), torch.randn(b, 2, s, 16)
    # the op takes the half-width (per-pair angle) tables; HF slices them from cat(freqs, freqs)
    _close(ad.torch_rope_with_qk_interleaving(q, k, cos[..., :8], sin[..., :8], 1),
           apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1))


@pytest.mark.parametrize("b,s", SHAPES)
def test_complex_freqs_equals_hf_llama4(b, s):
    _, _, freqs_cis = tables(b, s, 16)
    q, k = torch.randn(b, s, 4, 16), torch.randn(b, s, 2, 16)
    _close(ad.torch_rope_with_complex_freqs(q, k, freqs_cis, 2), apply_rotary_emb(q, k, freqs_cis))


def test_rope_ops_rotate_the_identity_position_to_itself():
    """Position 0 means angle 0: every RoPE form must return q and k unchanged."""
    cos, sin, freqs_cis = tables(1, 1, 16)
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16)
    _close(ad.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 1), (q, k))
    qc, kc = ad.torch_rope_with_complex_freqs(q.transpose(1, 2), k.transpose(1, 2), freqs_cis, 2)
    _close((qc, kc), (q.transpose(1, 2), k.transpose(1, 2)))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
def test_rmsnorm_equals_hf_llama(dtype, atol):
    norm = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    norm = norm.to(dtype)
    for shape in [(2, 5, 32), (3, 1, 32)]:
        x = torch.randn(shape, dtype=dtype) * 3
        with torch.no_grad():
            _close(ad.torch_rmsnorm(x, norm.weight, 1e-5), norm(x), atol=atol)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_simple_equals_f_linear(bias):
    w, b = torch.randn(6, 8), (torch.randn(6) if bias else None)
    for shape in [(2, 5, 8), (7, 8)]:
        x = torch.randn(shape)
        _close(ad.torch_linear_simple(x, w, b), F.linear(x, w, b))


# ---- fake kernels -------------------------------------------------------------------------


def _cases():
    cos, sin, freqs_cis = tables(2, 5, 16)
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    return [
        ("explicit", ad.torch_rope_with_explicit_cos_sin, (q, k, cos, sin, 1)),
        ("explicit_bf16_q_fp32_tables", ad.torch_rope_with_explicit_cos_sin, (bf(q), bf(k), cos, sin, 1)),
        ("explicit_bf16", ad.torch_rope_with_explicit_cos_sin, (bf(q), bf(k), bf(cos), bf(sin), 1)),
        ("interleave", ad.torch_rope_with_qk_interleaving, (q, k, cos[..., :8], sin[..., :8], 1)),
        ("interleave_bf16_q_fp32_tables", ad.torch_rope_with_qk_interleaving,
         (bf(q), bf(k), cos[..., :8], sin[..., :8], 1)),
        ("complex", ad.torch_rope_with_complex_freqs,
         (q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), freqs_cis, 2)),
        ("complex_bf16", ad.torch_rope_with_complex_freqs,
         (bf(q.transpose(1, 2)).contiguous(), bf(k.transpose(1, 2)).contiguous(), freqs_cis, 2)),
        ("rmsnorm", ad.torch_rmsnorm, (torch.randn(2, 5, 32), torch.randn(32), 1e-6)),
        ("rmsnorm_bf16", ad.torch_rmsnorm, (bf(torch.randn(2, 5, 32)), bf(torch.randn(32)), 1e-6)),
        ("rmsnorm_bf16_x_fp32_w", ad.torch_rmsnorm, (bf(torch.randn(2, 5, 32)), torch.randn(32), 1e-6)),
        ("linear_bias", ad.torch_linear_simple, (torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6))),
        ("linear_nobias", ad.torch_linear_simple, (torch.randn(2, 5, 8), torch.randn(6, 8), None)),
    ]


@pytest.mark.parametrize("name,op,args", _cases(), ids=[c[0] for c in _cases()])
def test_fake_kernel_matches_real_op(name, op, args):
    real = op(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(fake) == len(real)
    for f, r in zip(fake, real):
        assert isinstance(f, torch._subclasses.fake_tensor.FakeTensor)
        assert (tuple(f.shape), f.dtype) == (tuple(r.shape), r.dtype)


# ---- export -------------------------------------------------------------------------------


class _CallOp(torch.nn.Module):
    """Calls ``op`` with the module's tensor inputs in the tensor slots of ``template``."""

    def __init__(self, op, template):
        super().__init__()
        self.op, self.template = op, template

    def forward(self, *tensors):
        it = iter(tensors)
        return self.op(*[next(it) if isinstance(a, torch.Tensor) else a for a in self.template])


@pytest.mark.parametrize("name,op,args", _cases(), ids=[c[0] for c in _cases()])
def test_op_exports_as_one_node(name, op, args):
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    ep = torch.export.export(_CallOp(op, args), tensors, strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(op.default) == 1
    # nothing else but the getitems that unpack a (q, k) result
    assert all(t is op.default or getattr(t, "__name__", "") == "getitem" for t in targets), targets
    with torch.no_grad():
        out, ref = ep.module()(*tensors), op(*args)
    _close(out, ref, atol=0.0)
