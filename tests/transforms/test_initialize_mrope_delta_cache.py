"""initialize_mrope_delta_cache (cache_init): a per-slot int32 ``mrope_delta`` state cache added to
the positions on the rotary path of a multimodal-RoPE (mRoPE) model.

On a real tiny Cohere Compass text model (mRoPE with sections in every attention layer): the
match count, the cache input and the shifted rotary positions in the graph (the cached
attention still reads the plain positions), numerics of the cached graph against the uncached
graph (two shapes, chunked prefill, decodes beside another sequence, a reused slot: all with the
zero deltas text-only serving has), a non-zero delta really shifting only its own sequence's
rotary positions (against the uncached graph run at shifted ``position_ids``), a new sequence
never reading the delta its slot held before; detection (the model's rotary embedding decides,
Qwen3.5 has sections without naming them); and a near miss: plain-RoPE Llama is left alone.
"""

import pytest
import torch
from transformers import AutoConfig

from autodeploy.cache import build_sequence_info
from autodeploy.cache.resources import StateHandler
from autodeploy.models.factory import ModelFactory
from autodeploy.transform.graph_utils import is_op
from autodeploy.transform.interface import Stage
from autodeploy.transform.library.initialize_mrope_delta_cache import is_multimodal_rope
from helpers import build, coverage_checkpoint, family_checkpoint, rel_rmse
from state_cache_checks import (CACHED_ONLY, LIMITS, Cached, Pages, assert_close, build_cached, ids, reset,
                                run_all, uncached_logits)

KEY = "initialize_mrope_delta_cache"
ad = torch.ops.autodeploy
aten = torch.ops.aten
ROPE = (ad.torch_rope_with_explicit_cos_sin, ad.torch_rope_with_qk_interleaving, ad.torch_rope_with_complex_freqs)


@pytest.fixture(scope="module")
def compass():
    path, vocab = coverage_checkpoint("cohere_compass_text")
    return path, build_cached(path, vocab)


def _record(history):
    return next(r for r in history if r.key == KEY)


def _placeholder(gm, name):
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name)


def test_one_delta_cache_for_an_mrope_model(compass):
    path, c = compass
    assert AutoConfig.from_pretrained(path).rope_parameters["full_attention"]["mrope_section"]
    record = _record(c.context.history)
    assert record.status == "ok" and record.num_matches == 1
    assert c.cache.handlers["mrope_delta"] == StateHandler((1,), torch.int32)
    assert c.cache.state_names[-1] == "mrope_delta"
    assert c.cache.caches["mrope_delta"].shape == (c.cache.num_slots, 1)
    assert [n.name for n in c.graph.graph.nodes if n.op == "placeholder"][-1] == "mrope_delta"


def test_rotary_tables_read_shifted_positions_and_attention_the_plain_ones(compass):
    _, c = compass
    gm = c.graph
    position_ids, delta = _placeholder(gm, "position_ids"), _placeholder(gm, "mrope_delta")
    adds = [n for n in gm.graph.nodes if is_op(n, aten.add.Tensor) and n.args[0] is position_ids]
    assert len(adds) == 1
    shifted = adds[0]
    # the delta read per slot, and written back (0 at a sequence's first chunk)
    assert any(is_op(u, aten.index.Tensor) for u in delta.users)
    assert any(is_op(u, aten.index_put_) for u in delta.users)
    # the cos/sin rows each RoPE reads: a RoPE node's, or a cached attention's that took its RoPE in
    # (fuse_rope_into_trtllm_attention, which runs after this transform)
    tables = [t for n in gm.graph.nodes if is_op(n, ROPE) for t in n.args[2:4]]
    tables += [n.kwargs[k] for n in gm.graph.nodes for k in ("rope_cos", "rope_sin") if n.kwargs.get(k) is not None]
    assert tables
    for table in tables:
        assert is_op(table, aten.embedding) and table.args[1] is shifted
    # the cached attention's cache-slot computation keeps the plain positions
    prepare = [u for u in position_ids.users if is_op(u, ad.torch_cached_attention_prepare_metadata)]
    assert prepare and not any(is_op(u, aten.embedding) for u in position_ids.users)


def test_cached_graph_equals_the_uncached_graph(compass):
    """Text-only: the graph has the delta, the deltas stay 0 and nothing changes (two shapes,
    chunks, decodes beside another sequence, a reused slot)."""
    c = compass[1]
    assert "mrope_delta" in c.cache.caches
    run_all(c)
    assert not c.cache.caches["mrope_delta"].any()


def _step(c, tokens, starts, tables, slots):
    info = build_sequence_info(tokens, starts, tables, slots=slots)
    with torch.no_grad():
        out = c.graph(*c.cache.graph_args(info))[0]
    cu = info.cu_seqlen.tolist()
    return [out[cu[i]:cu[i + 1]] for i in range(len(tokens))]


def _uncached_at(c, token_ids, positions):
    with torch.no_grad():
        return c.uncached(torch.tensor([list(token_ids)]), torch.tensor([list(positions)]))[0]


def _check_written_deltas(c):
    reset(c)
    pages = Pages()
    seq, other = ids(11, 21, c.vocab), ids(8, 22, c.vocab)
    t_seq, t_other = pages.take(32), pages.take(32)
    delta_seq, delta_other = 7, -3
    _step(c, [seq[:5]], [0], [t_seq], [2])
    _step(c, [other[:6]], [0], [t_other], [0])
    c.cache.caches["mrope_delta"][2] = delta_seq
    c.cache.caches["mrope_delta"][0] = delta_other
    out_seq, out_other = _step(c, [seq[5:9], other[6:7]], [5, 6], [t_seq, t_other], [2, 0])
    (dec_seq,) = _step(c, [seq[9:10]], [9], [t_seq], [2])

    pos_seq = list(range(5)) + [p + delta_seq for p in range(5, 10)]
    ref_seq = _uncached_at(c, seq[:10], pos_seq)
    assert_close(out_seq, ref_seq[5:9], "prefill chunk with a delta")
    assert_close(dec_seq[0], ref_seq[9], "decode with a delta")
    ref_other = _uncached_at(c, other[:7], list(range(6)) + [6 + delta_other])
    assert_close(out_other[0], ref_other[6], "neighbour decode with its own delta")
    # the shift is real: the unshifted positions give other logits
    assert rel_rmse(dec_seq[0], uncached_logits(c, seq[:10])[9]) > 1e-3
    assert c.cache.caches["mrope_delta"][:, 0].tolist()[:3] == [delta_other, 0, delta_seq]


def test_a_written_delta_shifts_only_its_sequence(compass):
    """Deltas written after the prompts (as a multimodal runtime would): a mixed step (a prefill
    chunk beside a decode) and a decode step rotate each sequence at ``position + its delta``,
    equal to the uncached graph run at those positions; the cache positions stay plain."""
    _check_written_deltas(compass[1])


def test_without_optimize_rope_the_models_rotary_subgraph_reads_the_shift(compass):
    """No cos/sin tables: the head of HF's own rotary subgraph (four rows, sections interleaved
    by in-place copies) reads the shifted positions; same numbers."""
    path, c = compass
    res = build(path, up_to=Stage.CACHE_INIT, overrides={**CACHED_ONLY, "optimize_rope": {"enabled": False}},
                **LIMITS)
    assert _record(res.context.history).num_matches == 1
    assert not any(is_op(n, aten.embedding) and n.args[0].op == "get_attr" and "rope" in n.args[0].target
                   for n in res.graph.graph.nodes)
    _check_written_deltas(Cached(res.graph, res.cache, res.context, c.uncached, c.vocab))


def test_a_new_sequence_never_reads_a_stale_delta(compass):
    """A sequence starting in a slot whose last owner had a delta reads 0 (its first chunk
    clears the slot), so its later chunk and decode are unshifted too."""
    _, c = compass
    reset(c)
    pages = Pages()
    c.cache.caches["mrope_delta"][1] = 9  # left behind by a finished (multimodal) sequence
    fresh = ids(9, 23, c.vocab)
    table = pages.take(16)
    first = _step(c, [fresh[:4]], [0], [table], [1])[0]
    assert c.cache.caches["mrope_delta"][1].item() == 0
    second = _step(c, [fresh[4:8]], [4], [table], [1])[0]
    dec = _step(c, [fresh[8:9]], [8], [table], [1])[0]
    assert_close(torch.cat([first, second, dec]), uncached_logits(c, fresh), "fresh sequence in a used slot")


def test_detection_follows_the_models_rotary_embedding():
    """Qwen3.5's text rotary embedding is sectioned by default (its config names no sections);
    Qwen2 ignores sections even when its config names them (as a VL checkpoint's text config does)."""
    qwen35, _ = coverage_checkpoint("qwen3_5_text")
    assert "mrope_section" not in (AutoConfig.from_pretrained(qwen35).rope_parameters or {})
    assert is_multimodal_rope(ModelFactory(qwen35))
    compass_path, _ = coverage_checkpoint("cohere_compass_text")
    assert is_multimodal_rope(ModelFactory(compass_path))
    qwen2 = ModelFactory(family_checkpoint("qwen2"))
    assert not is_multimodal_rope(qwen2)
    qwen2.config.rope_parameters = {**qwen2.config.rope_parameters, "mrope_section": [2, 3, 3]}
    assert not is_multimodal_rope(qwen2)
    assert not is_multimodal_rope(None)


def test_plain_rope_model_is_left_alone():
    res = build(family_checkpoint("llama"), up_to=Stage.CACHE_INIT, max_seq_len=32, max_batch_size=2)
    record = _record(res.context.history)
    assert record.num_matches == 0 and "mrope_delta" not in res.cache.handlers
    assert "mrope_delta" not in [n.name for n in res.graph.graph.nodes if n.op == "placeholder"]
    assert not any(is_op(n, aten.index_put_) for n in res.graph.graph.nodes)
