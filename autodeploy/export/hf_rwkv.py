"""Export patch ``rwkv``: RWKV-4's recurrences become canonical state ops.

Every RWKV block keeps two kinds of state from token to token:

* the **token shift**: attention and feed-forward mix each token's (layer-normed) input with the
  previous token's, ``shifted = time_shift(x)`` (an ``nn.ZeroPad2d`` moving the sequence down one
  row). This patch makes each ``time_shift`` a depthwise causal convolution of width 2 whose taps
  are ``[1, 0]`` (``torch_causal_conv1d``): the same numbers (``1 * x_{t-1} + 0 * x_t``), and
  ``insert_cached_causal_conv`` keeps its one-token window per sequence;
* the **WKV** recurrence, which HF runs through the module function ``rwkv_linear_attention`` (a
  Python loop over the tokens): it becomes ``torch_wkv`` (``autodeploy.ops.wkv``), whose
  ``[3, c]`` state ``insert_cached_wkv`` keeps.

HF's eager model also *rescales* at its first inference call (``rescale_every``, against fp16
overflow): it divides the output weights of block ``i`` (``attention.output``,
``feed_forward.value``) by ``2 ** (i // rescale_every)`` in place and halves the hidden states
after every ``rescale_every`` blocks. The graph is exported from a model whose weights are loaded
later from the checkpoint, undivided, so this patch exports the rescaled forward (the halving) and
divides those two linears' *outputs* by the same powers of two instead of their weights: a scaling
by a power of two is exact, so the numbers are HF's (``layers_are_rescaled`` is set for the export
so HF's own in-place division does not run; it is restored after).

Calls with a state (HF's cache) run HF's code; the patch lasts one export.
"""

import sys
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .patch_registry import register_export_patch, replaced_attribute
from .state_kernels import previous_token

_ops = torch.ops.autodeploy
_HF_MODULE = "transformers.models.rwkv.modeling_rwkv"


def _wkv_fn(original: Callable) -> Callable:
    def rwkv_linear_attention(time_decay: Tensor, time_first: Tensor, key: Tensor, value: Tensor,
                              state: Optional[List[Tensor]] = None, return_state: bool = False) -> Tuple[Tensor, None]:
        if state is not None or return_state:
            return original(time_decay, time_first, key, value, state=state, return_state=return_state)
        return _ops.torch_wkv(time_decay, time_first, key, value), None

    return rwkv_linear_attention


def is_token_shift(module: nn.Module) -> bool:
    """RWKV's ``time_shift``: a zero pad of one row on top and one row off the bottom."""
    return isinstance(module, nn.ZeroPad2d) and tuple(module.padding) == (0, 0, 1, -1)


def _scaled_linear(linear: nn.Linear, factor: float) -> Callable[[Tensor], Tensor]:
    """``linear`` with its output times ``factor`` (a power of two: the same as scaling the weight)."""
    def forward(x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, linear.weight, linear.bias) * factor

    return forward


@register_export_patch(
    "rwkv",
    "RWKV-4: the token shift exports as a width-2 torch_causal_conv1d and rwkv_linear_attention (a loop over the "
    "tokens) as torch_wkv, both state ops the cache transforms serve; HF's rescaling (rescale_every) on the outputs",
)
@contextmanager
def _rwkv(model: nn.Module) -> Iterator[None]:
    hf = sys.modules.get(_HF_MODULE)
    blocks = [m for m in model.modules() if type(m).__name__ == "RwkvBlock"]
    if hf is None or not blocks or not callable(getattr(hf, "rwkv_linear_attention", None)):
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(replaced_attribute(hf, "rwkv_linear_attention", _wkv_fn(hf.rwkv_linear_attention)))
        for m in model.modules():
            if is_token_shift(m):
                stack.enter_context(replaced_attribute(m, "forward", previous_token))
            every = getattr(getattr(m, "config", None), "rescale_every", 0)
            if type(m).__name__ == "RwkvModel" and every > 0:
                stack.enter_context(replaced_attribute(m, "layers_are_rescaled", True))
                for i, block in enumerate(m.blocks):
                    if i // every:
                        factor = 2.0 ** -(i // every)
                        for linear in (block.attention.output, block.feed_forward.value):
                            stack.enter_context(replaced_attribute(linear, "forward", _scaled_linear(linear, factor)))
        yield
