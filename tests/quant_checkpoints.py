"""Tiny real quantized checkpoints, one per format, and an honest float reference for each.

The library's quantized loading is tested against checkpoints written here, so this module
implements every format's numerics on its own, from the formats' published layouts, and
shares no code with ``autodeploy.ops.quant`` (a bug copied into both sides would pass).

* ``float_checkpoint(model)``: a tiny HF model (random, seeded weights with a realistic spread)
  saved by ``save_pretrained``, plus a trained BPE tokenizer.
* ``quantized_checkpoint(model, fmt)``: that checkpoint quantized to ``fmt``: the quantized
  linears' tensors under the format's exact names, dtypes and shapes, the format's config
  entries, and every other tensor (embeddings, norms, ``lm_head``) unchanged.
* ``dequantized_state_dict(model, fmt)``: the float weights decoded from the written files.
* ``reference_model(model, fmt)``: the HF model with those decoded weights, plus fake
  quantization of the activations where the format quantizes them: the float computation a
  correct quantized runtime approximates (up to the GEMM's own accumulation order).

Checkpoints are cached under ``.cache/test-checkpoints/quant-<model>-<format>`` (and
``quant-<model>-float``), written atomically; bump ``WRITER_VERSION`` when the numerics change.
"""

import json
import os
import shutil
from typing import Callable, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT_CACHE = os.path.join(REPO, ".cache", "test-checkpoints")
# Part of every cached directory's validity: a checkpoint written by an older writer is rewritten.
WRITER_VERSION = "1"

FORMATS = ("fp8", "nvfp4", "fp8_block", "gptq", "awq", "ct_int4")
MODELS = ("llama", "qwen3", "nemotron")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
            tie_word_embeddings=False)
# Nemotron (transformers 5.23 NemotronConfig): the MLP is up_proj -> relu^2 -> down_proj
# (hidden_act "relu2", no gate), norms are LayerNorm1P (weight stored zero-centred, with a bias)
# whose epsilon field is ``norm_eps``, and ``partial_rotary_factor`` defaults to 0.5.
_EXTRA: Dict[str, Dict[str, object]] = {"llama": {}, "qwen3": {}, "nemotron": {"hidden_act": "relu2"}}

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = {"llama": ("gate_proj", "up_proj", "down_proj"), "qwen3": ("gate_proj", "up_proj", "down_proj"),
        "nemotron": ("up_proj", "down_proj")}
# The linear modules each format quantizes: every attention and MLP projection. ``lm_head``,
# the embeddings and the norms stay float in every format.
QUANTIZED_LINEARS: Dict[str, Tuple[str, ...]] = {
    model: tuple(
        [f"model.layers.{i}.self_attn.{p}" for i in range(TINY["num_hidden_layers"]) for p in _ATTN]
        + [f"model.layers.{i}.mlp.{p}" for i in range(TINY["num_hidden_layers"]) for p in _MLP[model]]
    )
    for model in MODELS
}

# Weight init (std of normal draws). transformers' default (initializer_range 0.02) gives almost
# uniform logits on a model this small, so greedy tokens would hinge on ties; with these the
# float model's top-2 logit gaps are typically ~0.1-1 (see test_quant_checkpoint_writer.py).
LINEAR_STD = 0.08
EMBED_STD = 0.5
LM_HEAD_STD = 0.25
NORM_STD = 0.1

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E2M1_MAX = 6.0
# e2m1 (FP4) code -> value: codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
NVFP4_GROUP = 16
FP8_BLOCK = 128
INT4_GROUP = 32
# AutoAWQ's GEMM packing: nibble j of each int32 holds output column 8c + AWQ_ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# compressed-tensors stores the group scales in the dtype of the model it quantized (bf16 for
# the usual bf16 checkpoints), and ``weight_shape`` as ``torch.tensor(weight.shape)``: int64.
CT_SCALE_DTYPE = torch.bfloat16
CT_SHAPE_DTYPE = torch.int64

MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.29.0"}


# ---- numerics shared by the writers and the activation fake-quant -----------------------------


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, as 4-bit codes (uint8), with ModelOpt's tie rule.

    ModelOpt's ``NVFP4QTensor._cast_fp4`` (NVIDIA/Model-Optimizer, qtensor/nvfp4_tensor.py):
    ``searchsorted`` on the midpoints [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5] (a tie goes to the
    lower value), plus one where |x| equals 0.75, 1.75 or 2.5 (those ties go up, to the even
    mantissa). Magnitudes above 5 become 6: the clamp to +-6 is implicit. Sign in bit 3.
    """
    mag = x.float().abs().contiguous()
    code = torch.searchsorted(_E2M1_BOUNDS, mag).to(torch.uint8)
    code = code + ((mag == 0.75) | (mag == 1.75) | (mag == 2.5)).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e2m1 values (float32)."""
    return E2M1_VALUES[e2m1_codes(x).long()]


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to float8_e4m3fn (a plain cast turns values past 448 into NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _as_int32(packed: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) reinterpreted as int32, as the formats store them."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _pack_nibbles(values: torch.Tensor, order: Tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Pack 4-bit values (0..15) eight to an int32 along the LAST dim: word c's nibble j (bits
    4j..4j+3) holds element ``8c + order[j]``."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    packed = sum(v[..., order[j]] << (4 * j) for j in range(8))
    return _as_int32(packed)


def _unpack_nibbles(packed: torch.Tensor, order: Tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Inverse of ``_pack_nibbles`` (int64 values 0..15)."""
    nibbles = (packed.to(torch.int64)[..., None] >> (4 * torch.arange(8))) & 15  # [..., words, j]
    out = torch.empty_like(nibbles)
    out[..., list(order)] = nibbles
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


# ---- weight writers: float [N, K] weight -> the format's tensors (suffix -> tensor) -------------


def _fp8_per_tensor(w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """ModelOpt FP8: e4m3 weight with one fp32 scale (shape []) = amax / 448.

    Verified: ModelOpt exports ``weight_scale`` = amax / 448 (a multiplier) and ``input_scale``
    = activation amax / 448 as 0-d fp32 tensors (the layout vLLM's ``ModelOptFp8LinearMethod``
    reads); the cast is ``clamp(w / scale, +-448).to(float8_e4m3fn)``.
    """
    scale = (w.float().abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(())
    return {"weight": _to_e4m3(w.float() / scale), "weight_scale": scale}


def _nvfp4(w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """ModelOpt NVFP4, blocks of 16 along K.

    Verified against NVIDIA/Model-Optimizer ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``:
    ``weight_scale_2`` = amax / (6 * 448) (fp32); per-block scale = block amax / (6 *
    weight_scale_2), zero blocks set to 1.0, clamped below at 2**-9 (e4m3's smallest subnormal),
    cast to float8_e4m3fn; values are ``w / (block_scale.float() * weight_scale_2)`` rounded by
    ``e2m1_codes``; packing is ``(q[..., 1::2] << 4) | q[..., 0::2]``: element 2i in the LOW
    nibble, 2i+1 in the high one.
    """
    n, k = w.shape
    wf = w.float()
    scale_2 = (wf.abs().amax() / (E2M1_MAX * FP8_MAX)).clamp(min=1e-12).reshape(())
    blocks = wf.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
    block_scale = blocks.abs().amax(-1) / (E2M1_MAX * scale_2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    block_scale = _to_e4m3(block_scale.clamp(min=2.0**-9))
    codes = e2m1_codes(blocks / (block_scale.float() * scale_2)[..., None]).reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {"weight": packed.to(torch.uint8), "weight_scale": block_scale, "weight_scale_2": scale_2}


def _fp8_block(w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Fine-grained FP8 (DeepSeek-V3 / Qwen3-FP8): e4m3 weight, fp32 ``weight_scale_inv``
    [ceil(N/128), ceil(K/128)], one per 128x128 tile; a tile at the edge scales by its own amax.

    Verified in transformers 5.23 ``integrations/finegrained_fp8.py``: ``weight_scale_inv`` is a
    multiplier (``Fp8Dequantize``: weight.float() * scale over the tile), = tile amax / 448.
    """
    n, k = w.shape
    nr, nc = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(nr * FP8_BLOCK, nc * FP8_BLOCK)
    padded[:n, :k] = w.float()
    tiles = padded.reshape(nr, FP8_BLOCK, nc, FP8_BLOCK)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale_inv[:, None, :, None]).reshape(nr * FP8_BLOCK, nc * FP8_BLOCK)[:n, :k]
    return {"weight": _to_e4m3(q).contiguous(), "weight_scale_inv": scale_inv.float()}


def _gptq(w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """AutoGPTQ (``checkpoint_format`` "gptq", i.e. v1) 4-bit asymmetric, group 32, desc_act off.

    Round-to-nearest with AutoGPTQ's ``Quantizer.find_params`` grid: per group, xmin =
    min(min, 0), xmax = max(max, 0), scale = (xmax - xmin) / 15, zero = round(-xmin / scale),
    q = clamp(round(w / scale) + zero, 0, 15). (GPTQ's Hessian-based error feedback only changes
    which q are chosen; the stored layout is the same.) Scales are fp16 and q is computed with
    the fp16 scale, as the packer does. Layout, verified in AutoGPTQ's ``QuantLinear.pack``
    (qlinear_cuda_old.py: ``qweight[row] |= intweight[j] << 4 * (j - i)`` over K, then ``zeros
    -= 1`` cast to uint32 and ``qzeros[:, col] |= zeros[:, j] << 4 * (j - i)`` over N): ``qweight``
    int32 [K/8, N], K-index 8r+j in nibble j of row r; ``qzeros`` int32 [K/g, N/8] holds
    zero - 1 (the v1 offset) with column 8c+j in nibble j; ``scales`` fp16 [K/g, N];
    ``g_idx`` int32 [K] = k // g. W = (q - zero) * scale.

    A group whose zero would be 0 (no negative value at all) gets zero 1 instead: v1 cannot
    store zero - 1 = -1 (AutoGPTQ's uint32 cast would smear it over the word). The decode still
    matches the stored tensors; it only clips that group's largest value to 14 * scale.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale16 = ((hi - lo) / 15).clamp(min=1e-8).half()
    s = scale16.float()
    zero = (-lo / s).round().clamp(1, 15)
    q = ((g / s[..., None]).round() + zero[..., None]).clamp(0, 15).reshape(n, k)
    return {
        "qweight": _pack_nibbles(q).T.contiguous(),  # packed along K, then [K/8, N]
        "qzeros": _pack_nibbles((zero - 1).T.contiguous()),
        "scales": scale16.T.contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32) // INT4_GROUP,
    }


def _awq(w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """AutoAWQ GEMM 4-bit, group 32, zero_point on.

    Round-to-nearest with AutoAWQ's ``pseudo_quantize_tensor`` grid: per group scale =
    clamp(max - min, 1e-5) / 15, zero = clamp(-round(min / scale), 0, 15), q = clamp(round(w /
    scale) + zero, 0, 15) (no activation-aware scale search: the search only rescales float
    weights before this step, so the layout is the same). Scales fp16; q uses the fp16 scale.
    Layout (AutoAWQ ``WQLinear_GEMM.from_linear``, and the same ``order_map`` in GPTQModel's
    AWQ packer): intweight is [K, N]; ``qweight`` int32 [K, N/8] with word c's nibble i holding
    column ``8c + order_map[i]``, order_map = [0, 2, 4, 6, 1, 3, 5, 7]; ``qzeros`` int32
    [K/g, N/8] packed the same way, zeros stored as they are (no minus one); ``scales`` fp16
    [K/g, N]. Unpackers undo it with AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7] (column m is
    nibble REVERSE[m]), the inverse permutation. W = (q - zero) * scale.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale16 = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scale16.float()
    zero = (-(lo / s).round()).clamp(0, 15)
    q = ((g / s[..., None]).round() + zero[..., None]).clamp(0, 15).reshape(n, k)
    return {
        "qweight": _pack_nibbles(q.T.contiguous(), AWQ_ORDER),
        "qzeros": _pack_nibbles(zero.T.contiguous(), AWQ_ORDER),
        "scales": scale16.T.contiguous(),
    }


def _ct_int4(w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """compressed-tensors ``pack-quantized``, int4 symmetric, group 32 (llm-compressor W4A16).

    Verified in neuralmagic/compressed-tensors: ``calculate_qparams`` (quantization/utils/
    helpers.py) gives symmetric scale = amax / (bit_range / 2) = amax / 7.5 with q in [-8, 7]
    (so +amax rounds to 8 and clips to 7); ``pack_to_int32`` (compressors/quantized_compressors/
    pack_quantized.py) adds 8 and packs along K, element 8c+i in bits 4i of word c, to
    ``weight_packed`` int32 [N, K/8]; ``compress_weight`` writes ``weight_shape`` as
    ``torch.tensor(weight.shape)``, i.e. int64 [2] (its ``compression_param_info`` says int32:
    loaders must accept both); ``weight_scale`` [N, K/g] has the quantized model's dtype (bf16
    for the usual bf16 models; q is computed with the bf16 scale). W = q * scale.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    scale = (g.abs().amax(-1) / 7.5).clamp(min=torch.finfo(torch.float32).eps).to(CT_SCALE_DTYPE)
    q = (g / scale.float()[..., None]).round().clamp(-8, 7).reshape(n, k)
    return {
        "weight_packed": _pack_nibbles(q + 8),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k], dtype=CT_SHAPE_DTYPE),
    }


_WRITERS: Dict[str, Callable[[torch.Tensor], Dict[str, torch.Tensor]]] = {
    "fp8": _fp8_per_tensor, "nvfp4": _nvfp4, "fp8_block": _fp8_block, "gptq": _gptq, "awq": _awq,
    "ct_int4": _ct_int4,
}


# ---- decoders: the written tensors -> float32 [N, K] --------------------------------------------


def _decode(fmt: str, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weight a format's tensors of one linear stand for (read back from the file)."""
    if fmt == "fp8":
        return t["weight"].float() * t["weight_scale"].float()
    if fmt == "nvfp4":
        packed = t["weight"]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        scale = t["weight_scale"].float().repeat_interleave(NVFP4_GROUP, dim=1)
        return E2M1_VALUES[codes.long()] * scale * t["weight_scale_2"].float()
    if fmt == "fp8_block":
        q = t["weight"].float()
        n, k = q.shape
        s = t["weight_scale_inv"].float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        return q * s[:n, :k]
    if fmt == "gptq":
        q = _unpack_nibbles(t["qweight"].T.contiguous()).T  # [K, N]
        zero = _unpack_nibbles(t["qzeros"]) + 1  # [K/g, N]
        g_idx = t["g_idx"].long()
        return ((q - zero[g_idx]) * t["scales"].float()[g_idx]).T.contiguous()
    if fmt == "awq":
        q = _unpack_nibbles(t["qweight"], AWQ_ORDER)  # [K, N]
        zero = _unpack_nibbles(t["qzeros"], AWQ_ORDER)  # [K/g, N]
        g = q.shape[0] // zero.shape[0]
        w = (q - zero.repeat_interleave(g, 0)) * t["scales"].float().repeat_interleave(g, 0)
        return w.T.contiguous()
    if fmt == "ct_int4":
        n, k = (int(v) for v in t["weight_shape"])
        q = _unpack_nibbles(t["weight_packed"])[:, :k] - 8
        return q * t["weight_scale"].float().repeat_interleave(k // t["weight_scale"].shape[1], 1)
    raise ValueError(f"unknown format {fmt!r}")


# ---- activation fake-quant (what the format does to a quantized linear's input) -----------------


def quantize_activation(fmt: str, x: torch.Tensor, input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` (the input of a quantized linear) quantized and dequantized as the format's runtime
    does it, in float32; weight-only formats return ``x`` unchanged.

    * fp8: static per-tensor, x -> clamp(x / input_scale, +-448).to(e4m3) * input_scale.
    * fp8_block: dynamic, per token and group of 128 channels (the last group may be partial):
      s = max(amax / 448, 1e-12), x -> (x / s).to(e4m3) * s.
    * nvfp4 (W4A4): per token and block of 16 channels, s = e4m3(amax / 6 / input_scale) (the
      cast saturating at 448, for tokens louder than the calibration),
      x -> e2m1_round(x / (s * input_scale)) * s * input_scale, 0 where s is 0.
    """
    if fmt == "fp8":
        s = input_scale.float()
        return _to_e4m3(x.float() / s).float() * s
    if fmt == "fp8_block":
        k = x.shape[-1]
        groups = -(-k // FP8_BLOCK)
        xp = torch.nn.functional.pad(x.float(), (0, groups * FP8_BLOCK - k))
        xg = xp.reshape(*x.shape[:-1], groups, FP8_BLOCK)
        s = (xg.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return ((xg / s).to(torch.float8_e4m3fn).float() * s).reshape(*x.shape[:-1], -1)[..., :k]
    if fmt == "nvfp4":
        g = input_scale.float()
        xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_GROUP, NVFP4_GROUP)
        s = _to_e4m3(xb.abs().amax(-1, keepdim=True) / E2M1_MAX / g).float()
        denom = s * g
        q = e2m1_round(xb / torch.where(s == 0, torch.ones_like(denom), denom)) * denom
        return torch.where(s == 0, torch.zeros_like(q), q).reshape(x.shape)
    return x


_ACT_QUANT = {"fp8", "fp8_block", "nvfp4"}  # the formats that quantize activations
_STATIC_INPUT_SCALE = {"fp8", "nvfp4"}  # ... with a calibrated input_scale in the checkpoint


# ---- the float models -------------------------------------------------------------------------


def _classes(model: str) -> Tuple[type, type]:
    """(config class, causal-LM class) of ``model`` in transformers 5.23."""
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
             "nemotron": ("NemotronConfig", "NemotronForCausalLM")}[model]
    return getattr(transformers, names[0]), getattr(transformers, names[1])


def _init_weights(module: torch.nn.Module, seed: int) -> None:
    """Deterministic weights with a realistic spread (see LINEAR_STD), independent of
    transformers' own init: linears, embeddings and ``lm_head`` normal, norms perturbed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.ndim == 1:  # norm weights (1 or, for LayerNorm1P, 0 centred) and biases
                p.add_(torch.randn(p.shape, generator=gen) * NORM_STD)
            else:
                std = EMBED_STD if "embed_tokens" in name else LM_HEAD_STD if name.startswith("lm_head") else LINEAR_STD
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def _write_float(model: str, directory: str) -> None:
    """The float checkpoint: HF model saved by ``save_pretrained``, generation config, tokenizer."""
    from transformers import GenerationConfig

    from autodeploy.models.tokenizer import save_tokenizer, special_token_ids, train_bpe_tokenizer

    config_cls, model_cls = _classes(model)
    tok = train_bpe_tokenizer(TINY["vocab_size"])
    ids = special_token_ids(tok)
    config = config_cls(**TINY, **_EXTRA[model], **ids)
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    _init_weights(hf, seed=MODELS.index(model))
    hf.save_pretrained(directory)
    GenerationConfig(do_sample=False, **ids).save_pretrained(directory)
    save_tokenizer(tok, directory, model_max_length=TINY["max_position_embeddings"])


def _load_hf(directory: str, model: str, state_dict: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model``'s HF class with the float config of ``directory`` and ``state_dict`` (fp32, eval,
    eager attention so the reference is plain math)."""
    config_cls, model_cls = _classes(model)
    config = config_cls.from_pretrained(directory)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._attn_implementation = "eager"
    hf = model_cls(config).to(torch.float32).eval()
    hf.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    return hf


def _calibrate(model: str, float_dir: str, sd: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Calibration: the largest |input| each quantized linear sees on a batch of random tokens
    (the float model, a fixed generator: the result is deterministic)."""
    hf = _load_hf(float_dir, model, sd)
    amax: Dict[str, float] = {}

    def hook(name: str):
        return lambda mod, args: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item()))

    handles = [hf.get_submodule(name).register_forward_pre_hook(hook(name)) for name in QUANTIZED_LINEARS[model]]
    tokens = torch.randint(0, TINY["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        hf(tokens)
    for h in handles:
        h.remove()
    return amax


# ---- the quantized checkpoints ----------------------------------------------------------------


def _quant_config(fmt: str) -> Tuple[Dict[str, object], Optional[Dict[str, object]]]:
    """(config.json ``quantization_config``, ``hf_quant_config.json`` or None) of ``fmt``."""
    if fmt in ("fp8", "nvfp4"):
        algo = {"fp8": "FP8", "nvfp4": "NVFP4"}[fmt]
        group = {"group_size": NVFP4_GROUP} if fmt == "nvfp4" else {}
        qcfg = {"quant_method": "modelopt", "quant_algo": algo, **group, "exclude_modules": ["lm_head"],
                "producer": dict(MODELOPT_PRODUCER)}
        hf_quant = {"producer": dict(MODELOPT_PRODUCER),
                    "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, **group,
                                     "exclude_modules": ["lm_head"]}}
        return qcfg, hf_quant
    if fmt == "fp8_block":
        # transformers 5.23 FineGrainedFP8Config names the skip list ``modules_to_not_convert``
        # (``ignored_layers`` is accepted as an alias).
        return {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "activation_scheme": "dynamic",
                "fmt": "e4m3", "modules_to_not_convert": ["lm_head"]}, None
    if fmt == "gptq":
        # GPTQConfig reads ``checkpoint_format`` as the legacy name of ``format`` ("gptq" = v1,
        # zeros stored minus one).
        return {"quant_method": "gptq", "bits": 4, "group_size": INT4_GROUP, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq"}, None
    if fmt == "awq":
        # AwqConfig reads ``version`` as the legacy name of ``format``.
        return {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP, "version": "gemm", "zero_point": True,
                "modules_to_not_convert": ["lm_head"]}, None
    if fmt == "ct_int4":
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                "group_size": INT4_GROUP},
                    "input_activations": None, "output_activations": None}}}, None
    raise ValueError(f"unknown format {fmt!r}")


def _write_quantized(model: str, fmt: str, directory: str) -> None:
    """Quantize the float checkpoint's linears to ``fmt``; copy every other file and tensor."""
    float_dir = float_checkpoint(model)
    sd = load_file(os.path.join(float_dir, "model.safetensors"))
    amax = _calibrate(model, float_dir, sd) if fmt in _STATIC_INPUT_SCALE else {}
    out: Dict[str, torch.Tensor] = {}
    linears = set(QUANTIZED_LINEARS[model])
    for name, t in sd.items():
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix not in linears:
            out[name] = t
            continue
        out.update({f"{prefix}.{k}": v for k, v in _WRITERS[fmt](t).items()})
        if fmt in _STATIC_INPUT_SCALE:
            bound = FP8_MAX if fmt == "fp8" else E2M1_MAX * FP8_MAX
            out[f"{prefix}.input_scale"] = torch.tensor(amax[prefix] / bound, dtype=torch.float32)
    shutil.copytree(float_dir, directory, ignore=shutil.ignore_patterns("*.safetensors", ".writer-version"))
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    qcfg, hf_quant = _quant_config(fmt)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    if hf_quant is not None:
        with open(os.path.join(directory, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant, f, indent=2)


def _valid(path: str, version: str) -> bool:
    try:
        with open(os.path.join(path, ".writer-version")) as f:
            written = f.read().strip()
    except OSError:
        return False
    return written == version and os.path.exists(os.path.join(path, "model.safetensors"))


def cached_checkpoint(name: str, write: Callable[[str], None], version: str = WRITER_VERSION) -> str:
    """``CKPT_CACHE/name``, written by ``write`` once per writer ``version``; atomic (a tmp dir,
    then ``os.replace``), so parallel test processes never see half a checkpoint. Shared by the
    test-checkpoint writers (``quant_moe_checkpoints`` has its own version)."""
    path = os.path.join(CKPT_CACHE, name)
    if _valid(path, version):
        return path
    os.makedirs(CKPT_CACHE, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    with open(os.path.join(tmp, ".writer-version"), "w") as f:
        f.write(version)
    if os.path.exists(path) and not _valid(path, version):  # stale (older writer): move it out of the way
        stale = f"{path}.stale{os.getpid()}"
        try:
            os.replace(path, stale)
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    try:
        os.replace(tmp, path)
    except OSError:  # another process put a checkpoint there first
        shutil.rmtree(tmp, ignore_errors=True)
        if not _valid(path, version):
            raise
    return path


_cached = cached_checkpoint


def float_checkpoint(model: str) -> str:
    """The float original of ``model``'s quantized checkpoints (cached directory)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; one of {MODELS}")
    return _cached(f"quant-{model}-float", lambda d: _write_float(model, d))


def quantized_checkpoint(model: str, fmt: str) -> str:
    """``model`` quantized to ``fmt`` (one of ``FORMATS``), as a cached checkpoint directory."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    float_checkpoint(model)
    return _cached(f"quant-{model}-{fmt}", lambda d: _write_quantized(model, fmt, d))


_SUFFIXES = {"fp8": ("weight", "weight_scale", "input_scale"),
             "nvfp4": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
             "fp8_block": ("weight", "weight_scale_inv"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
             "awq": ("qweight", "qzeros", "scales"), "ct_int4": ("weight_packed", "weight_scale", "weight_shape")}


def dequantized_state_dict(model: str, fmt: str) -> Dict[str, torch.Tensor]:
    """The whole float32 state dict the quantized checkpoint stands for: each quantized linear's
    ``weight`` decoded from the tensors read back from its safetensors file, everything else as
    stored. Keys are the float checkpoint's."""
    sd = load_file(os.path.join(quantized_checkpoint(model, fmt), "model.safetensors"))
    out: Dict[str, torch.Tensor] = {}
    linears = set(QUANTIZED_LINEARS[model])
    for prefix in linears:
        out[f"{prefix}.weight"] = _decode(fmt, {s: sd[f"{prefix}.{s}"] for s in _SUFFIXES[fmt]})
    for name, t in sd.items():
        if name.rpartition(".")[0] not in linears:
            out[name] = t.float()
    return out


def input_scales(model: str, fmt: str) -> Dict[str, torch.Tensor]:
    """The calibrated ``input_scale`` of each quantized linear (fp8 and nvfp4 only; else empty)."""
    if fmt not in _STATIC_INPUT_SCALE:
        return {}
    sd = load_file(os.path.join(quantized_checkpoint(model, fmt), "model.safetensors"))
    return {p: sd[f"{p}.input_scale"] for p in QUANTIZED_LINEARS[model]}


def reference_model(model: str, fmt: str) -> torch.nn.Module:
    """The float computation a quantized runtime of ``quantized_checkpoint(model, fmt)`` should
    approximate: the HF model class (fp32, eval, eager attention) with the dequantized weights,
    and, where ``fmt`` quantizes activations (fp8, fp8_block, nvfp4), a forward pre-hook on each
    quantized linear that fake-quantizes its input (``quantize_activation``)."""
    hf = _load_hf(quantized_checkpoint(model, fmt), model, dequantized_state_dict(model, fmt))
    if fmt in _ACT_QUANT:
        scales = input_scales(model, fmt)
        for name in QUANTIZED_LINEARS[model]:
            scale = scales.get(name)
            hf.get_submodule(name).register_forward_pre_hook(
                lambda mod, args, scale=scale: (quantize_activation(fmt, args[0], scale).to(args[0].dtype),)
                + tuple(args[1:])
            )
    return hf


def float_model(model: str) -> torch.nn.Module:
    """The float original as an HF model (fp32, eval, eager attention), for comparisons."""
    directory = float_checkpoint(model)
    return _load_hf(directory, model, load_file(os.path.join(directory, "model.safetensors")))
