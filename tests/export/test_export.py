"""The exporter: failures name the module, HF's global registries and eager runs are untouched,
export patches are registered by name, small modules export with dynamic dims."""

import pytest
import torch
from torch import fx, nn
from torch.export import Dim
from transformers import AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from autodeploy.export.exporter import export_causal_lm, export_to_graph_module
from autodeploy.export.patch_registry import export_patches
from autodeploy.models.factory import ModelFactory
from autodeploy.utils.errors import AutoDeployError, ExportError
from helpers import family_checkpoint

IMPLS = ("sdpa", "eager")


def _meta_llama():
    return ModelFactory(family_checkpoint("llama")).build_model()


def _registry_snapshot():
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    attns = ALL_ATTENTION_FUNCTIONS._global_mapping
    return {
        "masks": {k: masks.get(k) for k in IMPLS},
        "attns": {k: attns.get(k) for k in IMPLS},
        "mask_keys": list(masks),
    }


def _assert_registries_restored(before):
    after = _registry_snapshot()
    for kind in ("masks", "attns"):
        for impl in IMPLS:
            assert after[kind][impl] is before[kind][impl], (kind, impl)
    assert "autodeploy" not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert after["mask_keys"] == before["mask_keys"]


def _no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_data_dependent_control_flow_names_the_module():
    model = _meta_llama()
    before = _registry_snapshot()
    impl_before = model.config._attn_implementation
    mlp = model.model.layers[0].mlp
    original = mlp.forward

    def branchy(x):
        if x.sum() > 0:  # data-dependent: not exportable
            return original(x)
        return original(-x)

    mlp.forward = branchy
    try:
        with pytest.raises(ExportError) as exc:
            export_causal_lm(model, max_batch_size=4, max_seq_len=32)
    finally:
        del mlp.forward
    msg = str(exc.value)
    assert isinstance(exc.value, AutoDeployError)
    assert "model.layers.0.mlp" in msg and "LlamaMLP" in msg
    assert "model.layers.1" not in msg
    assert msg.count("\n") == 0, "one actionable line"
    # a failed export leaves nothing behind either
    _assert_registries_restored(before)
    assert model.config._attn_implementation == impl_before
    assert "forward" not in vars(model)
    assert _no_hooks_left(model)
    # ... and the same model exports once the offending code is gone
    gm = export_causal_lm(model, max_batch_size=4, max_seq_len=32)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids", "position_ids"]


def test_export_leaves_hf_registries_and_eager_runs_untouched():
    ckpt = family_checkpoint("llama")
    ids = torch.randint(0, 512, (2, 9))
    refs = {}
    hf = {}
    for impl in IMPLS:
        hf[impl] = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=impl).eval()
        with torch.no_grad():
            refs[impl] = hf[impl](input_ids=ids).logits

    before = _registry_snapshot()
    for route in ("autodeploy", "eager"):
        model = _meta_llama()
        impl_before = model.config._attn_implementation
        export_causal_lm(model, max_batch_size=4, max_seq_len=32, attn_implementation=route)
        assert model.config._attn_implementation == impl_before
        assert "forward" not in vars(model)
        assert _no_hooks_left(model)
        _assert_registries_restored(before)

    for impl in IMPLS:
        with torch.no_grad():
            out = hf[impl](input_ids=ids).logits
        assert torch.equal(out, refs[impl]), impl
        # HF's own masks are used again: causal (a later token does not change earlier logits)
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 512
        with torch.no_grad():
            out2 = hf[impl](input_ids=changed).logits
        torch.testing.assert_close(out2[:, :-1], out[:, :-1], rtol=0, atol=1e-6)
        assert not torch.allclose(out2[:, -1], out[:, -1])
    torch.testing.assert_close(refs["sdpa"], refs["eager"], rtol=1e-4, atol=1e-4)


def test_unsupported_attn_implementation():
    with pytest.raises(ExportError, match="attn_implementation"):
        export_causal_lm(_meta_llama(), max_batch_size=2, max_seq_len=8, attn_implementation="flash_attention_2")
    assert "autodeploy" not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def test_export_patches_registry():
    patches = export_patches()
    names = [p.name for p in patches]
    assert "no_grad" in names and "dbrx_experts" in names  # the generic and the per-family patches
    assert names == sorted(names) and len(set(names)) == len(names)
    assert all(p.description for p in patches)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x, y):
        return torch.relu(self.proj(x)) * y.sum(-1, keepdim=True)


def test_export_to_graph_module_dynamic_dims():
    torch.manual_seed(0)
    module = TwoInputs().eval()
    b, s = Dim("b", min=1, max=16), Dim("s", min=1, max=64)
    gm = export_to_graph_module(module, (torch.randn(2, 5, 8), torch.randn(2, 5, 3)),
                                dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}))
    assert isinstance(gm, fx.GraphModule)
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == 2
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    for batch, seq in [(1, 1), (3, 7), (16, 64)]:
        x, y = torch.randn(batch, seq, 8), torch.randn(batch, seq, 3)
        out = gm(x, y)
        assert isinstance(out, torch.Tensor), "a single output is returned as a tensor, not a tuple"
        torch.testing.assert_close(out, module(x, y))
    # parameters keep their module names
    assert {n for n, _ in gm.named_parameters()} == {"proj.weight", "proj.bias"}


class ModeRegions(nn.Module):
    """A no_grad region (as HF's rotary embedding has) and an autocast-off region, nested too."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("c", torch.randn(8))

    def forward(self, x):
        with torch.no_grad():
            y = x @ self.w + self.c
            with torch.autocast("cpu", enabled=False):
                y = torch.cos(y).float()
        with torch.autocast("cpu", enabled=False):
            z = (y * 2).float()
        return z + x


def test_grad_mode_and_autocast_off_regions_are_inlined():
    """Without the no_grad patch export wraps such regions in higher-order ops with subgraphs,
    which the flat-graph passes never enter: they are inlined into one graph."""
    module = ModeRegions().eval()
    x = torch.randn(3, 8)
    gm = export_to_graph_module(module, (x,), patches={"no_grad": False})
    assert not [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert not [name for name, m in gm.named_children() if isinstance(m, fx.GraphModule)]
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.aten.cos.default)
    torch.testing.assert_close(gm(x), module(x))


def _grad_regions(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = x * 2
        with torch.enable_grad():
            y = y + 1
    return y


def _recorded_grad_mode_calls(fn) -> list:
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        gm = make_fx(fn, pre_dispatch=True)(torch.randn(3))
    return [n.args[0] for n in gm.graph.nodes if n.target is torch._C._set_grad_enabled]


def test_grad_mode_calls_that_change_nothing_are_not_recorded():
    """Each recorded grad-mode call makes torch.export split and re-inline the whole graph
    (quadratic in the parameter count): under no_grad, HF's no_grad regions change nothing and
    are dropped before export sees them; an enable_grad region inside is still recorded."""
    from autodeploy.export.exporter import _UnchangedGradModeSkipped

    def skipped(x: torch.Tensor) -> torch.Tensor:
        with _UnchangedGradModeSkipped():
            return _grad_regions(x)

    assert _recorded_grad_mode_calls(_grad_regions) == [False, True, False, False]
    assert _recorded_grad_mode_calls(skipped) == [True, False]


def test_export_to_graph_module_unknown_patch():
    with pytest.raises(ValueError, match="nope"):
        export_to_graph_module(TwoInputs(), (torch.randn(2, 5, 8), torch.randn(2, 5, 3)), patches={"nope": True})


class _ConstantsInForward(nn.Module):
    """A causal toy LM whose forward builds constants the way HF code does: a Python-list index
    (Falcon's ``fused_qkv[..., [-2], :]``) and ``torch.tensor(data, device=x.device)`` (GPT-Neo's
    mask value, CPM-Ant's position list)."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(2 * hidden, vocab)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        picked = x[..., [-1, 0]]  # list index
        offsets = torch.tensor([3.0, -2.0], device=x.device)  # constant built on the model's device
        scale = torch.tensor(0.5, device=x.device)
        mixed = torch.cat([x * scale, x + (picked * offsets).sum(-1, keepdim=True)], dim=-1)
        return self.head(mixed)


def _export_on_meta(**patches: bool) -> fx.GraphModule:
    with torch.device("meta"):
        meta = _ConstantsInForward()
    return export_causal_lm(meta, max_batch_size=2, max_seq_len=8, patches=patches)


def _load_like(gm: fx.GraphModule, module: nn.Module) -> fx.GraphModule:
    """What load_weights does for this toy: parameters from ``module``, constants from export."""
    from autodeploy.transform.library.load_weights import _restore_constants

    for name, param in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(gm.get_submodule(owner), leaf, nn.Parameter(param.detach().clone()))
    _restore_constants(gm, torch.device("cpu"))
    return gm


def _meta_constants(gm: fx.GraphModule) -> list:
    lifted = [str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and "lifted" in str(n.target)]
    assert lifted, "the toy must produce lifted constants"
    return [t for t in lifted if getattr(gm, t).is_meta]


def test_constants_built_on_the_meta_device_keep_their_values():
    torch.manual_seed(0)
    module = _ConstantsInForward().eval()
    gm = _load_like(_export_on_meta(), module)
    assert _meta_constants(gm) == []
    ids = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(gm(ids, torch.arange(5).expand(2, 5)), module(ids))


@pytest.mark.parametrize("patch", ["list_index_constants", "meta_tensor_constants"])
def test_without_the_constant_patches_the_values_are_lost(patch):
    """Near miss: each patch switched off leaves at least one constant on the meta device."""
    module = _ConstantsInForward().eval()
    gm = _load_like(_export_on_meta(**{patch: False}), module)
    assert _meta_constants(gm)


def test_autodeploy_route_refuses_attention_arguments_it_would_drop():
    """An additive position bias (Inkling) must not vanish: the route refuses it, naming it, and
    export_causal_lm retries with HF's sdpa route (or the model's eager attention, see below).
    Positions and sinks are understood."""
    from autodeploy.export.hf_attention import RouteUnsupportedError, autodeploy_attention

    q = k = v = torch.randn(1, 4, 3, 8)
    module = nn.Module()
    out, _ = autodeploy_attention(module, q, k, v, None, scaling=0.5, position_ids=torch.arange(3)[None])
    assert out.shape == (1, 3, 4, 8)
    with pytest.raises(RouteUnsupportedError, match="position_bias"):
        autodeploy_attention(module, q, k, v, None, scaling=0.5, position_bias=torch.zeros(1, 4, 3, 3))


def test_fallback_route_is_eager_for_models_without_sdpa():
    """HF's sdpa function drops arguments a model without sdpa support passes (Inkling2's per-token
    sinks): such a model falls back to its own eager attention, the others to sdpa."""
    from autodeploy.export.exporter import _fallback_attn_implementation

    class NoSdpa(nn.Module):
        _supports_sdpa = False

    assert _fallback_attn_implementation(NoSdpa()) == "eager"
    assert _fallback_attn_implementation(nn.Module()) == "sdpa"


class _CountsExperts(nn.Module):
    """What transformers' grouped_mm experts do off CPU (and on the meta device during export):
    count tokens per expert with histc on integer ids."""

    def forward(self, ids):
        return torch.histc(ids.int(), bins=4, min=0, max=3)


def test_histc_on_integer_ids_is_exported_on_float_ids():
    ids = torch.tensor([[0, 1, 1, 3, 3, 3]])
    with pytest.raises(NotImplementedError, match="histogram_cpu"):
        _CountsExperts()(ids)  # the CPU kernel the traced int path would need does not exist
    gm = export_to_graph_module(_CountsExperts(), (ids,), dynamic_shapes=({1: Dim.DYNAMIC},))
    assert torch.equal(gm(ids), torch.tensor([1.0, 2.0, 0.0, 3.0]))
    assert torch.equal(gm(torch.tensor([[2, 2, 0]])), torch.tensor([1.0, 0.0, 2.0, 0.0]))
    with pytest.raises(Exception, match="histogram_cpu"):  # the patch off: the graph keeps the int histc
        export_to_graph_module(_CountsExperts(), (ids,), dynamic_shapes=({1: Dim.DYNAMIC},),
                               patches={"histc_float_input": False})(ids)
