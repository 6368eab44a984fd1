"""Paged KV cache with a device-side free list.

Pool ``k, v``: per layer ``[num_pages, Hkv, page_size, D]`` (head-major pages); ``block_table [B, max_pages]``
maps a row's logical page to a pool page (``-1``: none). Free pages sit on a stack
``free_pages[:num_free]``. ``reserve``, ``write``, ``advance`` and ``rollback`` are
pure array code: allocation and release run inside ``jit`` with no host round trip.

Allocation serves rows in batch order: rows needing pages get them from the top of
the stack while the running total fits; a row that does not fit takes nothing and
gets ``OUT_OF_PAGES`` (its write is then dropped and flagged, never routed into a
page it does not own).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass
from specjax.attention import gather_pages, live_attention
from specjax.cache.base import (
    CAPACITY_EXCEEDED,
    OUT_OF_PAGES,
    ROLLBACK_INVALID,
    Layers,
    as_rows,
    kernel_operands,
    key_block,
    layer_buffers,
    layer_spec,
    positions,
    set_rows,
)

__all__ = ["PagedKVCache", "gather_pages"]


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


@pytree_dataclass
class PagedKVCache:
    k: Layers  # per layer [num_pages, Hkv, page_size, D]: a tuple or a stack [L, ...]
    v: Layers
    block_table: jax.Array  # int32 [B, max_pages]
    pages_held: jax.Array  # int32 [B]: block_table[b, :pages_held[b]] are owned pages
    lengths: jax.Array  # int32 [B]
    free_pages: jax.Array  # int32 [num_pages]: stack, valid below num_free
    num_free: jax.Array  # int32 []: shared pool state
    status: jax.Array  # int32 [B]

    # batch-wide fields that are pool state, not a time base (cache_supports_per_sequence_advance)
    SHARED_POOL_FIELDS = ("num_free",)

    @classmethod
    def create(
        cls,
        layers: int,
        batch: int,
        num_pages: int,
        page_size: int,
        max_pages_per_seq: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
        stacked: bool = False,
    ) -> PagedKVCache:
        for name, val in (("num_pages", num_pages), ("page_size", page_size), ("max_pages_per_seq", max_pages_per_seq)):
            if val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        shape = (num_pages, kv_heads, page_size, head_dim)
        zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731  (distinct buffers: donatable)
        return cls(
            k=layer_buffers(layers, shape, dtype, stacked),
            v=layer_buffers(layers, shape, dtype, stacked),
            block_table=jnp.full((batch, max_pages_per_seq), -1, jnp.int32),
            pages_held=zeros(),
            lengths=zeros(),
            free_pages=jnp.arange(num_pages, dtype=jnp.int32)[::-1],  # pop page 0 first
            num_free=jnp.asarray(num_pages, jnp.int32),
            status=zeros(),
        )

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def page_size(self) -> int:
        return layer_spec(self.k).shape[2]

    @property
    def num_pages(self) -> int:
        return layer_spec(self.k).shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    def reserve(self, t: int, live: jax.Array | None = None) -> PagedKVCache:
        """Own enough pages for ``lengths[b] + t`` tokens in every ``live [B]`` row (default: all).

        Grants go smallest request first (ties in batch order) while the running total fits
        the free stack: a row needing no new page is always served, and a refused row could
        not have fit in what is left. Refused rows take nothing and get ``OUT_OF_PAGES``.
        """
        live = jnp.ones((self.batch,), bool) if live is None else live
        want = _ceil_div(self.lengths + t, self.page_size)
        over_budget = (want > self.max_pages) & live
        need = jnp.where(over_budget | ~live, 0, jnp.maximum(want - self.pages_held, 0))
        order = jnp.argsort(need, stable=True)
        fits_sorted = jnp.cumsum(need[order]) <= self.num_free
        granted = jnp.zeros((self.batch,), bool).at[order].set(fits_sorted)
        need = jnp.where(granted, need, 0)
        first = jnp.cumsum(need) - need  # this row's offset into the popped pages
        m = jnp.arange(self.max_pages, dtype=jnp.int32)[None]
        k_new = m - self.pages_held[:, None]  # index of the new page within this row
        fresh = (k_new >= 0) & (k_new < need[:, None])
        stack_idx = self.num_free - 1 - (first[:, None] + k_new)
        popped = self.free_pages[jnp.where(fresh, stack_idx, 0)]
        status = self.status | jnp.where(over_budget, CAPACITY_EXCEEDED, 0)
        status |= jnp.where(granted | over_budget | ~live, 0, OUT_OF_PAGES)
        return self.replace(
            block_table=jnp.where(fresh, popped, self.block_table),
            pages_held=self.pages_held + need,
            num_free=self.num_free - jnp.sum(need),
            status=status,
        )

    def write(self, layer: int | jax.Array, k_new: jax.Array, v_new: jax.Array) -> PagedKVCache:
        """Write ``[B, t, Hkv, D]`` at ``lengths[b] + [0, t)`` through the block table.

        Rows without owned pages for the whole write are not written and are flagged.
        """
        t = k_new.shape[1]
        fits = self.lengths + t <= self.pages_held * self.page_size
        pos = positions(self.lengths, t)
        logical = jnp.minimum(pos // self.page_size, self.max_pages - 1)  # in range when fits
        page = jnp.take_along_axis(self.block_table, logical, axis=1)
        page = jnp.where(fits[:, None], page, self.num_pages)  # explicit out-of-range: dropped
        slot = pos % self.page_size
        idx = (page, slice(None), slot)
        return self.replace(k=set_rows(self.k, layer, idx, k_new), v=set_rows(self.v, layer, idx, v_new),
                            status=self.status | jnp.where(fits, 0, CAPACITY_EXCEEDED))

    def advance(self, n: jax.Array | int) -> PagedKVCache:
        """``lengths += n`` within owned pages; otherwise the row stays and is flagged."""
        new = self.lengths + as_rows(n, self.batch)
        fits = new <= self.pages_held * self.page_size
        return self.replace(
            lengths=jnp.where(fits, new, self.lengths),
            status=self.status | jnp.where(fits, 0, CAPACITY_EXCEEDED),
        )

    def apply_plan(self, plan) -> PagedKVCache:
        return self.advance(plan.advance)

    def _push_free(self, freed: jax.Array) -> PagedKVCache:
        """Return the pages marked in ``freed [B, max_pages]`` to the free stack."""
        flat = freed.reshape(-1)
        rank = jnp.cumsum(flat) - 1
        dest = jnp.where(flat, self.num_free + rank, self.num_pages)  # out of range: dropped
        return self.replace(
            block_table=jnp.where(freed, -1, self.block_table),
            pages_held=self.pages_held - jnp.sum(freed, axis=1).astype(jnp.int32),
            free_pages=self.free_pages.at[dest].set(self.block_table.reshape(-1), mode="drop"),
            num_free=self.num_free + jnp.sum(flat),
        )

    def rollback(self, new_lengths: jax.Array | int) -> PagedKVCache:
        """Shrink rows to ``new_lengths`` (``<= lengths``); pages past it return to the pool."""
        new = as_rows(new_lengths, self.batch)
        ok = (new >= 0) & (new <= self.lengths)
        new = jnp.where(ok, new, self.lengths)
        keep = _ceil_div(new, self.page_size)
        m = jnp.arange(self.max_pages, dtype=jnp.int32)[None]
        freed = (m >= keep[:, None]) & (m < self.pages_held[:, None])
        return self._push_free(freed).replace(lengths=new,
                                              status=self.status | jnp.where(ok, 0, ROLLBACK_INVALID))

    def release(self, done: jax.Array) -> PagedKVCache:
        """Return every page of rows where ``done [B]`` is true (their length becomes 0);
        other rows keep everything they hold, pages reserved ahead included."""
        m = jnp.arange(self.max_pages, dtype=jnp.int32)[None]
        freed = done[:, None] & (m < self.pages_held[:, None])
        return self._push_free(freed).replace(lengths=jnp.where(done, 0, self.lengths))

    def rows_view(self, rows: jax.Array, width: int) -> PagedKVCache:
        """An empty cache over ``rows [R]`` (index ``batch``: a padding row), for refilling
        them: their pages go back to the pool first, and the view shares the pool, so
        ``put_rows(rows, view)`` must follow (the pool's state moves with the view)."""
        mask = jnp.zeros((self.batch,), bool).at[rows].set(True, mode="drop")
        pool = self.release(mask)
        r = rows.shape[0]
        return pool.replace(
            block_table=jnp.full((r, self.max_pages), -1, jnp.int32),
            pages_held=jnp.zeros((r,), jnp.int32),
            lengths=jnp.zeros((r,), jnp.int32),
            status=jnp.zeros((r,), jnp.int32),
        )

    def put_rows(self, rows: jax.Array, sub: PagedKVCache) -> PagedKVCache:
        """Rows ``rows [R]`` replaced by ``sub``'s (padding rows dropped); the pool is ``sub``'s."""
        put = lambda big, small: big.at[rows].set(small, mode="drop")  # noqa: E731
        return sub.replace(
            block_table=put(self.block_table, sub.block_table),
            pages_held=put(self.pages_held, sub.pages_held),
            lengths=put(self.lengths, sub.lengths),
            status=put(self.status, sub.status),
        )

    def gather(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per-row contiguous ``k, v [B, Hkv, max_pages * page_size, D]`` and ``key_pos``
        (``-1`` where the row owns no page)."""
        return self._gather(layer, self.block_table)

    def _gather(self, layer: int | jax.Array, block_table: jax.Array, first_page: jax.Array | int = 0):
        k, v, at = kernel_operands(self.k, self.v, layer)
        return gather_pages(k, v, block_table, first_page=first_page, layer=at)

    def attend(
        self,
        q: jax.Array,
        layer: int | jax.Array,
        *,
        window: int | None = None,
        scale: float | None = None,
        impl: str = "xla",
    ) -> jax.Array:
        """Attention of ``q [B, t_q, Hq, D]`` at ``lengths + [0, t_q)`` through the block table.

        Only live pages are read: XLA gathers key blocks of whole pages up to the batch's
        longest live row; the Pallas kernel visits each row's own live pages."""
        t_q = q.shape[1]
        zeros = jnp.zeros((self.batch,), jnp.int32)
        if impl == "pallas":
            from pallas_kernels.paged_attention import paged_attention  # lazy: pallas_kernels imports specjax

            k, v, at = kernel_operands(self.k, self.v, layer)
            return paged_attention(q, k, v, self.block_table, zeros, self.lengths, window=window, scale=scale,
                                   layer=at)
        ps, mp = self.page_size, self.max_pages
        block = key_block(mp * ps)
        ppb = block // ps if block % ps == 0 and mp % (block // ps) == 0 else mp  # pages per key block

        def read(j):  # key block j: logical pages j * ppb .. (j + 1) * ppb - 1 of every row
            bt = jax.lax.dynamic_slice_in_dim(self.block_table, j * ppb, ppb, axis=1)  # [B, ppb]
            return self._gather(layer, bt, first_page=j * ppb)

        return live_attention(q, read, positions(self.lengths, t_q), zeros, block=ppb * ps, num_blocks=mp // ppb,
                              window=window, scale=scale)
