"""Ragged masked attention: the one reference (kernel oracle, CPU path) and its live-range form.

Shapes: ``q [B, t_q, Hq, D]``, ``k, v [B, T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA).
Query ``i`` of row ``b`` sits at absolute position ``q_pos[b, i]``; key slot ``j``
holds position ``key_pos[b, j]`` (``-1``: empty). Visibility is ``specjax.masks.visible``
(one convention for every cache kind and for the Pallas kernels). Scores and softmax
run in float32 whatever the input dtype; a query with no visible key returns zeros.

Imports run one way: caches and ``pallas_kernels`` import this module, never the reverse.

* ``attention_with_positions`` / ``ragged_attention``: one pass over every slot (the oracle).
* ``live_attention``: the XLA path the model runs. Keys come in blocks read by a callback;
  a ``fori_loop`` with a dynamic trip count visits only blocks that hold a key visible to
  some row of the batch, with an online softmax, so the cost follows the batch's longest
  live row, not the buffer's capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax.masks import MASK_VALUE, visible

__all__ = [
    "attend_visible",
    "attention_with_positions",
    "gather_pages",
    "live_attention",
    "live_block_bounds",
    "masked_attention",
    "ragged_attention",
]


def _check(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4 [B, t, H, D]; got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k{k.shape} v{v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q{q.shape} and k{k.shape} must agree on batch and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")


def _scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """``q [B, t_q, Hq, D]``, ``k [B, T, Hkv, D]`` -> float32 scores ``[B, Hkv, G, t_q, T]``."""
    b, t_q, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t_q, hkv, hq // hkv, d)
    return jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale


def _weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """``p [B, Hkv, G, t_q, T]`` float32, ``v [B, T, Hkv, D]`` -> ``[B, Hkv, G, t_q, D]`` float32."""
    return jnp.einsum("bhgqk,bkhd->bhgqd", p, v, preferred_element_type=jnp.float32)


def _out(o: jax.Array, dtype) -> jax.Array:
    """``[B, Hkv, G, t_q, D]`` -> ``[B, t_q, Hq, D]``."""
    b, hkv, g, t_q, d = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t_q, hkv * g, d).astype(dtype)


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """``softmax(q k^T * scale + mask) v`` with an additive mask ``[B, 1, t_q, T]``."""
    return attend_visible(q, k, v, mask[:, 0] > 0.5 * MASK_VALUE, scale)


def attend_visible(q: jax.Array, k: jax.Array, v: jax.Array, ok: jax.Array, scale: float | None = None) -> jax.Array:
    """The core: one pass where boolean ``ok [B, t_q, T]`` (or broadcastable, e.g. ``[1, T, T]``
    for plain causal training) says which keys each query sees."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = _scores(q.astype(jnp.float32), k.astype(jnp.float32), scale)
    ok = ok[:, None, None]  # over (kv head, group)
    s = jnp.where(ok, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(ok, jnp.exp(s - m), 0.0)  # a query with no visible key: all zeros
    denom = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return _out(_weighted_values(p / denom, v.astype(jnp.float32)), q.dtype)


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
    """The reference: slot ``j`` of row ``b`` holds absolute position ``key_pos[b, j]``."""
    return attend_visible(q, k, v, visible(q_pos, key_pos, lead_pad, window), scale)


def ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lead_pad: jax.Array,
    q_start: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Dense per-row layout (the kernels' oracle): query ``t`` of row ``b`` sits at slot
    ``q_start[b] + t`` and sees slots ``[lead_pad[b], q_start[b] + t]`` (within ``window``)."""
    _check(q, k, v)
    b, t_q = q.shape[:2]
    t = k.shape[1]
    q_pos = jnp.asarray(q_start, jnp.int32)[:, None] + jnp.arange(t_q, dtype=jnp.int32)
    key_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return attention_with_positions(q, k, v, q_pos, key_pos, jnp.asarray(lead_pad, jnp.int32), window=window,
                                    scale=scale)


def gather_pages(
    k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's pool ``[num_pages, page_size, Hkv, D]`` read through ``block_table [B, M]``:
    contiguous ``k, v [B, M * page_size, Hkv, D]`` and ``key_pos [B, M * page_size]``
    (``-1`` where the row owns no page; those slots read page 0 and must stay masked)."""
    bt = jnp.asarray(block_table, jnp.int32)
    safe = jnp.where(bt >= 0, bt, 0)
    b, mp = bt.shape
    ps = k_pages.shape[1]
    k = k_pages[safe].reshape(b, mp * ps, *k_pages.shape[2:])
    v = v_pages[safe].reshape(b, mp * ps, *v_pages.shape[2:])
    pos = jnp.arange(mp * ps, dtype=jnp.int32).reshape(mp, ps)[None]
    key_pos = jnp.where((bt >= 0)[:, :, None], pos, -1).reshape(b, mp * ps)
    return k, v, key_pos


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
) -> jax.Array:
    """Attention over key blocks ``[first, stop)`` of ``live_block_bounds`` only.

    ``read_block(j) -> (k, v [B, block, Hkv, D], key_pos [B, block])`` reads key block
    ``j`` (slots ``j * block ..``, holding positions ``key_pos``; ``-1`` = empty). With
    one block there is no loop (one fused pass); otherwise a ``fori_loop`` with a dynamic
    trip count and an online softmax, float32 accumulation.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, t_q, hq, d = q.shape
    if num_blocks == 1:
        k, v, key_pos = read_block(jnp.int32(0))
        return attend_visible(q, k, v, visible(q_pos, key_pos, lead_pad, window), scale)
    first, stop = live_block_bounds(q_pos, lead_pad, window, block, num_blocks)
    q32 = q.astype(jnp.float32)

    def body(j, carry):
        m_prev, l_prev, acc_prev = carry
        k, v, key_pos = read_block(j)
        ok = visible(q_pos, key_pos, lead_pad, window)[:, None, None]  # [B, 1, 1, t_q, block]
        s = jnp.where(ok, _scores(q32, k.astype(jnp.float32), scale), MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)
        acc_new = alpha * acc_prev + _weighted_values(p, v.astype(jnp.float32))
        return m_new, l_new, acc_new

    probe_k = jax.eval_shape(read_block, jnp.int32(0))[0]
    hkv = probe_k.shape[2]
    g = hq // hkv
    init = (
        jnp.full((b, hkv, g, t_q, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((b, hkv, g, t_q, 1), jnp.float32),
        jnp.zeros((b, hkv, g, t_q, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first, stop, body, init)
    o = jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0)
    return _out(o, q.dtype)

