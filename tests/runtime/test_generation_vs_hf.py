"""Acceptance: greedy generation through the cached graph and the engine is token-identical to
HF ``generate`` (eager, same weights, fp32): a batch of 4 prompts of different lengths, 32 new
tokens each, for six families and both CPU attention backends."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from autodeploy import LLM, SamplingParams
from helpers import FAMILIES, family_checkpoint

PROMPTS = [
    "The for statement",
    "x",
    "A class definition defines a class object and the body of the class is executed",
    "Exceptions are raised when",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference():
    cache = {}

    def get(family, tokenizer):
        if family not in cache:
            model = AutoModelForCausalLM.from_pretrained(family_checkpoint(family), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, like ignore_eos
            outs = []
            for prompt in PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
                with torch.no_grad():
                    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                         pad_token_id=0, attention_mask=torch.ones_like(ids))
                outs.append(out[0, ids.shape[1]:].tolist())
            cache[family] = outs
        return cache[family]

    return get


# The default pipeline has every fusion on; the torch-compile case also switches the RMSNorm
# implementation to its compiled kernel, so every transform of the pipeline is exercised.
VARIANTS = {
    "sdpa": dict(attn_backend="sdpa"),
    "torch": dict(attn_backend="torch"),
    "torch-compile": dict(attn_backend="sdpa", compile_backend="torch-compile",
                          transforms={"fuse_rmsnorm": {"backend": "compile"}}),
}


# Suite time: every family runs the default backend (sdpa); the reference backend and the
# torch-compile pipeline run by default for two families and one (llama) each, all six with -m slow
# (torch-compile's tokens are also checked by tests/transforms/test_compile_model_backends.py).
DEFAULT_RUN = {"sdpa": set(FAMILIES), "torch": {"llama", "gemma"}, "torch-compile": {"llama"}}
CASES = [pytest.param(f, v, marks=() if f in DEFAULT_RUN[v] else pytest.mark.slow)
         for f in sorted(FAMILIES) for v in sorted(VARIANTS)]


@pytest.mark.parametrize("family, variant", CASES)
def test_greedy_generation_matches_hf(family, variant, hf_reference):
    llm = LLM(family_checkpoint(family), max_seq_len=96, max_batch_size=4, max_num_tokens=128, **VARIANTS[variant])
    backend = variant
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    expected = hf_reference(family, llm.tokenizer)
    for prompt, out, ref in zip(PROMPTS, outputs, expected):
        assert out.token_ids == ref, f"{family}/{backend}: {prompt!r} diverged at {_first_diff(out.token_ids, ref)}"
        assert out.finish_reason == "length"


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
