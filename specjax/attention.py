"""Ragged masked attention: the XLA reference path (CPU fast path, kernel oracle).

Shapes: ``q [B, t_q, Hq, D]``, ``k, v [B, T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA).
Scores and softmax run in float32 whatever the input dtype; a query with no
visible key returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.masks import MASK_VALUE, make_position_mask

__all__ = ["IMPLS", "attention_with_positions", "masked_attention", "ragged_attention"]

IMPLS = ("xla", "pallas", "auto")


def _check(q: jax.Array, k: jax.Array, v: jax.Array, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4 [B, t, H, D]; got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k{k.shape} v{v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q{q.shape} and k{k.shape} must agree on batch and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """``softmax(q k^T * scale + mask) v`` with an additive mask ``[B, 1, t_q, T]``."""
    b, t_q, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, t_q, hkv, g, d).astype(jnp.float32)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) * scale
    s = s + mask[:, :, None]  # [B, 1, 1, t_q, T] over (kv head, group)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    # a query with no visible key: every score equals the mask value, zero it out
    live = jnp.any(mask[:, :, None] > 0.5 * MASK_VALUE, axis=-1, keepdims=True)
    p = jnp.where(live, p, 0.0)
    denom = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / denom, v.astype(jnp.float32))
    return o.reshape(b, t_q, hq, d).astype(q.dtype)


def attention_with_positions(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    key_pos: jax.Array,
    lead_pad: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Attention where slot ``j`` of row ``b`` holds absolute position ``key_pos[b, j]``.

    Used by the rolling (ring) and paged (gathered) caches.
    """
    return masked_attention(q, k, v, make_position_mask(q_pos, key_pos, lead_pad, window), scale=scale)


def ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lead_pad: jax.Array,
    q_start: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Dense per-row layout: query ``t`` of row ``b`` sits at slot ``q_start[b] + t`` and
    sees slots ``[lead_pad[b], q_start[b] + t]`` (within ``window`` if given).

    ``impl``: ``"xla"`` (this reference), ``"pallas"`` (``pallas_kernels.ragged_attention``;
    interpret mode on CPU) or ``"auto"`` (Pallas on TPU/GPU, XLA on CPU).
    """
    _check(q, k, v, impl)
    if impl == "auto":
        impl = "xla" if jax.default_backend() == "cpu" else "pallas"
    if impl == "pallas":
        from pallas_kernels.ragged_attention import ragged_attention as pallas_ragged_attention

        t = k.shape[1]
        block_k = next(bk for bk in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if t % bk == 0)
        return pallas_ragged_attention(q, k, v, lead_pad, q_start, window=window, scale=scale, block_k=block_k)
    b, t_q = q.shape[:2]
    t = k.shape[1]
    q_pos = jnp.asarray(q_start, jnp.int32)[:, None] + jnp.arange(t_q, dtype=jnp.int32)
    key_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return attention_with_positions(
        q, k, v, q_pos, key_pos, jnp.asarray(lead_pad, jnp.int32), window=window, scale=scale
    )
