"""Dense KV cache with per-row lengths and lead pads.

``k, v``: per layer ``[B, kv_heads, capacity, head_dim]`` (head-major), a tuple of one
buffer per layer or one stack ``[L, B, ...]`` for the layer scan (``cache.base``: ``layer``
may then be traced). Row ``b``'s live entries are
slots ``[start[b], lengths[b])``. A write of ``t`` tokens puts them at slots
``lengths[b] .. lengths[b] + t - 1`` of *that* row (one scatter of ``B * t``
entries); the length moves only on ``advance``/``apply_plan``. Rejected slots are
neither freed nor zeroed: the next write overwrites them and masks keep them unread.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import ragged_attention as pallas_ragged_attention
from pallas_kernels.reference import TreeMask
from specjax._pytree import pytree_dataclass
from specjax.attention import live_attention
from specjax.cache.base import (
    CAPACITY_EXCEEDED,
    KERNEL_MAX_QUERIES,
    ROLLBACK_INVALID,
    Layers,
    as_rows,
    is_stacked,
    kernel_block,
    kernel_operands,
    key_block,
    layer_block,
    layer_buffers,
    layer_spec,
    move_slots,
    positions,
    set_all_layers,
    set_rows,
)
from specjax.cache.protocol import CommitsPlans

__all__ = ["DenseKVCache"]


@pytree_dataclass
class DenseKVCache(CommitsPlans):
    k: Layers  # per layer [B, Hkv, capacity, D]: a tuple, or a stack [L, B, Hkv, capacity, D]
    v: Layers
    lengths: jax.Array  # int32 [B]: next free slot (committed length incl. lead pad)
    start: jax.Array  # int32 [B]: lead pad; slots before it are never attended
    status: jax.Array  # int32 [B]: sticky status bits (cache.base)

    @classmethod
    def create(
        cls,
        layers: int,
        batch: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
        stacked: bool = False,
    ) -> DenseKVCache:
        shape = (batch, kv_heads, capacity, head_dim)
        zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731  (distinct buffers: donatable)
        kv = lambda: layer_buffers(layers, shape, dtype, stacked)  # noqa: E731
        return cls(kv(), kv(), zeros(), zeros(), zeros())

    @property
    def batch(self) -> int:
        return layer_spec(self.k).shape[0]

    @property
    def capacity(self) -> int:
        return layer_spec(self.k).shape[2]

    def write(self, layer: int | jax.Array, k_new: jax.Array, v_new: jax.Array,
              count: jax.Array | None = None) -> DenseKVCache:
        """Write ``k_new, v_new [B, t, Hkv, D]`` at each row's own offset ``lengths[b]``.

        ``count [B]`` (``<= t``): only each row's first ``count`` tokens are written, the rest
        dropped, so the row needs room for ``count`` slots, not ``t`` (a static-width write
        whose tail is padding). A row that would pass ``capacity`` is not written and gets
        ``CAPACITY_EXCEEDED``.
        """
        t = k_new.shape[1]
        n = t if count is None else count
        fits = self.lengths + n <= self.capacity
        pos = positions(self.lengths, t)
        keep = fits[:, None] if count is None else fits[:, None] & (jnp.arange(t)[None] < count[:, None])
        pos = jnp.where(keep, pos, self.capacity)  # explicit out-of-range: dropped
        rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], pos.shape)
        idx = (rows, slice(None), pos)  # (rows, :, pos): the indexed view is [B, t, Hkv, D], exactly k_new's shape
        return self.replace(k=set_rows(self.k, layer, idx, k_new), v=set_rows(self.v, layer, idx, v_new),
                            status=self.status | jnp.where(fits, 0, CAPACITY_EXCEEDED))

    def advance(self, n: jax.Array | int) -> DenseKVCache:
        """``lengths += n`` per row; a row that would pass capacity stays and is flagged."""
        n = as_rows(n, self.batch)
        new = self.lengths + n
        fits = new <= self.capacity
        return self.replace(
            lengths=jnp.where(fits, new, self.lengths),
            status=self.status | jnp.where(fits, 0, CAPACITY_EXCEEDED),
        )


    def rollback(self, new_lengths: jax.Array | int) -> DenseKVCache:
        """Set ``lengths`` to ``new_lengths`` in ``[start, lengths]``; nothing is zeroed."""
        new = as_rows(new_lengths, self.batch)
        ok = (new >= self.start) & (new <= self.lengths)
        return self.replace(
            lengths=jnp.where(ok, new, self.lengths),
            status=self.status | jnp.where(ok, 0, ROLLBACK_INVALID),
        )

    def compact(self, src: jax.Array) -> DenseKVCache:
        """Slot ``lengths + k`` takes the K/V of slot ``lengths + src[b, k]`` (``src [B, N]``, a
        verify window's compaction: ``specjax.tree.accepted_sources`` moves a tree's accepted
        path into place), in every layer; a slot whose source is itself is not touched."""
        b, n = src.shape
        k = jnp.arange(n, dtype=jnp.int32)[None]
        frm = jnp.clip(self.lengths[:, None] + src, 0, self.capacity - 1)
        to = self.lengths[:, None] + k
        to = jnp.where((src != k) & (to < self.capacity), to, self.capacity)  # explicit out-of-range: dropped
        rows = jnp.arange(b, dtype=jnp.int32)[:, None]
        frm, to = (rows, frm), (rows, to)
        return self.replace(k=move_slots(self.k, frm, to), v=move_slots(self.v, frm, to))

    def rows_view(self, rows: jax.Array, width: int) -> DenseKVCache:
        """An empty cache of ``width`` slots for ``rows [R]`` (a refill's prefill writes
        there); ``put_rows`` copies it into those rows' first ``width`` slots."""
        one = layer_spec(self.k)
        return DenseKVCache.create(len(self.k), rows.shape[0], width, one.shape[1], one.shape[3], one.dtype,
                                   is_stacked(self.k))

    def put_rows(self, rows: jax.Array, sub: DenseKVCache) -> DenseKVCache:
        """Rows ``rows [R]`` replaced by ``sub``'s (index ``batch``: a padding row, dropped).
        Slots past ``sub``'s capacity keep stale data, unread: they lie past the new length."""
        put = lambda big, small: big.at[rows].set(small, mode="drop")  # noqa: E731
        kv = lambda big, small: set_all_layers(big, (rows, slice(None), slice(0, sub.capacity)), small)  # noqa: E731
        return self.replace(k=kv(self.k, sub.k), v=kv(self.v, sub.v), lengths=put(self.lengths, sub.lengths),
                            start=put(self.start, sub.start), status=put(self.status, sub.status))

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
        """Attention of ``q [B, t_q, Hq, D]`` sitting at ``lengths + [0, t_q)`` (the tokens
        just written) over this layer's cache; ``[B, t_q, Hq, D]``. Reads only key blocks
        up to the batch's longest live row (XLA) or each row's own live blocks (Pallas)."""
        t_q = q.shape[1]
        # (a tree under a narrower window, or more queries than the kernel holds: XLA)
        if impl == "pallas" and t_q <= KERNEL_MAX_QUERIES and (tree is None or window is None or window >= t_q):
            k, v, at = kernel_operands(self.k, self.v, layer)
            return pallas_ragged_attention(q, k, v, self.start, self.lengths, window=window, scale=scale,
                                           block_k=kernel_block(self.capacity), layer=at, tree=tree)
        block = key_block(self.capacity)

        def read(j):  # key block j of this layer (one block: a tuple layer's buffer itself, no slice copy)
            k, v = (layer_block(x, layer, j * block, block, axis=2) for x in (self.k, self.v))
            return k, v, (j * block + jnp.arange(block, dtype=jnp.int32))[None]

        return live_attention(q, read, positions(self.lengths, t_q), self.start, block=block,
                              num_blocks=self.capacity // block, window=window, scale=scale, tree=tree)

