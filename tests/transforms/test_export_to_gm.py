"""export_to_gm (export): GraphModule(input_ids [b, s], position_ids [b, s]) -> logits [b, s, vocab]
with dynamic batch and sequence dims, for every HF attention route."""

import pytest
import torch
from torch import fx
from transformers import AutoModelForCausalLM

from autodeploy.config import load_deploy_config
from autodeploy.transform.interface import Stage
from autodeploy.utils.errors import AutoDeployError, ConfigError
from helpers import build, count_op, family_checkpoint, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
VOCAB = 512
# Everything between export and weight load, switched off to load into the raw export graph.
GRAPH_REWRITES = ["cleanup_assert_metadata", "cleanup_noop_cast", "cleanup_noop_slice", "cleanup_noop_add",
                  "cleanup_noop_mul", "cleanup_noop_view", "match_eager_attention", "match_sdpa_attention",
                  "match_repeat_kv", "match_rope_pattern", "match_rmsnorm_pattern", "match_linear_simple"]


@pytest.fixture(scope="module")
def hf_llama():
    return AutoModelForCausalLM.from_pretrained(family_checkpoint("llama"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported():
    return build(family_checkpoint("llama"), up_to=Stage.EXPORT)


def _inputs(batch, seq):
    return torch.randint(0, VOCAB, (batch, seq)), torch.arange(seq).expand(batch, seq).contiguous()


def _check_against_hf(gm, hf, shapes, tol=1e-5):
    for batch, seq in shapes:
        ids, pos = _inputs(batch, seq)
        with torch.no_grad():
            out = gm(ids, pos)
            ref = hf(input_ids=ids, position_ids=pos).logits
        assert isinstance(out, torch.Tensor), type(out)
        assert out.shape == (batch, seq, VOCAB)
        assert rel_rmse(out, ref) < tol, (batch, seq, rel_rmse(out, ref))


def test_interface(exported):
    gm = exported.graph
    assert isinstance(gm, fx.GraphModule)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders] == ["input_ids", "position_ids"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    assert len(output.args) == 1 and isinstance(output.args[0], fx.Node), "a single logits tensor"
    logits = output.args[0].meta["val"]
    ids = placeholders[0].meta["val"]
    assert logits.shape[-1] == VOCAB and logits.dim() == 3
    # batch and seq are symbolic and the logits' dims are the inputs' dims
    assert all(isinstance(d, torch.SymInt) for d in ids.shape)
    assert str(logits.shape[0]) == str(ids.shape[0]) and str(logits.shape[1]) == str(ids.shape[1])
    assert ids.dtype == torch.long
    assert all(p.is_meta for p in gm.parameters()), "export must not load weights"
    assert not any(n.op == "call_module" for n in gm.graph.nodes), "no guard or submodule calls"
    assert exported.context.history[1].key == "export_to_gm" and exported.context.history[1].status == "ok"


def test_dynamic_shapes_after_weight_load(hf_llama):
    gm = build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD).graph
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids", "position_ids"]
    # decode-like, batch other than the example's, and a sequence longer than the example's
    _check_against_hf(gm, hf_llama, [(1, 1), (3, 1), (2, 17), (5, 9)])


@pytest.mark.parametrize("route", ["autodeploy", "sdpa", "eager"])
def test_each_attention_route_exports_and_matches_hf(route, hf_llama):
    overrides = {k: {"enabled": False} for k in GRAPH_REWRITES}
    gm = build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD, route=route, overrides=overrides).graph
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids", "position_ids"]
    n_attn = count_op(gm, ad.torch_attention)
    n_sdpa = count_op(gm, aten.scaled_dot_product_attention)
    n_softmax = count_op(gm, [aten.softmax, aten._softmax])
    # the route taken shows in the raw export graph (no matcher ran)
    expected = {"autodeploy": (2, 0, 0), "sdpa": (0, 2, 0), "eager": (0, 0, 2)}[route]
    assert (n_attn, n_sdpa, n_softmax) == expected
    _check_against_hf(gm, hf_llama, [(2, 11), (1, 1)])


def test_unknown_export_patch_is_a_clear_error():
    from autodeploy.utils.errors import ConfigError

    with pytest.raises(ConfigError) as exc:  # at config time, before any export work
        build(family_checkpoint("llama"), up_to=Stage.EXPORT, overrides={"export_to_gm": {"patches": {"nope": True}}})
    msg = str(exc.value)
    assert "nope" in msg and "patch" in msg
    assert "no_grad" in msg  # the known patches are listed


def test_known_patch_can_be_switched_off():
    result = build(family_checkpoint("llama"), up_to=Stage.EXPORT,
                   overrides={"export_to_gm": {"patches": {"no_grad": False}}})
    assert [n.name for n in result.graph.graph.nodes if n.op == "placeholder"] == ["input_ids", "position_ids"]


def test_without_the_no_grad_patch_the_graph_is_flat_and_runs():
    """Exported with grad enabled, HF's ``@torch.no_grad`` rotary embedding is a
    ``wrap_with_set_grad_enabled`` region; export inlines it, so the cleanups remove its
    meta-device asserts (which failed the first CPU run) and RoPE is matched as without the switch."""
    overrides = {"export_to_gm": {"patches": {"no_grad": False}}}
    raw = build(family_checkpoint("llama"), up_to=Stage.EXPORT, overrides=overrides).graph
    assert not [n for n in raw.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert not [name for name, m in raw.named_children() if isinstance(m, fx.GraphModule)]
    gm = build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD, overrides=overrides).graph
    default = build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD).graph
    rope = ad.torch_rope_with_explicit_cos_sin
    assert count_op(gm, rope) == count_op(default, rope) > 0
    ids, pos = _inputs(2, 7)
    with torch.no_grad():
        torch.testing.assert_close(gm(ids, pos), default(ids, pos))


def test_bad_attn_implementation_rejected_by_config():
    with pytest.raises(ConfigError) as exc:
        load_deploy_config(model="tiny-llama",
                           overrides={"transforms": {"export_to_gm": {"attn_implementation": "flash"}}})
    assert "attn_implementation" in str(exc.value)


def test_export_requires_build_model():
    with pytest.raises(ConfigError, match="build_model"):
        build(family_checkpoint("llama"), up_to=Stage.EXPORT, overrides={"build_model": {"enabled": False}})


def _call_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_export_leaves_an_uncached_fake_mode_and_no_stack_traces_by_default(exported):
    """lean_tracing: the fake mode left on the graph (which every later shape propagation uses)
    runs without its dispatch cache, and no node carries a stack trace unless asked for."""
    from torch._guards import detect_fake_mode

    gm = exported.graph
    mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])
    assert mode is not None and mode.cache_enabled is False
    # (torch's runtime-assert pass names itself on the size nodes it adds, whatever the setting)
    assert not any("modeling_llama.py" in (n.meta.get("stack_trace") or "") for n in _call_nodes(gm))
    # the settings are back to torch's once the export is done
    import torch._dynamo.config as dynamo_config
    import torch.fx.config as fx_config

    assert dynamo_config.fake_tensor_cache_enabled is True and fx_config.do_not_emit_stack_traces is False


def test_stack_traces_on_request_name_the_source_line():
    res = build(family_checkpoint("llama"), up_to=Stage.EXPORT,
                overrides={"export_to_gm": {"stack_traces": True}})
    attn = [n for n in _call_nodes(res.graph) if n.target == ad.torch_attention.default]
    assert len(attn) == 2 and all("modeling_llama.py" in n.meta.get("stack_trace", "") for n in attn)
