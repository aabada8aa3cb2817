"""State-cache models through the engine: greedy tokens equal HF eager's, with chunked prefill and
under preemption (a preempted sequence gives its slot back and restarts from an empty state).

Models: a pure SSM (Mamba2: conv + SSD scan, no paged cache at all) and a hybrid (Qwen3-Next:
conv + gated delta rule beside attention layers), real tiny checkpoints.
"""

import pytest
import torch

from autodeploy import LLM, SamplingParams
from helpers import coverage_checkpoint, hf_model

NEW = 16
PROMPT_LENGTHS = (30, 9, 17, 5)
# 16-token steps (the 30- and 17-token prompts are chunked), 4-token pages, a pool too small
# for all four at once (they need 32 pages at the end): the engine must preempt
SMALL = dict(max_seq_len=64, max_batch_size=4, max_num_tokens=16, page_size=4)
POOL = {"initialize_cache": {"num_pages": 20}}


def _prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(path, prompts):
    model = hf_model(path)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("model_type,mode", [("mamba2", "state"), ("qwen3_next", "paged_kv+state")])
def test_chunked_prefill_and_preemption_give_hf_tokens(model_type, mode):
    path, vocab = coverage_checkpoint(model_type)
    prompts = _prompts(vocab)
    ref = _hf_greedy(path, prompts)
    llm = LLM(path, transforms=POOL, **SMALL)
    assert llm.build.context.cache_mode == mode
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert [list(o.token_ids) for o in outs] == ref
    # every slot is back once nothing runs
    assert sorted(scheduler.free_slots) == list(range(SMALL["max_batch_size"]))
    # a second round reuses the slots the first one dirtied: same tokens
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params)
    assert [list(o.token_ids) for o in again] == ref[:2]
