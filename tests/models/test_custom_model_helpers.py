"""The hierarchical checks of ``autodeploy.models.custom.testing``: each passes on equal models
and fails, saying what it measured, on models that differ where it looks (a check that cannot
fail is a defect). Toy models stand in for an HF model and its custom rewrite: the same weight
names, different call conventions (keyword vs positional layer inputs, an output object vs a
tensor), as between transformers and a lean model."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autodeploy.models.custom.testing import (
    assert_block_matches, assert_exports_at_two_shapes, assert_layer_matches, assert_logits_match, assert_rmse_close,
    copy_weights, relative_rmse,
)

VOCAB, HIDDEN = 32, 16


class HFStyleLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states, position_ids=None):
        return (hidden_states + torch.tanh(self.proj(hidden_states)),)


class HFStyleModel(nn.Module):
    """Calls its layers with keywords and returns an output object with ``.logits``."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(HFStyleLayer() for _ in range(2))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, position_ids=None, **kwargs):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden_states=hidden, position_ids=position_ids)[0]
        return SimpleNamespace(logits=self.lm_head(hidden))


class CustomLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, pos):
        return x + torch.tanh(self.proj(x))


class CustomModel(nn.Module):
    """Same weights by name; positional layer calls; returns the logits tensor."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(CustomLayer() for _ in range(2))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, position_ids, inputs_embeds=None, **unused):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, position_ids)
        return self.lm_head(hidden)


def _pair():
    torch.manual_seed(0)
    hf, custom = HFStyleModel().eval(), CustomModel().eval()
    copy_weights(hf, custom)
    return hf, custom


def _perturb(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.add_(0.5 * torch.randn_like(param))


def _ids(b=2, s=6):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))


# ---- assert_rmse_close ----------------------------------------------------------------------------
def test_rmse_close_passes_within_tolerance_and_reports_the_value_outside():
    expected = torch.ones(4, 4)
    assert relative_rmse(expected * 1.1, expected) == pytest.approx(0.1, rel=1e-5)
    assert relative_rmse(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_rmse(torch.ones(3), torch.zeros(3)) == float("inf")
    assert_rmse_close(expected * 1.1, expected, rmse_tol=0.11)
    with pytest.raises(AssertionError, match=r"layer 3: relative RMSE 1\.000e-01 exceeds the tolerance 5\.0e-02"):
        assert_rmse_close(expected * 1.1, expected, rmse_tol=0.05, msg="layer 3")


def test_rmse_close_fails_on_shape_and_non_finite_values():
    with pytest.raises(AssertionError, match=r"shape \(4,\) differs from the expected \(4, 1\)"):
        assert_rmse_close(torch.ones(4), torch.ones(4, 1), rmse_tol=1.0)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_rmse_close(torch.tensor([1.0, float("nan")]), torch.ones(2), rmse_tol=1.0)


# ---- copy_weights ---------------------------------------------------------------------------------
def test_copy_weights_copies_and_refuses_other_names():
    hf, custom = _pair()
    assert torch.equal(hf.layers[1].proj.weight, custom.layers[1].proj.weight)
    assert hf.layers[1].proj.weight.data_ptr() != custom.layers[1].proj.weight.data_ptr()  # a copy

    class Renamed(CustomModel):
        def __init__(self):
            super().__init__()
            self.head = self.lm_head
            del self.lm_head

    with pytest.raises(AssertionError, match="lacks .*head.weight.* no place for .*lm_head.weight"):
        copy_weights(hf, Renamed())


# ---- block ----------------------------------------------------------------------------------------
def test_block_matches_and_fails_on_a_different_weight():
    hf, custom = _pair()
    x = torch.randn(2, 5, HIDDEN)
    assert_block_matches(hf.layers[0].proj, custom.layers[0].proj, x)
    _perturb(custom.layers[0].proj.weight)
    with pytest.raises(AssertionError, match="proj: relative RMSE"):
        assert_block_matches(hf.layers[0].proj, custom.layers[0].proj, x, msg="proj")


# ---- layer ----------------------------------------------------------------------------------------
def test_layers_match_across_call_conventions():
    hf, custom = _pair()
    for i in range(2):
        assert_layer_matches(hf, custom, f"layers.{i}", _ids())


def test_a_wrong_layer_fails_alone():
    """Layer 0 broken: layer 0 fails; layer 1 still passes, because it is fed the HF layer's input
    rather than the (now different) output of the custom layer 0."""
    hf, custom = _pair()
    _perturb(custom.layers[0].proj.weight)
    with pytest.raises(AssertionError, match="layer layers.0: relative RMSE"):
        assert_layer_matches(hf, custom, "layers.0", _ids())
    assert_layer_matches(hf, custom, "layers.1", _ids())


def test_a_layer_the_forward_never_calls_fails():
    """A path to a module the forward does not run (a typo'd or unused layer) is an error, not a pass."""
    hf, custom = _pair()
    custom.spare = CustomLayer()
    with pytest.raises(AssertionError, match="layer spare was not called by the custom model"):
        assert_layer_matches(hf, custom, "layers.1", _ids(), custom_layer="spare")


# ---- model ----------------------------------------------------------------------------------------
def test_logits_match_and_fail_on_a_different_head():
    hf, custom = _pair()
    assert_logits_match(hf, custom, _ids())
    _perturb(custom.lm_head.weight)
    with pytest.raises(AssertionError, match=r"logits at \(batch, seq\) = \(2, 6\): relative RMSE"):
        assert_logits_match(hf, custom, _ids())


# ---- export ---------------------------------------------------------------------------------------
def test_exports_at_two_shapes():
    _, custom = _pair()
    gm = assert_exports_at_two_shapes(custom, VOCAB, shapes=((2, 7), (1, 3)))
    assert gm(_ids(3, 2), torch.arange(2).expand(3, 2)).shape == (3, 2, VOCAB)
    with pytest.raises(ValueError, match="two different"):
        assert_exports_at_two_shapes(custom, VOCAB, shapes=((2, 7), (2, 7)))


class ReadsPythonState(CustomModel):
    """Scales by a Python counter: export freezes the value it read, eager moves on."""

    calls = 0

    def forward(self, input_ids, position_ids, inputs_embeds=None, **unused):
        type(self).calls += 1
        return super().forward(input_ids, position_ids) * type(self).calls


def test_export_check_fails_when_the_graph_differs_from_eager():
    _, custom = _pair()
    model = ReadsPythonState()
    copy_weights(custom, model)
    with pytest.raises(AssertionError, match=r"exported graph vs eager at \(batch, seq\) = \(2, 7\): relative RMSE"):
        assert_exports_at_two_shapes(model, VOCAB)


class BranchesOnLength(CustomModel):
    """Python control flow on the sequence length: no dynamic sequence dim can be exported."""

    def forward(self, input_ids, position_ids, inputs_embeds=None, **unused):
        logits = super().forward(input_ids, position_ids)
        return logits * 2 if input_ids.shape[1] > 4 else logits


def test_export_check_fails_when_the_model_does_not_export_dynamically():
    model = BranchesOnLength().eval()
    with pytest.raises(AssertionError, match="does not export with dynamic batch and sequence"):
        assert_exports_at_two_shapes(model, VOCAB)
