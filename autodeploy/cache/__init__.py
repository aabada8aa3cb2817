"""Caches and the sequence interface the cached graph is called with."""

from .interface import CachedSequenceInterface, CacheConfig  # noqa: F401
from .resources import PagedKVHandler, ResourceHandler  # noqa: F401
from .sequence_info import METADATA_NAMES, SequenceInfo, build_sequence_info  # noqa: F401
