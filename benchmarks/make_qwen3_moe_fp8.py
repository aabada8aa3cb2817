"""Write a ~240M-parameter Qwen3-MoE-style checkpoint in fine-grained FP8, and its float twin, for
the quantized-MoE benchmark (``benchmarks/RESULTS.md``, "Fine-grained FP8 experts").

    .venv/bin/python benchmarks/make_qwen3_moe_fp8.py        # -> .cache/bench/qwen3-moe-240m-{float,fp8}

The layout is Qwen3-FP8's and DeepSeek-V3's (``quant_method: fp8``, ``weight_block_size: [128,
128]``, dynamic activations): every attention projection and every expert projection
(``mlp.experts.<e>.{gate,up,down}_proj``) stored as float8_e4m3fn with a ``weight_scale_inv`` per
128x128 tile; the router, norms, embeddings and ``lm_head`` float. The float checkpoint has
random weights (std 0.02, seeded) rounded through the format, so both checkpoints hold the same
weights. The encoder is ``autodeploy.ops.quant.formats.quantize_fp8_blocks`` (a benchmark
input, not a test reference: the tests use ``tests/quant_expert_checkpoints.py``).
"""

import argparse
import json
import os

import torch
from safetensors.torch import load_file, save_file

# ~240M parameters: 12 layers of 16 experts (top-4), hidden 768, expert width 384
CONFIG = dict(model_type="qwen3_moe", hidden_size=768, intermediate_size=2048, moe_intermediate_size=384,
              num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_experts=16,
              num_experts_per_tok=4, norm_topk_prob=True, vocab_size=32000, max_position_embeddings=4096,
              tie_word_embeddings=False)
QUANTIZED = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.o_proj.", ".mlp.experts.")
BLOCK = (128, 128)


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from autodeploy.ops.quant.formats import dequantize_fp8_blocks, quantize_fp8_blocks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(".cache", "bench"))
    args = parser.parse_args()
    raw = dict(CONFIG)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    float_dir = os.path.join(args.out, "qwen3-moe-240m-float")
    fp8_dir = os.path.join(args.out, "qwen3-moe-240m-fp8")
    model.save_pretrained(float_dir)  # per-expert tensors, as the releases name them
    sd = {}
    for f in sorted(os.listdir(float_dir)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(float_dir, f)))
    fp8, decoded = {}, {}
    for key, value in sd.items():
        if key.endswith(".weight") and any(q in key for q in QUANTIZED):
            q, s = quantize_fp8_blocks(value.float(), BLOCK)
            fp8[key], fp8[key[: -len("weight")] + "weight_scale_inv"] = q, s
            decoded[key] = dequantize_fp8_blocks(q, s, BLOCK)
        else:
            fp8[key] = decoded[key] = value
    for f in os.listdir(float_dir):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(float_dir, f))
    save_file(decoded, os.path.join(float_dir, "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(fp8_dir, exist_ok=True)
    config.save_pretrained(fp8_dir)
    save_file(fp8, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(fp8_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head", "mlp.gate"]}
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.0f}M parameters: {float_dir} ({_size(float_dir)}), {fp8_dir} ({_size(fp8_dir)})")


def _size(directory: str) -> str:
    total = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return f"{total / 2**20:.0f} MiB"


if __name__ == "__main__":
    main()
