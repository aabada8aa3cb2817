"""``cleanup_noop_view`` (post_export): Drop views to the same shape, `alias`, and `contiguous` of contiguous tensors.

Before::

    y = aten.view(x, x.shape); z = aten.alias(y)

After::

    z = x
"""

from ..cleanups import remove_noop_views
from ..interface import TransformRegistry
from ._cleanup_base import CleanupTransform


@TransformRegistry.register("cleanup_noop_view")
class CleanupNoopView(CleanupTransform):
    cleanup = staticmethod(remove_noop_views)
