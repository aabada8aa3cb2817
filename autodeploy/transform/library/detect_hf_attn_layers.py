"""``detect_hf_attn_layers`` (cache_init; the "transformers" mode): find the HF model's attention layers.

Before: the loaded HF module (``build_and_load_factory_model``). After: the same module, and
``ctx.hf_attention_layers``: each module that calls transformers' attention interface, in call
order, with its key/value heads and head dims (what its paged caches need), its sliding window,
and anything the cached attention op could not honour (a mask that is not causal or
sliding-window, a tensor argument such as an additive position bias, a non-causal layer). It
finds them by running the model once on a five-token prompt with the ``autodeploy_cached``
implementation in probe mode (plain causal attention), so it sees exactly the calls a step will
make, whatever the modules are named.
"""

from typing import Optional, Tuple

import torch
from torch import nn

from ...models.transformers_mode import detect_attention_layers
from ...utils.logging import get_logger
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)


class DetectHFAttnLayersConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    run_per_gm: bool = False
    requires_clean_graph: bool = False


@TransformRegistry.register("detect_hf_attn_layers")
class DetectHFAttnLayers(BaseTransform):
    config_class = DetectHFAttnLayersConfig
    requires = ("build_and_load_factory_model",)

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        if mod is None:
            raise RuntimeError("detect_hf_attn_layers needs the HF model (build_and_load_factory_model)")
        vocab = int(ctx.factory.vocab_size) if ctx.factory is not None else 2
        try:
            layers = detect_attention_layers(mod, torch.device(ctx.device), vocab)
        except Exception as exc:  # noqa: BLE001 - the model's own code failed under the probe
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            ctx.uncached_reason = f"the HF model failed with the cached attention in place ({type(exc).__name__}: {first})"
            ctx.hf_attention_layers = []
            logger.warning("detect_hf_attn_layers: %s", ctx.uncached_reason)
            return mod, TransformInfo(skipped=True, reason=ctx.uncached_reason[:200], is_clean=True,
                                      has_valid_shapes=True)
        ctx.hf_attention_layers = layers
        troubled = [layer for layer in layers if layer.problems]
        logger.info("detect_hf_attn_layers: %d attention layers through the attention interface%s", len(layers),
                    f", {len(troubled)} the KV cache cannot serve" if troubled else "")
        return mod, TransformInfo(num_matches=len(layers), is_clean=True, has_valid_shapes=True)
