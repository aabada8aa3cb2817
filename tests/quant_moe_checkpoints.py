"""Tiny real GPT-OSS checkpoints with MXFP4 experts, and an honest float reference.

autodeploy's loading of quantized MoE checkpoints is tested against the checkpoints written
here, so this module implements the MXFP4 numerics on its own, from the OCP Microscaling (MX)
v1.0 spec and the layout of OpenAI's GPT-OSS releases, and shares no code with
``autodeploy.ops.quant`` (a bug copied into both sides would pass).

* ``float_checkpoint()``: a tiny ``GptOssForCausalLM`` (seeded weights with a realistic spread,
  every value exactly representable in bf16) saved by ``save_pretrained`` in float32, plus a
  trained BPE tokenizer.
* ``mxfp4_checkpoint()``: the same model as ``openai/gpt-oss-*`` ships it: every layer's
  experts as ``mlp.experts.{gate_up,down}_proj_{blocks,scales}`` (uint8), their biases and
  every other tensor in bf16 (lossless: the values are bf16 already), and config.json's
  ``quantization_config`` = ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.
* ``dequantized_state_dict()``: the float32 weights decoded from the written file, in HF's
  parameter layout (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]).
* ``reference_model()``: HF's ``GptOssForCausalLM`` (float32, eval, eager attention and
  experts) with those weights: what a correct MXFP4 runtime computes, up to the GEMMs'
  accumulation order (MXFP4 here is weight-only; activations stay float).

The layout, verified against transformers 5.23 ``integrations/mxfp4.py`` (whose
``_convert_moe_packed_tensors`` is OpenAI's reference decoder): for a float expert weight
stored by HF as [E, in, out], the file holds ``W = param.transpose(1, 2)`` = [E, out, in]
quantized along ``in`` in groups of 32: ``*_scales`` uint8 [E, out, in/32] is the e8m0 shared
exponent (value 2^(s - 127)), ``*_blocks`` uint8 [E, out, in/32, 16] holds the 32 e2m1 codes of
a group two to a byte, element 2i in the LOW nibble and 2i+1 in the high one. So
``gate_up_proj_blocks`` is [E, 2I, H/32, 16] and ``down_proj_blocks`` [E, H, I/32, 16]. The 2I
rows of ``gate_up`` stay interleaved as in HF's parameter: row 2j is gate j, row 2j+1 is up j
(HF's ``GptOssExperts._apply_gate`` takes ``[..., ::2]`` / ``[..., 1::2]``).

Checkpoints are cached under ``.cache/test-checkpoints/quant-gpt_oss-{float,mxfp4}``, written
atomically; bump ``WRITER_VERSION`` when the numerics or the layout change.
"""

import json
import os
import shutil
from typing import Callable, Dict, Tuple

import torch
from safetensors.torch import load_file, save_file

# Part of every cached directory's validity: a checkpoint written by an older writer is rewritten.
WRITER_VERSION = "1"

# GPT-OSS shape, shrunk: hidden and intermediate sizes divisible by the MX group (32), and
# different (64 vs 128), so that every expert tensor's shape tells its axes apart (a loader that
# forgets a transpose, or takes the wrong group axis, fails on shapes, not only on values); layer
# types alternate sliding / full from the first layer, as GptOssConfig (and the releases) do.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
LAYERS = TINY["num_hidden_layers"]
EXPERT_PROJS = ("gate_up_proj", "down_proj")
# The float expert parameters the format quantizes; everything else stays bf16.
QUANTIZED_PARAMS: Tuple[str, ...] = tuple(
    f"model.layers.{i}.mlp.experts.{p}" for i in range(LAYERS) for p in EXPERT_PROJS
)
# openai/gpt-oss-20b and -120b config.json, verbatim: attention, router, embeddings and lm_head
# are not converted (only the experts are MXFP4).
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
# The releases store every non-expert tensor, and the expert biases, in bf16.
RELEASE_DTYPE = torch.bfloat16

# Weight init (std of normal draws), as in quant_checkpoints.py: transformers' default
# (initializer_range 0.02) gives almost uniform logits on a model this small, so greedy tokens
# would hinge on ties; with these the top-2 logit gaps are ~0.1-1.
LINEAR_STD = 0.08
EXPERT_STD = 0.08
EMBED_STD = 0.5
LM_HEAD_STD = 0.25
NORM_STD = 0.1  # norm weights: 1 + N(0, NORM_STD)
BIAS_STD = 0.1  # attention, router and expert biases
SINK_STD = 0.5  # attention sinks (a logit per head)

# A prompt whose greedy continuation under reference_model() has clear top-2 logit gaps at each
# of its first GREEDY_TOKENS steps (0.32-2.2 measured, logits std ~2; pinned by the writer test),
# so generation tests built on it do not hinge on near-ties.
GREEDY_PROMPT = "A list of numbers"
GREEDY_TOKENS = 8

MX_GROUP = 32
MX_PACK = MX_GROUP // 2  # bytes per group
E8M0_BIAS = 127
E2M1_EMAX = 2  # exponent of e2m1's largest normal (6 = 1.5 * 2^2)
E2M1_MAX = 6.0
# e2m1 code -> value: codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# An all-zero group's exponent (any would do: its codes are all 0); stored 127 = 2^0.
ZERO_GROUP_EXP = 0


# ---- MXFP4 numerics ---------------------------------------------------------------------------


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to e2m1 (round to nearest, ties to even mantissa, saturating at +-6) as 4-bit codes.

    Between consecutive magnitudes the grid step is 0.5 on [0, 2], 1 on [2, 4] and 2 on [4, 6],
    and on each stretch ``|x| / step`` is an integer whose parity is the code's last bit (the
    mantissa bit), so ``torch.round`` (half to even) is the IEEE rounding: 0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. Past 6 saturates to 6 (OCP MX v1.0 clamps
    rather than overflowing). Sign in bit 3, also for values that round to zero (-0).
    """
    mag = x.float().abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    q = (torch.round(mag / step) * step).clamp(max=E2M1_MAX)
    code = torch.searchsorted(E2M1_VALUES[:8], q.contiguous()).to(torch.uint8)
    assert torch.equal(E2M1_VALUES[code.long()], q), "e2m1 rounding left the grid"
    return code | ((x < 0).to(torch.uint8) << 3)


def mxfp4_quantize(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """OCP MX v1.0 MXFP4 of ``w`` [..., K] along its last dim: (blocks uint8 [..., K/32, 16],
    scales uint8 [..., K/32]).

    Per group of 32: shared exponent e = floor(log2(amax)) - 2 (2 = emax of e2m1), taken exactly
    from ``frexp``, clamped to e8m0's range [-127, 127] and stored as e + 127 (255 is e8m0's NaN);
    an all-zero group gets ``ZERO_GROUP_EXP``. Elements are ``e2m1_codes(v / 2^e)`` (the division
    by a power of two is exact), so a group's amax lands in [4, 8) and saturates to 6 above 6,
    as the spec's conversion does. Codes are packed two to a byte, element 2i in the low nibble.

    (OpenAI's own converter, triton_kernels ``downcast_to_mxfp_torch``, picks the exponent
    ceil(log2(amax / 6)) instead, which never saturates; both are valid MXFP4 and decode the same
    way. This writer follows the spec.)
    """
    *lead, k = w.shape
    assert k % MX_GROUP == 0, f"last dim {k} not a multiple of {MX_GROUP}"
    g = w.float().reshape(*lead, k // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    zero = torch.full_like(e, ZERO_GROUP_EXP, dtype=torch.int32)
    exp = torch.where(amax > 0, e.to(torch.int32) - 1 - E2M1_EMAX, zero)
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = g.double() * torch.pow(2.0, -exp.double())[..., None]
    codes = e2m1_codes(scaled)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.to(torch.uint8).contiguous(), (exp + E8M0_BIAS).to(torch.uint8).contiguous()


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse layout of ``mxfp4_quantize``: float32 [..., K] from blocks [..., K/32, 16] and e8m0
    scales [..., K/32], ``e2m1(code) * 2^(scale - 127)`` (computed in float64, so exact)."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == MX_PACK, (blocks.shape, scales.shape)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], MX_GROUP)
    values = E2M1_VALUES.double()[codes.long()]
    scale = torch.pow(2.0, scales.to(torch.float64) - E8M0_BIAS)
    out = (values * scale[..., None]).float()
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * MX_GROUP)


def quantize_expert_param(param: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF's float expert parameter [E, in, out] -> (blocks [E, out, in/32, 16], scales [E, out, in/32])."""
    return mxfp4_quantize(param.transpose(1, 2))


def dequantize_expert_param(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(blocks, scales) -> HF's float32 expert parameter [E, in, out]."""
    return mxfp4_dequantize(blocks, scales).transpose(1, 2).contiguous()


# ---- the float model --------------------------------------------------------------------------


def _config():
    from transformers import GptOssConfig

    from autodeploy.models.tokenizer import special_token_ids, train_bpe_tokenizer

    tok = train_bpe_tokenizer(TINY["vocab_size"])
    return GptOssConfig(**TINY, **special_token_ids(tok)), tok


def _std(name: str) -> float:
    if "embed_tokens" in name:
        return EMBED_STD
    if name.startswith("lm_head"):
        return LM_HEAD_STD
    if ".mlp.experts." in name and not name.endswith("_bias"):
        return EXPERT_STD
    return LINEAR_STD


def _init_weights(module: torch.nn.Module, seed: int = 0) -> None:
    """Deterministic weights with a realistic spread, independent of transformers' own init, then
    rounded to bf16 (so the bf16 tensors of the MXFP4 release layout are the same values)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.copy_(1 + torch.randn(p.shape, generator=gen) * NORM_STD)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * SINK_STD)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * _std(name))
            p.copy_(p.to(RELEASE_DTYPE).float())


def _write_float(directory: str) -> None:
    """The float checkpoint: HF model saved by ``save_pretrained`` (float32), generation config, tokenizer."""
    from transformers import GenerationConfig, GptOssForCausalLM

    from autodeploy.models.tokenizer import save_tokenizer, special_token_ids

    config, tok = _config()
    torch.manual_seed(0)
    hf = GptOssForCausalLM(config).to(torch.float32).eval()
    _init_weights(hf)
    hf.save_pretrained(directory)
    GenerationConfig(do_sample=False, **special_token_ids(tok)).save_pretrained(directory)
    save_tokenizer(tok, directory, model_max_length=TINY["max_position_embeddings"])


def _write_mxfp4(directory: str) -> None:
    """The release layout: experts -> *_blocks/*_scales, everything else bf16, quantization_config."""
    float_dir = float_checkpoint()
    sd = load_file(os.path.join(float_dir, "model.safetensors"))
    quantized = set(QUANTIZED_PARAMS)
    out: Dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name in quantized:
            out[f"{name}_blocks"], out[f"{name}_scales"] = quantize_expert_param(t)
        else:
            bf = t.to(RELEASE_DTYPE)
            assert torch.equal(bf.float(), t.float()), f"{name} is not bf16-exact"
            out[name] = bf
    shutil.copytree(float_dir, directory, ignore=shutil.ignore_patterns("*.safetensors", ".writer-version"))
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = json.loads(json.dumps(QUANTIZATION_CONFIG))
    cfg["dtype"] = "bfloat16"  # as the releases' config (the dtype of the unquantized tensors)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


# ---- cache -------------------------------------------------------------------------------------


def _cached(name: str, write: Callable[[str], None]) -> str:
    """``.cache/test-checkpoints/name`` written once per this writer's ``WRITER_VERSION`` (atomically; the
    cache logic is the dense writer's, which shares no numerics with this module)."""
    from quant_checkpoints import cached_checkpoint

    return cached_checkpoint(name, write, WRITER_VERSION)


# ---- public API --------------------------------------------------------------------------------


def float_checkpoint() -> str:
    """The float original of the MXFP4 checkpoint (cached directory, float32 safetensors)."""
    return _cached("quant-gpt_oss-float", _write_float)


def mxfp4_checkpoint() -> str:
    """The tiny GPT-OSS in OpenAI's MXFP4 release layout (cached directory)."""
    float_checkpoint()
    return _cached("quant-gpt_oss-mxfp4", _write_mxfp4)


def dequantized_state_dict() -> Dict[str, torch.Tensor]:
    """The whole float32 state dict the MXFP4 checkpoint stands for, under HF's parameter names:
    each expert projection decoded from the blocks and scales read back from the file, every other
    tensor as stored (bf16 -> float32, exact)."""
    sd = load_file(os.path.join(mxfp4_checkpoint(), "model.safetensors"))
    out: Dict[str, torch.Tensor] = {}
    for name in QUANTIZED_PARAMS:
        out[name] = dequantize_expert_param(sd[f"{name}_blocks"], sd[f"{name}_scales"])
    packed = {f"{name}{suffix}" for name in QUANTIZED_PARAMS for suffix in ("_blocks", "_scales")}
    for name, t in sd.items():
        if name not in packed:
            out[name] = t.float()
    return out


def _load_hf(directory: str, state_dict: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """``GptOssForCausalLM`` with the float config of ``directory`` and ``state_dict`` (float32,
    eval, eager attention and experts, so the reference is plain math)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig.from_pretrained(directory)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    hf = GptOssForCausalLM(config).to(torch.float32).eval()
    hf.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    return hf


def reference_model() -> torch.nn.Module:
    """The float computation a runtime of ``mxfp4_checkpoint()`` should approximate: HF's
    GPT-OSS (float32, eval, eager) with ``dequantized_state_dict()``."""
    return _load_hf(mxfp4_checkpoint(), dequantized_state_dict())


def float_model() -> torch.nn.Module:
    """The float original as an HF model (float32, eval, eager), for comparisons."""
    directory = float_checkpoint()
    return _load_hf(directory, load_file(os.path.join(directory, "model.safetensors")))
