"""Hierarchical checks for a lean custom model against its HF original (for contributors' tests).

A custom model is trusted only once it computes what transformers computes. Checking the full
model's logits alone says *that* something is wrong, not *where*; so the checks go down the
hierarchy, each with the same weights on both sides:

1. ``assert_block_matches``: one submodule pair (an MLP, a norm, an attention block) called with
   the same inputs;
2. ``assert_layer_matches``: one decoder layer, fed the hidden states the HF layer received, so an
   error in an earlier layer cannot hide or fake one here;
3. ``assert_logits_match``: the full model;
4. ``assert_exports_at_two_shapes``: the model through the project's exporter with dynamic batch
   and sequence, the graph equal to the eager module at two different shapes.

Closeness is the relative RMSE ``||actual - expected|| / ||expected||`` (``assert_rmse_close``),
which ignores the scale of the values and reports one number a failure message can show.
See ``docs/onboarding.md`` and ``tests/models/test_custom_model_example.py``.
"""

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from ...utils.errors import ExportError
from ...utils.logging import get_logger

logger = get_logger(__name__)

Shape = Tuple[int, int]


def relative_rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float32 (0 when both are zero)."""
    a, e = actual.detach().float(), expected.detach().float()
    diff, denom = (a - e).norm(), e.norm()
    if denom == 0:
        return 0.0 if diff == 0 else float("inf")
    return float(diff / denom)


def assert_rmse_close(actual: torch.Tensor, expected: torch.Tensor, rmse_tol: float, msg: str = "") -> None:
    """Fail unless the shapes are equal and the relative RMSE of ``actual`` against ``expected`` is
    at most ``rmse_tol``; the message gives the measured value (and ``msg`` says what was compared)."""
    where = f"{msg}: " if msg else ""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{where}shape {tuple(actual.shape)} differs from the expected {tuple(expected.shape)}")
    if not torch.isfinite(actual).all():
        raise AssertionError(f"{where}the output has non-finite values (NaN or inf)")
    value = relative_rmse(actual, expected)
    if not value <= rmse_tol:
        raise AssertionError(f"{where}relative RMSE {value:.3e} exceeds the tolerance {rmse_tol:.1e}")


def first_tensor(output: Any) -> torch.Tensor:
    """The tensor a module's output stands for: ``.logits`` of a model output, the first element
    of a tuple (HF layers return ``(hidden_states, ...)`` in some versions), or the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output:
        return first_tensor(output[0])
    raise TypeError(f"cannot find a tensor in a module output of type {type(output).__name__}")


def copy_weights(hf_model: nn.Module, custom_model: nn.Module) -> None:
    """Give ``custom_model`` the HF model's weights by name (strict: every name on both sides).

    A name the custom model lacks or adds is the custom model's bug: its parameters must carry
    the checkpoint's names (or the model must provide ``load_hooks()``), since the pipeline's
    loader finds tensors by name."""
    result = custom_model.load_state_dict(hf_model.state_dict(), strict=False)  # copies: no shared storage
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(
            "parameter names differ from the HF model's: the custom model lacks "
            f"{result.missing_keys[:5]} and has no place for {result.unexpected_keys[:5]}"
        )


@torch.no_grad()
def assert_block_matches(hf_block: nn.Module, custom_block: nn.Module, *args: Any, rmse_tol: float = 1e-5,
                         msg: str = "", **kwargs: Any) -> None:
    """Two submodules with the same weights give the same output for the same inputs."""
    expected = first_tensor(hf_block(*args, **kwargs))
    actual = first_tensor(custom_block(*args, **kwargs))
    assert_rmse_close(actual, expected, rmse_tol, msg or f"{type(custom_block).__name__} vs {type(hf_block).__name__}")


class _Call:
    """What one submodule received and returned during a forward."""

    def __init__(self) -> None:
        self.args: Tuple[Any, ...] = ()
        self.kwargs: Dict[str, Any] = {}
        self.output: Any = None


@contextmanager
def _recording(module: nn.Module, call: _Call) -> Iterator[None]:
    """Record the first call of ``module`` (its inputs and output)."""
    seen = [False]

    def hook(mod: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
        if not seen[0]:
            seen[0] = True
            call.args, call.kwargs, call.output = args, dict(kwargs), output

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _hidden_states_of(call: _Call) -> torch.Tensor:
    """The layer's input hidden states: its first positional tensor, or ``hidden_states=``."""
    if call.args and isinstance(call.args[0], torch.Tensor):
        return call.args[0]
    if isinstance(call.kwargs.get("hidden_states"), torch.Tensor):
        return call.kwargs["hidden_states"]
    raise TypeError("the layer was called without hidden states as its first argument or as hidden_states=")


def _with_hidden_states(call: _Call, hidden: torch.Tensor) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    if call.args and isinstance(call.args[0], torch.Tensor):
        return (hidden, *call.args[1:]), call.kwargs
    return call.args, {**call.kwargs, "hidden_states": hidden}


def _model_inputs(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    if position_ids is None:
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
    return {"input_ids": input_ids, "position_ids": position_ids}


@torch.no_grad()
def assert_layer_matches(hf_model: nn.Module, custom_model: nn.Module, layer: str, input_ids: torch.Tensor,
                         position_ids: Optional[torch.Tensor] = None, *, custom_layer: Optional[str] = None,
                         rmse_tol: float = 1e-5) -> None:
    """Decoder layer ``layer`` (a submodule path such as ``model.layers.1``; ``custom_layer`` if the
    custom model names it otherwise) computes what the HF layer computes, from the same input.

    Both models run once on ``input_ids``, recording what the layer received; then the custom
    layer runs again on its own recorded arguments (its RoPE tables, whatever it passes) but with
    the hidden states the HF layer received. Each model calls its layer its own way, so no common
    signature is needed, and an error in an earlier layer cannot show up here."""
    inputs = _model_inputs(input_ids, position_ids)
    hf_mod = hf_model.get_submodule(layer)
    custom_mod = custom_model.get_submodule(custom_layer or layer)
    hf_call, custom_call = _Call(), _Call()
    with _recording(hf_mod, hf_call):
        hf_model(**inputs)
    with _recording(custom_mod, custom_call):
        custom_model(**inputs)
    for call, path, side in ((hf_call, layer, "HF"), (custom_call, custom_layer or layer, "custom")):
        if call.output is None:
            raise AssertionError(f"layer {path} was not called by the {side} model's forward")
    args, kwargs = _with_hidden_states(custom_call, _hidden_states_of(hf_call))
    actual = first_tensor(custom_mod(*args, **kwargs))
    assert_rmse_close(actual, first_tensor(hf_call.output), rmse_tol, f"layer {custom_layer or layer}")


@torch.no_grad()
def assert_logits_match(hf_model: nn.Module, custom_model: nn.Module, input_ids: torch.Tensor,
                        position_ids: Optional[torch.Tensor] = None, *, rmse_tol: float = 1e-5) -> None:
    """The full models give the same logits for the same tokens."""
    inputs = _model_inputs(input_ids, position_ids)
    expected = first_tensor(hf_model(**inputs))
    actual = first_tensor(custom_model(**inputs))
    assert_rmse_close(actual, expected, rmse_tol, f"logits at (batch, seq) = {tuple(input_ids.shape)}")


def assert_exports_at_two_shapes(model: nn.Module, vocab_size: int, shapes: Sequence[Shape] = ((2, 7), (1, 3)),
                                 *, rmse_tol: float = 1e-5, max_batch_size: int = 4,
                                 max_seq_len: int = 64) -> fx.GraphModule:
    """Export ``model`` (with its weights) as the pipeline does, batch and sequence dynamic, and
    check that the graph gives the eager module's logits at each of two different shapes (one
    shape could be the one traced; two show the graph did not bake a length in). Returns the graph."""
    from ...export.exporter import export_causal_lm

    if len({tuple(s) for s in shapes}) < 2:
        raise ValueError(f"give two different (batch, seq) shapes, not {list(shapes)}")
    for b, s in shapes:
        if not (1 <= b <= max_batch_size and 1 <= s <= max_seq_len):
            raise ValueError(f"shape {(b, s)} is outside max_batch_size={max_batch_size}, max_seq_len={max_seq_len}")
    model.eval()
    try:
        gm = export_causal_lm(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    except ExportError as exc:
        raise AssertionError(f"{type(model).__name__} does not export with dynamic batch and sequence: {exc}") from exc
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    for b, s in shapes:
        inputs = _model_inputs(torch.randint(0, vocab_size, (b, s), generator=generator).to(device), None)
        with torch.no_grad():
            expected = first_tensor(model(**inputs))
            actual = first_tensor(gm(inputs["input_ids"], inputs["position_ids"]))
        assert_rmse_close(actual, expected, rmse_tol, f"exported graph vs eager at (batch, seq) = {(b, s)}")
    logger.info("%s exports and matches eager at %s", type(model).__name__, list(shapes))
    return gm


__all__: List[str] = [
    "relative_rmse", "assert_rmse_close", "first_tensor", "copy_weights", "assert_block_matches",
    "assert_layer_matches", "assert_logits_match", "assert_exports_at_two_shapes",
]
