"""``cleanup_noop_cast`` (post_export): Drop casts to the dtype a tensor already has (`to`, `_to_copy`, `convert_element_type`).

Before::

    y = aten.to.dtype(x, f32)  # x is f32

After::

    y = x
"""

from ..cleanups import remove_identity_casts
from ..interface import TransformRegistry
from ._cleanup_base import CleanupTransform


@TransformRegistry.register("cleanup_noop_cast")
class CleanupNoopCast(CleanupTransform):
    cleanup = staticmethod(remove_identity_casts)
