"""Tiny real Qwen3-MoE and DeepSeek-V3 checkpoints with quantized experts, and an honest float reference.

autodeploy's loading of quantized mixture-of-experts checkpoints is tested against the checkpoints
written here. The per-linear numerics (ModelOpt FP8 per-tensor, ModelOpt NVFP4, fine-grained FP8
128x128 blocks) are the dense writer's (``tests/quant_checkpoints.py``: ``_WRITERS``, ``_decode``,
``quantize_activation``), which implements them from the formats' published layouts; like it,
this module shares no code with ``autodeploy.ops.quant`` (a bug copied into both sides would pass).

* ``float_checkpoint(model)``: a tiny ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM`` (seeded
  weights with a realistic spread) saved by ``save_pretrained`` in float32, plus a BPE tokenizer.
* ``quantized_checkpoint(model, fmt)``: that checkpoint with every routed expert projection
  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`` (and the dense linears of
  ``QUANTIZED_LINEARS[(model, fmt)]``) stored in ``fmt`` under the dense writer's per-linear names,
  every other tensor unchanged, and the format's config entries.
* ``dequantized_state_dict(model, fmt)``: the float32 weights decoded from the written file, in the
  checkpoint's per-expert naming.
* ``reference_model(model, fmt)``: the HF model (float32, eval, eager attention and experts) with
  those weights, plus activation fake-quant: a forward pre-hook on each quantized dense linear, and
  a replacement forward of each layer's ``mlp.experts`` that fake-quantizes, per expert, the rows
  routed to it with THAT expert's input scales (static for fp8 / nvfp4, dynamic for fp8_block),
  runs gate / up, ``silu(gate) * up``, fake-quantizes that, runs down, and sums the outputs
  weighted by the routing weights, all in float32.

Layout facts, verified (sources read with the repository search tools):

* transformers 5.23 (``conversion_mapping.py``: ``qwen3_moe`` and ``deepseek_v3`` use the
  ``qwen2_moe`` converters): the modules hold stacked ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate
  rows first: ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)`` of
  ``experts.*.gate_proj.weight`` and ``experts.*.up_proj.weight``) and ``mlp.experts.down_proj``
  [E, H, I]; ``save_pretrained`` writes them back per expert as
  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (checked on the written file).
  The experts' forward is ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
  (``Qwen3MoeExperts`` / ``DeepseekV3Experts``, wrapped by ``use_experts_implementation``). The
  routers (``Qwen3MoeTopKRouter``, ``DeepseekV3TopkRouter``) are not ``nn.Linear``.
* vLLM ``model_executor/layers/quantization/modelopt.py``: ``ModelOptFp8MoEMethod`` loads the
  per-expert tensors into ``w13_weight`` [E, 2I, H] fp8, ``w13_weight_scale`` [E, 2] (gate and up
  keep their own per-tensor scales; requantized to their max at load), ``w2_weight_scale`` [E],
  ``w13_input_scale`` [E] (gate and up of one expert share one slot) and ``w2_input_scale`` [E];
  ``ModelOptNvFp4FusedMoE`` loads ``w13_weight`` uint8 [E, 2I, H/2], ``w13_weight_scale`` e4m3
  [E, 2I, H/16], ``w13_weight_scale_2`` [E, 2] (it warns when gate's and up's differ and uses
  gate's), ``w13_input_scale`` [E, 2] and the ``w2_*`` analogues. Note: for per-tensor FP8 vLLM
  then collapses the per-expert input scales to their max over experts ("Per tensor kernels require
  single activation scale. Use the max."); this reference uses each expert's own stored scale, the
  finer computation the file describes (the two are 5-16% logits rel. RMSE apart here: see
  test_quant_expert_checkpoint_writer.py).
* NVIDIA Model-Optimizer (``modelopt/torch/export/quant_utils.py`` ``preprocess_linear_fusion``,
  ``modelopt/torch/export/moe_utils.py`` ``_export_fused_experts``, ``sync_moe_gate_up_amax``):
  for NVFP4 the weight global amax (so ``weight_scale_2``) is unified over linears that read the
  same input (q/k/v; gate/up, including each expert's gate/up pair: "Serving engines fuse gate_proj
  and up_proj ... and require a single weight_scale_2"); per-tensor FP8 is excluded from that
  fusion (each linear keeps its own ``weight_scale``). This writer does the same: in nvfp4 the
  q/k/v (Qwen3) and every gate/up pair share ``weight_scale_2``; in fp8 nothing is unified. An
  expert that calibration never reached gets the largest input amax among its peers
  (``set_expert_quantizer_amax``: "max from existing quantizers in current batch"); so does this
  writer (per layer, separately for gate/up and for down).
* Calibration (a deliberate difference): ModelOpt calibrates MoE layers with every token sent to
  every expert (``plugins/huggingface.py`` ``_QuantSparseMoe``), so its gate/up input scales are
  equal across a layer's experts. Here each expert's gate/up ``input_scale`` is the amax of the rows
  the float model actually routes to it, and its down ``input_scale`` the amax of its
  ``silu(gate) * up`` on those rows, so every expert's scales differ and a loader that applies one
  expert's scale (or one layer-wide scale) to another is caught. gate and up of one expert get the
  same ``input_scale`` (they read the same input). Dense linears are calibrated as
  ``quant_checkpoints._calibrate`` does. fp8: ``input_scale`` = amax / 448; nvfp4: amax / (6 * 448).
* DeepSeek-V3 (``deepseek-ai/DeepSeek-V3`` README_WEIGHTS.md): ``quantization_config`` =
  ``{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size":
  [128, 128]}``; ``weight_scale_inv`` float32 per 128x128 block, edge blocks zero-padded before the
  scale is taken; dequantization multiplies. A tensor listing of the release layout (DeepSeek-R1,
  same layout; third-party page): ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa`` ([576, 7168],
  scale_inv [5, 56]: partial edge tiles), ``kv_b_proj``, ``o_proj``, the dense MLPs, shared and
  routed experts are F8_E4M3 + F32 ``weight_scale_inv``; ``mlp.gate.weight`` (router) BF16,
  ``mlp.gate.e_score_correction_bias`` F32, norms, embeddings and ``lm_head`` BF16. The releases
  keep their unquantized tensors in bf16; here they stay float32, as in the dense writer.
* DeepSeek nvfp4 quantizes the MLP linears only (dense MLP, shared and routed experts) and leaves
  attention float. Partly verified: the model card of ``nvidia/DeepSeek-R1-FP4-v2`` says it
  "additionally quantizes the wo module in attention layers" compared to ``nvidia/DeepSeek-R1-FP4``,
  consistent with v1 keeping attention unquantized; v1's exact ``exclude_modules`` was not seen.
  It also exercises float linears next to quantized ones.
* Exclude lists name what stays float: ``lm_head``, the routers ``model.layers.*.mlp.gate`` and (for
  DeepSeek nvfp4) ``model.layers.*.self_attn*``; written in ModelOpt's ``exclude_modules``
  (hf_quant_config.json and config.json) and as ``modules_to_not_convert`` for fp8_block. The
  patterns work both as fnmatch wildcards (vLLM's ModelOpt ``is_layer_excluded``) and as
  transformers' ``should_convert_module`` regexes (``mlp.gate`` does not match ``mlp.gate_proj``).

Shapes: Qwen3-MoE hidden 64, moe_intermediate 96 (not the hidden size, so a transposed layout fails
on shapes; a multiple of 16 for NVFP4; below 128, so fine-grained FP8 has partial tiles), 8 experts,
top-2, both layers MoE. DeepSeek-V3: 3 layers (layer 0 dense MLP, 1-2 MoE with one shared
expert), 8 experts in 2 groups, top-2 from 1 group, moe_intermediate 48, MLA with q/kv LoRA rank 32.
Every quantized linear's K is a multiple of 16.

Checkpoints are cached under ``.cache/test-checkpoints/quant_experts-<model>-<fmt>`` (and
``quant_experts-<model>-float``), written atomically; bump ``WRITER_VERSION`` when the numerics or
the layout change.
"""

import json
import os
import shutil
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from quant_checkpoints import (
    _SUFFIXES,
    _WRITERS,
    E2M1_MAX,
    FP8_MAX,
    _decode,
    _init_weights,
    _quant_config,
    cached_checkpoint,
    quantize_activation,
)

# Part of every cached directory's validity: a checkpoint written by an older writer is rewritten.
WRITER_VERSION = "1"

MODELS = ("qwen3_moe", "deepseek_v3")
FORMATS: Dict[str, Tuple[str, ...]] = {"qwen3_moe": ("fp8", "fp8_block", "nvfp4"), "deepseek_v3": ("fp8_block", "nvfp4")}

VOCAB = 512
_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB,
               max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu")
TINY: Dict[str, Dict[str, object]] = {
    "qwen3_moe": dict(_COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, moe_intermediate_size=96,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    # tests/helpers.py MOE_FAMILIES["deepseek_v3"], with 8 experts, 3 layers and moe_intermediate 48
    "deepseek_v3": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, head_dim=8, moe_intermediate_size=48,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32,
                        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}
MOE_LAYER_IDS: Dict[str, Tuple[int, ...]] = {"qwen3_moe": (0, 1), "deepseek_v3": (1, 2)}
MOE_LAYERS: Dict[str, int] = {m: len(ids) for m, ids in MOE_LAYER_IDS.items()}
NUM_EXPERTS: Dict[str, int] = {"qwen3_moe": 8, "deepseek_v3": 8}
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

# Every routed expert projection (per-expert prefix), quantized in every format.
QUANTIZED_EXPERT_PROJS: Dict[str, Tuple[str, ...]] = {
    m: tuple(f"model.layers.{i}.mlp.experts.{e}.{p}" for i in MOE_LAYER_IDS[m] for e in range(NUM_EXPERTS[m])
             for p in EXPERT_PROJS)
    for m in MODELS
}

_QWEN_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_DEEPSEEK_MLPS = tuple([f"model.layers.0.mlp.{p}" for p in EXPERT_PROJS]
                       + [f"model.layers.{i}.mlp.shared_experts.{p}" for i in MOE_LAYER_IDS["deepseek_v3"]
                          for p in EXPERT_PROJS])
_DEEPSEEK_ATTN = tuple(f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in _MLA)
# The dense (nn.Linear) modules each format quantizes besides the routed experts.
QUANTIZED_LINEARS: Dict[Tuple[str, str], Tuple[str, ...]] = {
    **{("qwen3_moe", f): tuple(f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in _QWEN_ATTN)
       for f in FORMATS["qwen3_moe"]},
    ("deepseek_v3", "fp8_block"): _DEEPSEEK_ATTN + _DEEPSEEK_MLPS,
    ("deepseek_v3", "nvfp4"): _DEEPSEEK_MLPS,
}
# What stays float, as exclude patterns (fnmatch wildcards, and transformers-compatible regexes).
FLOAT_PATTERNS: Dict[Tuple[str, str], Tuple[str, ...]] = {
    **{("qwen3_moe", f): ("lm_head", "model.layers.*.mlp.gate") for f in FORMATS["qwen3_moe"]},
    ("deepseek_v3", "fp8_block"): ("lm_head", "model.layers.*.mlp.gate"),
    ("deepseek_v3", "nvfp4"): ("lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"),
}

# Weight init, as quant_checkpoints (its _init_weights is reused: linears, routers and experts
# N(0, 0.08), embeddings 0.5, lm_head 0.25, norms 1 + N(0, 0.1)); DeepSeek's router correction
# bias (a buffer) N(0, BIAS_STD).
BIAS_STD = 0.02
_SEEDS = {"qwen3_moe": 11, "deepseek_v3": 12}

# Calibration batch: random tokens (fixed generator), as quant_checkpoints._calibrate.
CALIB_SHAPE = (4, 32)
CALIB_SEED = 1234

_STATIC_INPUT_SCALE = {"fp8", "nvfp4"}  # formats with a calibrated input_scale per linear
_INPUT_BOUND = {"fp8": FP8_MAX, "nvfp4": E2M1_MAX * FP8_MAX}

# Prompts whose greedy continuation under reference_model(model, fmt), for every fmt, has clear
# top-2 logit gaps at each of the first GREEDY_TOKENS steps (pinned by the writer test; picked from
# 300 random four-word prompts: min gap over formats and steps 0.375 (qwen3_moe) and 0.242
# (deepseek_v3), logits std 1.9-2.1; "The quick brown fox" gets down to 0.085 and 0.011).
GREEDY_PROMPT: Dict[str, str] = {"qwen3_moe": "A small returns data", "deepseek_v3": "The small to the"}
GREEDY_TOKENS = 8


# ---- the float models -------------------------------------------------------------------------


def _classes(model: str) -> Tuple[type, type]:
    """(config class, causal-LM class) of ``model`` in transformers 5.23."""
    import transformers

    names = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
             "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}[model]
    return getattr(transformers, names[0]), getattr(transformers, names[1])


def _check_model(model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; one of {MODELS}")


def _write_float(model: str, directory: str) -> None:
    """The float checkpoint: HF model saved by ``save_pretrained`` (float32, per-expert names),
    generation config, tokenizer."""
    from transformers import GenerationConfig

    from autodeploy.models.tokenizer import save_tokenizer, special_token_ids, train_bpe_tokenizer

    config_cls, model_cls = _classes(model)
    tok = train_bpe_tokenizer(VOCAB)
    ids = special_token_ids(tok)
    config = config_cls(**TINY[model], **ids)
    torch.manual_seed(0)
    hf = model_cls(config).to(torch.float32).eval()
    _init_weights(hf, seed=_SEEDS[model])
    gen = torch.Generator().manual_seed(_SEEDS[model] + 100)
    with torch.no_grad():
        for name, buf in sorted(hf.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * BIAS_STD)
    hf.save_pretrained(directory)
    GenerationConfig(do_sample=False, **ids).save_pretrained(directory)
    save_tokenizer(tok, directory, model_max_length=int(TINY[model]["max_position_embeddings"]))


def _stack_experts(model: str, sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Per-expert state dict (the checkpoint's naming) -> the HF 5.23 module's: per MoE layer,
    ``mlp.experts.gate_up_proj`` [E, 2I, H] = per expert cat(gate, up) (gate rows first) and
    ``mlp.experts.down_proj`` [E, H, I]. float32."""
    out = {k: v.float() for k, v in sd.items() if ".mlp.experts." not in k}
    used = set()
    for i in MOE_LAYER_IDS[model]:
        p = f"model.layers.{i}.mlp.experts"
        gate_up, down = [], []
        for e in range(NUM_EXPERTS[model]):
            names = [f"{p}.{e}.{proj}.weight" for proj in EXPERT_PROJS]
            used.update(names)
            gate_up.append(torch.cat([sd[names[0]].float(), sd[names[1]].float()], dim=0))
            down.append(sd[names[2]].float())
        out[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{p}.down_proj"] = torch.stack(down)
    left = {k for k in sd if ".mlp.experts." in k} - used
    assert not left, f"unexpected expert tensors {sorted(left)[:4]}"
    return out


def _load_hf(directory: str, model: str, state_dict: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model``'s HF class with the float config of ``directory`` and the per-expert
    ``state_dict`` stacked into its expert parameters (float32, eval, eager attention and experts)."""
    config_cls, model_cls = _classes(model)
    config = config_cls.from_pretrained(directory)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    hf = model_cls(config).to(torch.float32).eval()
    hf.load_state_dict(_stack_experts(model, state_dict), strict=True)
    return hf


def _moe_experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor,
                         gate_up_input: Callable[[int, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]],
                         down_input: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed experts of one layer, written out in float32: for each expert, the rows routed to
    it, ``gate_up_input(e, x)`` -> the inputs of its gate and up projections, ``silu(gate) * up``,
    ``down_input(e, h)`` -> the input of its down projection, the output weighted by the routing
    weight and summed per token. (With identity callables this is HF's eager experts loop.)"""
    x = hidden_states.float()
    out = torch.zeros_like(x)
    n_experts, two_i, _ = experts.gate_up_proj.shape
    inter = two_i // 2
    for e in range(n_experts):
        token, slot = torch.nonzero(top_k_index == e, as_tuple=True)
        if token.numel() == 0:
            continue
        w = experts.gate_up_proj[e].float()
        x_gate, x_up = gate_up_input(e, x[token])
        h = F.silu(x_gate @ w[:inter].T) * (x_up @ w[inter:].T)
        y = down_input(e, h) @ experts.down_proj[e].float().T
        out.index_add_(0, token, y * top_k_weights[token, slot].float()[:, None])
    return out.to(hidden_states.dtype)


def _bind_experts(experts: torch.nn.Module, gate_up_input, down_input) -> None:
    """Replace ``experts.forward`` (this instance only) by ``_moe_experts_forward`` with the given
    input transforms; the signature is HF 5.23's ``(hidden_states, top_k_index, top_k_weights)``."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _moe_experts_forward(self, hidden_states, top_k_index, top_k_weights, gate_up_input, down_input)

    experts.forward = types.MethodType(forward, experts)


def calibration_tokens() -> torch.Tensor:
    """The calibration batch (random token ids, fixed generator)."""
    return torch.randint(0, VOCAB, CALIB_SHAPE, generator=torch.Generator().manual_seed(CALIB_SEED))


def _fill_unreached(amax: Dict[int, float], n_experts: int) -> Dict[int, float]:
    """Per-expert amax of one layer and projection kind; an expert no calibration token reached
    gets the largest amax among its layer's experts (ModelOpt's fallback)."""
    if not amax:
        raise ValueError("no expert of the layer was reached by calibration")
    top = max(amax.values())
    return {e: amax.get(e, top) for e in range(n_experts)}


def _calibrate(model: str, float_dir: str, sd: Dict[str, torch.Tensor], dense: Tuple[str, ...]) -> Dict[str, float]:
    """Static input amax of each quantized linear on the calibration batch through the float model:
    dense linears the largest |input| they see; routed experts per expert (see the module doc)."""
    hf = _load_hf(float_dir, model, sd)
    amax: Dict[str, float] = {}

    def record(key: str, t: torch.Tensor) -> None:
        amax[key] = max(amax.get(key, 0.0), t.abs().max().item())

    handles = [hf.get_submodule(name).register_forward_pre_hook(
        lambda mod, args, name=name: record(name, args[0])) for name in dense]
    per_expert: Dict[Tuple[int, str], Dict[int, float]] = {}
    for i in MOE_LAYER_IDS[model]:
        gu, dn = per_expert.setdefault((i, "gate_up"), {}), per_expert.setdefault((i, "down"), {})

        def gate_up_input(e, x, gu=gu):
            gu[e] = max(gu.get(e, 0.0), x.abs().max().item())
            return x, x

        def down_input(e, h, dn=dn):
            dn[e] = max(dn.get(e, 0.0), h.abs().max().item())
            return h

        _bind_experts(hf.model.layers[i].mlp.experts, gate_up_input, down_input)
    with torch.no_grad():
        hf(calibration_tokens())
    for h in handles:
        h.remove()
    for (i, kind), values in per_expert.items():
        for e, a in _fill_unreached(values, NUM_EXPERTS[model]).items():
            projs = ("gate_proj", "up_proj") if kind == "gate_up" else ("down_proj",)
            for proj in projs:
                amax[f"model.layers.{i}.mlp.experts.{e}.{proj}"] = a
    return amax


# ---- the quantized checkpoints ----------------------------------------------------------------


def quant_config(model: str, fmt: str) -> Tuple[Dict[str, object], Optional[Dict[str, object]]]:
    """(config.json ``quantization_config``, ``hf_quant_config.json`` or None): the dense writer's
    entries for ``fmt`` with the exclude list naming what stays float here (``FLOAT_PATTERNS``)."""
    qcfg, hf_quant = _quant_config(fmt)
    patterns = list(FLOAT_PATTERNS[(model, fmt)])
    if fmt == "fp8_block":
        qcfg["modules_to_not_convert"] = patterns
    else:
        qcfg["exclude_modules"] = patterns
        hf_quant["quantization"]["exclude_modules"] = list(patterns)
    return qcfg, hf_quant


def shared_input_groups(model: str, fmt: str) -> List[Tuple[str, ...]]:
    """Groups of quantized linears that read the same input and so (NVFP4 only, as ModelOpt)
    share ``weight_scale_2``: q/k/v (Qwen3), and every gate/up pair (dense MLP, shared experts,
    each routed expert). Empty for the other formats."""
    if fmt != "nvfp4":
        return []
    groups: List[Tuple[str, ...]] = []
    dense = set(QUANTIZED_LINEARS[(model, fmt)])
    for name in QUANTIZED_LINEARS[(model, fmt)]:
        if name.endswith(".q_proj"):
            base = name[: -len("q_proj")]
            groups.append(tuple(base + p for p in ("q_proj", "k_proj", "v_proj")))
        elif name.endswith(".gate_proj"):
            base = name[: -len("gate_proj")]
            assert base + "up_proj" in dense
            groups.append((name, base + "up_proj"))
    for name in QUANTIZED_EXPERT_PROJS[model]:
        if name.endswith(".gate_proj"):
            groups.append((name, name[: -len("gate_proj")] + "up_proj"))
    return groups


def _encode(model: str, fmt: str, sd: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    """prefix -> the format's tensors (suffix -> tensor) of every quantized linear."""
    prefixes = list(QUANTIZED_LINEARS[(model, fmt)]) + list(QUANTIZED_EXPERT_PROJS[model])
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for group in shared_input_groups(model, fmt):
        # NVFP4 of the rows stacked is NVFP4 of each with the group's global amax: the e4m3 block
        # scales depend on their own 16 values and weight_scale_2 only.
        ws = [sd[f"{p}.weight"] for p in group]
        t = _WRITERS[fmt](torch.cat(ws, dim=0))
        row = 0
        for p, w in zip(group, ws):
            n = w.shape[0]
            out[p] = {"weight": t["weight"][row:row + n].clone(), "weight_scale": t["weight_scale"][row:row + n].clone(),
                      "weight_scale_2": t["weight_scale_2"].clone()}
            row += n
    for p in prefixes:
        if p not in out:
            out[p] = _WRITERS[fmt](sd[f"{p}.weight"])
    return out


def _write_quantized(model: str, fmt: str, directory: str) -> None:
    """Quantize the float checkpoint's experts and dense linears to ``fmt``; copy everything else."""
    float_dir = float_checkpoint(model)
    sd = load_file(os.path.join(float_dir, "model.safetensors"))
    static = fmt in _STATIC_INPUT_SCALE
    amax = _calibrate(model, float_dir, sd, QUANTIZED_LINEARS[(model, fmt)]) if static else {}
    encoded = _encode(model, fmt, sd)
    out: Dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix not in encoded:
            out[name] = t
            continue
        out.update({f"{prefix}.{k}": v for k, v in encoded[prefix].items()})
        if static:
            out[f"{prefix}.input_scale"] = torch.tensor(amax[prefix] / _INPUT_BOUND[fmt], dtype=torch.float32)
    assert all(f"{p}.weight" in sd for p in encoded)
    shutil.copytree(float_dir, directory, ignore=shutil.ignore_patterns("*.safetensors", ".writer-version"))
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    qcfg, hf_quant = quant_config(model, fmt)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    if hf_quant is not None:
        with open(os.path.join(directory, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant, f, indent=2)


def _cached(name: str, write: Callable[[str], None]) -> str:
    return cached_checkpoint(name, write, WRITER_VERSION)


# ---- public API --------------------------------------------------------------------------------


def float_checkpoint(model: str) -> str:
    """The float original of ``model``'s quantized checkpoints (cached directory, float32)."""
    _check_model(model)
    return _cached(f"quant_experts-{model}-float", lambda d: _write_float(model, d))


def quantized_checkpoint(model: str, fmt: str) -> str:
    """``model`` with quantized experts in ``fmt`` (one of ``FORMATS[model]``), as a cached directory."""
    _check_model(model)
    if fmt not in FORMATS[model]:
        raise ValueError(f"unknown format {fmt!r} for {model}; one of {FORMATS[model]}")
    float_checkpoint(model)
    return _cached(f"quant_experts-{model}-{fmt}", lambda d: _write_quantized(model, fmt, d))


def quantized_prefixes(model: str, fmt: str) -> Tuple[str, ...]:
    """Every quantized linear of the checkpoint: the dense ones, then the routed expert projections."""
    return tuple(QUANTIZED_LINEARS[(model, fmt)]) + QUANTIZED_EXPERT_PROJS[model]


def _read(model: str, fmt: str) -> Dict[str, torch.Tensor]:
    return load_file(os.path.join(quantized_checkpoint(model, fmt), "model.safetensors"))


def dequantized_state_dict(model: str, fmt: str) -> Dict[str, torch.Tensor]:
    """The whole float32 state dict the quantized checkpoint stands for, in its per-expert naming:
    each quantized linear's ``weight`` decoded from the tensors read back from the file, every
    other tensor as stored. Keys are the float checkpoint's."""
    sd = _read(model, fmt)
    prefixes = set(quantized_prefixes(model, fmt))
    out: Dict[str, torch.Tensor] = {}
    for prefix in prefixes:
        out[f"{prefix}.weight"] = _decode(fmt, {s: sd[f"{prefix}.{s}"] for s in _SUFFIXES[fmt]})
    for name, t in sd.items():
        if name.rpartition(".")[0] not in prefixes:
            out[name] = t.float()
    return out


def input_scales(model: str, fmt: str) -> Dict[str, torch.Tensor]:
    """The calibrated ``input_scale`` of each quantized linear, dense and per expert (fp8 and nvfp4
    only; empty for fp8_block, whose activations are quantized dynamically)."""
    if fmt not in _STATIC_INPUT_SCALE:
        return {}
    sd = _read(model, fmt)
    return {p: sd[f"{p}.input_scale"] for p in quantized_prefixes(model, fmt)}


def _reference(model: str, fmt: str, directory: str, state_dict: Dict[str, torch.Tensor],
               scales: Dict[str, torch.Tensor], quantize_activations: bool = True) -> torch.nn.Module:
    """The HF model with ``state_dict`` (per-expert naming), the experts' forward replaced by
    ``_moe_experts_forward`` and, with ``quantize_activations``, ``fmt``'s activation fake-quant on
    every quantized linear's input (``scales``: static input scales by prefix, fp8 / nvfp4)."""
    hf = _load_hf(directory, model, state_dict)

    def q(x: torch.Tensor, prefix: str) -> torch.Tensor:
        if not quantize_activations:
            return x
        return quantize_activation(fmt, x, scales.get(prefix)).to(x.dtype)

    if quantize_activations:
        for name in QUANTIZED_LINEARS[(model, fmt)]:
            hf.get_submodule(name).register_forward_pre_hook(
                lambda mod, args, name=name: (q(args[0], name),) + tuple(args[1:]))
    for i in MOE_LAYER_IDS[model]:
        p = f"model.layers.{i}.mlp.experts"

        def gate_up_input(e, x, p=p):
            return q(x, f"{p}.{e}.gate_proj"), q(x, f"{p}.{e}.up_proj")

        def down_input(e, h, p=p):
            return q(h, f"{p}.{e}.down_proj")

        _bind_experts(hf.model.layers[i].mlp.experts, gate_up_input, down_input)
    return hf


def reference_model(model: str, fmt: str) -> torch.nn.Module:
    """The float computation a quantized runtime of ``quantized_checkpoint(model, fmt)`` should
    approximate (up to its GEMMs' accumulation order): the HF model class (float32, eval, eager
    attention and experts) with ``dequantized_state_dict(model, fmt)``, a forward pre-hook on each
    quantized dense linear that fake-quantizes its input, and per-expert activation fake-quant
    inside the routed experts (each expert with its own input scales)."""
    return _reference(model, fmt, quantized_checkpoint(model, fmt), dequantized_state_dict(model, fmt),
                      input_scales(model, fmt))


def float_model(model: str) -> torch.nn.Module:
    """The float original as an HF model (float32, eval, eager attention and experts), for comparisons."""
    directory = float_checkpoint(model)
    return _load_hf(directory, model, load_file(os.path.join(directory, "model.safetensors")))

