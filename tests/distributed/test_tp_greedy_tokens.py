"""Greedy tokens through ``LLM`` at world size 2 and 4 equal HF's (and so world size 1's) for the
families the sharding has to get right: GQA with fewer KV heads than ranks (Qwen3 at 4: each KV
head replicated on two ranks), per-head q/k norms (Qwen3), expert parallelism (Mixtral, Qwen3-MoE),
Gemma's (1 + w) norms and tied head (kept whole). Rank 0 schedules and samples; the others follow.
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
                                          ("qwen3_moe", 4)])
def test_greedy_tokens_at_several_ranks_equal_hf(family, world):
    results = _run_ranks(partial(_job, family=family, world=world), world=world, timeout=400)
    for r in results:
        assert "error" not in r, r.get("error")
    assert results[0]["tokens"] == _hf_greedy(family)
    # every rank holds the same share (the embedding, norms and replicated parts are whole on each)
    assert len({r["bytes"] for r in results}) == 1, [r["bytes"] for r in results]
    single = _weight_bytes(hf_model(_checkpoint(family)))
    assert all(r["bytes"] < single for r in results), (single, [r["bytes"] for r in results])
