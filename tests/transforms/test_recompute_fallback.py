"""``recompute_fallback``: the cache-consistency check catches state outside attention, and the
recompute path (paged token cache, uncached graph over each history) is exact.

The stateful model is a real LFM2 checkpoint with a short-convolution layer next to an
attention layer, built with ``insert_cached_causal_conv`` off, so that its convolution state has
no cache (what any state op without a cache transform looks like); the near miss is Llama,
whose state lives entirely in the KV cache.
"""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.cache.consistency import check_cache_consistency
from autodeploy.cache.recompute import RecomputeRunner, TokenCacheHandler
from autodeploy.export.exporter import export_causal_lm
from autodeploy.transform.interface import Stage
from autodeploy.utils.errors import ConfigError
from helpers import build, family_checkpoint, stateful_checkpoint

PROMPTS = ["The for statement", "x", "A class definition defines a class object"]
SMALL = dict(max_seq_len=64, max_batch_size=4, max_num_tokens=128, page_size=8)
NO_CONV_CACHE = {"insert_cached_causal_conv": {"enabled": False}}


def _hf_greedy(path: str, tokenizer, prompts, new_tokens: int):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, attention_mask=torch.ones_like(ids))
        outs.append(out[0, ids.shape[1]:].tolist())
    return outs


def test_state_outside_attention_fails_the_check_and_recompute_matches_hf():
    path = stateful_checkpoint("lfm2")
    res = build(path, overrides=NO_CONV_CACHE, **SMALL)
    ctx = res.context
    assert ctx.cache_mode == "recompute"
    assert "disagrees with itself" in ctx.recompute_reason
    assert list(res.cache.handlers) == ["token_cache"]
    assert [r.status for r in ctx.history if r.key == "recompute_fallback"] == ["ok"]

    llm = LLM(path, transforms=NO_CONV_CACHE, **SMALL)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert ours == _hf_greedy(path, llm.tokenizer, PROMPTS, 12)


def test_the_paged_kv_graph_of_a_stateful_model_is_caught_by_the_check():
    """The check itself, on the KV-cached LFM2 graph (fallback off): the two schedules disagree."""
    path = stateful_checkpoint("lfm2")
    with pytest.raises(ConfigError, match="cannot run with a KV cache: the KV-cached graph disagrees"):
        build(path, overrides={"recompute_fallback": {"mode": "never"}, **NO_CONV_CACHE}, **SMALL)
    res = build(path, overrides={"recompute_fallback": {"enabled": False}, **NO_CONV_CACHE}, **SMALL)
    result = check_cache_consistency(res.graph, res.cache, res.factory.vocab_size, torch.float32)
    assert result is not None and not result.ok and result.error > 1e-4


def test_attention_only_model_passes_the_check_and_keeps_the_kv_cache():
    """Near miss: Llama's schedules agree (fp32 noise), so nothing changes."""
    res = build(family_checkpoint("llama"), **SMALL)
    assert res.context.cache_mode == "paged_kv"
    assert [r.status for r in res.context.history if r.key == "recompute_fallback"] == ["skipped"]
    result = check_cache_consistency(res.graph, res.cache, res.factory.vocab_size, torch.float32)
    assert result is not None and result.ok and result.error < 1e-5


CHECK_RAN = "KV-cache consistency check: rel. RMSE"


def test_the_check_runs_for_the_torch_compile_backend(caplog):
    """Issue 21: the check used to be skipped for every backend but torch-simple (see the slow
    test below for why it can run). Built up to cache_init: the check, not compile_model's
    warm-up, is what this looks at."""
    with caplog.at_level("INFO", logger="autodeploy.transform.library.recompute_fallback"):
        res = build(family_checkpoint("llama"), up_to=Stage.CACHE_INIT,
                    overrides={"compile_model": {"backend": "torch-compile"}}, **SMALL)
    assert res.context.compile_backend == "torch-compile"
    assert res.context.cache_mode == "paged_kv"
    assert CHECK_RAN in caplog.text and "skipped" not in caplog.text


@pytest.mark.slow
def test_torch_compile_builds_after_the_check_give_the_kv_cache_tokens(caplog):
    """After the check's eager runs, torch.compile of the model (and of a second model in the same
    process, with the compiled RMSNorm kernels) works and gives the torch-simple tokens. Before,
    the check's runs added variants of the process-wide compiled RMSNorm until dynamo's recompile
    limit, and a later model's torch.compile failed with "Attempt to trace generator"."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    compiled = dict(compile_backend="torch-compile", transforms={"fuse_rmsnorm": {"backend": "compile"}})
    for family in ("llama", "qwen3"):
        path = family_checkpoint(family)
        simple = [o.token_ids for o in LLM(path, **SMALL).generate(PROMPTS, params)]
        caplog.clear()
        with caplog.at_level("INFO", logger="autodeploy.transform.library.recompute_fallback"):
            llm = LLM(path, **compiled, **SMALL)
        assert CHECK_RAN in caplog.text, family
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == simple, family


def test_mode_always_gives_the_same_tokens_as_the_kv_cache():
    path = family_checkpoint("llama")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kv = [o.token_ids for o in LLM(path, **SMALL).generate(PROMPTS, params)]
    llm = LLM(path, transforms={"recompute_fallback": {"mode": "always"}}, **SMALL)
    assert llm.build.context.cache_mode == "recompute"
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == kv


def test_recompute_mode_refuses_compile_backends_that_need_the_kv_graph():
    with pytest.raises(ConfigError, match="recompute mode.*torch-simple"):
        build(family_checkpoint("llama"), compile_backend="torch-compile",
              overrides={"recompute_fallback": {"mode": "always"}, "compile_model": {"backend": "torch-compile"}},
              **SMALL)


class _LoopOverSeq(nn.Module):
    """A causal toy LM whose recurrence is a Python loop over the sequence: torch.export
    specialises the sequence length, so only a static-length export works."""

    def __init__(self, vocab: int = 32, hidden: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        state = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            state = torch.tanh(self.mix(state) + x[:, t])
            outs.append(state)
        return self.head(torch.stack(outs, dim=1))


def test_static_length_export_fallback_and_padded_recompute_are_exact():
    torch.manual_seed(0)
    model = _LoopOverSeq().eval()
    with pytest.raises(Exception, match="Constraints violated|specialized"):
        export_causal_lm(model, max_batch_size=4, max_seq_len=12)
    gm = export_causal_lm(model, max_batch_size=4, max_seq_len=12, static_seq_len=12)
    assert gm.meta["autodeploy_export"]["static_seq_len"] == 12
    runner = RecomputeRunner(gm, page_size=4, static_seq_len=12)
    cache = TokenCacheHandler().allocate(8, 4, torch.device("cpu"))
    a, b = torch.randint(0, 32, (7,)), torch.randint(0, 32, (3,))
    from autodeploy.cache.sequence_info import build_sequence_info

    info = build_sequence_info([a.tolist(), b.tolist()], [0, 0], [[0, 1], [2]])
    with torch.no_grad():
        out = runner(*info.as_inputs().values(), cache)
        ref_a, ref_b = model(a[None])[0, -1], model(b[None])[0, -1]
    assert out.shape == (1, 2, 32)
    torch.testing.assert_close(out[0, 0], ref_a)
    torch.testing.assert_close(out[0, 1], ref_b)
    # decode one more token for sequence a: its history comes back from the token cache
    nxt = torch.tensor([5])
    info = build_sequence_info([nxt.tolist()], [7], [[0, 1]])
    with torch.no_grad():
        out = runner(*info.as_inputs().values(), cache)
        ref = model(torch.cat([a, nxt])[None])[0, -1]
    torch.testing.assert_close(out[0, 0], ref)
    with pytest.raises(RuntimeError, match="static length 12"):
        long = build_sequence_info([list(range(13))], [0], [[4, 5, 6, 7]])
        runner(*long.as_inputs().values(), cache)


class _ChunkPadded(nn.Module):
    """Chunked like SSM scans: pad the sequence to a multiple of 4, work per chunk. The named seq
    dim is rejected by export's constraint solver; an automatic one (seq >= 2) is accepted."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        b, s, h = x.shape
        x = torch.nn.functional.pad(x, (0, 0, 0, (4 - s % 4) % 4))
        x = x.view(b, -1, 4, h).cumsum(2).reshape(b, -1, h)[:, :s]
        return self.head(x)


def test_automatic_dynamic_dim_fallback_and_one_token_padding():
    torch.manual_seed(0)
    model = _ChunkPadded().eval()
    gm = export_causal_lm(model, max_batch_size=4, max_seq_len=12, static_seq_len=12)
    meta = gm.meta["autodeploy_export"]
    assert meta["min_seq_len"] == 2 and "static_seq_len" not in meta
    runner = RecomputeRunner(gm, page_size=4, min_seq_len=2)
    with torch.no_grad():
        for length in (1, 2, 7, 12):  # 1 is padded to 2; the others run at their own length
            ids = torch.randint(0, 32, (length,))
            torch.testing.assert_close(runner.last_logits([ids])[0, 0], model(ids[None])[0, -1])
