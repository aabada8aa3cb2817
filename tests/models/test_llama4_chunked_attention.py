"""Llama 4's chunked-local attention (its RoPE layers see only the keys of their own chunk of
``attention_chunk_size`` positions; the NoPE layers see everything) served from the paged KV
cache, in the graph mode and in the transformers mode: greedy tokens equal HF's for prompts and
generations that cross chunk boundaries (the coverage config's chunk is 8 tokens)."""

import pytest

from autodeploy import LLM, SamplingParams
from helpers import coverage_checkpoint, hf_greedy_tokens, hf_model

PROMPTS = [[3, 17, 42, 9, 100, 7, 55, 21, 8, 13, 2], [5, 6, 7]]
NEW = 10


def _hf_greedy(path: str) -> list:
    return hf_greedy_tokens(path, PROMPTS, NEW)


def _greedy(llm: LLM) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def checkpoint():
    path, _ = coverage_checkpoint("llama4_text")
    config = hf_model(path).config
    assert config.attention_chunk_size < len(PROMPTS[0]) + NEW  # the chunks really cut the histories
    assert "chunked_attention" in config.layer_types and "full_attention" in config.layer_types
    return path


def test_graph_mode_caches_chunked_attention_and_matches_hf(checkpoint):
    llm = LLM(checkpoint, max_seq_len=64, max_batch_size=4)
    assert llm.build.context.cache_mode == "paged_kv"
    chunks = [n.kwargs.get("attention_chunk") for n in llm.build.graph_module.graph.nodes
              if n.op == "call_function" and "cached_attention_with_cache" in str(n.target)]
    chunk = hf_model(checkpoint).config.attention_chunk_size
    layer_types = hf_model(checkpoint).config.layer_types
    assert chunks == [chunk if t == "chunked_attention" else None for t in layer_types]
    assert _greedy(llm) == _hf_greedy(checkpoint)


@pytest.mark.slow  # ~7 s; the transformers mode's chunk handling is also in its coverage sweep
def test_transformers_mode_caches_chunked_attention_and_matches_hf(checkpoint):
    llm = LLM(checkpoint, mode="transformers", max_seq_len=64, max_batch_size=4)
    assert llm.build.context.cache_mode == "paged_kv"
    chunk = hf_model(checkpoint).config.attention_chunk_size
    layer_types = hf_model(checkpoint).config.layer_types
    assert [layer.attention_chunk for layer in llm.build.context.hf_attention_layers] == [
        chunk if t == "chunked_attention" else None for t in layer_types]
    assert _greedy(llm) == _hf_greedy(checkpoint)


@pytest.mark.slow  # ~10 s: a third build
def test_the_sdpa_route_leaves_the_chunked_mask_explicit_and_runs_in_recompute_mode(checkpoint):
    """Near miss: the matchers of HF's sdpa route do not read the chunk (only the autodeploy route
    passes it to torch_attention), so that export keeps the mask explicit and the build falls back to
    recompute mode, still token-identical; never a cached attention that ignores the chunk."""
    llm = LLM(checkpoint, max_seq_len=64, max_batch_size=4,
              transforms={"export_to_gm": {"attn_implementation": "sdpa"}})
    assert llm.build.context.cache_mode == "recompute"
    assert "explicit mask" in llm.build.context.recompute_reason
    assert _greedy(llm) == _hf_greedy(checkpoint)
