"""Ragged masked attention: the live-range XLA path the model runs, over the one reference.

The reference (visibility, one masked pass, slot positions) lives with the kernels it is the
oracle of, in ``pallas_kernels.reference`` (JAX only); this module re-exports it:
``attend_visible``, ``attention_with_positions``, ``reference_attention`` (the dense layout),
``gather_pages``, ``ring_positions``. Shapes: ``q [B, t_q, Hq, D]``, ``k, v [B, Hkv, T, D]``
(head-major everywhere: with the batch and head axes leading, XLA's batched dot reads the cache
as stored; a ``[B, T, Hkv, D]`` cache made XLA:CPU transpose the whole cache in every layer).

* ``live_attention``: keys come in blocks read by a callback; a ``fori_loop`` with a dynamic
  trip count visits only blocks that hold a key visible to some row of the batch, with an
  online softmax, so the cost follows the batch's longest live row, not the buffer's capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.reference import (
    MASK_VALUE,
    TreeMask,
    attend_visible,
    attention_with_positions,
    finite_weighted_values,
    gather_pages,
    group_mask,
    key_major_scores,
    online_softmax_step,
    ring_positions,
    stack_groups,
    tree_mask_visible,
    unstack_groups,
    visible,
)
from pallas_kernels.reference import (
    dense_reference as reference_attention,  # the dense layout: the kernels' oracle
)

__all__ = [
    "attend_visible",
    "attention_with_positions",
    "gather_pages",
    "live_attention",
    "live_block_bounds",
    "masked_attention",
    "reference_attention",
    "ring_positions",
    "TreeMask",
]


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """``softmax(q k^T * scale + mask) v`` with an additive mask ``[B, 1, t_q, T]``."""
    return attend_visible(q, k, v, mask[:, 0] > 0.5 * MASK_VALUE, scale)


# ----------------------------------------------------------------------------- live range


def live_block_bounds(
    q_pos: jax.Array, lead_pad: jax.Array, window: int | None, block: int, num_blocks: int
) -> tuple[jax.Array, jax.Array]:
    """``(first, last + 1)`` key blocks (in the dense position layout: slot == position) that
    hold any key visible to any query of the batch. Scalars; ``first >= last + 1`` when none."""
    hi = jnp.max(q_pos)  # the batch's last query position: nothing past it is visible
    lo = lead_pad if window is None else jnp.maximum(lead_pad, q_pos[:, 0] - window + 1)
    lo = jnp.maximum(jnp.min(lo), 0)
    first = jnp.minimum(lo // block, num_blocks)
    stop = jnp.clip(hi // block + 1, first, num_blocks)
    return first, stop


BlockReader = Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def live_attention(
    q: jax.Array,
    read_block: BlockReader,
    q_pos: jax.Array,
    lead_pad: jax.Array,
    *,
    block: int,
    num_blocks: int,
    window: int | None = None,
    scale: float | None = None,
    tree: TreeMask | None = None,
) -> jax.Array:
    """Attention over key blocks ``[first, stop)`` of ``live_block_bounds`` only.

    ``read_block(j) -> (k, v [B, Hkv, block, D], key_pos [B, block])`` reads key block
    ``j`` (slots ``j * block ..``, holding positions ``key_pos``; ``-1`` = empty). With
    one block there is no loop (one fused pass); otherwise a ``fori_loop`` with a dynamic
    trip count and an online softmax, float32 accumulation. ``q_pos``: the queries' slots.

    ``tree``: the queries are nodes of a token tree (``TreeMask``) and ``key_pos`` names each
    key's slot (the dense position layout of the dense and paged caches).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, t_q, hq, d = q.shape

    def mask(key_pos):
        if tree is None:
            return visible(q_pos, key_pos, lead_pad, window)
        return tree_mask_visible(key_pos, key_pos, lead_pad, tree, window)

    if num_blocks == 1:
        k, v, key_pos = read_block(jnp.int32(0))
        return attend_visible(q, k, v, mask(key_pos), scale)
    first, stop = live_block_bounds(q_pos, lead_pad, window, block, num_blocks)
    if tree is not None:  # a node's position may lie below its slot: the window's reach starts there
        first = jnp.minimum(first, live_block_bounds(tree.q_pos, lead_pad, window, block, num_blocks)[0])
    hkv = jax.eval_shape(read_block, jnp.int32(0))[0].shape[1]
    g = hq // hkv
    qg = stack_groups(q.astype(jnp.float32), hkv)

    def body(j, carry):
        m_prev, l_prev, acc_prev = carry  # m, l [B, Hkv, 1, R] (key-major), acc [B, Hkv, R, D]
        k, v, key_pos = read_block(j)
        ok = group_mask(mask(key_pos), g)  # [B, 1, block, G * t_q]
        s = key_major_scores(qg, k.astype(jnp.float32), scale)
        m_new, l_new, p, alpha = online_softmax_step(m_prev, l_prev, s, ok, axis=2)
        acc_new = alpha.swapaxes(2, 3) * acc_prev + finite_weighted_values(p, v)
        return m_new, l_new, acc_new

    init = (
        jnp.full((b, hkv, 1, g * t_q), MASK_VALUE, jnp.float32),
        jnp.zeros((b, hkv, 1, g * t_q), jnp.float32),
        jnp.zeros((b, hkv, g * t_q, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first, stop, body, init)
    denom = denom.swapaxes(2, 3)
    o = jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0)
    return unstack_groups(o, t_q, q.dtype)

