"""Prefix caching of a state-cache model and the logits processors, on a GPU (``make test-gpu``).

Both were built on CPU machines. On CUDA the state copies are ``copy_`` between the captured
graphs' state caches and the snapshot rows (the graphs hold the caches by address, which a copy
keeps), and the penalties scatter into logits on the device. Each test compares with HF eager
(float32) on the same GPU. Deselected by ``make test`` and skipped without CUDA; run with
``DEVICE=cpu`` in the environment they check the same on the CPU (how they were written).
"""

import os
import random

import pytest
import torch

from autodeploy import LLM, SamplingParams
from helpers import coverage_checkpoint

DEVICE = os.environ.get("DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (make test-gpu)")]
NEW = 6


def _hf(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()


def _hf_generate(model, prompt, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=DEVICE), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["auto", "torch-cudagraph"] if DEVICE == "cuda" else ["auto"])
def test_state_snapshots_resume_mamba2_with_hf_tokens(backend):
    path, vocab = coverage_checkpoint("mamba2")
    llm = LLM(path, device=DEVICE, dtype="float32", max_seq_len=64, max_batch_size=4, page_size=4,
              max_num_tokens=64, compile_backend=backend)
    rng = random.Random(0)
    head = [rng.randrange(3, vocab) for _ in range(22)]
    prompts = [head + [5, 6, 7], head + [8], [rng.randrange(3, vocab) for _ in range(30)], head + [9, 10, 11, 12]]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    store = llm.engine.snapshots
    assert (llm.engine.scheduler.prefix_hit_tokens, store.num_saved, store.num_restored) == (20, 1, 1)
    model = _hf(path)
    assert [list(o) for o in outs] == [_hf_generate(model, p) for p in prompts]
    llm.shutdown()


def test_penalties_and_logit_bias_give_hf_tokens():
    from helpers import family_checkpoint

    path = family_checkpoint("llama")
    llm = LLM(path, device=DEVICE, dtype="float32", max_seq_len=64, max_batch_size=4)
    prompts = [[3, 17, 29, 41, 5, 11, 2], [7, 8, 9]]
    plain = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], plain)
    bias = {first[0].outputs[0].token_ids[2]: -50.0, 77: 3.0}
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=0.5,
                            logit_bias=bias)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert outs != [list(o.outputs[0].token_ids) for o in first]
    model = _hf(path)
    want = [_hf_generate(model, p, repetition_penalty=0.5, sequence_bias={(t,): b for t, b in bias.items()})
            for p in prompts]
    assert outs == want
    llm.shutdown()
