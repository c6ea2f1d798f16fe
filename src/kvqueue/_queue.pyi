# The compiled twin's types are the pure twin's: one source of truth.
from ._queue_py import FreeKVCacheBlockQueue as FreeKVCacheBlockQueue

__all__ = ("FreeKVCacheBlockQueue",)
