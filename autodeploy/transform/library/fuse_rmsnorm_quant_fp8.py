"""``fuse_rmsnorm_quant_fp8`` (post_load_fusion): an RMSNorm emits the FP8 input of the linears it feeds.

Before (a ModelOpt FP8 Llama layer after ``fuse_fp8_linear``, ``fuse_add_rms_norm`` and
``fuse_rmsnorm``; every q/k/v linear quantizes the same normed tensor with its own op)::

    y, s = autodeploy.native_fused_add_rmsnorm(h, r, P.norm_w, eps)
    yq = autodeploy.torch_quant_fp8_activation(y, P.q_proj.input_scale)   # } the same values
    yk = autodeploy.torch_quant_fp8_activation(y, P.k_proj.input_scale)   # } three times: the
    yv = autodeploy.torch_quant_fp8_activation(y, P.v_proj.input_scale)   # } scales are equal
    q = aten.linear(yq, ...); k = aten.linear(yk, ...); v = aten.linear(yv, ...)

After::

    y8, s = autodeploy.native_fused_add_rmsnorm_quant_fp8(h, r, P.norm_w, eps, P.q_proj.input_scale)
    q = aten.linear(y8, ...); k = aten.linear(y8, ...); v = aten.linear(y8, ...)

A norm matches when *every* user of its normed output is an FP8 activation quantization and their
input scales hold equal values (ModelOpt calibrates q/k/v, and gate/up, on the same input, so
their scales agree). A norm with any other user (the final norm feeding the float LM head), or
with differing scales, is left alone: fusing it would change what another consumer sees.

Norm forms handled, as the default pipeline leaves them at this point: ``torch_rmsnorm`` and
``native_rmsnorm`` (the first layer's input norm, whose input is the embedding), and the normed
(first) output of ``torch_fused_add_rmsnorm`` / ``native_fused_add_rmsnorm`` (every other norm,
after ``fuse_add_rms_norm``). Each keeps its backend: a ``native_*`` norm becomes the ``native_*``
fused op, a ``torch_*`` one the reference. ``compiled_*`` norms (``fuse_rmsnorm`` backend
``compile``) are left alone: there is no compiled fused op, and replacing it by the reference
would undo that choice.

Fine-grained FP8 (per-group, dynamic) the same way: ``fuse_finegrained_fp8_linear`` leaves
``torch_quant_fp8_group_activation(y, 128)`` in front of each linear. A norm whose every user is
that op with one group size becomes ``*_rmsnorm_quant_fp8_group`` (the group size passed on)::

    y, s = autodeploy.native_fused_add_rmsnorm(h, r, P.norm_w, eps)
    yq = autodeploy.torch_quant_fp8_group_activation(y, 128)   # } scales computed from y itself:
    yk = autodeploy.torch_quant_fp8_group_activation(y, 128)   # } the same tensor each time
    ->  y8, s = autodeploy.native_fused_add_rmsnorm_quant_fp8_group(h, r, P.norm_w, eps, 128)

There is no scale to compare: the quantization is dynamic, so equal group sizes mean equal
outputs, bit for bit. Users with different group sizes, or a mix of static and per-group FP8
users, are near misses, left alone.

Why: on a GPU the norm kernel writes FP8 directly, so the activation is read and written once
instead of once per linear. On the CPU the fused op computes the norm and one quantization and
the duplicate quantization passes (and their op dispatches) go. Measured on the ``small``
preset's shapes (hidden 768; 2-core AMD EPYC, one thread, native norms, the ops timed in
interleaved rounds, medians): a norm feeding q/k/v took 88 -> 33 us at one row, 158 -> 58 us at
8 rows, 388 -> 141 us at 32 rows and 5.7 -> 2.4 ms for a 512-token prefill; a norm feeding
gate/up 65 -> 34 us at one row. That is ~1.0 ms of a batch-1 decode step of the 12-layer model.
The output equals the unfused graph's exactly (the same functions compute it).
"""

import torch
from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_norm_fusion import ADD_FP8, ADD_FP8_GROUP, PLAIN_FP8, PLAIN_FP8_GROUP, fuse_norm_quant

ad = torch.ops.autodeploy


class FuseRMSNormQuantFP8Config(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION


@TransformRegistry.register("fuse_rmsnorm_quant_fp8")
class FuseRMSNormQuantFP8(BaseTransform):
    config_class = FuseRMSNormQuantFP8Config
    # the activation ops exist only after fuse_fp8_linear; the norm's final form (add fused, backend
    # chosen) only after fuse_add_rms_norm and fuse_rmsnorm, which know nothing of the fused ops
    run_after = ("fuse_fp8_linear", "fuse_finegrained_fp8_linear", "fuse_add_rms_norm", "fuse_rmsnorm")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_norm_quant(gm, ad.torch_quant_fp8_activation, PLAIN_FP8, ADD_FP8, self._key)
        count += fuse_norm_quant(gm, ad.torch_quant_fp8_group_activation, PLAIN_FP8_GROUP, ADD_FP8_GROUP, self._key,
                                 report_compiled=False)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
