"""Qwen4-Exp's QSA indexer (``autodeploy.export.hf_qsa``): the ``qsa_indexer`` export patch and its
``torch_qsa_indexer`` op select exactly HF's tokens, the HF model exports with a dynamic sequence
(one graph for every length, one-token steps included) and its graph equals HF eager, and
``autodeploy.LLM`` gives HF's greedy tokens.

The budget is 8 tokens in blocks of 4 (2 blocks) against up to 40 tokens, so the top-k is sparse
and its width (``min(2, #blocks)``) changes with the query position. Ties matter: with one
indexer head about half of the block scores are ``relu(.) = 0``, and a zeroed query projection
makes every score tie, so the test fails if the op breaks ties otherwise than HF's ``topk``.
"""

import pytest
import torch
from torch import fx
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf_qwen4

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.coverage.configs import tiny_config
from autodeploy.export import export_causal_lm
from autodeploy.export.hf_qsa import _qsa_indexer, is_qsa_indexer
from helpers import _cached_checkpoint, count_op, graph_logits, rel_rmse

ad = torch.ops.autodeploy
BUDGET, RATIO = 8, 4


def _config(**overrides):
    """The coverage sweep's tiny Qwen4-Exp text config (recipe a) with a sparse indexer, two layers
    (a GatedDeltaNet one, then an indexed-attention one) to keep the exports short."""
    cfg = tiny_config("qwen4_exp_text", "a")
    cfg.update(indexer_budget=BUDGET, indexer_compress_ratio=RATIO, num_hidden_layers=2,
               layer_types=["linear_attention", "indexed_attention"], **overrides)
    return cfg


def _hf_config(**overrides):
    cfg = _config(**overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "eager"
    return config


def _perturb_norms(module: torch.nn.Module, seed: int) -> None:
    """HF initialises the (1 + w) norms and the PLE conv at zero: give them values to check."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _causal_float_mask(batch: int, seq: int) -> torch.Tensor:
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)
    return mask.expand(batch, 1, seq, seq)


@pytest.mark.parametrize("heads,zero_queries", [(2, False), (1, False), (1, True)])
def test_op_selects_exactly_hfs_tokens(heads, zero_queries):
    config = _hf_config(indexer_n_heads=heads)
    rotary = hf_qwen4.Qwen4ExpTextRotaryEmbedding(config)
    torch.manual_seed(heads)
    indexer = hf_qwen4.Qwen4ExpTextQSAIndexer(config, 1).eval()
    _perturb_norms(indexer, heads)
    if zero_queries:  # every block scores 0: HF's topk tie-breaking decides alone
        with torch.no_grad():
            indexer.index_qk_proj.weight[: heads * config.indexer_head_dim].zero_()
    assert is_qsa_indexer(indexer)
    original = type(indexer).forward
    batch, seq = 2, 40
    hidden = torch.randn(batch, seq, config.hidden_size)
    cos, sin = rotary(hidden, torch.arange(seq).expand(3, batch, seq))
    sparse_rows = 0
    for s in list(range(1, 13)) + [19, 27, 40]:
        args = (hidden[:, :s], (cos[:, :s], sin[:, :s]), _causal_float_mask(batch, s), None)
        with torch.no_grad():
            ref = indexer(*args)
            with _qsa_indexer(indexer):
                out = indexer(*args)
        assert out.dtype == torch.bool and out.shape == ref.shape == (batch, 1, s, s)
        assert torch.equal(out, ref), f"selection differs from HF at seq {s}"
        sparse_rows += int((ref.sum(-1) < torch.arange(1, s + 1)).sum())
    assert sparse_rows > 0  # the budget really dropped tokens
    assert type(indexer).forward is original  # the patch lives for the context only


def test_op_returns_hfs_fixed_width_index_list():
    q, keys = torch.randn(1, 13, 2, 16), torch.randn(1, 13, 16)
    cos, sin = torch.ones(1, 13, 16), torch.zeros(1, 13, 16)
    idx = ad.torch_qsa_indexer(q, keys, cos, sin, torch.zeros(16), 1e-6, BUDGET, RATIO)
    assert idx.shape == (1, 13, BUDGET + RATIO - 1) and idx.dtype == torch.int32
    assert idx[0, 0].tolist() == [0] + [-1] * (BUDGET + RATIO - 2)  # no complete block: the tail only
    assert idx[0, 12, BUDGET:].tolist() == [12, -1, -1]  # 3 blocks, the best 2 (8 tokens), then the tail
    assert set(idx[0, 12, :BUDGET].tolist()) < set(range(12)) and len(set(idx[0, 12, :BUDGET].tolist())) == BUDGET


def test_hf_model_exports_dynamically_and_equals_hf():
    # PLE on a linear layer, partial rotary with mRoPE sections: every option of the stack in play
    config = _hf_config(ple_layer_ids=[1], eos_token_id=2, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    _perturb_norms(hf, 0)
    original = hf_qwen4.Qwen4ExpTextQSAIndexer.forward
    gm = export_causal_lm(hf, max_batch_size=4, max_seq_len=64)
    assert count_op(gm, ad.torch_qsa_indexer) == config.layer_types.count("indexed_attention") == 1
    for op in (ad.torch_attention, ad.torch_moe, ad.torch_gated_delta_rule, ad.torch_causal_conv1d):
        assert count_op(gm, op) > 0, op
    assert hf_qwen4.Qwen4ExpTextQSAIndexer.forward is original  # HF's forward is back after the export
    for batch, seq in ((2, 29), (1, 1), (3, 7)):
        ids = torch.randint(3, config.vocab_size, (batch, seq))
        with torch.no_grad():
            ref = hf(input_ids=ids, position_ids=torch.arange(seq).expand(batch, seq)).logits
        err = rel_rmse(graph_logits(gm, ids), ref)
        assert err < 1e-5, f"rel rmse {err} against HF at (batch, seq) = {(batch, seq)}"


@pytest.mark.slow  # ~14 s: the whole pipeline in recompute mode; the export test above stays default
def test_llm_greedy_tokens_equal_hf():
    from autodeploy import LLM, SamplingParams

    checkpoint = _cached_checkpoint("qwen4-exp-qsa-sparse-2l", _config())
    llm = LLM(checkpoint, max_seq_len=64, max_batch_size=2, max_num_tokens=128, log_summary=False)
    graphs = [m for m in llm.build.graph_module.modules() if isinstance(m, fx.GraphModule)]  # recompute wraps one
    assert sum(count_op(g, ad.torch_qsa_indexer) for g in graphs) == 1
    assert llm.build.context.cache_mode == "recompute"  # the attention's selection mask is explicit
    prompts = ["The for statement", "A class definition defines a class object and the body of the class"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outputs):
        ids = llm.tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref, prompt
