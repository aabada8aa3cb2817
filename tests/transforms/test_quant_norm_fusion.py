"""fuse_rmsnorm_quant_fp8, fuse_rmsnorm_quant_nvfp4, fuse_relu2_quant_nvfp4 (post_load_fusion): the op
before a quantized linear emits its quantized input.

On the tiny ModelOpt checkpoints of ``tests/quant_checkpoints.py`` after the default backends
(``fuse_add_rms_norm``, ``fuse_rmsnorm``, ``fuse_fp8_linear`` / ``fuse_nvfp4_linear``), as the
default pipeline leaves the graph. The writer calibrates each linear on its own, but q/k/v (and
gate/up) see the same input, so their input scales are equal values: per layer the input norm
(-> q/k/v) and the post-attention norm (-> gate/up) fuse, 4 norms in the 2-layer Llama and Qwen3
(Qwen3's q/k norms feed RoPE, the final norm the float LM head: left alone); 4 activation ops
stay (o_proj, down_proj). Nemotron's norms are LayerNorms (no match); its relu^2 MLP fuses with
the down projection's NVFP4 quantization once per layer (2), and not in the FP8 checkpoint.

Fine-grained FP8 (``fp8_block``, dynamic per-group activations after
``fuse_finegrained_fp8_linear``): ``fuse_rmsnorm_quant_fp8`` fuses the same 4 norms into the
``*_rmsnorm_quant_fp8_group`` ops, bit-equal to the unfused graph; hand-written graphs pin the
near misses (group sizes that differ, another reader, a static FP8 reader beside the per-group ones).

Numerics: the fused graph equals the unfused one (the same functions compute both; checked to
1e-6 at two shapes, exactly for per-group FP8) and still matches the float reference model.
"""

import copy

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import quant_checkpoints as qc
from autodeploy.transform.interface import Stage
from helpers import apply_transform, build, count_op, export_gm, graph_logits, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
LINEAR_BACKEND = {"fp8": "fuse_fp8_linear", "nvfp4": "fuse_nvfp4_linear", "fp8_block": "fuse_finegrained_fp8_linear"}
ACT = {"fp8": ad.torch_quant_fp8_activation, "nvfp4": ad.torch_quant_nvfp4_activation,
       "fp8_block": ad.torch_quant_fp8_group_activation}
NORM_KEY = {"fp8": "fuse_rmsnorm_quant_fp8", "nvfp4": "fuse_rmsnorm_quant_nvfp4", "fp8_block": "fuse_rmsnorm_quant_fp8"}
KEYS = ("fuse_rmsnorm_quant_fp8", "fuse_rmsnorm_quant_nvfp4", "fuse_relu2_quant_nvfp4")
# (plain norm, fused add+norm) -> their fused twins, per fuse_rmsnorm backend
FUSED = {("native", "fp8"): (ad.native_rmsnorm_quant_fp8, ad.native_fused_add_rmsnorm_quant_fp8),
         ("native", "nvfp4"): (ad.native_rmsnorm_quant_nvfp4, ad.native_fused_add_rmsnorm_quant_nvfp4),
         ("torch", "fp8"): (ad.torch_rmsnorm_quant_fp8, ad.torch_fused_add_rmsnorm_quant_fp8),
         ("torch", "nvfp4"): (ad.torch_rmsnorm_quant_nvfp4, ad.torch_fused_add_rmsnorm_quant_nvfp4),
         ("native", "fp8_block"): (ad.native_rmsnorm_quant_fp8_group, ad.native_fused_add_rmsnorm_quant_fp8_group),
         ("torch", "fp8_block"): (ad.torch_rmsnorm_quant_fp8_group, ad.torch_fused_add_rmsnorm_quant_fp8_group)}
NORMS = (ad.torch_rmsnorm, ad.native_rmsnorm, ad.torch_fused_add_rmsnorm, ad.native_fused_add_rmsnorm)
SHAPES = ((1, 7), (3, 4))
_LOADED = {}


def _unfused(model: str, fmt: str, norm_backend: str = "native"):
    """A fresh copy of the checkpoint's graph as the default post_load_fusion leaves it before
    these transforms (norms fused with their residual add, backend chosen; linears split)."""
    if (model, fmt) not in _LOADED:
        _LOADED[(model, fmt)] = build(qc.quantized_checkpoint(model, fmt), up_to=Stage.WEIGHT_LOAD, max_seq_len=64,
                                      max_batch_size=2).graph
    gm = copy.deepcopy(_LOADED[(model, fmt)])
    for key, cfg in (("fuse_add_rms_norm", {}), ("fuse_rmsnorm", {"backend": norm_backend}),
                     (LINEAR_BACKEND[fmt], {})):
        gm, _ = apply_transform(key, gm, **cfg)
    return gm


def _assert_same_as(gm, ref_gm, model: str, fmt: str) -> None:
    """(c) the unfused graph's logits to 1e-6, and the float reference's as the loading tests do."""
    reference = qc.reference_model(model, fmt)
    for b, s in SHAPES:
        ids = torch.randint(0, 512, (b, s))
        out = graph_logits(gm, ids)
        assert rel_rmse(out, graph_logits(ref_gm, ids)) < 1e-6, f"{model}/{fmt} {(b, s)}: fused != unfused"
        with torch.no_grad():
            expected = reference(ids).logits
        assert rel_rmse(out, expected) < 1e-5, f"{model}/{fmt} {(b, s)}: off the float reference"


def _input_scales(gm) -> int:
    return sum(name.endswith("input_scale") for name, _ in gm.named_buffers())


@pytest.mark.parametrize("model, fmt, backend", [("llama", "fp8", "native"), ("llama", "fp8", "torch"),
                                                 ("llama", "nvfp4", "native"), ("qwen3", "nvfp4", "torch"),
                                                 ("llama", "fp8_block", "native"), ("llama", "fp8_block", "torch")])
def test_norm_feeding_equal_scale_quants_fuses(model, fmt, backend):
    """fp8_block (fine-grained FP8): the per-group activations have no scale (dynamic), so no
    scale attribute is dropped, and the fused graph equals the unfused one bit for bit."""
    ref = _unfused(model, fmt, backend)
    gm, record = apply_transform(NORM_KEY[fmt], copy.deepcopy(ref))
    # (a) per layer the input norm (q/k/v) and the post-attention norm (gate/up)
    assert record.num_matches == 4
    # (b) layer 0's input norm is plain (its input is the embedding), the other three are add+norms
    plain, add = FUSED[(backend, fmt)]
    assert count_op(gm, plain) == 1 and count_op(gm, add) == 3
    assert count_op(gm, ACT[fmt]) == 4  # o_proj and down_proj of each layer
    assert count_op(gm, NORMS) == 1 + (4 if model == "qwen3" else 0)  # the final norm (+ Qwen3's q/k norms)
    # k/v's and up's copies of the shared scale (per-group FP8 has none)
    assert _input_scales(gm) == _input_scales(ref) - (0 if fmt == "fp8_block" else 6)
    _assert_same_as(gm, ref, model, fmt)  # (c)
    if fmt == "fp8_block":
        for b, s in SHAPES:
            ids = torch.randint(0, 512, (b, s))
            assert torch.equal(graph_logits(gm, ids), graph_logits(ref, ids))
    # (d) the other transforms find nothing here
    for key in KEYS:
        if key != NORM_KEY[fmt]:
            assert apply_transform(key, copy.deepcopy(ref))[1].num_matches == 0


def test_relu2_feeding_nvfp4_quant_fuses():
    ref = _unfused("nemotron", "nvfp4")
    gm, record = apply_transform("fuse_relu2_quant_nvfp4", copy.deepcopy(ref))
    assert record.num_matches == 2  # (a) one MLP per layer
    assert count_op(gm, ad.torch_relu2_quant_nvfp4) == 2  # (b)
    assert count_op(gm, (aten.relu, aten.square)) == 0
    assert count_op(gm, ad.torch_quant_nvfp4_activation) == count_op(ref, ad.torch_quant_nvfp4_activation) - 2
    _assert_same_as(gm, ref, "nemotron", "nvfp4")  # (c)
    # (d) LayerNorm1P is no RMSNorm: the norm fusions find nothing
    for key in NORM_KEY.values():
        assert apply_transform(key, copy.deepcopy(ref))[1].num_matches == 0


def test_fp8_nemotron_is_a_near_miss():
    """relu^2 feeding an FP8 quantization (no fused twin) and LayerNorms: nothing matches."""
    ref = _unfused("nemotron", "fp8")
    for key in KEYS:
        gm, record = apply_transform(key, copy.deepcopy(ref))
        assert record.num_matches == 0
        assert count_op(gm, ad.torch_quant_fp8_activation) == 12 and count_op(gm, aten.square) == 2


def test_differing_scales_leave_that_norm_alone():
    """(d) layer 0's k_proj calibrated differently: its input norm keeps q/k/v's three quant ops."""
    ref = _unfused("llama", "fp8")
    scale = ref.get_submodule("model.layers.0.self_attn.k_proj").input_scale
    scale.mul_(1.0 + 2.0**-20)
    gm, record = apply_transform("fuse_rmsnorm_quant_fp8", copy.deepcopy(ref))
    assert record.num_matches == 3
    assert count_op(gm, ad.native_rmsnorm) == 1 and count_op(gm, ad.native_rmsnorm_quant_fp8) == 0
    assert count_op(gm, ad.torch_quant_fp8_activation) == 4 + 3
    ids = torch.randint(0, 512, (2, 5))
    assert rel_rmse(graph_logits(gm, ids), graph_logits(ref, ids)) < 1e-6


def test_compiled_norms_are_left_alone():
    """(d) fuse_rmsnorm's compile backend has no fused twin: replacing its norms by the reference
    would undo that choice, so nothing matches."""
    ref = _unfused("llama", "fp8", "compile")
    gm, record = apply_transform("fuse_rmsnorm_quant_fp8", copy.deepcopy(ref))
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_quant_fp8_activation) == 14


class _NormThenQuant(nn.Module):
    """RMSNorm feeding two FP8 activation quantizations, optionally with ``extra``: another user
    of the normed value (``float``), or an NVFP4 quantization of it (``nvfp4``)."""

    def __init__(self, scales=(0.01, 0.01), extra: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(64) + 0.5)
        self.register_buffer("s0", torch.tensor(scales[0]))
        self.register_buffer("s1", torch.tensor(scales[1]))
        self.extra = extra

    def forward(self, x):
        y = ad.torch_rmsnorm(x, self.weight, 1e-6)
        out = ad.torch_quant_fp8_activation(y, self.s0) + ad.torch_quant_fp8_activation(y, self.s1)
        if self.extra == "float":
            out = out + y
        if self.extra == "nvfp4":
            out = out + ad.torch_quant_nvfp4_activation(y, self.s1)
        return out


class _Relu2ThenQuant(nn.Module):
    """relu^2 feeding an NVFP4 quantization; ``extra`` reads the ReLU or the square elsewhere."""

    def __init__(self, extra: str = "", square: str = "square"):
        super().__init__()
        self.register_buffer("s", torch.tensor(0.002))
        self.extra, self.square = extra, square

    def forward(self, x):
        r = torch.relu(x)
        a = torch.square(r) if self.square == "square" else r * r if self.square == "mul" else r.pow(3)
        out = ad.torch_quant_nvfp4_activation(a, self.s)
        return out + (r if self.extra == "relu" else a if self.extra == "square" else 0)


@pytest.mark.parametrize("module, key, matches", [
    (_NormThenQuant(), "fuse_rmsnorm_quant_fp8", 1),  # the positive control of the rows below
    (_NormThenQuant(extra="float"), "fuse_rmsnorm_quant_fp8", 0),
    (_NormThenQuant(scales=(0.01, 0.02)), "fuse_rmsnorm_quant_fp8", 0),
    (_NormThenQuant(extra="nvfp4"), "fuse_rmsnorm_quant_fp8", 0),
    (_NormThenQuant(extra="nvfp4"), "fuse_rmsnorm_quant_nvfp4", 0),
    (_Relu2ThenQuant(), "fuse_relu2_quant_nvfp4", 1),
    (_Relu2ThenQuant(square="mul"), "fuse_relu2_quant_nvfp4", 1),
    (_Relu2ThenQuant(square="cube"), "fuse_relu2_quant_nvfp4", 0),
    (_Relu2ThenQuant(extra="relu"), "fuse_relu2_quant_nvfp4", 0),
    (_Relu2ThenQuant(extra="square"), "fuse_relu2_quant_nvfp4", 0),
], ids=["control", "other-user", "scales-differ", "other-format", "other-format-nvfp4", "relu2-control",
        "relu-times-relu", "relu-cubed", "relu-read-elsewhere", "square-read-elsewhere"])
def test_near_misses_are_left_alone(module, key, matches):
    x = torch.randn(2, 3, 64)
    gm = export_gm(module, x)
    before = sorted(str(n.target) for n in gm.graph.nodes)
    fused, record = apply_transform(key, copy.deepcopy(gm))
    assert record.num_matches == matches
    if not matches:
        assert sorted(str(n.target) for n in fused.graph.nodes) == before
    for shape in ((2, 3, 64), (1, 5, 64)):
        x = torch.randn(*shape)
        with torch.no_grad():
            assert rel_rmse(fused(x), gm(x)) < 1e-6


# ---- per-group FP8 (fine-grained FP8's dynamic activations) --------------------------------------
GROUP_OPS = {ad.torch_rmsnorm_quant_fp8_group: ad.torch_rmsnorm, ad.native_rmsnorm_quant_fp8_group: ad.native_rmsnorm,
             ad.torch_fused_add_rmsnorm_quant_fp8_group: ad.torch_fused_add_rmsnorm,
             ad.native_fused_add_rmsnorm_quant_fp8_group: ad.native_fused_add_rmsnorm}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [256, 200], ids=["two-groups", "partial-group"])
@pytest.mark.parametrize("op", list(GROUP_OPS), ids=lambda op: str(op).rpartition(".")[2])
def test_fp8_group_norm_ops_equal_the_norm_then_the_group_quantization(op, dim, dtype):
    """Bit-equal to the norm it replaces followed by ``torch_quant_fp8_group_activation``; the
    fake kernel gives the same shapes and dtypes."""
    g = torch.Generator().manual_seed(dim)
    x, r = (torch.randn(3, 5, dim, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    norm, is_add = GROUP_OPS[op], "fused_add" in str(op)
    got = op(x, r, w, 1e-6, 128) if is_add else (op(x, w, 1e-6, 128),)
    normed = norm(x, r, w, 1e-6) if is_add else (norm(x, w, 1e-6),)
    want = (ad.torch_quant_fp8_group_activation(normed[0], 128), *normed[1:])
    assert not torch.equal(want[0], normed[0])  # the quantization changed the values: not vacuous
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with FakeTensorMode() as mode:
        fx_, fr, fw = (mode.from_tensor(t) for t in (x, r, w))
        fake = op(fx_, fr, fw, 1e-6, 128) if is_add else (op(fx_, fw, 1e-6, 128),)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in got]


class _NormThenGroupQuant(nn.Module):
    """An RMSNorm (plain or fused with the residual add) read by per-group FP8 quantizations of
    ``sizes`` (None: the op's default, 128), optionally with ``extra``: another user of the normed
    value (``float``) or a static FP8 quantization of it (``static``)."""

    def __init__(self, sizes=(128, 128), extra: str = "", add: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(256) + 0.5)
        self.register_buffer("s", torch.tensor(0.01))
        self.sizes, self.extra, self.add = sizes, extra, add

    def forward(self, x, r):
        if self.add:
            y, summed = ad.torch_fused_add_rmsnorm(x, r, self.weight, 1e-6)
        else:
            y, summed = ad.torch_rmsnorm(x, self.weight, 1e-6), r
        outs = [ad.torch_quant_fp8_group_activation(y) if g is None else ad.torch_quant_fp8_group_activation(y, g)
                for g in self.sizes]
        if self.extra == "float":
            outs.append(y * 2.0)
        if self.extra == "static":
            outs.append(ad.torch_quant_fp8_activation(y, self.s))
        return (*outs, summed)


@pytest.mark.parametrize("module, key, fused", [
    (_NormThenGroupQuant(), "fuse_rmsnorm_quant_fp8", ad.torch_rmsnorm_quant_fp8_group),
    (_NormThenGroupQuant(add=True), "fuse_rmsnorm_quant_fp8", ad.torch_fused_add_rmsnorm_quant_fp8_group),
    (_NormThenGroupQuant(sizes=(None, 128, 128)), "fuse_rmsnorm_quant_fp8", ad.torch_rmsnorm_quant_fp8_group),
    (_NormThenGroupQuant(sizes=(128, 64)), "fuse_rmsnorm_quant_fp8", None),
    (_NormThenGroupQuant(add=True, extra="float"), "fuse_rmsnorm_quant_fp8", None),
    (_NormThenGroupQuant(extra="static"), "fuse_rmsnorm_quant_fp8", None),
    (_NormThenGroupQuant(), "fuse_rmsnorm_quant_nvfp4", None),
], ids=["control", "add-control", "default-size", "group-sizes-differ", "other-user", "mixed-with-static",
        "other-format-nvfp4"])
def test_fp8_group_norms_fuse_and_near_misses_are_left_alone(module, key, fused):
    """(a) one match or none; (b) the fused op in, every group quantization out; (c) bit-equal to
    the unfused graph at two shapes; (d) group sizes that differ, another reader of the normed
    value, a static FP8 reader beside the per-group ones, the NVFP4 key: left alone."""
    x, r = torch.randn(2, 3, 256), torch.randn(2, 3, 256)
    gm = export_gm(module, x, r)
    # export drops an argument equal to the default; restore the calls as written (the pipeline's
    # fuse_finegrained_fp8_linear passes 128 explicitly)
    acts = [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target == ad.torch_quant_fp8_group_activation.default]
    assert len(acts) == len(module.sizes)
    for node, size in zip(acts, module.sizes):
        node.args, node.kwargs = (node.args[0],) if size is None else (node.args[0], size), {}
    gm.recompile()
    before = sorted(str(n.target) for n in gm.graph.nodes)
    out, record = apply_transform(key, copy.deepcopy(gm))
    assert record.num_matches == (1 if fused else 0)
    if fused:
        assert count_op(out, fused) == 1
        assert count_op(out, (ad.torch_quant_fp8_group_activation, ad.torch_rmsnorm, ad.torch_fused_add_rmsnorm)) == 0
        node = next(n for n in out.graph.nodes if n.op == "call_function" and n.target == fused.default)
        assert node.args[-1] == 128  # the group size passed on
    else:
        assert sorted(str(n.target) for n in out.graph.nodes) == before
    for shape in ((2, 3, 256), (1, 5, 256)):
        args = (torch.randn(*shape), torch.randn(*shape))
        with torch.no_grad():
            for a, b in zip(out(*args), gm(*args)):
                assert torch.equal(a, b)
