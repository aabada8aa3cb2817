"""``cleanup_noop_slice`` (post_export): Drop slices that cover a whole dimension.

Before::

    y = aten.slice(x, 1, 0, INT64_MAX)

After::

    y = x
"""

from ..cleanups import remove_noop_slices
from ..interface import TransformRegistry
from ._cleanup_base import CleanupTransform


@TransformRegistry.register("cleanup_noop_slice")
class CleanupNoopSlice(CleanupTransform):
    cleanup = staticmethod(remove_noop_slices)
