"""``cleanup_assert_metadata`` (post_export): Drop export's `aten._assert_tensor_metadata` checks.

Before::

    _assert_tensor_metadata(x, dtype=f32); y = f(x)

After::

    y = f(x)
"""

from ..cleanups import remove_assert_metadata
from ..interface import TransformRegistry
from ._cleanup_base import CleanupTransform


@TransformRegistry.register("cleanup_assert_metadata")
class CleanupAssertMetadata(CleanupTransform):
    cleanup = staticmethod(remove_assert_metadata)
