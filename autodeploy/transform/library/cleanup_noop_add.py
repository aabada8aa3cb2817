"""``cleanup_noop_add`` (post_export): Drop additions and subtractions of zero that keep dtype and shape.

Before::

    y = aten.add(x, 0)

After::

    y = x
"""

from ..cleanups import remove_add_zero
from ..interface import TransformRegistry
from ._cleanup_base import CleanupTransform


@TransformRegistry.register("cleanup_noop_add")
class CleanupNoopAdd(CleanupTransform):
    cleanup = staticmethod(remove_add_zero)
