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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass, static_field
from specjax.attention import attend_visible, ring_positions
from specjax.cache.base import (
    CAPACITY_EXCEEDED,
    ROLLBACK_INVALID,
    UNBOUNDED,
    Layers,
    as_rows,
    is_stacked,
    layer_buffers,
    layer_spec,
    set_all_layers,
    set_rows,
)

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
class CompressedKVCache:
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

    def visibility(self, t_q: int) -> jax.Array:
        """Boolean ``[B, t_q, slots + size + t_q]``: queries at ``lengths + [0, t_q)`` over
        ``[memory slots | ring slots before the write | the t_q new tokens]``."""
        rel = self.lengths - self.start
        q_rel = rel[:, None] + jnp.arange(t_q, dtype=jnp.int32)[None]  # [B, t]
        cut = memory_cut(q_rel, self.window, self.block)[:, :, None]  # [B, t, 1]
        ok_mem = jnp.arange(self.slots, dtype=jnp.int32)[None, None] < cut
        old = ring_positions(rel, 0, self.size)[:, None]  # [B, 1, size]: latest position < rel (-1: none)
        ok_old = (old >= cut * self.block) & (old >= 0)
        new = q_rel[:, None, :]  # [B, 1, t]
        ok_new = (new >= cut * self.block) & (new <= q_rel[:, :, None])
        return jnp.concatenate([ok_mem, ok_old, ok_new], axis=2)

    def write_attend(
        self, layer: int | jax.Array, q: jax.Array, k_new: jax.Array, v_new: jax.Array, *, scale: float | None = None
    ) -> tuple[CompressedKVCache, jax.Array]:
        """``write`` then compressed-memory attention of ``q [B, t, Hq, D]`` at ``lengths + [0, t)``
        over the new memory, the ring as it was and the new K/V: ``(cache, [B, t, Hq, D])``."""
        out = self.write(layer, k_new, v_new)
        hm = lambda x: x.astype(layer_spec(self.k).dtype).transpose(0, 2, 1, 3)  # noqa: E731  [B, Hkv, t, D]
        k = jnp.concatenate([out.mem_k[layer], self.k[layer], hm(k_new)], axis=2)
        v = jnp.concatenate([out.mem_v[layer], self.v[layer], hm(v_new)], axis=2)
        return out, attend_visible(q, k, v, self.visibility(q.shape[1]), scale)

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

    def apply_plan(self, plan) -> CompressedKVCache:
        return self.advance(plan.advance)

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
