"""insert_cached_residual_add (cache_init): the residual stream leaving chosen decoder layers is
written every step into a per-step token buffer ``[max_num_tokens, hidden]``.

On the tiny llama built through cache_init (fused add+RMSNorm, fused GEMMs, gathered logits: the
real pipeline), with ``layers: [0, -1]``: one capture op and one buffer input per chosen layer;
the logits equal those of the same build without the transform on a prefill step and on a mixed
step (two prefills and a decode); the captured rows equal each HF decoder layer's output for
the same tokens (HF's ``output_hidden_states`` entry ``i + 1``, except the last entry, which HF
takes after the final norm). The same on a hybrid (LFM2: a short-convolution layer with a state
cache beside an attention layer). Near misses: ``layers: []`` leaves the graph alone; an index
out of range is a ConfigError naming the valid range.
"""

import random

import pytest
import torch

from autodeploy.cache import build_sequence_info
from autodeploy.cache.resources import TokenBufferHandler
from autodeploy.ops.hidden_states import torch_capture_hidden_states
from autodeploy.transform.interface import Stage
from autodeploy.transform.library.insert_cached_residual_add import resolve_layers
from autodeploy.utils.errors import ConfigError
from helpers import build, count_op, coverage_checkpoint, family_checkpoint, hf_model, rel_rmse

ad = torch.ops.autodeploy
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
HIDDEN, NUM_LAYERS, VOCAB = 64, 2, 512
OVERRIDES = {"resize_kv_cache": {"enabled": False}, "initialize_cache": {"num_pages": 24}}


def _build(path, layers):
    return build(path, up_to=Stage.CACHE_INIT,
                 overrides={**OVERRIDES, "insert_cached_residual_add": {"layers": layers}}, **LIMITS)


@pytest.fixture(scope="module")
def captured():
    return _build(family_checkpoint("llama"), [0, -1])


@pytest.fixture(scope="module")
def plain():
    return _build(family_checkpoint("llama"), [])


def _record(res):
    return next(r for r in res.context.history if r.key == "insert_cached_residual_add")


def _ids(n, seed, vocab=VOCAB):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _steps(vocab=VOCAB):
    """(tokens, starts, tables, state slots) of two steps: prefill C (6 tokens); then prefill A (9),
    prefill B (5) and C's decode; and each sequence's tokens up to the end of the step (the HF
    reference)."""
    free = list(range(24))
    random.Random(1).shuffle(free)
    ta, tb, tc = ([free.pop() for _ in range(n)] for n in (3, 2, 2))
    a, b, c = _ids(9, 1, vocab), _ids(5, 2, vocab), _ids(6, 3, vocab)
    return [([c], [0], [tc], [2], [c]), ([a, b, [77]], [0, 0, 6], [ta, tb, tc], [0, 1, 2], [a, b, c + [77]])]


def _run(res, vocab=VOCAB):
    """Per step: the logits and the captured rows ``{layer: [T, hidden]}`` (copied)."""
    res.cache.allocate(res.cache.num_pages)
    out = []
    for tokens, starts, tables, slots, histories in _steps(vocab):
        info = build_sequence_info(tokens, starts, tables, slots=slots)
        with torch.no_grad():
            logits = res.graph(*res.cache.graph_args(info)).clone()
        rows = {layer: res.cache.caches[name][:info.num_tokens].clone()
                for layer, name in res.cache.captured_layers.items()}
        out.append((info, histories, logits, rows))
    return out


def _hf_layer_outputs(path, ids):
    """Each HF decoder layer's output for ``ids`` (forward hooks) and HF's ``hidden_states``."""
    hf = hf_model(path)
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            hidden = hf(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    return [outs[i][0] for i in range(len(hf.model.layers))], [h[0] for h in hidden]


def _check_rows_equal_hf(path, res, vocab=VOCAB, layers=(0, NUM_LAYERS - 1)):
    assert list(res.cache.captured_layers) == list(layers)
    for info, histories, _, rows in _run(res, vocab):
        cu = info.cu_seqlen.tolist()
        starts = info.input_pos.tolist()
        for i, history in enumerate(histories):
            ref, _ = _hf_layer_outputs(path, history)
            for layer in layers:
                got = rows[layer][cu[i]:cu[i + 1]]
                want = ref[layer][starts[i]:len(history)]
                assert got.shape == want.shape
                assert rel_rmse(got, want) < 1e-5, (layer, i, rel_rmse(got, want))


# ---- (a) match count, (b) the op and the buffer inputs ----------------------------------------------
def test_one_capture_and_one_buffer_per_chosen_layer(captured, plain):
    record = _record(captured)
    assert record.status == "ok" and record.num_matches == 2
    gm, cache = captured.graph, captured.cache
    captures = [n for n in gm.graph.nodes if n.target == ad.torch_capture_hidden_states.default]
    assert len(captures) == 2
    assert cache.captured_layers == {0: "hidden_states_0", 1: "hidden_states_1"}
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[-2:] == ["hidden_states_0", "hidden_states_1"]
    assert placeholders[:-2] == [n.name for n in plain.graph.graph.nodes if n.op == "placeholder"]
    # each op writes its own buffer from a residual sum (the fused add+RMSNorm's second output)
    assert [c.args[1].name for c in captures] == ["hidden_states_0", "hidden_states_1"]
    for c in captures:
        source = c.args[0]
        assert source.target.__name__ == "getitem" and source.args[1] == 1
        assert "fused_add_rmsnorm" in str(source.args[0].target)
    # the last layer's sum feeds the final norm, whose normed output is what the LM head reads
    assert captures[1].args[0].args[0].args[2].target == "model.norm.weight"
    # a third kind of cache input: neither paged nor per-sequence state
    assert cache.buffer_names == ["hidden_states_0", "hidden_states_1"]
    assert cache.paged_names == plain.cache.paged_names and cache.state_names == plain.cache.state_names == []
    for name in cache.buffer_names:
        assert cache.handlers[name] == TokenBufferHandler(HIDDEN, torch.float32)
        assert cache.caches[name].shape == (LIMITS["max_num_tokens"], HIDDEN)
    assert cache.buffer_bytes() == 2 * LIMITS["max_num_tokens"] * HIDDEN * 4
    assert cache.cache_bytes() == cache.paged_bytes() + cache.buffer_bytes()
    # a new pool keeps the buffers (fixed size); the pages are allocated again
    buffer, pages = cache.caches["hidden_states_0"], cache.caches["k_cache_0"]
    cache.allocate(cache.num_pages + 2)
    assert cache.caches["hidden_states_0"] is buffer and cache.caches["k_cache_0"] is not pages


# ---- (c) numerics -------------------------------------------------------------------------------------
def test_logits_unchanged_at_two_shapes(captured, plain):
    assert count_op(captured.graph, ad.torch_capture_hidden_states) == 2  # a comparison of two different graphs
    for (info, _, got, _), (_, _, ref, _) in zip(_run(captured), _run(plain)):
        assert got.shape == ref.shape == (1, info.num_sequences, VOCAB)
        assert rel_rmse(got, ref) < 1e-6


def test_captured_rows_equal_hf_layer_outputs(captured):
    _check_rows_equal_hf(family_checkpoint("llama"), captured)


def test_hf_hidden_states_convention():
    """HF's ``hidden_states[i + 1]`` is layer i's output, except the last entry: after the norm."""
    path = family_checkpoint("llama")
    ids = _ids(7, 4)
    layers, hidden = _hf_layer_outputs(path, ids)
    assert len(hidden) == NUM_LAYERS + 1
    for i in range(NUM_LAYERS - 1):
        torch.testing.assert_close(hidden[i + 1], layers[i], rtol=0, atol=0)
    torch.testing.assert_close(hidden[-1], hf_model(path).model.norm(layers[-1]), rtol=1e-6, atol=1e-6)
    assert rel_rmse(hidden[-1], layers[-1]) > 0.1


def test_hybrid_conv_and_attention_layers():
    path, vocab = coverage_checkpoint("lfm2")
    res = _build(path, [0, 1])
    assert _record(res).num_matches == 2 and res.cache.state_names  # the conv layer keeps its state cache
    _check_rows_equal_hf(path, res, vocab)


def test_capture_op_writes_only_the_step_rows():
    buffer = torch.zeros(6, 4)
    hidden = torch.arange(12.0).reshape(1, 3, 4)
    assert torch_capture_hidden_states(hidden, buffer) is None
    torch.testing.assert_close(buffer[:3], hidden[0])
    assert (buffer[3:] == 0).all()


# ---- (d) near misses ------------------------------------------------------------------------------------
def test_no_layers_leaves_the_graph_alone(plain):
    record = _record(plain)
    assert record.status == "skipped" and record.num_matches == 0
    assert count_op(plain.graph, ad.torch_capture_hidden_states) == 0
    assert plain.cache.buffer_names == [] and plain.cache.captured_layers == {}


def test_bad_layer_index_is_a_config_error():
    with pytest.raises(ConfigError, match=r"layers: layer 2 is out of range.*2 decoder layers.*0\.\.1.*-2\.\.-1"):
        _build(family_checkpoint("llama"), [1, 2])
    # the same rule, without a build each: from the end, and a layer named twice
    assert resolve_layers([0, -1], 2) == [0, 1] and resolve_layers([-2], 2) == [0]
    with pytest.raises(ConfigError, match=r"layer -3 is out of range.*0\.\.1"):
        resolve_layers([-3], 2)
    with pytest.raises(ConfigError, match=r"layer 1 is named twice"):
        resolve_layers([1, -1], 2)
