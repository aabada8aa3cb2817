"""insert_cached_attention (cache_init): torch_attention -> the backend's cached op over a paged cache.

Structure on a real tiny llama; numerics against the uncached graph (after weight_load) run on
each sequence alone; errors on graphs it must not cache (explicit mask, non-causal).
"""

import copy
import random

import pytest
import torch
from torch import nn
from torch.export import Dim

from autodeploy.cache import build_sequence_info
from autodeploy.cache.attention_backends import PAGED_ATTENTION_METADATA
from autodeploy.cache.sequence_info import METADATA_NAMES
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.errors import ConfigError
from helpers import Nested, build, count_op, export_gm, family_checkpoint, rel_rmse

ad = torch.ops.autodeploy
CACHED_OPS = {"torch": ad.torch_cached_attention_with_cache, "sdpa": ad.sdpa_cached_attention_with_cache}
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
NUM_LAYERS = 2
VOCAB = 512


@pytest.fixture(scope="module")
def uncached():
    return build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD).graph


@pytest.fixture(scope="module", params=["torch", "sdpa"])
def cached(request):
    res = build(family_checkpoint("llama"), up_to=Stage.CACHE_INIT, overrides={"resize_kv_cache": {"enabled": False},
                                                                 "gather_logits_before_lm_head": {"enabled": False}},
                attn_backend=request.param, **LIMITS)
    return request.param, res


def _fresh(res, seed=0):
    """Zero the pool (a new allocation) and hand out pages from a shuffled free list."""
    res.cache.allocate(res.cache.num_pages)
    free = list(range(res.cache.num_pages))
    random.Random(seed).shuffle(free)
    return free


def _take(free, n_tokens, page_size=LIMITS["page_size"]):
    return [free.pop() for _ in range(-(-n_tokens // page_size))]


def _uncached_logits(gm, ids):
    with torch.no_grad():
        return gm(torch.tensor([ids]), torch.arange(len(ids))[None])[0]


def _step(res, tokens, starts, tables):
    info = build_sequence_info(tokens, starts, tables)
    with torch.no_grad():
        out = res.graph(*res.cache.graph_args(info))
    assert out.shape == (1, info.num_tokens, VOCAB)
    return out[0], info


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


# ---- structure -------------------------------------------------------------------------------
def test_graph_structure(cached):
    backend, res = cached
    gm = res.graph
    record = next(r for r in res.context.history if r.key == "insert_cached_attention")
    assert record.status == "ok" and record.num_matches == NUM_LAYERS
    assert count_op(gm, ad.torch_attention) == 0
    assert count_op(gm, CACHED_OPS[backend]) == NUM_LAYERS
    other = CACHED_OPS["sdpa" if backend == "torch" else "torch"]
    assert count_op(gm, other) == 0
    assert count_op(gm, ad.torch_cached_attention_prepare_metadata) == 1
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    expected = ["input_ids", "position_ids", "batch_info", "seq_len", "input_pos", "cu_seqlen", "page_table",
                "slot_idx", "use_initial_state", "logits_index"]
    for layer in range(NUM_LAYERS):
        expected += [f"k_cache_{layer}", f"v_cache_{layer}"]
    assert names == expected
    assert res.cache.input_names == expected
    assert gm.meta["autodeploy_cached"] == {"attn_backend": backend, "layers": NUM_LAYERS}
    # every cached op reads the one shared slot mapping and its own layer's caches
    prepare = next(n for n in gm.graph.nodes if n.op == "call_function"
                   and n.target == ad.torch_cached_attention_prepare_metadata.default)
    assert prepare.args[-1] == LIMITS["page_size"]
    cached_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == CACHED_OPS[backend].default]
    for layer, node in enumerate(cached_nodes):
        assert node.args[8] is prepare
        # the paged attention op takes its metadata by name: not the state slots
        assert [a.name for a in node.args[3:8]] == list(PAGED_ATTENTION_METADATA)
        assert list(PAGED_ATTENTION_METADATA) == list(METADATA_NAMES[:5])
        assert [node.args[9].name, node.args[10].name] == [f"k_cache_{layer}", f"v_cache_{layer}"]


# ---- numerics --------------------------------------------------------------------------------
def test_single_prefill_matches_uncached(cached, uncached):
    _, res = cached
    free = _fresh(res)
    ids = _ids(7, seed=1)
    out, _ = _step(res, [ids], [0], [_take(free, 7)])
    ref = _uncached_logits(uncached, ids)
    assert rel_rmse(out, ref) < 1e-5


def test_two_prefills_then_decode_match_uncached(cached, uncached):
    _, res = cached
    free = _fresh(res, seed=2)
    a, b = _ids(9, seed=3), _ids(5, seed=4)
    tables = [_take(free, 10), _take(free, 6)]
    out, info = _step(res, [a, b], [0, 0], tables)
    assert rel_rmse(out[:9], _uncached_logits(uncached, a)) < 1e-5
    assert rel_rmse(out[9:], _uncached_logits(uncached, b)) < 1e-5
    # decode one token each; the reference is the last position of the extended sequence
    na, nb = 17, 301
    out, info = _step(res, [[na], [nb]], [9, 5], tables)
    assert info.batch_info.tolist() == [0, 0, 2]
    ref_a = _uncached_logits(uncached, a + [na])[-1]
    ref_b = _uncached_logits(uncached, b + [nb])[-1]
    assert rel_rmse(out[0], ref_a) < 1e-5
    assert rel_rmse(out[1], ref_b) < 1e-5
    # the decode depended on the cache: with the history wiped it is different
    res.cache.allocate(res.cache.num_pages)
    wiped, _ = _step(res, [[na], [nb]], [9, 5], tables)
    assert rel_rmse(wiped[0], ref_a) > 1e-2


def test_chunked_prefill_with_a_decode_matches_uncached(cached, uncached):
    _, res = cached
    free = _fresh(res, seed=5)
    a, b = _ids(10, seed=6), _ids(4, seed=7)
    tables = [_take(free, 10), _take(free, 5)]
    first, _ = _step(res, [a[:6], b], [0, 0], tables)
    # a's second chunk continues at input_pos 6 while b decodes
    out, info = _step(res, [a[6:], [42]], [6, 4], tables)
    assert info.batch_info.tolist() == [1, 4, 1]
    ref_a = _uncached_logits(uncached, a)
    assert rel_rmse(torch.cat([first[:6], out[:4]]), ref_a) < 1e-5
    assert rel_rmse(out[4], _uncached_logits(uncached, b + [42])[-1]) < 1e-5


# ---- errors ----------------------------------------------------------------------------------
def test_unknown_backend_is_a_config_error(uncached):
    ctx = PipelineContext(max_seq_len=32, max_num_tokens=32, max_batch_size=2, page_size=4)
    gm = copy.deepcopy(uncached)
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'.*available: sdpa, torch"):
        build_transform("insert_cached_attention", {"backend": "flash"})(gm, ctx)
    assert count_op(gm, ad.torch_attention) == NUM_LAYERS  # graph untouched
    assert ctx.cache is None


class _Attn(nn.Module):
    """Minimal cacheable-looking graph: embedding -> q/k/v -> torch_attention -> logits."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.emb = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 32)
        self.register_buffer("slopes", torch.tensor([0.5, -0.25]), persistent=False)

    def forward(self, input_ids, position_ids):
        x = self.emb(input_ids)
        b, s = input_ids.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).unbind(2)
        mask = None
        if self.mode == "mask":
            mask = (position_ids[:, None, :, None] >= position_ids[:, None, None, :])
        causal = self.mode != "bidirectional"
        alibi = self.slopes if self.mode == "alibi" else None
        o = ad.torch_attention(q, k, v, mask, 0.0, causal and mask is None, None, None, None, None, alibi)
        return self.out(o.reshape(b, s, 16))


def _small_graph(mode, dynamic=None):
    ids = torch.randint(0, 32, (2, 6))  # batch 2: a batch of 1 would specialise the dim
    return export_gm(_Attn(mode).eval(), ids, torch.arange(6)[None].expand(2, 6), dynamic=dynamic)


def _apply(gm, backend="sdpa", **config):
    ctx = PipelineContext(max_seq_len=16, max_num_tokens=16, max_batch_size=2, page_size=4)
    out = build_transform("insert_cached_attention", {"backend": backend, **config})(gm, ctx)
    return out, ctx


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_small_causal_graph_is_cached_and_matches(backend):
    """Positive control for the error cases below: the same module, causal without a mask."""
    torch.manual_seed(0)
    gm = _small_graph("causal")
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad():
        ref = gm(ids, torch.arange(6)[None])
    gm, ctx = _apply(gm, backend)
    assert ctx.history[-1].num_matches == 1 and count_op(gm, ad.torch_attention) == 0
    ctx.cache.allocate(8)
    info = build_sequence_info([ids[0].tolist()], [0], [[5, 2]])
    with torch.no_grad():
        out = gm(*ctx.cache.graph_args(info))
    assert rel_rmse(out, ref) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_alibi_slopes_reach_the_cached_op_and_positions_stay_absolute(backend):
    """ALiBi (BLOOM, MPT): the cached op gets the slopes; a prefill chunk then two decodes give the
    uncached graph's logits, which needs the bias over every cached key at its absolute position
    (the query's own position only shifts a row, which softmax cancels)."""
    torch.manual_seed(0)
    gm = _small_graph("alibi", dynamic=[{0: Dim.DYNAMIC, 1: Dim.DYNAMIC}] * 2)  # steps of 4 and 1 tokens
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad():
        ref = gm(ids, torch.arange(6)[None])[0]
    gm, ctx = _apply(gm, backend)
    cached = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == CACHED_OPS[backend].default]
    assert len(cached) == 1 and count_op(gm, ad.torch_attention) == 0
    assert cached[0].kwargs["alibi_slopes"].op == "get_attr"
    ctx.cache.allocate(8)
    outs = []
    for start, end in ((0, 4), (4, 5), (5, 6)):
        info = build_sequence_info([ids[0, start:end].tolist()], [start], [[5, 2]])
        with torch.no_grad():
            outs.append(gm(*ctx.cache.graph_args(info))[0])
    assert rel_rmse(torch.cat(outs), ref) < 1e-5


def test_explicit_mask_is_an_error_naming_the_node():
    gm = _small_graph("mask")
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_attention.default)
    assert node.args[3] is not None  # the mask survived export
    with pytest.raises(RuntimeError, match=rf"attention {node.name}\b.*explicit mask"):
        _apply(gm, on_uncacheable="error")


def test_non_causal_attention_is_an_error():
    gm = _small_graph("bidirectional")
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_attention.default)
    with pytest.raises(RuntimeError, match=rf"attention {node.name}\b.*not causal"):
        _apply(gm, on_uncacheable="error")


def test_uncacheable_attention_errors_name_the_module_that_made_it():
    """The error names the module (path and class, from export's ``nn_module_stack``) so a user can
    find the layer in the model's code; the exported module itself has no path: its class alone."""
    ids = torch.randint(0, 32, (2, 6))
    nested = export_gm(Nested(_Attn("mask")).eval(), ids, torch.arange(6)[None].expand(2, 6))
    with pytest.raises(RuntimeError, match=r"attention torch_attention \(layers\.0, _Attn\) still has an explicit mask"):
        _apply(nested, on_uncacheable="error")
    with pytest.raises(RuntimeError, match=r"attention torch_attention \(_Attn\) is not causal"):
        _apply(_small_graph("bidirectional"), on_uncacheable="error")


@pytest.mark.parametrize("kind, reason", [("mask", "explicit mask"), ("bidirectional", "not causal")])
def test_uncacheable_attention_is_left_for_recompute_with_its_reason(kind, reason):
    """The default: the graph stays uncached (attention intact) and recompute_fallback gets the reason."""
    gm = _small_graph(kind)
    out, ctx = _apply(gm)
    assert count_op(out, ad.torch_attention) == 1 and ctx.cache is None
    assert reason in ctx.uncached_reason and ctx.history[-1].status == "skipped"
