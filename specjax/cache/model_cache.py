"""A whole model's per-row KV state: one cache per layer kind, sharing ``lengths``.

This is the cache interface the engine drives (``specjax.protocols``): any model's
``init_cache`` returns a ``ModelCache`` (or an object with its methods). ``kv_cache`` builds
the one most models need: every layer global, dense or paged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass
from specjax.cache.compressed import CompressedKVCache
from specjax.cache.dense import DenseKVCache
from specjax.cache.paged import PagedKVCache
from specjax.cache.rolling import RollingKVCache

__all__ = ["CACHE_KINDS", "ModelCache", "global_cache", "kv_cache"]

CACHE_KINDS = ("dense", "paged")

GlobalCache = DenseKVCache | PagedKVCache


@pytree_dataclass
class ModelCache:
    """Per-row KV state of a whole model: global layers in a dense or paged cache,
    sliding-window layers in a rolling cache, compressed-memory layers in a compressed
    cache. All parts share the same ``lengths``."""

    global_kv: GlobalCache | None
    local_kv: RollingKVCache | None
    memory_kv: CompressedKVCache | None = None

    @property
    def parts(self) -> tuple:
        return tuple(c for c in (self.global_kv, self.local_kv, self.memory_kv) if c is not None)

    @property
    def lengths(self) -> jax.Array:
        return self.parts[0].lengths

    @property
    def status(self) -> jax.Array:
        out = self.parts[0].status
        for c in self.parts[1:]:
            out = out | c.status
        return out

    def _map(self, fn) -> ModelCache:
        each = lambda c: None if c is None else fn(c)  # noqa: E731
        return ModelCache(each(self.global_kv), each(self.local_kv), each(self.memory_kv))

    def reserve(self, t: int | jax.Array, live: jax.Array | None = None) -> ModelCache:
        """Paged global layers: own pages for ``t`` more tokens in ``live [B]`` rows (default
        all; no-op for other kinds)."""
        return self._map(lambda c: c.reserve(t, live) if isinstance(c, PagedKVCache) else c)

    def bound_write(self, n: jax.Array) -> ModelCache:
        """The next write's tokens past ``n [B]`` per row are padding (a right-padded prefill):
        rolling and compressed layers neither keep nor pool them (a no-op for other kinds)."""
        return self._map(lambda c: c.bound_write(n) if isinstance(c, PagedKVCache | RollingKVCache | CompressedKVCache)
                         else c)

    def on_pool_of(self, other: ModelCache) -> ModelCache:
        """These rows over ``other``'s paged pool storage (two views of one pool, written one
        after the other); every other part is the rows' own."""
        if isinstance(self.global_kv, PagedKVCache) and isinstance(other.global_kv, PagedKVCache):
            return self.replace(global_kv=self.global_kv.on_pool_of(other.global_kv))
        return self

    def without_pool(self) -> ModelCache:
        """These rows without a paged pool's storage (carried beside the cache that owns it:
        ``on_pool_of`` gives it back)."""
        if isinstance(self.global_kv, PagedKVCache):
            return self.replace(global_kv=self.global_kv.replace(k=None, v=None))
        return self

    def release(self, idle: jax.Array) -> ModelCache:
        """Paged global layers: return every page of ``idle [B]`` rows to the pool."""
        return self._map(lambda c: c.release(idle) if isinstance(c, PagedKVCache) else c)

    def split_pool(self, groups: int) -> ModelCache:
        """Paged global layers (empty): one pool per ``groups`` contiguous row blocks, i.e. one
        per data shard of a mesh (``PagedKVCache.split_pool``; a no-op for other kinds)."""
        return self._map(lambda c: c.split_pool(groups) if isinstance(c, PagedKVCache) else c)

    def rows_view(self, rows: jax.Array, width: int, shared: tuple | None = None) -> ModelCache:
        """Empty caches for refilling ``rows [R]`` with prompts of ``width`` tokens (a paged
        view shares the pool: ``put_rows`` must follow). ``shared``: cached prefix pages the
        rows start on (``PagedKVCache.rows_view``; only a cache of paged global layers alone)."""
        if shared is not None:
            if not self.shares_prefixes:
                raise ValueError("shared prefix pages need a cache of paged global layers only")
            return ModelCache(self.global_kv.rows_view(rows, width, shared), None, None)
        return self._map(lambda c: c.rows_view(rows, width))

    @property
    def shares_prefixes(self) -> bool:
        """Whether rows can start on cached prompt-prefix pages: every layer is a global layer
        in a paged pool (a sliding-window ring or compressed memory keeps no prefix pages)."""
        return isinstance(self.global_kv, PagedKVCache) and self.local_kv is None and self.memory_kv is None

    def register(self, upto: jax.Array) -> ModelCache:
        """Paged global layers: each row's first ``upto [B]`` pages hold a cached prefix."""
        return self._map(lambda c: c.register(upto) if isinstance(c, PagedKVCache) else c)

    def put_rows(self, rows: jax.Array, sub: ModelCache) -> ModelCache:
        """Rows ``rows [R]`` replaced by ``sub``'s (index ``batch``: a padding row, dropped)."""
        put = lambda big, small: None if big is None else big.put_rows(rows, small)  # noqa: E731
        return ModelCache(put(self.global_kv, sub.global_kv), put(self.local_kv, sub.local_kv),
                          put(self.memory_kv, sub.memory_kv))

    def advance(self, n: jax.Array | int) -> ModelCache:
        return self._map(lambda c: c.advance(n))

    def apply_plan(self, plan) -> ModelCache:
        return self._map(lambda c: c.apply_plan(plan))

    def rollback(self, new_lengths: jax.Array) -> ModelCache:
        return self._map(lambda c: c.rollback(new_lengths))

    def compact(self, src: jax.Array) -> ModelCache:
        """Move a tree's accepted path into place (``DenseKVCache.compact``; ``src [B, N]``) in
        every layer (compressed-memory layers pool its blocks again)."""
        return self._map(lambda c: c.compact(src))

    def with_lengths(self, lengths: jax.Array) -> ModelCache:
        """Same buffers, write offset moved to ``lengths`` (scratch writes past the
        committed length, e.g. chained drafting; restore with ``with_lengths`` after)."""
        return self._map(lambda c: c.replace(lengths=lengths))


def global_cache(kind: str, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, *,
                 page_size: int = 16, num_pages: int | None = None, dtype=jnp.float32,
                 stacked: bool = False) -> GlobalCache:
    """``layers`` full-attention layers' K/V for ``batch`` rows of ``capacity`` slots: a dense
    cache, or a paged pool of ``num_pages`` pages (``None``: every row's full capacity)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache kind must be 'dense' or 'paged', got {kind!r}")
    if kind == "dense":
        return DenseKVCache.create(layers, batch, capacity, kv_heads, head_dim, dtype, stacked)
    max_pages = -(-capacity // page_size)
    pages = batch * max_pages if num_pages is None else num_pages
    return PagedKVCache.create(layers, batch, pages, page_size, max_pages, kv_heads, head_dim, dtype, stacked)


def kv_cache(layers: int, kv_heads: int, head_dim: int, batch: int, capacity: int, *, kind: str = "dense",
             page_size: int = 16, num_pages: int | None = None, dtype=jnp.float32) -> ModelCache:
    """A ``ModelCache`` of ``layers`` full-attention layers (K/V ``[B, kv_heads, slot, head_dim]``
    per layer): what a model written outside specjax needs (``specjax.nnx_adapter``)."""
    return ModelCache(global_cache(kind, layers, batch, capacity, kv_heads, head_dim, page_size=page_size,
                                   num_pages=num_pages, dtype=dtype), None, None)
