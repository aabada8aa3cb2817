"""Acceptance (issue 18, DSA): DeepSeek Sparse Attention models run with the MLA latent cache and an
indexer-key cache, not in recompute mode, and give HF eager's greedy tokens with a top-k (4) far
below the sequence lengths (up to 48 tokens), so the sparse selection is in play at every step.

The coverage sweep checks the DSA types at their default top-k (2048, dense at its lengths);
this is the sparse case. DeepSeek-V3.2 (half-split indexer RoPE) and HY-V4 (the roped part last,
the scale on the head weights, per-head attention sinks, and "shared" layers reusing the previous
layer's selection: 3 MLA layers, 2 indexers) run by default, GLM-MoE-DSA (interleaved RoPE) with
``-m slow``.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.coverage.configs import tiny_config
from helpers import _cached_checkpoint, count_op

ad = torch.ops.autodeploy
PROMPTS = ["The for statement", "x", "A class definition defines a class object and the body of the class is executed",
           "Exceptions are raised when"]
NEW_TOKENS, TOPK = 24, 4


def _checkpoint(model_type: str) -> str:
    config = tiny_config(model_type, "a")
    config.get("text_config", config)["index_topk"] = TOPK
    return _cached_checkpoint(f"dsa-sparse-{model_type}", config)


INDEXERS = {"deepseek_v32": (2, 2), "hy_v4": (3, 2), "glm_moe_dsa": (2, 2)}  # (MLA layers, indexers)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "hy_v4", pytest.param("glm_moe_dsa", marks=pytest.mark.slow)])
def test_sparse_attention_greedy_tokens_equal_hf(model_type):
    checkpoint = _checkpoint(model_type)
    llm = LLM(checkpoint, max_seq_len=96, max_batch_size=4, max_num_tokens=128, log_summary=False)
    cache = llm.build.cache
    assert llm.build.context.cache_mode == "paged_kv"
    layers = sum(name.startswith("mla_cache_") for name in cache.paged_names)
    indexers = sum(name.startswith("index_cache_") for name in cache.paged_names)
    assert (layers, indexers) == INDEXERS[model_type]
    assert count_op(llm.build.graph_module, ad.torch_cached_dsa_indexer) == indexers
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref, prompt
