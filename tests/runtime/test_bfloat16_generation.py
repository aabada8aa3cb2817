"""bfloat16 on the CPU, against HF eager in bfloat16 on the same weights.

The cache-consistency check (``recompute_fallback``) must not take bf16 rounding for state
outside attention: the ``small`` preset's two schedules differ by ~1e-2 in bf16 with no state
anywhere (a decode step reads its keys back from the cache and attends in another kernel than the
prefill did), which a flat 1e-2 tolerance sent to recompute mode (~10x slower, on an AVX-512 CPU).
The engine's answers then follow HF's: teacher-forced on the engine's own greedy tokens, HF picks
the same token at almost every step and the log-probabilities agree to bf16's precision (exact
token equality is not a bf16 contract: near-ties flip with any change of reduction order).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.cache.consistency import tolerance_for
from autodeploy.models.presets import preset_dir
from autodeploy.utils.cpu import native_bf16
from helpers import build

PROMPTS = ["The for statement", "A class definition defines a class object and", "Exceptions are raised when"]
NEW_TOKENS = 16


def test_tolerances_follow_the_dtype_precision():
    assert tolerance_for(torch.float32) == 1e-5
    assert tolerance_for(torch.float16) == 10 * 2 ** -10 and tolerance_for(torch.bfloat16) == 10 * 2 ** -7


@pytest.mark.skipif(not native_bf16(), reason="this CPU emulates bfloat16 GEMMs (~500x slower than float32 on one "
                    "AVX2-only CPU measured): minutes of the default suite for a path auto never takes there")
def test_small_in_bfloat16_keeps_the_kv_cache_and_follows_hf_bfloat16():
    res = build("small", dtype="bfloat16", max_seq_len=64, max_batch_size=4, max_num_tokens=128)
    assert res.context.cache_mode == "paged_kv", res.context.recompute_reason
    del res

    llm = LLM("small", dtype="bfloat16", max_seq_len=64, max_batch_size=4, max_num_tokens=128)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0))
    hf = AutoModelForCausalLM.from_pretrained(preset_dir("small"), dtype=torch.bfloat16).eval()
    agree, steps, worst = 0, 0, 0.0
    for out in outs:
        prompt, tokens = list(out.prompt_token_ids), list(out.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        ref = logits.log_softmax(-1)
        agree += int((ref.argmax(-1) == torch.tensor(tokens)).sum())
        steps += len(tokens)
        ours = torch.tensor([step[t] for step, t in zip(out.outputs[0].logprobs, tokens)])
        worst = max(worst, float((ours - ref[torch.arange(len(tokens)), tokens]).abs().max()))
    assert agree >= 0.85 * steps, (agree, steps)
    assert worst < 0.15, worst


def test_auto_dtype_on_cpu_stays_float32_and_says_when_bf16_is_native(monkeypatch):
    """``dtype: auto`` on CPU is float32 (exact against HF's float32) whatever the CPU; for a bf16
    checkpoint on a CPU with native bf16 one log line says bfloat16 would be faster."""
    from autodeploy.config import deploy_config as module
    from autodeploy.config.deploy_config import load_deploy_config

    said = []  # the module logger's INFO lines (caplog saw them twice after other tests' logging setup)
    monkeypatch.setattr(module.logger, "info", lambda message, *args: said.append(message % args))
    config = load_deploy_config(model="small")
    for native, checkpoint, hint in ((True, torch.bfloat16, True), (True, torch.float32, False),
                                     (False, torch.bfloat16, False)):
        module._hint_bfloat16_once.cache_clear()
        monkeypatch.setattr(module, "native_bf16", lambda: native)
        said.clear()
        assert config.torch_dtype(checkpoint) == torch.float32
        assert config.torch_dtype(checkpoint) == torch.float32  # said once
        assert sum("computes bfloat16 natively" in line for line in said) == int(hint), (native, checkpoint, said)
