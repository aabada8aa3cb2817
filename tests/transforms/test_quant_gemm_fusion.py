"""fuse_fp8_gemms, fuse_fp4_gemms, fuse_finegrained_fp8_swiglu, fuse_nvfp4_swiglu: canonical quantized
linears that share an input -> one quantized GEMM (+ split, or + silu_and_mul).

The fusion is exact: the weights' codes (and NVFP4's e4m3 block scales, fine-grained FP8's tile
scales) are concatenated unchanged, and a per-tensor weight scale (FP8 ``weight_scale``, NVFP4
``weight_scale_2``) becomes a per-row float32 vector [N] (each linear's scale over its rows), or
stays the common scalar when all are equal. Checked here:

* on the tiny quantized Llama checkpoints of ``quant_checkpoints`` built up to weight loading
  (canonical quantized ops, nothing fused; each transform runs on a deep copy): (a) exact match
  counts, (b) the fused op in place of the originals (which are freed), (c) the fused graph's
  logits equal the unfused graph's at two shapes (~1e-6, float summation order only), the fused
  tensors are the originals concatenated bit for bit with the per-row scale (or the scalar, for
  scales made equal by construction), and the backend (``fuse_fp8_linear`` /
  ``fuse_nvfp4_linear``) keeps the result;
* (d) near misses left alone: different input scales, a straddling fine-grained tile, an input
  with another user, mixed bias, the other formats (partly on small hand-built graphs);
* the default pipeline (these fusions on) generates the reference model's greedy tokens.

The checkpoints' calibrated input scales are per input tensor, so q/k/v share one and gate/up
share one; their weight scales differ (one per linear), so the per-row path is what they exercise.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.llm import LLM
from autodeploy.ops.quant import formats
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.transform.interface import Stage

import quant_checkpoints as qc
from helpers import apply_transform, build, count_op, export_gm, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
FP8, NVFP4, BLOCK = (ad.torch_quant_fp8_linear.default, ad.torch_quant_nvfp4_linear.default,
                     ad.torch_quant_finegrained_fp8_linear.default)
ACTIVATION = {"fp8": ad.torch_quant_fp8_activation.default, "nvfp4": ad.torch_quant_nvfp4_activation.default}
SCALE = {"fp8": "weight_scale", "nvfp4": "weight_scale_2"}  # the per-tensor weight scale that becomes per row
LAYERS = qc.TINY["num_hidden_layers"]
ATTN, MLP = ("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))
GROUPS = (ATTN, MLP)
SHAPES = ((1, 7), (3, 4))
EXACT = 1e-6  # fused vs unfused: the same values, summed in another order
_BUILDS = {}


def _loaded(fmt: str):
    """The tiny Llama in ``fmt`` after weight loading (built once per test session; a fresh copy each call)."""
    if fmt not in _BUILDS:
        _BUILDS[fmt] = build(qc.quantized_checkpoint("llama", fmt), up_to=Stage.WEIGHT_LOAD, max_seq_len=64,
                             max_batch_size=2).graph
    return copy.deepcopy(_BUILDS[fmt])


IDS = [torch.randint(0, qc.TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(i))
       for i, shape in enumerate(SHAPES)]


def _outputs(gm):
    """Logits at each of ``SHAPES``."""
    outs = []
    for ids in IDS:
        with torch.no_grad():
            out = gm(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand(*ids.shape))
        outs.append(out[0] if isinstance(out, (tuple, list)) else out)
    return outs


_ORIGINAL = {}


def _original(fmt: str):
    """The unfused graph's logits (computed once per session)."""
    if fmt not in _ORIGINAL:
        _loaded(fmt)
        _ORIGINAL[fmt] = _outputs(_BUILDS[fmt])
    return _ORIGINAL[fmt]


def _error(a, b) -> float:
    """Largest relative RMS difference between two graphs' outputs over ``SHAPES``."""
    return max(rel_rmse(x, y) for x, y in zip(a, b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _linears(gm, layer: int, group):
    parent, names = group
    return [gm.get_submodule(f"model.layers.{layer}.{parent}.{n}") for n in names]


def _fused_module(gm, layer: int, group):
    parent, names = group
    return gm.get_submodule(f"model.layers.{layer}.{parent}.fused_{'_'.join(names)}")


def _assert_concatenated(fused_gm, unfused_gm, fmt: str, groups) -> set:
    """The rule on the tensors: codes (and NVFP4's block scales) concatenated bit for bit, the input
    scale kept, the per-tensor weight scale a per-row float32 vector, or the scalar when the
    group's scales are equal. Returns which of "per-row" / "scalar" it saw."""
    scale, kinds = SCALE[fmt], set()
    for layer in range(LAYERS):
        for group in groups:
            fused, mods = _fused_module(fused_gm, layer, group), _linears(unfused_gm, layer, group)
            assert {n for n, _ in fused.named_buffers()} == {"weight", "input_scale", "weight_scale", scale}
            for name in ("weight", "weight_scale") if fmt == "nvfp4" else ("weight",):
                assert torch.equal(_bits(getattr(fused, name)), torch.cat([_bits(getattr(m, name)) for m in mods]))
            assert torch.equal(fused.input_scale, mods[0].input_scale)
            got, first = getattr(fused, scale), getattr(mods[0], scale)
            if all(torch.equal(getattr(m, scale), first) for m in mods):
                assert got.dim() == 0 and torch.equal(got, first)
                kinds.add("scalar")
            else:
                rows = torch.cat([getattr(m, scale).float().reshape(1).expand(m.weight.shape[0]) for m in mods])
                assert got.dtype == torch.float32 and torch.equal(got, rows)
                kinds.add("per-row")
    return kinds


# ---- fuse_fp8_gemms / fuse_fp4_gemms on the tiny Llama -------------------------------------------

GEMMS = {"fp8": ("fuse_fp8_gemms", FP8, "fuse_fp8_linear"), "nvfp4": ("fuse_fp4_gemms", NVFP4, "fuse_nvfp4_linear")}


def _assert_backend_keeps(gm, fmt: str, n_linears: int, expected) -> None:
    """The backend (activation op + float GEMM over the weight decoded once, per-row scale
    included) matches every fused linear and keeps the fused graph's logits."""
    decoded, record = apply_transform(GEMMS[fmt][2], gm)
    assert record.num_matches == n_linears and count_op(decoded, ACTIVATION[fmt]) == n_linears
    assert _error(_outputs(decoded), expected) < EXACT


@pytest.mark.parametrize("fmt", sorted(GEMMS))
def test_fuse_quant_gemms_on_llama(fmt):
    key, op, _ = GEMMS[fmt]
    gm, record = apply_transform(key, _loaded(fmt))
    # (a) per layer: q/k/v share the attention norm's output, gate/up the MLP norm's -> 2 x 2 groups
    assert record.num_matches == 2 * LAYERS
    # (b) 7 quantized linears per layer -> qkv, o, gate_up, down; each group's output split back
    assert count_op(gm, op) == 4 * LAYERS and count_op(gm, aten.split_with_sizes) == 2 * LAYERS
    assert not any(".q_proj." in n or ".gate_proj." in n for n, _ in gm.named_buffers())  # originals freed
    # (c) the rule on the tensors: the checkpoint's weight scales differ within each group -> per row
    assert _assert_concatenated(gm, _BUILDS[fmt], fmt, GROUPS) == {"per-row"}
    # ... so the fused graph is the unfused one (no weight rounded again), also after the backend
    out = _outputs(gm)
    assert _error(out, _original(fmt)) < EXACT
    _assert_backend_keeps(gm, fmt, 4 * LAYERS, out)


@pytest.mark.parametrize("fmt", sorted(GEMMS))
def test_equal_weight_scales_keep_the_scalar(fmt):
    """(c) every linear of a group given the same weight scale (by construction): the fused op
    keeps the 0-d scalar, and the result is still the unfused graph's."""
    unfused = _loaded(fmt)
    for layer in range(LAYERS):
        for group in GROUPS:
            mods = _linears(unfused, layer, group)
            for m in mods[1:]:
                setattr(m, SCALE[fmt], getattr(mods[0], SCALE[fmt]).clone())
    expected = _outputs(unfused)
    gm, record = apply_transform(GEMMS[fmt][0], copy.deepcopy(unfused))
    assert record.num_matches == 2 * LAYERS
    assert _assert_concatenated(gm, unfused, fmt, GROUPS) == {"scalar"}
    out = _outputs(gm)
    assert _error(out, expected) < EXACT
    _assert_backend_keeps(gm, fmt, 4 * LAYERS, out)


@pytest.mark.parametrize("fmt", sorted(GEMMS))
def test_different_input_scales_are_left_alone(fmt):
    """(d) layer 0's k_proj calibrated differently: its q/k/v group stays; the other three fuse."""
    key, op, _ = GEMMS[fmt]
    gm = _loaded(fmt)
    k_proj = gm.get_submodule("model.layers.0.self_attn.k_proj")
    k_proj.input_scale = k_proj.input_scale * 1.01
    gm, record = apply_transform(key, gm)
    assert record.num_matches == 2 * LAYERS - 1
    assert count_op(gm, op) == 4 * LAYERS + 2
    assert hasattr(gm.get_submodule("model.layers.0.self_attn.q_proj"), "weight")


def test_nvfp4_swiglu_then_gemms_pipeline_order():
    """fuse_nvfp4_swiglu claims gate/up first; fuse_fp4_gemms then fuses q/k/v only."""
    gm, swiglu = apply_transform("fuse_nvfp4_swiglu", _loaded("nvfp4"))
    gm, gemms = apply_transform("fuse_fp4_gemms", gm)
    assert (swiglu.num_matches, gemms.num_matches) == (LAYERS, LAYERS)
    assert count_op(gm, NVFP4) == 4 * LAYERS and count_op(gm, ad.torch_silu_and_mul) == LAYERS
    assert _error(_outputs(gm), _original("nvfp4")) < EXACT


# ---- fuse_finegrained_fp8_swiglu / fuse_nvfp4_swiglu on the tiny Llama ---------------------------

SWIGLU = {"fp8_block": ("fuse_finegrained_fp8_swiglu", BLOCK, "fuse_finegrained_fp8_linear"),
          "nvfp4": ("fuse_nvfp4_swiglu", NVFP4, "fuse_nvfp4_linear")}


@pytest.mark.parametrize("fmt", sorted(SWIGLU))
def test_fuse_quant_swiglu_on_llama(fmt):
    key, op, backend = SWIGLU[fmt]
    gm, record = apply_transform(key, _loaded(fmt))
    # (a) one SwiGLU per layer (for fp8_block gate's N = 128 = one whole block_n tile)
    assert record.num_matches == LAYERS
    # (b) gate/up -> one op; silu * mul -> silu_and_mul
    assert count_op(gm, op) == 6 * LAYERS and count_op(gm, ad.torch_silu_and_mul) == LAYERS
    assert count_op(gm, aten.silu) == 0 and count_op(gm, aten.mul) == count_op(_BUILDS[fmt], aten.mul) - LAYERS
    # (c) the tensors concatenated (fine-grained FP8: weight and tile scales; NVFP4: per-row
    # weight_scale_2), so the result is the unfused graph's, also after the backend
    for layer in range(LAYERS):
        fused, mods = _fused_module(gm, layer, MLP), _linears(_BUILDS[fmt], layer, MLP)
        assert torch.equal(_bits(fused.weight), torch.cat([_bits(m.weight) for m in mods]))
        if fmt == "fp8_block":
            assert torch.equal(fused.weight_scale_inv, torch.cat([m.weight_scale_inv for m in mods]))
    if fmt == "nvfp4":
        assert _assert_concatenated(gm, _BUILDS[fmt], fmt, (MLP,)) == {"per-row"}
    out = _outputs(gm)
    assert _error(out, _original(fmt)) < EXACT
    decoded, record = apply_transform(backend, gm)
    assert record.num_matches == 6 * LAYERS and count_op(decoded, op) == 0
    assert _error(_outputs(decoded), out) < EXACT


def test_nvfp4_swiglu_different_input_scales_are_left_alone():
    """(d) layer 1's up_proj calibrated differently: that pair stays."""
    gm = _loaded("nvfp4")
    up = gm.get_submodule("model.layers.1.mlp.up_proj")
    up.input_scale = up.input_scale * 0.99
    gm, record = apply_transform("fuse_nvfp4_swiglu", gm)
    assert record.num_matches == LAYERS - 1
    assert hasattr(gm.get_submodule("model.layers.1.mlp.gate_proj"), "weight")


def test_other_formats_are_left_alone():
    """(d) each transform touches only its own format."""
    assert apply_transform("fuse_fp4_gemms", _loaded("fp8"))[1].num_matches == 0
    assert apply_transform("fuse_nvfp4_swiglu", _loaded("fp8_block"))[1].num_matches == 0
    assert apply_transform("fuse_finegrained_fp8_swiglu", _loaded("nvfp4"))[1].num_matches == 0
    assert apply_transform("fuse_fp8_gemms", _loaded("nvfp4"))[1].num_matches == 0


# ---- hand-built graphs: bias, another user, shared weights, straddling tiles ---------------------


def _fp8_linear(n: int, k: int, input_scale: float, bias: bool, gen: torch.Generator) -> nn.Module:
    m = nn.Module()
    w = torch.randn(n, k, generator=gen) * 0.1
    s = w.abs().amax() / 448
    m.register_buffer("weight", formats.fp8_encode(w / s))
    m.register_buffer("input_scale", torch.tensor(input_scale))
    m.register_buffer("weight_scale", s)
    m.bias = nn.Parameter(torch.randn(n, generator=gen) * 0.1) if bias else None
    return m


class FP8Group(nn.Module):
    """Three FP8 linears of one input (each with its own weight scale); ``other_user`` also feeds
    that input to a relu."""

    def __init__(self, bias: bool = False, other_user: bool = False, sizes=(32, 16, 16)):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.lins = nn.ModuleList(_fp8_linear(n, 32, 0.01, bias, gen) for n in sizes)
        self.other_user = other_user

    def forward(self, x):
        h = torch.tanh(x)
        outs = [FP8(h, m.weight, m.bias, m.input_scale, m.weight_scale) for m in self.lins]
        outs[0] = outs[0].view(*outs[0].shape[:-1], 4, 8)
        return (*outs, torch.relu(h)) if self.other_user else tuple(outs)


def _block_linear(n: int, k: int, block: int, gen: torch.Generator) -> nn.Module:
    m = nn.Module()
    w = torch.randn(n, k, generator=gen) * 0.1
    tiles = w.new_zeros(-(-n // block), -(-k // block))
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            tiles[i, j] = w[i * block:(i + 1) * block, j * block:(j + 1) * block].abs().amax() / 448
    m.register_buffer("weight", formats.fp8_encode(w / formats.expand_blocks(tiles, (block, block), (n, k))))
    m.register_buffer("weight_scale_inv", tiles)
    return m


class BlockSwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) in fine-grained FP8 with ``block`` x ``block`` tiles."""

    def __init__(self, n: int, block: int = 32, k: int = 64, gate_other_user: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.gate, self.up = _block_linear(n, k, block, gen), _block_linear(n, k, block, gen)
        self.down = _block_linear(k, n, block, gen)
        self.block, self.gate_other_user = block, gate_other_user

    def _lin(self, m, x):
        return BLOCK(x, m.weight, None, m.weight_scale_inv, self.block, self.block)

    def forward(self, x):
        g = self._lin(self.gate, x)
        y = self._lin(self.down, F.silu(g) * self._lin(self.up, x))
        return (y, g.sum(-1)) if self.gate_other_user else y


def _run(key: str, module: nn.Module, k: int):
    """Export ``module``, apply ``key``; the outputs must equal the unfused graph's at two shapes."""
    gm = export_gm(module, torch.randn(2, 5, k))
    ref = copy.deepcopy(gm)
    gm, record = apply_transform(key, gm)
    for shape in ((2, 5, k), (1, 3, k)):
        x = torch.randn(*shape)
        with torch.no_grad():
            a, b = ref(x), gm(x)
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert u.shape == v.shape and rel_rmse(v, u) < EXACT
    return gm, record


def test_fp8_gemms_with_bias_positive_control():
    gm, record = _run("fuse_fp8_gemms", FP8Group(bias=True), 32)
    assert record.num_matches == 1 and count_op(gm, FP8) == 1
    fused = gm.get_submodule("lins.fused_0_1_2")
    assert fused.bias.shape == (64,) and fused.weight_scale.shape == (64,)  # three scales -> per row


def test_fp8_gemms_input_with_another_user_is_left_alone():
    """(d) the shared input also feeds a relu (fuse_gemms' rule: every user must be such a linear)."""
    gm, record = _run("fuse_fp8_gemms", FP8Group(other_user=True), 32)
    assert record.num_matches == 0 and count_op(gm, FP8) == 3


def test_fp8_gemms_mixed_bias_is_left_alone():
    module = FP8Group(bias=True)
    module.lins[1].bias = None
    gm, record = _run("fuse_fp8_gemms", module, 32)
    assert record.num_matches == 0 and count_op(gm, FP8) == 3


class FP8SharedTwice(FP8Group):
    """The same two FP8 linears applied to two inputs (shared weights): two groups, one fused copy."""

    def __init__(self):
        super().__init__(sizes=(32, 32))

    def forward(self, x):
        a, b = self.lins
        h1 = torch.tanh(x)
        p = FP8(h1, a.weight, None, a.input_scale, a.weight_scale)
        q = FP8(h1, b.weight, None, b.input_scale, b.weight_scale)
        h2 = torch.sigmoid(p - 0.5 * q)
        return FP8(h2, a.weight, None, a.input_scale, a.weight_scale) * FP8(h2, b.weight, None, b.input_scale,
                                                                              b.weight_scale)


def test_fp8_gemms_shared_weights_are_fused_once():
    gm, record = _run("fuse_fp8_gemms", FP8SharedTwice(), 32)
    assert record.num_matches == 2 and count_op(gm, FP8) == 2
    fused = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith(".weight")}
    assert fused == {"lins.fused_0_1.weight"}
    assert not hasattr(gm.get_submodule("lins.0"), "weight")


@pytest.mark.parametrize("n, fused", [(64, True), (48, False)])
def test_finegrained_swiglu_straddling_tile_is_left_alone(n, fused):
    """(d) gate N = 48 with 32-row tiles: gate's last tile would share a scale row with up's first
    rows, so the pair stays apart; N = 64 (two whole tiles) is the positive control."""
    gm, record = _run("fuse_finegrained_fp8_swiglu", BlockSwiGLU(n), 64)
    assert record.num_matches == int(fused)
    assert count_op(gm, BLOCK) == (2 if fused else 3) and count_op(gm, ad.torch_silu_and_mul) == int(fused)


def test_finegrained_swiglu_gate_with_another_user_is_left_alone():
    gm, record = _run("fuse_finegrained_fp8_swiglu", BlockSwiGLU(64, gate_other_user=True), 64)
    assert record.num_matches == 0 and count_op(gm, aten.silu) == 1


# ---- the whole default pipeline ------------------------------------------------------------------

# what each format's default pipeline fuses (transform -> matches): the quantized fusions, then
# fuse_silu_mul (it turns fuse_fp8_gemms' gate/up split into silu_and_mul; NVFP4's SwiGLU fusion
# makes that op itself), then the backend over the 4 fused GEMMs per layer (7 linears unfused)
E2E = {"fp8": {"fuse_fp8_gemms": 2 * LAYERS, "fuse_silu_mul": LAYERS, "fuse_fp8_linear": 4 * LAYERS},
       "nvfp4": {"fuse_nvfp4_swiglu": LAYERS, "fuse_fp4_gemms": LAYERS, "fuse_silu_mul": 0,
                 "fuse_nvfp4_linear": 4 * LAYERS}}


@pytest.mark.parametrize("fmt", sorted(E2E))
def test_llm_generates_the_reference_tokens(fmt):
    """The default pipeline (the quantized fusions, fuse_silu_mul, the backend, KV cache, sampler)
    gives exactly the greedy tokens of the checkpoint's reference model: fusing changes no weight."""
    llm = LLM(qc.quantized_checkpoint("llama", fmt), max_seq_len=64, max_batch_size=4)
    history = {r.key: r.num_matches for r in llm.build.context.history}
    assert {key: history[key] for key in E2E[fmt]} == E2E[fmt]
    # one activation quantization per fused GEMM: standalone, inside a norm (fuse_rmsnorm_quant_*) or,
    # for FP8's o_proj, inside the attention (fuse_trtllm_attn_quant_fp8: the cached op's out_scale)
    gm = llm.build.graph_module
    quant = [n for n in gm.graph.nodes if n.op == "call_function" and "quant" in str(n.target)]
    in_attention = [n for n in gm.graph.nodes if n.op == "call_function" and n.kwargs.get("out_scale") is not None]
    assert len(in_attention) == (LAYERS if fmt == "fp8" else 0)
    assert len(quant) + len(in_attention) == 4 * LAYERS and count_op(gm, ad.torch_silu_and_mul) == LAYERS
    prompts = [[5, 17, 33, 2, 99, 100], [7, 8, 9]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    ref = qc.reference_model("llama", fmt)
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    assert [out.outputs[0].token_ids for out in outs] == expected
