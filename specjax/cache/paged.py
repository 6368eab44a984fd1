"""Paged KV cache with a device-side free list.

Pool ``k, v``: per layer ``[num_pages, Hkv, page_size, D]`` (head-major pages); ``block_table [B, max_pages]``
maps a row's logical page to a pool page (``-1``: none). Free pages sit on a stack
``free_pages[:num_free]``. ``reserve``, ``write``, ``advance`` and ``rollback`` are
pure array code: allocation and release run inside ``jit`` with no host round trip.

Allocation serves rows in batch order: rows needing pages get them from the top of
the stack while the running total fits; a row that does not fit takes nothing and
gets ``OUT_OF_PAGES`` (its write is then dropped and flagged, never routed into a
page it does not own).

**Pool groups** (``split_pool(G)``: one pool per data shard of a mesh). The ``B`` rows and
the ``N`` pages split into ``G`` contiguous groups: rows ``[g * B/G, (g + 1) * B/G)`` take
pages only from pages ``[g * N/G, (g + 1) * N/G)``, through group ``g``'s own free stack
(``free_pages[g * N/G : (g + 1) * N/G]``, ``num_free [G]``). Block tables hold page ids
*within the group*, so on a mesh whose data axis is ``G`` each shard's rows, block tables,
free stack and pages are one ungrouped cache (``per_shard`` hands the kernels exactly that)
and no page, allocation or attention read crosses a shard. Allocation is the ungrouped
code ``vmap``-ed over the groups. With one pool (``num_free`` a scalar) every row shares it.

**Shared pages** (the prefix cache: ``specjax.prefix_cache``). ``refs [num_pages]`` counts the
rows holding each page; a page returns to the free stack when its last row lets it go.
``rows_view(..., shared=)`` starts refilled rows on pages already in the pool (their length
is the shared tokens, so they write only past them). A page ``register``-ed as holding a
prompt prefix is ``cached``: once unreferenced it goes to the *bottom* of the free stack
(newest deepest, a prefix's first page below its later ones), so allocation takes uncached
pages first and then evicts cached ones least recently released first, a prefix's tail
before its head. Popping a page clears ``cached`` (the host reads it to forget evicted pages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import paged_attention
from pallas_kernels.reference import TreeMask
from specjax._pytree import pytree_dataclass
from specjax.attention import gather_pages, live_attention
from specjax.cache.base import (
    CAPACITY_EXCEEDED,
    KERNEL_MAX_QUERIES,
    OUT_OF_PAGES,
    POOL_GROUP_MISMATCH,
    ROLLBACK_INVALID,
    UNBOUNDED,
    Layers,
    as_rows,
    kernel_operands,
    key_block,
    layer_buffers,
    layer_spec,
    move_slots,
    positions,
    set_rows,
)
from specjax.cache.protocol import CommitsPlans

__all__ = ["PagedKVCache", "gather_pages"]


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


@pytree_dataclass
class PagedKVCache(CommitsPlans):
    k: Layers  # per layer [num_pages, Hkv, page_size, D]: a tuple or a stack [L, ...]
    v: Layers
    block_table: jax.Array  # int32 [B, max_pages]
    pages_held: jax.Array  # int32 [B]: block_table[b, :pages_held[b]] are owned pages
    lengths: jax.Array  # int32 [B]
    free_pages: jax.Array  # int32 [num_pages]: stack(s), valid below num_free (per group: see split_pool)
    num_free: jax.Array  # int32 [] (one pool) or [G] (one per group): shared pool state
    status: jax.Array  # int32 [B]
    write_end: jax.Array  # int32 [B]: absolute end of the next write's real tokens (bound_write)
    refs: jax.Array  # int32 [num_pages]: rows holding each page (0: on the free stack)
    cached: jax.Array  # bool [num_pages]: holds a registered prompt prefix (``register``)

    # batch-wide fields that are pool state, not a time base (cache_supports_per_sequence_advance)
    SHARED_POOL_FIELDS = ("num_free",)
    _POOL = ("free_pages", "refs", "cached")  # [num_pages] pool arrays, split per group like the stack
    _ROWS = {"block_table": -1, "pages_held": 0, "lengths": 0, "status": 0, "write_end": UNBOUNDED}  # per row: empty

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
        groups: int = 1,
    ) -> PagedKVCache:
        """An empty cache; ``groups > 1``: ``split_pool(groups)`` (one pool per data shard)."""
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
            write_end=jnp.full((batch,), UNBOUNDED, jnp.int32),
            refs=jnp.zeros((num_pages,), jnp.int32),
            cached=jnp.zeros((num_pages,), bool),
        ).split_pool(groups)

    def split_pool(self, groups: int) -> PagedKVCache:
        """This *empty* cache with its pool split into ``groups`` pools, one per contiguous block
        of ``batch / groups`` rows, each of ``num_pages / groups`` pages (one per data shard of a
        mesh: ``specjax.sharding``). ``groups=1`` on a one-pool cache returns it unchanged."""
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups={groups!r} is invalid: must be an int >= 1")
        if groups == 1 and self.num_free.ndim == 0:
            return self
        for name, n in (("batch", self.batch), ("num_pages", self.num_pages)):
            if n % groups:
                raise ValueError(f"{name}={n} is invalid for groups={groups}: each group takes an equal share, "
                                 f"so it must divide by {groups}")
        n = self.num_pages // groups
        return self.replace(free_pages=jnp.tile(jnp.arange(n, dtype=jnp.int32)[::-1], groups),
                            num_free=jnp.full((groups,), n, jnp.int32))

    @property
    def groups(self) -> int:
        """How many pools the pages are split into (``split_pool``); 1 for one shared pool."""
        return int(self.num_free.size)

    def _pool_table(self) -> jax.Array:
        """``block_table`` with pool page ids: each group-local id plus its group's first page
        (-1 kept); with one pool, the table itself."""
        if self.num_free.ndim == 0:
            return self.block_table
        g = self.groups
        base = (jnp.arange(self.batch, dtype=jnp.int32) // (self.batch // g)) * (self.num_pages // g)  # [B]
        return jnp.where(self.block_table >= 0, self.block_table + base[:, None], -1)

    def _groupwise(self, fn, *rows: jax.Array) -> PagedKVCache:
        """``fn(cache, *rows)`` (the ungrouped allocator code, which never touches the pool's
        K/V) on each group: ``vmap`` over ``[G, B/G, ...]`` views; with one pool, directly."""
        if self.num_free.ndim == 0:
            return fn(self, *rows)
        g = self.groups
        split = lambda x: x.reshape(g, x.shape[0] // g, *x.shape[1:])  # noqa: E731
        merge = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        per_row = tuple(self._ROWS)
        axes = self.replace(k=None, v=None, **{f: 0 for f in (*per_row, *self._POOL, "num_free")})
        view = self.replace(**{f: getattr(self, f).reshape(g, -1) for f in self._POOL},
                            **{f: split(getattr(self, f)) for f in per_row})
        out = jax.vmap(fn, in_axes=(axes, *[0] * len(rows)), out_axes=axes)(view, *map(split, rows))
        return out.replace(**{f: getattr(out, f).reshape(-1) for f in self._POOL},
                           **{f: merge(getattr(out, f)) for f in per_row})

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

    def reserve(self, t: int | jax.Array, live: jax.Array | None = None) -> PagedKVCache:
        """Own enough pages for ``lengths[b] + t`` tokens (``t``: one int, or ``[B]`` per row) in
        every ``live [B]`` row (default: all).

        Grants go smallest request first (ties in batch order) while the running total fits
        the free stack (the row's group's): a row needing no new page is always served, and a
        refused row could not have fit in what is left. Refused rows take nothing and get
        ``OUT_OF_PAGES``.
        """
        live = jnp.ones((self.batch,), bool) if live is None else live
        return self._groupwise(PagedKVCache._reserve, as_rows(t, self.batch), live)

    def _reserve(self, t: jax.Array, live: jax.Array) -> PagedKVCache:
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
        taken = jnp.where(fresh, popped, self.refs.shape[0])  # out of range: dropped
        return self.replace(
            block_table=jnp.where(fresh, popped, self.block_table),
            pages_held=self.pages_held + need,
            num_free=self.num_free - jnp.sum(need),
            status=status,
            refs=self.refs.at[taken].set(1, mode="drop"),
            cached=self.cached.at[taken].set(False, mode="drop"),  # a popped cached page is evicted
        )

    def bound_write(self, n: jax.Array | int) -> PagedKVCache:
        """The next write's tokens past ``n [B]`` per row are padding (a right-padded prefill):
        they are not written and need no page. ``advance`` clears the bound."""
        return self.replace(write_end=self.lengths + as_rows(n, self.batch))

    def write(self, layer: int | jax.Array, k_new: jax.Array, v_new: jax.Array) -> PagedKVCache:
        """Write ``[B, t, Hkv, D]`` at ``lengths[b] + [0, t)`` (up to ``bound_write``'s end)
        through the block table.

        Rows without owned pages for the whole write are not written and are flagged.
        """
        t = k_new.shape[1]
        pos = positions(self.lengths, t)
        fits = jnp.minimum(self.lengths + t, self.write_end) <= self.pages_held * self.page_size
        page, slot = self._page_slots(pos)
        real = fits[:, None] & (pos < self.write_end[:, None])
        page = jnp.where(real, page, self.num_pages)  # explicit out-of-range: dropped
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
            write_end=jnp.full_like(self.write_end, UNBOUNDED),
        )


    def _push_free(self, freed: jax.Array) -> PagedKVCache:
        """Return the pages marked in ``freed [B, max_pages]`` to the top of the free stack: a
        row's own pages past its prompt (``rollback``), never shared (nor still a cached prefix)."""
        flat = freed.reshape(-1)
        rank = jnp.cumsum(flat) - 1
        n = self.free_pages.shape[0]
        dest = jnp.where(flat, self.num_free + rank, n)  # out of range: dropped
        ids = self.block_table.reshape(-1)
        return self._drop(freed).replace(
            free_pages=self.free_pages.at[dest].set(ids, mode="drop"),
            num_free=self.num_free + jnp.sum(flat),
            refs=self.refs.at[jnp.where(flat, ids, n)].set(0, mode="drop"),
            cached=self.cached.at[jnp.where(flat, ids, n)].set(False, mode="drop"),
        )

    def _drop(self, freed: jax.Array) -> PagedKVCache:
        """The entries marked in ``freed [B, max_pages]`` out of the rows' block tables."""
        return self.replace(block_table=jnp.where(freed, -1, self.block_table),
                            pages_held=self.pages_held - jnp.sum(freed, axis=1).astype(jnp.int32))

    def rollback(self, new_lengths: jax.Array | int) -> PagedKVCache:
        """Shrink rows to ``new_lengths`` (``<= lengths``); pages past it return to the pool."""
        return self._groupwise(PagedKVCache._rollback, as_rows(new_lengths, self.batch))

    def _rollback(self, new: jax.Array) -> PagedKVCache:
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
        return self._groupwise(PagedKVCache._release, done)

    def _release(self, done: jax.Array) -> PagedKVCache:
        # each page loses one reference per releasing row holding it; a page whose count
        # reaches zero goes back: cached ones below the stack (LRU), the others on top
        n, mp = self.refs.shape[0], self.max_pages
        m = jnp.broadcast_to(jnp.arange(mp, dtype=jnp.int32)[None], self.block_table.shape)
        freed = done[:, None] & (m < self.pages_held[:, None])
        ids = jnp.where(freed, self.block_table, n).reshape(-1)  # n: dropped
        lost = jnp.zeros((n,), jnp.int32).at[ids].add(1, mode="drop")
        refs = self.refs - lost
        back = (lost > 0) & (refs == 0)
        deep, top = back & self.cached, back & ~self.cached
        first = jnp.full((n,), mp, jnp.int32).at[ids].min(m.reshape(-1), mode="drop")  # its lowest logical page
        below = jnp.argsort(jnp.where(deep, first, mp + 1), stable=True)  # deep pages first, heads deepest
        above = jnp.argsort(~top, stable=True)  # pages for the top first, in id order
        n_deep = jnp.sum(deep)
        i = jnp.arange(n, dtype=jnp.int32)
        kept = self.free_pages[jnp.clip(i - n_deep, 0, n - 1)]
        new_top = above[jnp.clip(i - n_deep - self.num_free, 0, n - 1)]
        stack = jnp.where(i < n_deep, below[i], jnp.where(i < n_deep + self.num_free, kept, new_top))
        return self._drop(freed).replace(lengths=jnp.where(done, 0, self.lengths), refs=refs,
                                         free_pages=stack.astype(jnp.int32),
                                         num_free=self.num_free + jnp.sum(back))

    def register(self, upto: jax.Array) -> PagedKVCache:
        """Mark each row's first ``upto [B]`` pages as holding a registered prompt prefix
        (``cached``: kept deep in the free stack once no row holds them)."""
        return self._groupwise(PagedKVCache._register, upto)

    def _register(self, upto: jax.Array) -> PagedKVCache:
        m = jnp.arange(self.max_pages, dtype=jnp.int32)[None]
        mark = (m < jnp.minimum(upto, self.pages_held)[:, None]) & (self.block_table >= 0)
        ids = jnp.where(mark, self.block_table, self.refs.shape[0])
        return self.replace(cached=self.cached.at[ids].set(True, mode="drop"))

    def _share(self, pages: jax.Array, count: jax.Array) -> PagedKVCache:
        """One more reference on each of the first ``count [R]`` entries of ``pages [R, M]``
        (pool page ids); a page no row held leaves the free stack (order kept)."""
        n = self.refs.shape[0]
        take = jnp.arange(pages.shape[1], dtype=jnp.int32)[None] < count[:, None]
        gained = jnp.zeros((n,), jnp.int32).at[jnp.where(take, pages, n).reshape(-1)].add(1, mode="drop")
        pulled = (gained > 0) & (self.refs == 0)
        i = jnp.arange(n, dtype=jnp.int32)
        stays = (i < self.num_free) & ~pulled[jnp.clip(self.free_pages, 0, n - 1)]
        dest = jnp.where(stays, jnp.cumsum(stays) - 1, n)
        return self.replace(refs=self.refs + gained, num_free=jnp.sum(stays).astype(jnp.int32),
                            free_pages=self.free_pages.at[dest].set(self.free_pages, mode="drop"))

    def compact(self, src: jax.Array) -> PagedKVCache:
        """Logical slot ``lengths + k`` takes the K/V of slot ``lengths + src[b, k]`` (``src
        [B, N]``: ``DenseKVCache.compact``), through the block table, in every layer; a slot
        whose source is itself, or outside the row's own pages, is not written."""
        k = jnp.arange(src.shape[1], dtype=jnp.int32)[None]
        frm_page, frm_off = self._page_slots(self.lengths[:, None] + src)
        to = self.lengths[:, None] + k
        to_page, to_off = self._page_slots(to)
        ok = (src != k) & (to < self.pages_held[:, None] * self.page_size) & (frm_page >= 0)
        frm = (jnp.maximum(frm_page, 0), frm_off)
        to = (jnp.where(ok, to_page, self.num_pages), to_off)  # explicit out-of-range: dropped
        return self.replace(k=move_slots(self.k, frm, to), v=move_slots(self.v, frm, to))

    def _page_slots(self, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(pool page, offset)`` of each row's logical slots ``pos [B, N]`` (``>= 0``; a slot past
        the row's pages reads its last page: callers guard their writes)."""
        logical = jnp.minimum(pos // self.page_size, self.max_pages - 1)
        return jnp.take_along_axis(self._pool_table(), logical, axis=1), pos % self.page_size

    def rows_view(self, rows: jax.Array, width: int, shared: tuple | None = None) -> PagedKVCache:
        """An empty cache over ``rows [R]`` (index ``batch``: a padding row), for refilling
        them: their pages go back to the pool first, and the view shares the pool, so
        ``put_rows(rows, view)`` must follow (the pool's state moves with the view).
        ``shared = (pages [R, M], count [R])``: row ``r`` starts on the pool's pages
        ``pages[r, :count[r]]`` (group-local ids; a cached prompt prefix), holding them as its
        first pages with its length at their end: it writes only past them.

        With ``G`` pool groups the view has them too: ``rows`` is group-major, its ``g``-th
        block of ``R / G`` entries rows of group ``g`` (or padding). A row listed in another
        group's block gets ``POOL_GROUP_MISMATCH`` (its pages would come from a foreign pool)."""
        mask = jnp.zeros((self.batch,), bool).at[rows].set(True, mode="drop")
        pool = self.release(mask)
        r, g = rows.shape[0], self.groups
        if r % g:
            raise ValueError(f"rows_view: {r} rows cannot be split over the cache's {g} pool groups (R % G != 0)")
        status = jnp.zeros((r,), jnp.int32)
        if g > 1:
            slot = jnp.arange(r, dtype=jnp.int32)
            wrong = (rows < self.batch) & (rows // (self.batch // g) != slot // (r // g))
            status = jnp.where(wrong, POOL_GROUP_MISMATCH, 0)
        view = pool.take_rows(jnp.full((r,), self.batch, jnp.int32)).replace(status=status)  # r empty rows
        if shared is None:
            return view
        pages, count = shared
        count = jnp.where(rows < self.batch, jnp.clip(count, 0, self.max_pages), 0)
        m = jnp.arange(self.max_pages, dtype=jnp.int32)[None]
        view = view._groupwise(PagedKVCache._share, pages, count)
        return view.replace(block_table=jnp.where(m < count[:, None], pages, -1), pages_held=count,
                            lengths=count * self.page_size)

    def on_pool_of(self, other: PagedKVCache) -> PagedKVCache:
        """These rows over ``other``'s pool storage (``k``, ``v``): two views of one pool written
        one after the other (``forward_mixed``) share what the later left."""
        return self.replace(k=other.k, v=other.v)

    def take_rows(self, rows: jax.Array) -> PagedKVCache:
        """Rows ``rows [R]`` (index ``batch``: an empty padding row) over the same pool: what
        ``put_rows(rows, ...)`` takes back (group-major under pool groups, as ``rows_view``)."""
        return self.replace(**{f: jnp.take(getattr(self, f), rows, axis=0, mode="fill", fill_value=fill)
                               for f, fill in self._ROWS.items()})

    def put_rows(self, rows: jax.Array, sub: PagedKVCache) -> PagedKVCache:
        """Rows ``rows [R]`` replaced by ``sub``'s (padding rows dropped); the pool is ``sub``'s."""
        return sub.replace(**{f: getattr(self, f).at[rows].set(getattr(sub, f), mode="drop") for f in self._ROWS})

    def gather(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per-row contiguous ``k, v [B, Hkv, max_pages * page_size, D]`` and ``key_pos``
        (``-1`` where the row owns no page)."""
        return self._gather(layer, self._pool_table())

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
        tree: TreeMask | None = None,
    ) -> jax.Array:
        """Attention of ``q [B, t_q, Hq, D]`` at ``lengths + [0, t_q)`` through the block table.

        Only live pages are read: XLA gathers key blocks of whole pages up to the batch's
        longest live row; the Pallas kernel visits each row's own live pages."""
        t_q = q.shape[1]
        zeros = jnp.zeros((self.batch,), jnp.int32)
        table = self._pool_table()
        # (a tree under a narrower window, or more queries than the kernel holds: XLA)
        if impl == "pallas" and t_q <= KERNEL_MAX_QUERIES and (tree is None or window is None or window >= t_q):
            k, v, at = kernel_operands(self.k, self.v, layer)
            return paged_attention(q, k, v, table, zeros, self.lengths, window=window, scale=scale,
                                   layer=at, tree=tree)
        ps, mp = self.page_size, self.max_pages
        block = key_block(mp * ps)
        ppb = block // ps if block % ps == 0 and mp % (block // ps) == 0 else mp  # pages per key block

        def read(j):  # key block j: logical pages j * ppb .. (j + 1) * ppb - 1 of every row
            bt = jax.lax.dynamic_slice_in_dim(table, j * ppb, ppb, axis=1)  # [B, ppb]
            return self._gather(layer, bt, first_page=j * ppb)

        return live_attention(q, read, positions(self.lengths, t_q), zeros, block=ppb * ps, num_blocks=mp // ppb,
                              window=window, scale=scale, tree=tree)
