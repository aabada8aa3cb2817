"""Write a ~200M-parameter GPT-OSS-style checkpoint with MXFP4 experts, and its float twin,
for the quantized-MoE benchmark (``benchmarks/RESULTS.md``, "MXFP4 experts").

    .venv/bin/python benchmarks/make_gpt_oss_mxfp4.py            # -> .cache/bench/gpt-oss-200m-{float,mxfp4}

The float checkpoint has random weights (std 0.02, seeded) rounded through MXFP4, so both
checkpoints hold the same model: the float one stores the experts decoded, the MXFP4 one stores
them as OpenAI's releases do (``experts.{gate_up,down}_proj_{blocks,scales}``, uint8, groups of
32 along the input, low nibble first, ``quantization_config: {quant_method: mxfp4}``). The
encoder is ``autodeploy.ops.quant.formats.quantize_mxfp4`` (a benchmark input, not a test
reference: the tests use the independent writer in ``tests/quant_moe_checkpoints.py``).
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file

# ~200M parameters: 12 layers of 8 experts (top-2) with hidden 768 and expert width 768
CONFIG = dict(model_type="gpt_oss", hidden_size=768, intermediate_size=768, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_local_experts=8,
              num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096, sliding_window=128,
              tie_word_embeddings=False)
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from autodeploy.ops.quant.formats import dequantize_mxfp4, quantize_mxfp4

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
    float_dir = os.path.join(args.out, "gpt-oss-200m-float")
    mx_dir = os.path.join(args.out, "gpt-oss-200m-mxfp4")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    mx = {}
    for key, value in sd.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(value.transpose(1, 2))  # stored [E, out, in]
            mx[f"{key}_blocks"], mx[f"{key}_scales"] = blocks, scales
            sd[key] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            mx[key] = value
    model.load_state_dict(sd)
    model.save_pretrained(float_dir)
    os.makedirs(mx_dir, exist_ok=True)
    config.save_pretrained(mx_dir)
    save_file(mx, os.path.join(mx_dir, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(mx_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.0f}M parameters: {float_dir} ({_size(float_dir)}), {mx_dir} ({_size(mx_dir)})")


def _size(directory: str) -> str:
    total = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return f"{total / 2**20:.0f} MiB"


if __name__ == "__main__":
    main()
