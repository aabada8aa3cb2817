"""Canonical ops: ``torch.ops.autodeploy.<backend>_<family>_<name>``.

``torch_*`` ops are the reference implementation and the IR the transforms speak; each has a
fake kernel so it survives ``torch.export`` and shape propagation. Backend implementations
(other prefixes) live beside them and are chosen by later transforms.
"""

from . import attention, cached_attention, compiled, delta_rule, linear, mlp, moe, normalization, rope, ssm  # noqa: F401
from . import cca_conv, diagonal_recurrence, gdn_gating, l2norm, linear_attention, mlstm, wkv  # noqa: F401
from . import hidden_states  # noqa: F401
from . import quant  # noqa: F401
from . import collectives  # noqa: F401
from . import collective_fusions  # noqa: F401  (after collectives and quant: it fuses their ops)
from . import dsa, mla  # noqa: F401
from . import streams  # noqa: F401  (aux CUDA stream fork/join for the multi_stream_* transforms)
from . import moe_onednn  # noqa: F401  (after quant: its op reuses the quantized MoE input quantizer)

# ssm imports causal_conv (the causal convolution ops and the state-slot step driver both families share)
