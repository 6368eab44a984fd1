"""Dense KV cache with per-row lengths and lead pads.

``k, v``: one buffer per layer, ``[B, kv_heads, capacity, head_dim]`` each (head-major;
separate buffers so a layer's attention reads its buffer in place and a write updates
it in place: a slice of one stacked buffer would be copied). Row ``b``'s live entries are
slots ``[start[b], lengths[b])``. A write of ``t`` tokens puts them at slots
``lengths[b] .. lengths[b] + t - 1`` of *that* row (one scatter of ``B * t``
entries); the length moves only on ``advance``/``apply_plan``. Rejected slots are
neither freed nor zeroed: the next write overwrites them and masks keep them unread.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass
from specjax.attention import live_attention
from specjax.cache.base import (
    CAPACITY_EXCEEDED,
    ROLLBACK_INVALID,
    as_rows,
    kernel_block,
    key_block,
    positions,
    replace_layer,
)

__all__ = ["DenseKVCache"]


@pytree_dataclass
class DenseKVCache:
    k: tuple[jax.Array, ...]  # per layer [B, Hkv, capacity, D]
    v: tuple[jax.Array, ...]  # per layer [B, Hkv, capacity, D]
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
    ) -> DenseKVCache:
        shape = (batch, kv_heads, capacity, head_dim)
        zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731  (distinct buffers: donatable)
        kv = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(layers))  # noqa: E731
        return cls(kv(), kv(), zeros(), zeros(), zeros())

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array) -> DenseKVCache:
        """Write ``k_new, v_new [B, t, Hkv, D]`` at each row's own offset ``lengths[b]``.

        A row that would pass ``capacity`` is not written and gets ``CAPACITY_EXCEEDED``.
        """
        t = k_new.shape[1]
        fits = self.lengths + t <= self.capacity
        pos = positions(self.lengths, t)
        pos = jnp.where(fits[:, None], pos, self.capacity)  # explicit out-of-range: dropped
        rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], pos.shape)
        # (rows, :, pos): the indexed view is [B, t, Hkv, D], exactly k_new's shape
        k = self.k[layer].at[rows, :, pos].set(k_new.astype(self.k[layer].dtype), mode="drop")
        v = self.v[layer].at[rows, :, pos].set(v_new.astype(self.v[layer].dtype), mode="drop")
        status = self.status | jnp.where(fits, 0, CAPACITY_EXCEEDED)
        return self.replace(k=replace_layer(self.k, layer, k), v=replace_layer(self.v, layer, v), status=status)

    def advance(self, n: jax.Array | int) -> DenseKVCache:
        """``lengths += n`` per row; a row that would pass capacity stays and is flagged."""
        n = as_rows(n, self.batch)
        new = self.lengths + n
        fits = new <= self.capacity
        return self.replace(
            lengths=jnp.where(fits, new, self.lengths),
            status=self.status | jnp.where(fits, 0, CAPACITY_EXCEEDED),
        )

    def apply_plan(self, plan) -> DenseKVCache:
        """Commit a step plan: each row advances by ``plan.advance``."""
        return self.advance(plan.advance)

    def rollback(self, new_lengths: jax.Array | int) -> DenseKVCache:
        """Set ``lengths`` to ``new_lengths`` in ``[start, lengths]``; nothing is zeroed."""
        new = as_rows(new_lengths, self.batch)
        ok = (new >= self.start) & (new <= self.lengths)
        return self.replace(
            lengths=jnp.where(ok, new, self.lengths),
            status=self.status | jnp.where(ok, 0, ROLLBACK_INVALID),
        )

    def rows_view(self, rows: jax.Array, width: int) -> DenseKVCache:
        """An empty cache of ``width`` slots for ``rows [R]`` (a refill's prefill writes
        there); ``put_rows`` copies it into those rows' first ``width`` slots."""
        return DenseKVCache.create(len(self.k), rows.shape[0], width, self.k[0].shape[1], self.k[0].shape[3],
                                   self.k[0].dtype)

    def put_rows(self, rows: jax.Array, sub: DenseKVCache) -> DenseKVCache:
        """Rows ``rows [R]`` replaced by ``sub``'s (index ``batch``: a padding row, dropped).
        Slots past ``sub``'s capacity keep stale data, unread: they lie past the new length."""
        width = sub.capacity
        put = lambda big, small: big.at[rows].set(small, mode="drop")  # noqa: E731

        def kv(big, small):
            return tuple(b.at[rows, :, :width].set(s, mode="drop") for b, s in zip(big, small, strict=True))

        return self.replace(k=kv(self.k, sub.k), v=kv(self.v, sub.v), lengths=put(self.lengths, sub.lengths),
                            start=put(self.start, sub.start), status=put(self.status, sub.status))

    def attend(
        self,
        q: jax.Array,
        layer: int,
        *,
        window: int | None = None,
        scale: float | None = None,
        impl: str = "xla",
    ) -> jax.Array:
        """Attention of ``q [B, t_q, Hq, D]`` sitting at ``lengths + [0, t_q)`` (the tokens
        just written) over this layer's cache; ``[B, t_q, Hq, D]``. Reads only key blocks
        up to the batch's longest live row (XLA) or each row's own live blocks (Pallas)."""
        t_q = q.shape[1]
        if impl == "pallas":
            # lazy import: pallas_kernels imports specjax (the reference), never the reverse at import time
            from pallas_kernels.ragged_attention import ragged_attention as pallas_ragged_attention

            return pallas_ragged_attention(q, self.k[layer], self.v[layer], self.start, self.lengths, window=window,
                                           scale=scale, block_k=kernel_block(self.capacity))
        block = key_block(self.capacity)
        k_l, v_l = self.k[layer], self.v[layer]

        def read(j):
            if block == self.capacity:  # one block: the buffer itself, no slice copy
                return k_l, v_l, jnp.arange(block, dtype=jnp.int32)[None]
            k = jax.lax.dynamic_slice_in_dim(k_l, j * block, block, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v_l, j * block, block, axis=2)
            return k, v, (j * block + jnp.arange(block, dtype=jnp.int32))[None]

        return live_attention(q, read, positions(self.lengths, t_q), self.start, block=block,
                              num_blocks=self.capacity // block, window=window, scale=scale)
