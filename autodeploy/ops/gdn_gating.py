"""Gated DeltaNet gating: ``torch_fused_gdn_gating``, the decay gate and beta of one layer.

Every Gated DeltaNet layer (Qwen3-Next, Qwen3.5, OLMo-Hybrid in transformers 5.23) computes, per
token and value head, in front of its delta rule::

    beta = b.sigmoid()                                                   # b's dtype
    g    = -A_log.float().exp() * F.softplus(a.float() + dt_bias)        # float32 (the log-decay)

``a`` and ``b`` are per-head projections of the hidden state (``[b, s, h]``), ``A_log`` and
``dt_bias`` per-head weights (``[h]``). In the exported graph that is six elementwise ops (seven
with the casts of a half-precision model) per layer per step; at decode sizes each costs more in
dispatch than in arithmetic. The op is the same expression (same operations in the same order,
so the values are bit-identical to HF's), as one node with both outputs.

``neg_exp_A_log``, when given, is ``-A_log.float().exp()`` computed once (``fuse_gdn_gating``
does that at load, since ``A_log`` is a weight): two ops fewer per call and the same values.
``A_log`` stays an input, so the node still says what it computes; a later backend may ignore
the precomputed tensor. Nothing checks that the two agree: the weights do not change after load.

Dtypes follow HF: ``g`` is float32 (``a.float() + dt_bias`` promotes; a float64 ``dt_bias``
would give float64, as in HF), ``beta`` keeps ``b``'s dtype.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("autodeploy::torch_fused_gdn_gating", mutates_args=())
def torch_fused_gdn_gating(
    A_log: Tensor, a: Tensor, b: Tensor, dt_bias: Tensor, neg_exp_A_log: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """``(g, beta) = (-exp(A_log.float()) * softplus(a.float() + dt_bias), sigmoid(b))``.

    ``neg_exp_A_log``: ``-exp(A_log.float())`` precomputed (optional; same values).
    """
    decay = neg_exp_A_log if neg_exp_A_log is not None else -A_log.float().exp()
    # a.float() costs a dispatch even when it returns a itself (at decode sizes each op is microseconds)
    return decay * F.softplus((a if a.dtype == torch.float32 else a.float()) + dt_bias), torch.sigmoid(b)


@torch_fused_gdn_gating.register_fake
def _torch_fused_gdn_gating_fake(A_log, a, b, dt_bias, neg_exp_A_log=None):
    g_dtype = torch.promote_types(torch.float32, dt_bias.dtype)
    g_shape = torch.broadcast_shapes(A_log.shape, a.shape, dt_bias.shape)
    beta_dtype = b.dtype if b.is_floating_point() else torch.get_default_dtype()
    return a.new_empty(g_shape, dtype=g_dtype), b.new_empty(b.shape, dtype=beta_dtype)


__all__: List[str] = ["torch_fused_gdn_gating"]
