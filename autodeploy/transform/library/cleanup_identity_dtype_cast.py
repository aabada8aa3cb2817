"""``cleanup_identity_dtype_cast`` (compile): drop casts that change nothing, once more before
compiling (fusions and weight dtypes can leave new ones behind).

Before::

    y = aten._to_copy(x, dtype=f32)     # x is f32, same device/layout, no copy flag

After::

    y = x

A cast that changes dtype, device, layout or memory format, or asks for a copy, stays. Same
rule as ``cleanup_noop_cast`` (one implementation, ``cleanups.remove_identity_casts``).
"""

from ..cleanups import remove_identity_casts
from ..interface import Stage, TransformRegistry
from ._cleanup_base import CleanupConfig, CleanupTransform


class CleanupIdentityCastConfig(CleanupConfig):
    stage: Stage = Stage.COMPILE


@TransformRegistry.register("cleanup_identity_dtype_cast")
class CleanupIdentityDtypeCast(CleanupTransform):
    config_class = CleanupIdentityCastConfig
    cleanup = staticmethod(remove_identity_casts)
