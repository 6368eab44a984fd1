"""Compressed-memory KV cache: a raw window plus one pooled K/V slot per older block, per row.

A compressed layer's query at row-relative position ``r`` (``r = position - start``) reads

* one **memory slot** per full block ``c < cut(r) = max(r - window + 1, 0) // block``: the
  mean of the block's ``block`` keys (values), in the cache's dtype (pooled in float32);
* the **raw** K/V of positions ``cut(r) * block .. r``: the last ``window`` tokens and the
  rest of the block the window starts in (between ``window`` and ``window + block - 1`` keys).

Every earlier token is in exactly one memory slot, every later one is raw: no token counted
twice, none lost. ``compressed_attention`` is that rule over a whole prefix (the oracle).

Per row (the per-row time base): ``lengths`` (committed, absolute), ``start`` (lead pad),
``compressed`` (memory slots that count: always ``(lengths - start) // block`` after a
commit), and a raw ring where relative position ``p`` lives in slot ``p % size``. One row
during a verify step (block 4, window 6, 14 tokens committed, 4 drafts written)::

    positions  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 | 14 15 16 17
               committed                             | drafts (scratch)
    memory     [  m0  ] [  m1   ] [    m2   ] [ m3: pooled with drafts 14, 15: scratch ]
    counted    m0 m1 m2 (compressed = 14 // 4 = 3); m3 counts only once 12..15 commit,
               and by then a later write touching 14 or 15 has pooled it again
    query 17   reads m0 m1 m2 (cut = 3) and raw 12 .. 17

* ``write`` puts new K/V (known tokens and drafts) in the ring at ``lengths + [0, t)`` and
  pools every block the write completes into that block's memory slot, reading the block's
  older tokens from the ring. A slot at or past ``compressed`` is scratch, not yet the row's
  memory: it is pooled again whenever a later write touches its block, and a query reads it
  only when the block lies wholly before the query's window, i.e. when its tokens are
  committed or in the same write (as the oracle reads them).
* ``advance(n)`` commits ``n`` tokens per row (tokens the latest write wrote): the row's
  ``compressed`` moves to its new block count, so every block the commit completes (zero,
  one or several, at different steps for different rows) becomes memory, inside the jitted
  step, at static shapes. A counted slot was last pooled when its block's last token was
  written, so it holds committed tokens only: a draft never reaches a counted slot.
* ``write_attend`` attends over ``[memory | the ring before this write | the new K/V]``, so
  one write may be wider than the ring (a prefill: ``bound_write`` says where each row's
  real tokens end; later ones are padding, never written). Memory slots below ``cut(r)``
  count for a query whether committed or pooled by this very write (a long prefill).
* ``rollback(L)`` moves ``lengths`` back (at most ``slack``) and ``compressed`` to
  ``(L - start) // block``; memory buffers are never written by it.

Sizes: ``slack`` bounds how far any write reaches past the committed length (a verify
window plus chained drafts) and a rollback; the ring holds ``window + block + 2 * slack``
slots, so every key a later query needs is still there. ``slots = ceil(capacity / block)``.
Cost per query: ``slots + ring + t`` keys = ``capacity / block + window + block + 2 * slack +
t``, never the row's length. This cache kind runs the XLA path only (no Pallas kernel yet).

Token trees: a tree's nodes are written in window order and attend by ``TreeMask``
(``visibility``); with ``window`` at least the tree's window no node reads a memory slot the
tree's write pooled, and ``compact`` moves the accepted path into place and pools its blocks
again, so the commit counts blocks of committed tokens only (``docs/design/trees.md``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass, static_field
from specjax.attention import TreeMask, attend_visible, ring_positions, tree_mask_visible
from specjax.cache.base import (
    CAPACITY_EXCEEDED,
    ROLLBACK_INVALID,
    UNBOUNDED,
    Layers,
    as_rows,
    is_stacked,
    layer_buffers,
    layer_spec,
    move_slots,
    set_all_layers,
    set_rows,
)
from specjax.cache.protocol import CommitsPlans

__all__ = ["CompressedKVCache", "compressed_attention", "memory_cut", "pool_blocks"]


def memory_cut(q_rel: jax.Array, window: int, block: int) -> jax.Array:
    """Blocks a query at relative position ``q_rel`` reads as memory slots (``cut(r)``)."""
    return jnp.maximum(q_rel - window + 1, 0) // block


def pool_blocks(x: jax.Array, block: int) -> jax.Array:
    """``x [B, H, n * block, D]`` -> block means ``[B, H, n, D]`` (float32 sum, ``x``'s dtype)."""
    b, h, t, d = x.shape
    return x.astype(jnp.float32).reshape(b, h, t // block, block, d).mean(axis=3).astype(x.dtype)


def compressed_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, block: int, scale: float | None = None
) -> jax.Array:
    """The oracle: ``q [B, T, Hq, D]`` over ``k, v [B, T, Hkv, D]`` of positions ``0 .. T-1``
    (one whole prefix, no cache) under the compressed-memory rule. ``[B, T, Hq, D]``."""
    t = q.shape[1]
    n = t // block
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # head-major [B, Hkv, T, D]
    mem_k, mem_v = pool_blocks(kh[:, :, : n * block], block), pool_blocks(vh[:, :, : n * block], block)
    pos = jnp.arange(t, dtype=jnp.int32)
    cut = memory_cut(pos, window, block)[:, None]  # [T, 1]
    ok_mem = jnp.arange(n, dtype=jnp.int32)[None] < cut  # [T, n]
    ok_raw = (pos[None] >= cut * block) & (pos[None] <= pos[:, None])  # [T, T]
    ok = jnp.concatenate([ok_mem, ok_raw], axis=1)[None]
    return attend_visible(q, jnp.concatenate([mem_k, kh], axis=2), jnp.concatenate([mem_v, vh], axis=2), ok, scale)


@pytree_dataclass
class CompressedKVCache(CommitsPlans):
    k: Layers  # per layer [B, Hkv, size, D]: raw ring, relative position p in slot p % size (tuple or stack)
    v: Layers
    mem_k: Layers  # per layer [B, Hkv, slots, D]: slot c = mean of block c's keys
    mem_v: Layers
    lengths: jax.Array  # int32 [B]: committed length (absolute; next write offset)
    start: jax.Array  # int32 [B]: lead pad; blocks count from here (relative positions)
    compressed: jax.Array  # int32 [B]: memory slots that count (the rest are scratch)
    write_end: jax.Array  # int32 [B]: absolute end of the next write's real tokens (bound_write)
    status: jax.Array  # int32 [B]
    window: int = static_field()
    block: int = static_field()
    slack: int = static_field()

    @classmethod
    def create(
        cls,
        layers: int,
        batch: int,
        capacity: int,
        window: int,
        block: int,
        slack: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
        stacked: bool = False,
    ) -> CompressedKVCache:
        """Empty memory for rows of up to ``capacity`` tokens (``ceil(capacity / block)`` slots)."""
        if min(window, block, slack, capacity) < 1:
            raise ValueError(f"capacity, window, block and slack must be >= 1, got capacity={capacity}, "
                             f"window={window}, block={block}, slack={slack}")
        size = window + block + 2 * slack
        slots = -(-capacity // block)
        zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731  (distinct buffers: donatable)
        buf = lambda n: layer_buffers(layers, (batch, kv_heads, n, head_dim), dtype, stacked)  # noqa: E731
        return cls(buf(size), buf(size), buf(slots), buf(slots), zeros(), zeros(), zeros(),
                   jnp.full((batch,), UNBOUNDED, jnp.int32), zeros(), window, block, slack)

    @property
    def batch(self) -> int:
        return layer_spec(self.k).shape[0]

    @property
    def size(self) -> int:
        return layer_spec(self.k).shape[2]

    @property
    def slots(self) -> int:
        return layer_spec(self.mem_k).shape[2]

    def bound_write(self, n: jax.Array | int) -> CompressedKVCache:
        """The next write's tokens past ``n [B]`` per row are padding: not written, never pooled
        (until the next ``advance``). A write wider than ``slack`` needs this bound and a commit
        up to it: the prefill of right-padded prompts."""
        return self.replace(write_end=self.lengths + as_rows(n, self.batch))

    def write(self, layer: int | jax.Array, k_new: jax.Array, v_new: jax.Array) -> CompressedKVCache:
        """Write ``k_new, v_new [B, t, Hkv, D]`` at ``lengths + [0, t)``: pool every block the write
        completes (scratch until committed), keep the row's last ``size`` real positions in the ring."""
        b, t = k_new.shape[:2]
        rel = self.lengths - self.start
        end = jnp.minimum(self.lengths + t, self.write_end) - self.start  # relative end of real tokens
        # blocks the write touches: pool those it completes (older tokens from the ring, the rest new)
        c = (rel // self.block)[:, None] + jnp.arange((t - 1) // self.block + 2, dtype=jnp.int32)[None]  # [B, n]
        p = c[:, :, None] * self.block + jnp.arange(self.block, dtype=jnp.int32)  # [B, n, block]
        src = jnp.where(p >= rel[:, None, None], self.size + p - rel[:, None, None], p % self.size)
        src = jnp.clip(src, 0, self.size + t - 1).reshape(b, 1, -1, 1)
        dest = jnp.where(((c + 1) * self.block <= end[:, None]) & (c < self.slots), c, self.slots)  # else dropped
        rows = jnp.arange(b, dtype=jnp.int32)[:, None]
        # the ring keeps real positions in [end - size, end): at most size of them, one slot each
        q = rel[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, t]
        slot = jnp.where((q < end[:, None]) & (q >= end[:, None] - self.size), q % self.size, self.size)

        def update(ring, mem, new):  # both layouts are written in place (cache.base.set_rows)
            new = new.astype(layer_spec(ring).dtype)
            both = jnp.concatenate([ring[layer], new.transpose(0, 2, 1, 3)], axis=2)  # [B, Hkv, size + t, D]
            blocks = jnp.take_along_axis(both, src, axis=2)  # [B, Hkv, n * block, D]
            pooled = pool_blocks(blocks, self.block).transpose(0, 2, 1, 3)
            return set_rows(ring, layer, (rows, slice(None), slot), new), \
                set_rows(mem, layer, (rows, slice(None), dest), pooled)

        k, mem_k = update(self.k, self.mem_k, k_new)
        v, mem_v = update(self.v, self.mem_v, v_new)
        return self.replace(k=k, v=v, mem_k=mem_k, mem_v=mem_v)

    def visibility(self, t_q: int, tree: TreeMask | None = None) -> jax.Array:
        """Boolean ``[B, t_q, slots + size + t_q]``: queries at ``lengths + [0, t_q)`` over
        ``[memory slots | ring slots before the write | the t_q new tokens]``.

        ``tree``: the queries are token-tree nodes at ``tree.q_pos``; a raw key at a slot from
        ``tree.start`` on is tree node ``slot - tree.start`` (written by this write or an
        earlier one: a draft model's beams), read where ``tree.anc`` allows; memory slots and
        the prefix's raw keys by each query's own position (``write_attend``)."""
        rel = self.lengths - self.start
        old = ring_positions(rel, 0, self.size)  # [B, size]: latest relative slot < rel (-1: none)
        slot = jnp.concatenate([old, rel[:, None] + jnp.arange(t_q, dtype=jnp.int32)[None]], axis=1)  # [B, size + t]
        if tree is None:
            q_rel = slot[:, self.size:]
            raw = (slot[:, None, :] >= 0) & (slot[:, None, :] <= q_rel[:, :, None])
        else:  # every tree node lies past each query's cut (window >= t): only the prefix's raw keys are cut
            at = jnp.where(slot >= 0, slot + self.start[:, None], -1)  # absolute slots (a committed key's position)
            raw = tree_mask_visible(at, at, self.start, tree)
            q_rel = tree.q_pos - self.start[:, None]
        cut = memory_cut(q_rel, self.window, self.block)[:, :, None]  # [B, t, 1]
        ok_mem = jnp.arange(self.slots, dtype=jnp.int32)[None, None] < cut
        return jnp.concatenate([ok_mem, raw & (slot[:, None, :] >= cut * self.block)], axis=2)

    def write_attend(
        self, layer: int | jax.Array, q: jax.Array, k_new: jax.Array, v_new: jax.Array, *,
        scale: float | None = None, tree: TreeMask | None = None,
    ) -> tuple[CompressedKVCache, jax.Array]:
        """``write`` then compressed-memory attention of ``q [B, t, Hq, D]`` at ``lengths + [0, t)``
        over the new memory, the ring as it was and the new K/V: ``(cache, [B, t, Hq, D])``.

        ``tree``: the ``t`` tokens are token-tree nodes (``TreeMask``), written in window order;
        each reads the memory and raw tokens of its own position and its own branch. The blocks
        a tree's writes pool hold window order, not a branch, so no query may read them: that
        holds when ``window`` is at least the tree's window (every memory slot a node reads lies
        before the tree: ``engine.config.check_tree_memory``); ``compact`` pools the accepted
        path's blocks again."""
        out = self.write(layer, k_new, v_new)
        hm = lambda x: x.astype(layer_spec(self.k).dtype).transpose(0, 2, 1, 3)  # noqa: E731  [B, Hkv, t, D]
        k = jnp.concatenate([out.mem_k[layer], self.k[layer], hm(k_new)], axis=2)
        v = jnp.concatenate([out.mem_v[layer], self.v[layer], hm(v_new)], axis=2)
        return out, attend_visible(q, k, v, self.visibility(q.shape[1], tree), scale)

    def advance(self, n: jax.Array | int) -> CompressedKVCache:
        """Commit ``n [B]`` tokens per row (written by the latest write): every block the commit
        completes becomes memory. A row that would pass its memory stays and is flagged
        ``CAPACITY_EXCEEDED``. Clears ``bound_write``."""
        new = self.lengths + as_rows(n, self.batch)
        blocks = (new - self.start) // self.block
        fits = blocks <= self.slots
        return self.replace(
            lengths=jnp.where(fits, new, self.lengths), compressed=jnp.where(fits, blocks, self.compressed),
            write_end=jnp.full_like(self.write_end, UNBOUNDED),
            status=self.status | jnp.where(fits, 0, CAPACITY_EXCEEDED),
        )


    def rollback(self, new_lengths: jax.Array | int) -> CompressedKVCache:
        """Roll back to ``new_lengths`` in ``[max(start, lengths - slack), lengths]``; memory slots
        past the new length stop counting (their buffers are untouched: re-pooled on re-write)."""
        new = as_rows(new_lengths, self.batch)
        ok = (new >= self.start) & (new <= self.lengths) & (self.lengths - new <= self.slack)
        new = jnp.where(ok, new, self.lengths)
        return self.replace(
            lengths=new, compressed=jnp.minimum(self.compressed, (new - self.start) // self.block),
            status=self.status | jnp.where(ok, 0, ROLLBACK_INVALID),
        )

    def compact(self, src: jax.Array) -> CompressedKVCache:
        """Position ``lengths + k`` takes the K/V of position ``lengths + src[b, k]`` (``src [B, N]``:
        ``DenseKVCache.compact``) in ring slots, every layer; then every block the verify window
        completes is pooled again from the ring (the write pooled the window in tree order). A
        block past the accepted path stays scratch: only ``advance`` makes a block count."""
        b, n = src.shape
        rel = self.lengths - self.start
        k = jnp.arange(n, dtype=jnp.int32)[None]
        rows = jnp.arange(b, dtype=jnp.int32)[:, None]
        frm = (rows, (rel[:, None] + src) % self.size)
        to = (rows, jnp.where(src != k, (rel[:, None] + k) % self.size, self.size))  # explicit out-of-range: dropped
        ring_k, ring_v = move_slots(self.k, frm, to), move_slots(self.v, frm, to)
        end = jnp.minimum(self.lengths + n, self.write_end) - self.start
        c = (rel // self.block)[:, None] + jnp.arange((n - 1) // self.block + 2, dtype=jnp.int32)[None]  # [B, nc]
        slot = (c[:, :, None] * self.block + jnp.arange(self.block, dtype=jnp.int32)).reshape(b, -1) % self.size
        dest = jnp.where(((c + 1) * self.block <= end[:, None]) & (c < self.slots), c, self.slots)  # else dropped
        return self.replace(k=ring_k, v=ring_v, mem_k=_pool_into(self.mem_k, ring_k, rows, slot, dest, self.block),
                            mem_v=_pool_into(self.mem_v, ring_v, rows, slot, dest, self.block))

    def rows_view(self, rows: jax.Array, width: int) -> CompressedKVCache:
        """Empty memory for ``rows [R]`` (a refill's prefill of ``width`` tokens, bounded per row)."""
        one = layer_spec(self.k)
        return CompressedKVCache.create(len(self.k), rows.shape[0], self.slots * self.block, self.window, self.block,
                                        self.slack, one.shape[1], one.shape[3], one.dtype, is_stacked(self.k))

    def put_rows(self, rows: jax.Array, sub: CompressedKVCache) -> CompressedKVCache:
        """Rows ``rows [R]`` replaced by ``sub``'s (index ``batch``: a padding row, dropped)."""
        put = lambda big, small: big.at[rows].set(small, mode="drop")  # noqa: E731
        each = lambda big, small: set_all_layers(big, (rows,), small)  # noqa: E731
        return self.replace(k=each(self.k, sub.k), v=each(self.v, sub.v), mem_k=each(self.mem_k, sub.mem_k),
                            mem_v=each(self.mem_v, sub.mem_v), lengths=put(self.lengths, sub.lengths),
                            start=put(self.start, sub.start), compressed=put(self.compressed, sub.compressed),
                            write_end=put(self.write_end, sub.write_end), status=put(self.status, sub.status))


def _pool_into(mem: Layers, ring: Layers, rows: jax.Array, slot: jax.Array, dest: jax.Array, block: int) -> Layers:
    """Every layer's ``mem[rows, :, dest] = `` the means of ring slots ``slot [B, nc * block]``
    taken ``block`` at a time (``dest [B, nc]``; out of range: dropped)."""
    def one(m, x, lead):
        blocks = x[(*lead, rows, slice(None), slot)]  # [B, nc * block, (L,) Hkv, D]: the indexed axes lead
        b, t = blocks.shape[:2]
        pooled = blocks.astype(jnp.float32).reshape(b, t // block, block, *blocks.shape[2:]).mean(axis=2)
        return m.at[(*lead, rows, slice(None), dest)].set(pooled.astype(m.dtype), mode="drop")

    if isinstance(mem, tuple):
        return tuple(one(m, x, ()) for m, x in zip(mem, ring, strict=True))
    return one(mem, ring, (slice(None),))
