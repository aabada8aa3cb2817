"""Export patches for one model family each: expert blocks written as data-dependent Python
loops that ``torch.export`` cannot trace with dynamic shapes.

Each patch replaces the block's forward, for the duration of one export only, by the canonical
op computing the same thing over the module's own parameters (views, no copies), so the graph is
what ``match_moe_pattern`` would have produced and ``fuse_moe`` takes it from there. A block whose
activation is not SiLU keeps HF's forward (and export reports the failure as before).
"""

import importlib
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from .patch_registry import register_export_patch


def _act_name(act: nn.Module) -> str:
    return type(act).__name__.lower().replace("activation", "")


@contextmanager
def _forward_replaced(module_path: str, class_name: str,
                      make_forward: Callable[[Callable], Callable]) -> Iterator[None]:
    """Swap ``class_name.forward`` (from ``module_path``) for ``make_forward(original)`` while the
    export runs; nothing happens with a transformers that lacks the family."""
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError):
        yield
        return
    original = cls.forward
    cls.forward = make_forward(original)
    try:
        yield
    finally:
        cls.forward = original


def _dbrx_forward(original: Callable) -> Callable:
    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if _act_name(self.mlp.activation_fn) != "silu":
            return original(self, hidden_states, top_k_index, top_k_weights)
        batch = hidden_states.shape[0]
        x = hidden_states.reshape(-1, self.hidden_size)
        shape = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
        gate_up = torch.cat([self.mlp.w1.view(shape), self.mlp.v1.view(shape)], dim=1)  # [E, 2I, H]
        down = self.mlp.w2.view(shape).transpose(1, 2)  # DBRX multiplies by w2 untransposed: [E, H, I]
        out = torch.ops.autodeploy.torch_moe_fused(
            x, top_k_index, top_k_weights.to(x.dtype), gate_up, down, None, None, "silu", 1.0, 0.0
        )
        return out.view(batch, -1, self.hidden_size)

    return forward


def _longcat_forward(original: Callable) -> Callable:
    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if _act_name(self.act_fn) != "silu" or self.gate_up_proj is None:
            return original(self, hidden_states, top_k_index, top_k_weights)
        routed = top_k_index < self.num_routed_experts
        weights = top_k_weights.to(hidden_states.dtype)
        out = torch.ops.autodeploy.torch_moe_fused(
            hidden_states, torch.where(routed, top_k_index, torch.zeros_like(top_k_index)),
            torch.where(routed, weights, torch.zeros_like(weights)),
            self.gate_up_proj[: self.num_routed_experts], self.down_proj, None, None, "silu", 1.0, 0.0,
        )
        identity = torch.where(routed, torch.zeros_like(weights), weights).sum(-1, keepdim=True)
        return out + hidden_states * identity

    return forward


@register_export_patch(
    "dbrx_experts",
    "DBRX experts loop over the experts hit (nonzero, data-dependent): export them as torch_moe_fused over "
    "views of the stacked w1/v1/w2 parameters",
)
def _dbrx_experts(model: nn.Module):  # type: ignore[no-untyped-def]
    return _forward_replaced("transformers.models.dbrx.modeling_dbrx", "DbrxExperts", _dbrx_forward)


@register_export_patch(
    "longcat_flash_experts",
    "LongCat-Flash experts loop over the experts hit and include zero-compute (identity) experts: export the "
    "routed ones as torch_moe_fused and the identity experts as a weighted skip",
)
def _longcat_flash_experts(model: nn.Module):  # type: ignore[no-untyped-def]
    return _forward_replaced("transformers.models.longcat_flash.modeling_longcat_flash", "LongcatFlashExperts",
                             _longcat_forward)
