"""Prefix caching on every decode-only type that runs with state caches (docs/coverage.md's
``state`` and ``paged KV + state`` rows): each state op resumes from a restored copy of its state.

Per type, on the coverage sweep's tiny checkpoint: two prompts sharing a 22-token head (the
second computes it again and leaves a copy of the state after its 5 whole pages), an unrelated
prompt (so the slot the next one runs in holds another state), and a third prompt with the same
head, which starts from the copy; then the unrelated prompt's next turn (its prompt, its answer
and two tokens more), which starts from its whole tail: its partly filled last page copied and
the copy of its final state restored. Their greedy tokens and log-probabilities, and every other
prompt's, equal HF's on the whole sequence: a state op whose restored state were not what it
reads (a state outside the state caches, a slot read before the copy) would change them.

Measured 2026-11-29 (AVX2 EPYC): the log-probabilities are within 1.7e-6 of HF's; with the
restore skipped (the third prompt resumes from the unrelated prompt's state) 19 types fail,
by up to 2.6e-2 (zamba2). For bamba, granitemoehybrid, lfm2, lfm2_moe and zamba the tiny random
checkpoints hardly feel the state at that point (the skipped restore changes their
log-probabilities by under 2e-5), so for them the tokens only check that resuming runs. What
bites for every type is the state itself: the copy (every state cache's row) equals the state a
fresh engine holds after a prefill of the 20-token head alone (with the copy taken from the
wrong slot all of those five fail it). cohere_compass_text's only state is its M-RoPE position
delta, which is 0 for text: it has nothing to resume, and its rows are compared all the same.
The next turn (added the same day, Intel AVX-512): with its tail's state copy not restored (it
resumes from whatever its slot held), 21 of the 25 types fail HF's tokens or log-probabilities.
"""

import random

import pytest
import torch

from autodeploy import LLM, SamplingParams
from helpers import coverage_checkpoint, hf_model

STATE_TYPES = [
    "bailing_hybrid", "bamba", "cohere_compass_text", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba",
    "kimi_linear", "lfm2", "lfm2_moe", "lfm3", "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma", "rwkv", "xlstm", "zamba", "zamba2", "zaya",
]
NEW = 6


def _hf_check(path: str, prompt: list, tokens: list, logprobs: list) -> None:
    model = hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]), use_cache=False).logits[0].float()
    rows = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    want = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert rows.argmax(-1).tolist() == tokens  # HF's greedy choice at every step
    assert torch.allclose(torch.tensor(logprobs), want, atol=1e-5), (logprobs, want.tolist())


@pytest.mark.slow  # 50 builds and 25 HF references: 134 s with -n 2 on 2 cores, ~4 min on one
@pytest.mark.parametrize("model_type", STATE_TYPES)
def test_a_restored_state_gives_hf_tokens_and_logprobs(model_type):
    path, vocab = coverage_checkpoint(model_type)
    llm = LLM(path, dtype="float32", max_seq_len=64, max_batch_size=4, page_size=4, max_num_tokens=64)
    assert llm.engine.snapshots is not None, "no state caches: not a state type any more (docs/coverage.md)"
    rng = random.Random(0)
    head = [rng.randrange(3, vocab) for _ in range(22)]
    prompts = [head + [rng.randrange(3, vocab) for _ in range(3)], head + [rng.randrange(3, vocab) for _ in range(1)],
               [rng.randrange(3, vocab) for _ in range(30)], head + [rng.randrange(3, vocab) for _ in range(6)]]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in prompts]  # one by one
    _check_copy_is_the_state_after(path, head[:20], llm)
    prompts.append(prompts[2] + list(outs[2].token_ids) + [rng.randrange(3, vocab) for _ in range(2)])
    outs.append(llm.generate([{"prompt_token_ids": prompts[4]}], params)[0].outputs[0])
    store = llm.engine.snapshots
    # hits: the head's 5 pages, then all 30 + 5 tokens the unrelated prompt computed (7 pages and a
    # tail of 3); copies: where the second prompt parted, and each sequence's final state
    assert (llm.engine.scheduler.prefix_hit_tokens, store.num_saved, store.num_restored) == (20 + 35, 1 + 5, 2)
    assert llm.engine.pool.num_tail_hits == 1
    for prompt, out in zip(prompts, outs):
        _hf_check(path, prompt, list(out.token_ids), [step[t] for step, t in zip(out.logprobs, out.token_ids)])


def _check_copy_is_the_state_after(path: str, prefix: list, llm: LLM) -> None:
    """The copy after ``prefix``'s whole pages equals each state cache's slot in an engine without
    prefix caching that ran ``prefix`` alone (one prefill chunk; the token it samples is never run)."""
    pages, ids = llm.engine.pool.match(prefix + [3])
    llm.engine.pool.free(pages)
    assert len(ids) * 4 == len(prefix) and ids[-1] in llm.engine.snapshots
    copy = {name: t.clone() for name, t in llm.engine.snapshots.copy_of(ids[-1]).items()}
    fresh = LLM(path, dtype="float32", max_seq_len=64, max_batch_size=4, page_size=4, max_num_tokens=64,
                enable_prefix_caching=False)
    fresh.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    slot = 0  # the lowest free slot: the one sequence ran there
    assert sorted(copy) == sorted(fresh.engine.cache.state_names)
    wanted = {name: fresh.engine.cache.caches[name][slot] for name in copy}
    if any(not name.startswith("mrope_delta") for name in copy):  # an M-RoPE delta is 0 for text
        assert any(bool(w.ne(0).any()) for w in wanted.values()), "the fresh engine's states are all zero"
    for name, saved in copy.items():
        assert torch.allclose(saved, wanted[name], rtol=1e-4, atol=1e-6), (name, (saved - wanted[name]).abs().max())
