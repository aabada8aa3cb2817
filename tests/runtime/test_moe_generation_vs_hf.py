"""Acceptance (issue 7, MoE): tiny Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and GPT-OSS
checkpoints (4 experts, top-2) run the full default pipeline (export, canonicalisation, fusions
including fuse_moe, cached attention, engine): greedy generation is token-identical to HF
``generate`` (eager, fp32) and the uncached graph's logits equal HF's within 1e-4 relative RMSE at
two shapes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.transform.interface import Stage
from helpers import MOE_FAMILIES, MOE_LAYERS, build, count_op, moe_family_checkpoint, rel_rmse

ad = torch.ops.autodeploy
PROMPTS = [
    "The for statement",
    "x",
    "A class definition defines a class object and the body of the class is executed",
    "Exceptions are raised when",
]
NEW_TOKENS = 32
SHAPES = [(2, 11), (3, 1)]


def _families(fast):
    return [f if f in fast else pytest.param(f, marks=pytest.mark.slow) for f in sorted(MOE_FAMILIES)]


# The default run keeps the logits of both weight layouts (per-expert Qwen2-MoE with its gated
# shared expert, stacked GPT-OSS) and the generation of one; `-m slow` runs all six families.


@pytest.fixture(scope="module")
def hf_model():
    cache = {}

    def get(family):
        if family not in cache:
            model = AutoModelForCausalLM.from_pretrained(moe_family_checkpoint(family), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, like ignore_eos
            cache[family] = model
        return cache[family]

    return get


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("family", _families({"qwen2_moe", "gpt_oss"}))
def test_logits_match_hf(family, hf_model):
    result = build(moe_family_checkpoint(family), up_to=Stage.POST_LOAD_FUSION, max_seq_len=64, max_batch_size=4)
    gm = result.graph
    # the default CPU path: fuse_moe's grouped op, its experts packed for oneDNN by select_moe_backend
    assert count_op(gm, ad.onednn_grouped_moe_fused) == MOE_LAYERS[family]
    assert count_op(gm, [ad.torch_moe, ad.torch_moe_fused, ad.grouped_moe_fused]) == 0
    hf = hf_model(family)
    for batch, seq in SHAPES:
        ids = torch.randint(0, MOE_FAMILIES[family]["vocab_size"], (batch, seq))
        pos = torch.arange(seq).expand(batch, seq)
        with torch.no_grad():
            ref = hf(input_ids=ids, position_ids=pos).logits
            out = gm(ids, pos)
        assert out.shape == ref.shape
        assert rel_rmse(out, ref) < 1e-4, (family, batch, seq, rel_rmse(out, ref))


@pytest.mark.parametrize("family", _families({"qwen2_moe"}))
def test_greedy_generation_matches_hf(family, hf_model):
    llm = LLM(moe_family_checkpoint(family), max_seq_len=96, max_batch_size=4, max_num_tokens=128)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    model = hf_model(family)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref, f"{family}: {prompt!r} diverged at {_first_diff(out.token_ids, ref)}"
        assert out.finish_reason == "length"
