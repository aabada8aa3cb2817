"""``cleanup_noop_mul`` (post_export): Drop multiplications and divisions by one that keep dtype and shape.

Before::

    y = aten.mul(x, 1.0)

After::

    y = x
"""

from ..cleanups import remove_mul_one
from ..interface import TransformRegistry
from ._cleanup_base import CleanupTransform


@TransformRegistry.register("cleanup_noop_mul")
class CleanupNoopMul(CleanupTransform):
    cleanup = staticmethod(remove_mul_one)
