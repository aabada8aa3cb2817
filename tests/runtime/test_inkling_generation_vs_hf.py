"""Inkling (``inkling_text``) runs with its paged KV cache and its short-convolution state caches,
not in recompute mode, and gives HF eager's greedy tokens and log-probabilities.

Its attention adds a query-conditioned relative position bias (``export/hf_inkling.py``:
``torch_attention``'s ``rel_logits``) and, in full-attention layers, scales queries and bias by
a log of the position. The config here makes both bite at test lengths: a relative extent of 6
(keys further back get no bias) and a log-scaling floor of 4 (HF's default turns it off), with
sliding (window 8) and full layers interleaved, prompts up to 21 tokens and 24 new tokens.
"""

import math

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.coverage.configs import tiny_config
from helpers import _cached_checkpoint, count_op, hf_model

ad = torch.ops.autodeploy
PROMPTS = [[3, 17, 29, 41, 5, 11, 2, 9, 14, 30, 12, 7, 8, 100, 101, 102, 250, 3, 4, 5, 6], [7, 8, 9],
           [300, 301, 302, 303, 304, 305, 306, 307, 308, 309]]
NEW = 24


def _checkpoint() -> str:
    config = tiny_config("inkling_text", "a")
    config.update(num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
                  mlp_layer_types=["sparse"] * 4, rel_extent=6, log_scaling_n_floor=4, log_scaling_alpha=0.5)
    return _cached_checkpoint("inkling-relative-bias", config)


def _hf_logprobs(checkpoint: str, prompt, tokens):
    """HF eager's log-probabilities of ``tokens`` after ``prompt`` (teacher-forced)."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = hf_model(checkpoint)(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_inkling_keeps_its_caches_and_gives_hfs_greedy_tokens():
    checkpoint = _checkpoint()
    llm = LLM(checkpoint, max_seq_len=64, max_batch_size=4, max_num_tokens=64, log_summary=False)
    assert llm.build.context.cache_mode == "paged_kv+state"
    graph = llm.build.graph_module
    cached = [n for n in graph.graph.nodes if n.op == "call_function" and n.target in (
        ad.sdpa_cached_attention_with_cache.default, ad.torch_cached_attention_with_cache.default)]
    assert len(cached) == 4 and all(n.kwargs.get("rel_logits") is not None for n in cached)
    assert count_op(graph, ad.torch_attention) == 0
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0))
    model = hf_model(checkpoint)
    model.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        tokens = list(out.outputs[0].token_ids)
        assert tokens == ref, prompt
        ours = torch.tensor([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)])
        assert torch.allclose(ours, _hf_logprobs(checkpoint, prompt, tokens), atol=1e-4), prompt


@pytest.mark.parametrize("position, expected", [(0, 1.0), (3, 1.0), (7, 1.0 + 0.5 * math.log(2.0))])
def test_log_scaling_is_hfs_formula_at_absolute_positions(position, expected):
    """``tau`` at absolute positions, HF's formula (1 below the floor of 4). That the graph takes those
    positions from ``position_ids``, not from an arange restarting at 0 each cached step, is what the
    generation test above checks (with the arange it fails)."""
    from transformers import AutoConfig

    from autodeploy.export.hf_inkling import log_scaling

    config = AutoConfig.from_pretrained(_checkpoint())
    assert log_scaling(config, torch.tensor([[position]])).item() == pytest.approx(expected)
