"""Sliding-window KV cache: a per-row ring of ``window + slack`` slots.

Absolute position ``p`` of row ``b`` lives in slot ``p % size``. Every row has its
own ``lengths [b]`` (absolute), so rows append, advance and roll back by different
amounts. With ``slack >= w`` (the verify window), rolling back up to ``slack``
tokens never loses an entry still inside any row's window: a slot clobbered by a
rejected token held position ``p - size <= new_len - window``, already outside
the window of every later query.

A write wider than ``slack`` (a long prefill) goes through ``write_attend``, which attends
over the ring as it was plus the new K/V, so the ring need not hold the whole write:
``bound_write(prompt_len)`` says where each right-padded row's real tokens end, and the
ring keeps each row's own last ``size`` real positions. The ring (and every decode step's
attention) is then sized by the decode writes, not by the prompt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import ring_attention
from pallas_kernels.reference import TreeMask, tree_mask_visible
from specjax._pytree import pytree_dataclass, static_field
from specjax.attention import attend_visible, attention_with_positions, ring_positions
from specjax.cache.base import (
    KERNEL_MAX_QUERIES,
    ROLLBACK_INVALID,
    UNBOUNDED,
    Layers,
    as_rows,
    is_stacked,
    kernel_block,
    kernel_operands,
    layer_buffers,
    layer_spec,
    move_slots,
    positions,
    set_all_layers,
    set_rows,
)
from specjax.cache.protocol import CommitsPlans

__all__ = ["RollingKVCache"]


@pytree_dataclass
class RollingKVCache(CommitsPlans):
    k: Layers  # per layer [B, Hkv, window + slack, D] (head-major): a tuple or a stack [L, ...]
    v: Layers
    lengths: jax.Array  # int32 [B]: absolute position of the next token
    start: jax.Array  # int32 [B]: lead pad (absolute); earlier positions never attended
    status: jax.Array  # int32 [B]
    write_end: jax.Array  # int32 [B]: absolute end of the next write's real tokens (bound_write)
    window: int = static_field()
    slack: int = static_field()

    @classmethod
    def create(
        cls,
        layers: int,
        batch: int,
        window: int,
        slack: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
        stacked: bool = False,
    ) -> RollingKVCache:
        if window < 1 or slack < 1:
            raise ValueError(f"window and slack must be >= 1, got window={window}, slack={slack}")
        shape = (batch, kv_heads, window + slack, head_dim)
        zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731  (distinct buffers: donatable)
        kv = lambda: layer_buffers(layers, shape, dtype, stacked)  # noqa: E731
        return cls(kv(), kv(), zeros(), zeros(), zeros(), jnp.full((batch,), UNBOUNDED, jnp.int32), window, slack)

    @property
    def batch(self) -> int:
        return layer_spec(self.k).shape[0]

    @property
    def size(self) -> int:
        return self.window + self.slack

    def bound_write(self, n: jax.Array | int) -> RollingKVCache:
        """The next write's tokens past ``n [B]`` per row are padding: never written (until the
        next ``advance``). A write wider than ``slack`` needs it (the right-padded prefill)."""
        return self.replace(write_end=self.lengths + as_rows(n, self.batch))

    def write(self, layer: int | jax.Array, k_new: jax.Array, v_new: jax.Array) -> RollingKVCache:
        """Write ``[B, t, Hkv, D]`` at absolute positions ``lengths[b] + [0, t)``; ``t <= slack``
        (wider: ``write_attend``, since ``attend`` reads only the ring)."""
        t = k_new.shape[1]
        if t > self.slack:
            raise ValueError(f"a write of t={t} tokens needs slack >= t, but slack={self.slack} "
                             "(a wider write goes through write_attend)")
        return self._put(layer, k_new, v_new)

    def _put(self, layer: int | jax.Array, k_new: jax.Array, v_new: jax.Array) -> RollingKVCache:
        """The ring keeps each row's real positions in ``[end - size, end)``, one slot each."""
        t = k_new.shape[1]
        pos = positions(self.lengths, t)
        end = jnp.minimum(self.lengths + t, self.write_end)[:, None]
        slots = jnp.where((pos < end) & (pos >= end - self.size), pos % self.size, self.size)  # else dropped
        rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], slots.shape)
        idx = (rows, slice(None), slots)
        return self.replace(k=set_rows(self.k, layer, idx, k_new), v=set_rows(self.v, layer, idx, v_new))

    def write_attend(
        self, layer: int | jax.Array, q: jax.Array, k_new: jax.Array, v_new: jax.Array, *, scale: float | None = None
    ) -> tuple[RollingKVCache, jax.Array]:
        """Write ``k_new, v_new [B, t, Hkv, D]`` (any ``t``) and attend ``q [B, t, Hq, D]`` over
        the ring as it was plus the new K/V (XLA): ``(cache, [B, t, Hq, D])``."""
        t = q.shape[1]
        hm = lambda x: x.astype(layer_spec(self.k).dtype).transpose(0, 2, 1, 3)  # noqa: E731  [B, Hkv, t, D]
        k = jnp.concatenate([self.k[layer], hm(k_new)], axis=2)
        v = jnp.concatenate([self.v[layer], hm(v_new)], axis=2)
        new_pos = positions(self.lengths, t)
        key_pos = jnp.concatenate([ring_positions(self.lengths, 0, self.size), new_pos], axis=1)
        out = attention_with_positions(q, k, v, new_pos, key_pos, self.start, window=self.window, scale=scale)
        return self._put(layer, k_new, v_new), out

    def advance(self, n: jax.Array | int) -> RollingKVCache:
        """``lengths += n`` per row; clears ``bound_write``."""
        return self.replace(lengths=self.lengths + as_rows(n, self.batch),
                            write_end=jnp.full_like(self.write_end, UNBOUNDED))


    def rollback(self, new_lengths: jax.Array | int) -> RollingKVCache:
        """Roll back to ``new_lengths`` in ``[max(start, lengths - slack), lengths]``."""
        new = as_rows(new_lengths, self.batch)
        ok = (new >= self.start) & (new <= self.lengths) & (self.lengths - new <= self.slack)
        return self.replace(
            lengths=jnp.where(ok, new, self.lengths),
            status=self.status | jnp.where(ok, 0, ROLLBACK_INVALID),
        )

    def compact(self, src: jax.Array) -> RollingKVCache:
        """Position ``lengths + k`` takes the K/V of position ``lengths + src[b, k]`` (``src
        [B, N]``: ``DenseKVCache.compact``), in ring slots, every layer."""
        b, n = src.shape
        k = jnp.arange(n, dtype=jnp.int32)[None]
        frm = (self.lengths[:, None] + src) % self.size
        to = jnp.where(src != k, (self.lengths[:, None] + k) % self.size, self.size)  # explicit out-of-range: dropped
        rows = jnp.arange(b, dtype=jnp.int32)[:, None]
        frm, to = (rows, frm), (rows, to)
        return self.replace(k=move_slots(self.k, frm, to), v=move_slots(self.v, frm, to))

    def rows_view(self, rows: jax.Array, width: int) -> RollingKVCache:
        """An empty ring for ``rows [R]`` (a refill's prefill of ``width`` tokens, bounded per row)."""
        one = layer_spec(self.k)
        return RollingKVCache.create(len(self.k), rows.shape[0], self.window, self.slack, one.shape[1], one.shape[3],
                                     one.dtype, is_stacked(self.k))

    def put_rows(self, rows: jax.Array, sub: RollingKVCache) -> RollingKVCache:
        """Rows ``rows [R]`` replaced by ``sub``'s whole rings (padding rows dropped)."""
        put = lambda big, small: big.at[rows].set(small, mode="drop")  # noqa: E731
        kv = lambda big, small: set_all_layers(big, (rows,), small)  # noqa: E731
        return self.replace(k=kv(self.k, sub.k), v=kv(self.v, sub.v), lengths=put(self.lengths, sub.lengths),
                            start=put(self.start, sub.start), status=put(self.status, sub.status),
                            write_end=put(self.write_end, sub.write_end))

    def key_positions(self, t_q: int) -> jax.Array:
        """``[B, size]``: the absolute position each ring slot holds once ``t_q`` tokens were
        written at ``lengths`` (``-1``: never written)."""
        return ring_positions(self.lengths, t_q, self.size)

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
        """Windowed attention of ``q [B, t_q, Hq, D]`` at ``lengths + [0, t_q)`` over the ring
        (``window + slack`` slots: the cost is the window's, whatever the row's length).
        ``tree``: the queries are token-tree nodes: a ring slot's logical slot is the position
        ``key_positions`` names, so the tree mask reads it as it reads a dense cache's slot, the
        window counted along each node's branch (the ring kernel where the window holds the
        whole verify window, ``window >= t_q``; the XLA path otherwise)."""
        if window is not None and window != self.window:
            raise ValueError(f"window={window} differs from this cache's window={self.window}")
        t_q = q.shape[1]
        if impl == "pallas" and t_q <= KERNEL_MAX_QUERIES and (tree is None or self.window >= t_q):
            k, v, at = kernel_operands(self.k, self.v, layer)
            return ring_attention(q, k, v, self.start, self.lengths, window=self.window, scale=scale, layer=at,
                                  block_k=kernel_block(self.size), tree=tree)
        if tree is not None:
            slot = self.key_positions(t_q)
            ok = tree_mask_visible(slot, slot, self.start, tree, self.window)
            return attend_visible(q, self.k[layer], self.v[layer], ok, scale)
        return attention_with_positions(
            q, self.k[layer], self.v[layer], positions(self.lengths, t_q), self.key_positions(t_q), self.start,
            window=self.window, scale=scale,
        )
