"""Ragged additive attention masks.

A row's queries sit at absolute positions ``q_pos [B, t_q]``; its keys at
``key_pos [B, T]`` (``-1`` marks an empty slot). Key ``j`` is visible to query ``q``
iff ``lead_pad <= key_pos[j] <= q_pos[q]`` and, with a window ``W``,
``key_pos[j] > q_pos[q] - W``. Allowed slots add ``0.0``; excluded ones add
``MASK_VALUE`` (finite, so a fully masked row yields no NaN). Dead slots are
excluded here, never by zero-filling K/V. ``MASK_VALUE`` and ``visible`` live with the
kernels (``pallas_kernels.reference``); the additive masks are built from them here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import MASK_VALUE, visible  # the one visibility rule, with the kernels

__all__ = [
    "MASK_VALUE",
    "make_left_padded_causal_mask",
    "make_position_mask",
    "visible",
]

def make_position_mask(
    q_pos: jax.Array, key_pos: jax.Array, lead_pad: jax.Array, window: int | None = None
) -> jax.Array:
    """Additive float32 mask ``[B, 1, t_q, T]`` from absolute query/key positions."""
    ok = visible(q_pos, key_pos, lead_pad, window)
    return jnp.where(ok, 0.0, MASK_VALUE).astype(jnp.float32)[:, None]


def make_left_padded_causal_mask(
    lead_pad: jax.Array, q_start: jax.Array, t_q: int, num_keys: int, window: int | None = None
) -> jax.Array:
    """Additive float32 mask ``[B, 1, t_q, num_keys]`` for a dense per-row layout.

    Query ``q`` of row ``i`` sits at key slot ``q_start[i] + q`` and may attend slot
    ``j`` iff ``lead_pad[i] <= j <= q_start[i] + q`` (and ``j > q_start[i] + q - window``).
    """
    lead_pad = jnp.asarray(lead_pad, jnp.int32)
    q_start = jnp.asarray(q_start, jnp.int32)
    q_pos = q_start[:, None] + jnp.arange(t_q, dtype=jnp.int32)[None]
    key_pos = jnp.broadcast_to(jnp.arange(num_keys, dtype=jnp.int32), (lead_pad.shape[0], num_keys))
    return make_position_mask(q_pos, key_pos, lead_pad, window)
