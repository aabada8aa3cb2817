"""How HF's multi-head latent attention reaches the IR as ``torch_mla``.

Every MLA family in transformers (DeepSeek-V2/V3/V3.2, Kimi, GLM-4-MoE-Lite, MiniCPM3, LongCat,
Youtu, Mistral-4, ...) computes its latent ``kv_nope`` (normalised, ``[b, 1, s, kv_lora_rank]``)
and roped ``k_rot`` (``[b, 1, s, qk_rope_head_dim]``), hands both to the KV cache, then calls
``self.expand_kv(kv_nope, k_rot)`` for per-head keys and values and passes those to the attention
interface. The latent is exactly what an MLA cache holds, so the route needs two hooks:

* the ``mla_latent_attention`` export patch wraps ``expand_kv`` of every class that has one (and
  a plain ``kv_b_proj``) for the duration of one export, recording which key tensor came from
  which latent;
* ``autodeploy_attention`` (``hf_attention``) asks ``claimed_mla`` whether its key is such an
  expansion; when it is, and the attention is causal (no explicit mask, window or soft-cap;
  per-head sinks go along), it emits ``torch_mla`` over the latent, the roped key part and ``kv_b_proj``'s
  weight instead of ``torch_attention`` over the expanded K/V. The expansion is then dead code
  and export drops it.

Declined, with the model keeping the expanded route (which serves it exactly, with a larger
cache): a ``kv_b_proj`` with a bias or that is not a plain ``nn.Linear``, and a checkpoint with a
``quantization_config`` (its ``kv_b_proj`` may be stored quantized, and ``torch_mla`` reads the
weight directly, not through a linear the quantization transforms would rewrite).
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from ..utils.logging import get_logger
from .patch_registry import register_export_patch

logger = get_logger(__name__)


@dataclass(frozen=True)
class MLAInputs:
    """What one ``expand_kv`` call was given: the latent ``[b, 1, s, L]``, the roped key part
    ``[b, 1, s, d_rope]`` and the module (its ``kv_b_proj`` and head sizes)."""

    latent: torch.Tensor
    k_rot: torch.Tensor
    module: nn.Module
    key: torch.Tensor  # kept so its id cannot be reused while the export runs


# id(key tensor expand_kv returned) -> the latent it came from, for the current export
_EXPANSIONS: Dict[int, MLAInputs] = {}
_SIZE_ATTRS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def is_mla_attention(module: nn.Module) -> bool:
    """An HF MLA attention module whose expansion ``torch_mla`` can take over."""
    proj = getattr(module, "kv_b_proj", None)
    return (callable(getattr(type(module), "expand_kv", None)) and type(proj) is nn.Linear and proj.bias is None
            and all(isinstance(getattr(module, a, None), int) for a in _SIZE_ATTRS))


def _expand_kv_functional(module: nn.Module, kv_nope: torch.Tensor,
                          k_rot: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF's ``expand_kv`` (the same code in all 17 MLA families of transformers 5.23) without its
    ``new_empty`` + in-place ``copy_``: export keeps in-place writes even when nothing reads the
    result, and the expansion must be dead code once ``torch_mla`` takes the latent."""
    batch, _, seq, _ = kv_nope.shape
    d_nope, d_v = module.qk_nope_head_dim, module.v_head_dim
    kv = module.kv_b_proj(kv_nope).view(batch, seq, -1, d_nope + d_v).transpose(1, 2)
    k_nope, value = torch.split(kv, [d_nope, d_v], dim=-1)
    key = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    return key, value


def _wrap_expand_kv(original: Callable) -> Callable:
    def expand_kv(self: nn.Module, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if not (is_mla_attention(self) and kv_nope.dim() == 4 and kv_nope.shape[1] == 1 and k_rot.dim() == 4
                and k_rot.shape[1] == 1):
            return original(self, kv_nope, k_rot)
        key, value = _expand_kv_functional(self, kv_nope, k_rot)
        _EXPANSIONS[id(key)] = MLAInputs(kv_nope, k_rot, self, key)
        return key, value

    return expand_kv


def _quantized(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    return any(getattr(c, "quantization_config", None) for c in configs if c is not None)


@register_export_patch(
    "mla_latent_attention",
    "MLA attention (DeepSeek-V2/V3 style: expand_kv over kv_b_proj) exports as torch_mla over the latent, so the "
    "cache can hold the latent instead of per-head K/V",
)
@contextmanager
def _mla_latent_attention(model: nn.Module) -> Iterator[None]:
    classes = {type(m) for m in model.modules() if is_mla_attention(m)}
    if not classes:
        yield
        return
    if _quantized(model):
        logger.info("MLA attention kept expanded: the checkpoint is quantized (kv_b_proj may be stored quantized)")
        yield
        return
    originals = {cls: cls.__dict__.get("expand_kv") for cls in classes}
    for cls in classes:
        cls.expand_kv = _wrap_expand_kv(cls.expand_kv)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.expand_kv
            else:
                cls.expand_kv = original
        _EXPANSIONS.clear()


def claimed_mla(module: nn.Module, query: torch.Tensor, key: torch.Tensor) -> Optional[MLAInputs]:
    """The latent behind ``key`` when it is an ``expand_kv`` result of ``module`` whose query
    (``bnsd``) has the nope + rope width, else None."""
    found = _EXPANSIONS.get(id(key))
    if found is None or found.key is not key or found.module is not module:
        return None
    if query.shape[-1] != module.qk_nope_head_dim + module.qk_rope_head_dim:
        return None
    return found


def mla_attention(found: MLAInputs, query: torch.Tensor, is_causal: bool, scaling: Optional[float],
                  topk_indices: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch_mla`` for a claimed attention; ``query`` arrives ``bnsd``, the output leaves ``bsnd``.
    ``topk_indices``: DSA's selection (``hf_dsa``); ``sinks``: per-head softmax sinks (HY-V4)."""
    module = found.module
    d_nope = module.qk_nope_head_dim
    q = query.transpose(1, 2)  # [b, s, n, d_nope + d_rope]
    latent = found.latent[:, 0]  # [b, s, L]
    kpe = found.k_rot.transpose(1, 2)  # [b, s, 1, d_rope]
    return torch.ops.autodeploy.torch_mla(q[..., :d_nope], q[..., d_nope:], latent, kpe, module.kv_b_proj.weight,
                                          is_causal, scaling, topk_indices, sinks)
