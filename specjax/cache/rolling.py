"""Sliding-window KV cache: a per-row ring of ``window + slack`` slots.

Absolute position ``p`` of row ``b`` lives in slot ``p % size``. Every row has its
own ``lengths [b]`` (absolute), so rows append, advance and roll back by different
amounts. With ``slack >= w`` (the verify window), rolling back up to ``slack``
tokens never loses an entry still inside any row's window: a slot clobbered by a
rejected token held position ``p - size <= new_len - window``, already outside
the window of every later query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass, static_field
from specjax.attention import attention_with_positions, ring_positions
from specjax.cache.base import ROLLBACK_INVALID, as_rows, positions, replace_layer

__all__ = ["RollingKVCache"]


@pytree_dataclass
class RollingKVCache:
    k: tuple[jax.Array, ...]  # per layer [B, Hkv, window + slack, D] (head-major)
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # int32 [B]: absolute position of the next token
    start: jax.Array  # int32 [B]: lead pad (absolute); earlier positions never attended
    status: jax.Array  # int32 [B]
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
    ) -> RollingKVCache:
        if window < 1 or slack < 1:
            raise ValueError(f"window and slack must be >= 1, got window={window}, slack={slack}")
        shape = (batch, kv_heads, window + slack, head_dim)
        zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731  (distinct buffers: donatable)
        kv = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(layers))  # noqa: E731
        return cls(kv(), kv(), zeros(), zeros(), zeros(), window, slack)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def size(self) -> int:
        return self.window + self.slack

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array) -> RollingKVCache:
        """Write ``[B, t, Hkv, D]`` at absolute positions ``lengths[b] + [0, t)``; ``t <= slack``."""
        t = k_new.shape[1]
        if t > self.slack:
            raise ValueError(f"a write of t={t} tokens needs slack >= t, but slack={self.slack}")
        slots = positions(self.lengths, t) % self.size
        rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], slots.shape)
        k = self.k[layer].at[rows, :, slots].set(k_new.astype(self.k[layer].dtype), mode="promise_in_bounds")
        v = self.v[layer].at[rows, :, slots].set(v_new.astype(self.v[layer].dtype), mode="promise_in_bounds")
        return self.replace(k=replace_layer(self.k, layer, k), v=replace_layer(self.v, layer, v))

    def advance(self, n: jax.Array | int) -> RollingKVCache:
        return self.replace(lengths=self.lengths + as_rows(n, self.batch))

    def apply_plan(self, plan) -> RollingKVCache:
        return self.advance(plan.advance)

    def rollback(self, new_lengths: jax.Array | int) -> RollingKVCache:
        """Roll back to ``new_lengths`` in ``[max(start, lengths - slack), lengths]``."""
        new = as_rows(new_lengths, self.batch)
        ok = (new >= self.start) & (new <= self.lengths) & (self.lengths - new <= self.slack)
        return self.replace(
            lengths=jnp.where(ok, new, self.lengths),
            status=self.status | jnp.where(ok, 0, ROLLBACK_INVALID),
        )

    def rows_view(self, rows: jax.Array, width: int) -> RollingKVCache:
        """An empty ring for ``rows [R]`` (``width <= slack``: the prefill fits one write)."""
        if width > self.slack:
            raise ValueError(f"a refill of width {width} needs slack >= {width}, but slack={self.slack}")
        return RollingKVCache.create(len(self.k), rows.shape[0], self.window, self.slack, self.k[0].shape[1],
                                     self.k[0].shape[3], self.k[0].dtype)

    def put_rows(self, rows: jax.Array, sub: RollingKVCache) -> RollingKVCache:
        """Rows ``rows [R]`` replaced by ``sub``'s whole rings (padding rows dropped)."""
        put = lambda big, small: big.at[rows].set(small, mode="drop")  # noqa: E731
        kv = lambda big, small: tuple(put(b, s) for b, s in zip(big, small, strict=True))  # noqa: E731
        return self.replace(k=kv(self.k, sub.k), v=kv(self.v, sub.v), lengths=put(self.lengths, sub.lengths),
                            start=put(self.start, sub.start), status=put(self.status, sub.status))

    def key_positions(self, t_q: int) -> jax.Array:
        """``[B, size]``: the absolute position each ring slot holds once ``t_q`` tokens were
        written at ``lengths`` (``-1``: never written)."""
        return ring_positions(self.lengths, t_q, self.size)

    def attend(
        self,
        q: jax.Array,
        layer: int,
        *,
        window: int | None = None,
        scale: float | None = None,
        impl: str = "xla",
    ) -> jax.Array:
        """Windowed attention of ``q [B, t_q, Hq, D]`` at ``lengths + [0, t_q)`` over the ring
        (``window + slack`` slots: the cost is the window's, whatever the row's length)."""
        if window is not None and window != self.window:
            raise ValueError(f"window={window} differs from this cache's window={self.window}")
        t_q = q.shape[1]
        if impl == "pallas":
            from pallas_kernels.ragged_attention import ring_attention  # lazy: pallas_kernels imports specjax

            return ring_attention(q, self.k[layer], self.v[layer], self.start, self.lengths, window=self.window,
                                  scale=scale)
        return attention_with_positions(
            q, self.k[layer], self.v[layer], positions(self.lengths, t_q), self.key_positions(t_q), self.start,
            window=self.window, scale=scale,
        )
