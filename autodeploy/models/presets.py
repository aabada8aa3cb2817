"""Built-in model presets: an HF config plus a seed, materialised once as a real checkpoint.

On first use a preset is written to ``$AUTODEPLOY_CACHE/presets/<name>`` (default
``~/.cache/autodeploy``): ``config.json``, ``model.safetensors``, ``generation_config.json`` and a
trained byte-level BPE tokenizer. From then on it is loaded by exactly the code that loads a
user's checkpoint directory, so presets exercise the real loading path.
"""

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..utils.errors import ModelSourceError
from ..utils.logging import get_logger
from ..utils.paths import cache_root

logger = get_logger(__name__)

PRESET_FORMAT_VERSION = 2  # 2: the tokenizer's chat template renders tools and tool calls
DEFAULT_PRESET = "demo"


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: Dict[str, Any]
    seed: int = 0
    # A committed checkpoint directory (relative to this package) instead of random weights.
    bundled_dir: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    # The dtype the weights are saved in: bfloat16 halves the disk and the write time of the big
    # GPU preset; the small ones stay float32 so that every dtype a test asks for is exact.
    save_dtype: str = "float32"

    def fingerprint(self) -> str:
        key: Dict[str, Any] = {"v": PRESET_FORMAT_VERSION, "config": self.config, "seed": self.seed}
        if self.save_dtype != "float32":  # keeps the float32 presets' fingerprints (and caches) as they were
            key["save_dtype"] = self.save_dtype
        blob = json.dumps(key, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tiny(model_type: str, **overrides: Any) -> Dict[str, Any]:
    base = dict(
        model_type=model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return base


PRESETS: Dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("demo", "4M-parameter Llama trained on Python's pydoc topics (scripts/train_demo_model.py); "
               "writes English about Python", {"model_type": "llama"}, bundled_dir="demo"),
        Preset("tiny-llama", "2-layer Llama, hidden 64, GQA 4/2 heads, random weights",
               _tiny("llama")),
        Preset("tiny-mistral", "2-layer Mistral with a 16-token sliding window, random weights",
               _tiny("mistral", sliding_window=16)),
        Preset("tiny-qwen2", "2-layer Qwen2 (q/k/v biases), random weights", _tiny("qwen2")),
        Preset("tiny-qwen3", "2-layer Qwen3 (QK-norm), random weights", _tiny("qwen3")),
        Preset("tiny-gemma", "2-layer Gemma (scaled embeddings, 1+w RMSNorm, tied head), random weights",
               _tiny("gemma", tie_word_embeddings=True)),
        Preset("tiny-phi3", "2-layer Phi-3 (fused qkv and gate/up weights), random weights",
               _tiny("phi3", pad_token_id=0)),
        Preset("small", "~125M Llama (hidden 768, 12 layers, 12/4 heads, vocab 32000), random weights; benchmarks",
               dict(model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                    max_position_embeddings=4096, tie_word_embeddings=False)),
        Preset("small-gpt2", "~110M GPT-2 (hidden 768, 12 layers, 12 heads, tanh-GELU MLP, LayerNorm, vocab 32000), "
               "random weights; benchmarks of element-wise chains no pattern fusion covers",
               dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_inner=3072, vocab_size=32000,
                    n_positions=2048, activation_function="gelu_new")),
        Preset("medium", "~0.45B Llama (hidden 1024, 24 layers, 16/8 heads, vocab 32000), random weights; benchmarks",
               dict(model_type="llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                    max_position_embeddings=4096, tie_word_embeddings=False)),
        Preset("large", "~1.1B Llama (hidden 2048, 22 layers, 32/4 heads, vocab 32000; TinyLlama's shape), random "
               "bfloat16 weights; GPU benchmarks",
               dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                    max_position_embeddings=4096, tie_word_embeddings=False), save_dtype="bfloat16"),
    ]
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ModelSourceError(f"unknown preset '{name}'; available: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def preset_dir(name: str) -> str:
    """The checkpoint directory of a preset, materialising it on first use."""
    preset = get_preset(name)
    if preset.bundled_dir is not None:
        return os.path.join(os.path.dirname(__file__), preset.bundled_dir)
    target = os.path.join(cache_root(), "presets", name)
    stamp = os.path.join(target, ".autodeploy-preset")
    if os.path.exists(stamp) and open(stamp).read().strip() == preset.fingerprint():
        return target
    logger.info("materialising preset '%s' into %s", name, target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(target))
    try:
        write_random_checkpoint(preset.config, tmp, seed=preset.seed, save_dtype=preset.save_dtype)
        with open(os.path.join(tmp, ".autodeploy-preset"), "w") as f:
            f.write(preset.fingerprint())
        if os.path.exists(target):
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(stamp):  # another process won the race
            return target
        raise
    return target


def write_random_checkpoint(config_dict: Dict[str, Any], directory: str, seed: int = 0,
                            save_dtype: str = "float32", zero_parameter_std: Optional[float] = None) -> str:
    """Write a complete HF checkpoint with seeded random weights and a trained tokenizer.

    The weights are drawn in float32 and saved in ``save_dtype``. Also used by the tests to build
    checkpoints from any transformers config.

    ``zero_parameter_std``: parameters that the model's own init leaves all zero (biases excepted)
    get normal values of this std instead. HF zero-initialises some multiplicative parameters
    (ZAYA's key scale ``temp``, AFMoE's router, xLSTM's gate projections, Gemma-style ``1 + w``
    norms, attention sinks), which would make whole paths of a random model invisible in its
    logits: a checker comparing against HF could not see them computed wrong.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from .tokenizer import save_tokenizer, special_token_ids, train_bpe_tokenizer

    cfg = dict(config_dict)
    model_type = cfg.pop("model_type")
    tok = train_bpe_tokenizer(cfg.get("vocab_size", 512))
    ids = special_token_ids(tok)
    for key, value in ids.items():
        cfg.setdefault(key, value)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if zero_parameter_std is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.is_floating_point() and not name.endswith("bias") and not param.any():
                    param.normal_(0.0, zero_parameter_std)
    if save_dtype != "float32":
        model = model.to(getattr(torch, save_dtype))
    model.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
        do_sample=False,
    ).save_pretrained(directory)
    save_tokenizer(tok, directory, model_max_length=getattr(config, "max_position_embeddings", 2048))
    return directory
