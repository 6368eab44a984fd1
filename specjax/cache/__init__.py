"""KV caches that carry per-row lengths: dense, rolling (sliding window), paged, compressed memory.

Shared interface: the ``KVCache`` Protocol (``protocol.py``): ``write(layer, k_new, v_new)`` at
each row's own offset, ``advance(n)`` / ``apply_plan(plan)`` (one shared rule), ``rollback``,
``compact``, ``put_rows``, and a sticky per-row ``status``.
"""

from specjax.cache.align import front_align_batch, front_pad_kv_cache
from specjax.cache.base import (
    CAPACITY_EXCEEDED,
    OUT_OF_PAGES,
    POOL_GROUP_MISMATCH,
    ROLLBACK_INVALID,
    STATUS_OK,
    describe_status,
)
from specjax.cache.capability import cache_supports_per_sequence_advance
from specjax.cache.compressed import CompressedKVCache
from specjax.cache.dense import DenseKVCache
from specjax.cache.model_cache import CACHE_KINDS, ModelCache, global_cache, kv_cache
from specjax.cache.paged import PagedKVCache
from specjax.cache.protocol import KVCache
from specjax.cache.rolling import RollingKVCache

__all__ = [
    "CACHE_KINDS",
    "CAPACITY_EXCEEDED",
    "OUT_OF_PAGES",
    "POOL_GROUP_MISMATCH",
    "ROLLBACK_INVALID",
    "STATUS_OK",
    "CompressedKVCache",
    "DenseKVCache",
    "KVCache",
    "ModelCache",
    "PagedKVCache",
    "RollingKVCache",
    "cache_supports_per_sequence_advance",
    "describe_status",
    "front_align_batch",
    "front_pad_kv_cache",
    "global_cache",
    "kv_cache",
]
