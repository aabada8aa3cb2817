"""Greedy tokens through ``LLM`` at world size 2 and 4 equal HF's (and so world size 1's) for the
families the sharding has to get right: GQA with fewer KV heads than ranks (Qwen3 at 4: each KV
head replicated on two ranks), per-head q/k norms (Qwen3), expert parallelism (Mixtral, Qwen3-MoE),
Gemma's (1 + w) norms and tied head (kept whole), GPT-OSS's attention sinks (split with their
heads), half-table RoPE and alternating sliding windows. Rank 0 schedules and samples; the others follow.
Each rank reports the bytes of the weights it holds, so the test also pins what a rank saves."""

from functools import partial
from typing import Any, Dict

import pytest
import torch

from helpers import MOE_FAMILIES, family_checkpoint, hf_greedy_tokens, hf_model, moe_family_checkpoint
from test_collectives import _run_ranks

PROMPTS = [[3, 17, 29, 41, 5, 11, 2], [7, 8, 9]]
NEW = 8


def _checkpoint(family: str) -> str:
    return moe_family_checkpoint(family) if family in MOE_FAMILIES else family_checkpoint(family)


def _weight_bytes(module: torch.nn.Module) -> int:
    from autodeploy.transform.interface import model_tensor_bytes

    return model_tensor_bytes(module)


def _job(rank: int, family: str, world: int) -> Dict[str, Any]:
    from autodeploy import LLM, SamplingParams

    llm = LLM(_checkpoint(family), world_size=world, max_seq_len=64, max_batch_size=4, max_num_tokens=64)
    held = _weight_bytes(llm.build.graph)
    if not llm.is_driver:
        llm.follow()
        return {"bytes": held}
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                       SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    llm.shutdown()
    return {"bytes": held, "tokens": [list(o.outputs[0].token_ids) for o in out]}


def _hf_greedy(family: str) -> list:
    return hf_greedy_tokens(_checkpoint(family), PROMPTS, NEW)


@pytest.mark.slow  # 15-40 s each on 2 cores: every rank builds the engine
@pytest.mark.distributed
@pytest.mark.parametrize("family,world", [("llama", 2), ("llama", 4), ("qwen3", 2), ("qwen3", 4), ("gemma", 2),
                                          ("gemma", 4), ("mixtral", 2), ("mixtral", 4), ("qwen3_moe", 2),
                                          ("qwen3_moe", 4), ("gpt_oss", 2)])
def test_greedy_tokens_at_several_ranks_equal_hf(family, world):
    results = _run_ranks(partial(_job, family=family, world=world), world=world, timeout=400)
    for r in results:
        assert "error" not in r, r.get("error")
    assert results[0]["tokens"] == _hf_greedy(family)
    # every rank holds the same share (the embedding, norms and replicated parts are whole on each)
    assert len({r["bytes"] for r in results}) == 1, [r["bytes"] for r in results]
    single = _weight_bytes(hf_model(_checkpoint(family)))
    assert all(r["bytes"] < single for r in results), (single, [r["bytes"] for r in results])


def _state_prefix_job(rank: int, world: int) -> Dict[str, Any]:
    """Qwen3-Next (Gated DeltaNet state caches and attention, both split by heads; the experts
    sharded) with prefix
    caching: three prompts sharing a 22-token head, one after another, and an unrelated one
    before the third (so the slot the third runs in holds another state): the third starts from
    the state copy the second left, which every rank must restore on its own. Then the third's next
    turn (its prompt, its answer and two tokens more) starts from its whole tail: the last page
    copied and the state after its last computed token restored, on every rank."""
    import random

    from autodeploy import LLM, SamplingParams
    from helpers import coverage_checkpoint

    path, vocab = coverage_checkpoint("qwen3_next")
    llm = LLM(path, dtype="float32", world_size=world, max_seq_len=64, max_batch_size=4, page_size=4,
              max_num_tokens=64)
    if not llm.is_driver:
        llm.follow()
        return {}
    rng = random.Random(0)
    head = [rng.randrange(3, vocab) for _ in range(22)]
    prompts = [head + [rng.randrange(3, vocab) for _ in range(k)] for k in (1, 3)]
    prompts += [[rng.randrange(3, vocab) for _ in range(30)], head + [rng.randrange(3, vocab) for _ in range(7)]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in prompts]
    hits = llm.engine.scheduler.prefix_hit_tokens
    prompts.append(prompts[-1] + list(outs[-1].token_ids) + [rng.randrange(3, vocab) for _ in range(2)])
    outs.append(llm.generate([{"prompt_token_ids": prompts[-1]}], params)[0].outputs[0])
    store = llm.engine.snapshots
    llm.shutdown()
    return {"tokens": [list(o.token_ids) for o in outs], "prompts": prompts, "path": path,
            "logprobs": [[step[t] for step, t in zip(o.logprobs, o.token_ids)] for o in outs],
            "hits": (hits, llm.engine.scheduler.prefix_hit_tokens - hits), "tails": llm.engine.pool.num_tail_hits,
            "copies": (store.num_saved, store.num_restored)}


@pytest.mark.slow  # ~40 s on 2 cores: both ranks build a Qwen3-Next
@pytest.mark.distributed
def test_state_snapshots_of_prefix_caching_at_two_ranks_give_hf_tokens():
    results = _run_ranks(partial(_state_prefix_job, world=2), world=2, timeout=400)
    for r in results:
        assert "error" not in r, r.get("error")
    lead = results[0]
    # the next turn: all 29 + 5 tokens the third computed (8 pages and a tail of 2); copies: where
    # the prompts parted, and the final state of each sequence (after a last page, or under a whole tail)
    assert lead["hits"] == (20, 34) and lead["tails"] == 1
    assert lead["copies"] == (1 + 5, 2)
    assert lead["tokens"] == hf_greedy_tokens(lead["path"], lead["prompts"], 6)
    # the greedy tokens of a tiny random model hardly feel its state: its log-probabilities do
    model = hf_model(lead["path"])
    for prompt, tokens, logprobs in zip(lead["prompts"], lead["tokens"], lead["logprobs"]):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
        want = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-4), (logprobs, want.tolist())


def _tail_pages_job(rank: int, world: int) -> Dict[str, Any]:
    """Llama with prefix caching and pages of 4 tokens: a prompt, then the next turn (the prompt,
    its answer and two tokens more), which starts from a copy of the first one's partly filled
    last page: rank 0 sends the copy with the step and every rank copies its own shard."""
    from autodeploy import LLM, SamplingParams

    llm = LLM(_checkpoint("llama"), dtype="float32", world_size=world, max_seq_len=64, max_batch_size=4, page_size=4,
              max_num_tokens=64)
    if not llm.is_driver:
        llm.follow()
        return {}
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)  # 11 + 4 computed: 3 of a last page
    first = llm.generate([{"prompt_token_ids": PROMPTS[0] + [13, 19, 23, 31]}], params)[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids + [43, 47]
    second = llm.generate([{"prompt_token_ids": follow}], params)[0]
    llm.shutdown()
    return {"prompts": [first.prompt_token_ids, follow],
            "tokens": [list(first.outputs[0].token_ids), list(second.outputs[0].token_ids)],
            "tails": llm.engine.pool.num_tail_hits, "hits": llm.engine.scheduler.prefix_hit_tokens}


@pytest.mark.slow  # ~30 s on 2 cores: both ranks build the engine
@pytest.mark.distributed
def test_tail_pages_at_two_ranks_give_hf_tokens():
    results = _run_ranks(partial(_tail_pages_job, world=2), world=2, timeout=400)
    for r in results:
        assert "error" not in r, r.get("error")
    lead = results[0]
    assert lead["tails"] == 1 and lead["hits"] == 11 + 4  # everything the first one computed
    for prompt, tokens in zip(lead["prompts"], lead["tokens"]):
        assert tokens == hf_greedy_tokens(_checkpoint("llama"), [prompt], 5)[0]
