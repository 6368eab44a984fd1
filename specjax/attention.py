"""Ragged masked attention: the one reference (kernel oracle, CPU path) and its live-range form.

Shapes: ``q [B, t_q, Hq, D]``, ``k, v [B, Hkv, T, D]`` with ``Hq % Hkv == 0`` (GQA).
K/V are head-major everywhere (caches, kernels, references): with the batch and head
axes leading, XLA's batched dot reads the cache as stored; a ``[B, T, Hkv, D]`` cache
made XLA:CPU transpose the whole cache in every layer (measured in the README).
Query ``i`` of row ``b`` sits at absolute position ``q_pos[b, i]``; key slot ``j``
holds position ``key_pos[b, j]`` (``-1``: empty). Visibility is ``specjax.masks.visible``
(one convention for every cache kind and for the Pallas kernels). Scores and softmax
run in float32 whatever the input dtype; a query with no visible key returns zeros; a
non-finite value (a model's NaN in a padding slot) is dropped, never multiplied by a zero weight.

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
    "ring_positions",
]


def _check(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q [B, t, Hq, D], k, v [B, Hkv, T, D] must be rank 4; got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k{k.shape} v{v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q{q.shape} and k{k.shape} must agree on batch and head_dim")
    if q.shape[2] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[1]}")


def _group(q: jax.Array, hkv: int) -> jax.Array:
    """``q [B, t_q, Hq, D]`` -> ``[B, Hkv, G * t_q, D]``: row ``g * t_q + t`` is query ``t`` of
    head ``h * G + g``, so each KV head's keys are read once for its whole group."""
    b, t_q, hq, d = q.shape
    groups = hq // hkv
    return q.reshape(b, t_q, hkv, groups, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, groups * t_q, d)


def _scores(qg: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """``qg [B, Hkv, R, D]``, ``k [B, Hkv, T, D]`` -> float32 scores, key-major ``[B, Hkv, T, R]``.

    Key-major because XLA:CPU runs ``K @ q^T`` (a tall matrix times a few columns) about
    3x faster than ``q @ K^T`` for the few queries of a decode window (README)."""
    return jnp.einsum("bhkd,bhqd->bhkq", k, qg, preferred_element_type=jnp.float32) * scale


def _weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """``p [B, Hkv, T, R]`` (key-major) float32, ``v [B, Hkv, T, D]`` -> ``[B, Hkv, R, D]`` float32."""
    return jnp.einsum("bhqk,bhkd->bhqd", p.swapaxes(2, 3), v, preferred_element_type=jnp.float32)


def _finite_values(v: jax.Array) -> jax.Array:
    """``v`` as float32 with non-finite entries set to zero. A masked slot may hold anything (a
    model's NaN at a padding position, which the padding queries after it do see), and its
    zero weight would not hide it (``0 * NaN`` is NaN). A real NaN still shows: the token that
    made it carries NaN in its own hidden state (and a NaN key it makes is a NaN score)."""
    v = v.astype(jnp.float32)
    return jnp.where(jnp.isfinite(v), v, 0.0)


def _group_mask(ok: jax.Array, groups: int) -> jax.Array:
    """Visibility ``[B, t_q, T]`` -> key-major ``[B, 1, T, G * t_q]`` in ``_group``'s row order."""
    return jnp.tile(ok[:, None], (1, 1, groups, 1)).swapaxes(2, 3)


def _out(o: jax.Array, t_q: int, dtype) -> jax.Array:
    """``[B, Hkv, G * t_q, D]`` -> ``[B, t_q, Hq, D]``."""
    b, hkv, r, d = o.shape
    groups = r // t_q
    return o.reshape(b, hkv, groups, t_q, d).transpose(0, 3, 1, 2, 4).reshape(b, t_q, hkv * groups, d).astype(dtype)


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """``softmax(q k^T * scale + mask) v`` with an additive mask ``[B, 1, t_q, T]``."""
    return attend_visible(q, k, v, mask[:, 0] > 0.5 * MASK_VALUE, scale)


def attend_visible(q: jax.Array, k: jax.Array, v: jax.Array, ok: jax.Array, scale: float | None = None) -> jax.Array:
    """The core: one pass where boolean ``ok [B, t_q, T]`` (or broadcastable, e.g. ``[1, T, T]``
    for plain causal training) says which keys each query sees. ``k, v [B, Hkv, T, D]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    hkv, t_q = k.shape[1], q.shape[1]
    s = _scores(_group(q.astype(jnp.float32), hkv), k.astype(jnp.float32), scale)
    ok = _group_mask(ok, q.shape[2] // hkv)
    s = jnp.where(ok, s, MASK_VALUE)
    m = jnp.max(s, axis=2, keepdims=True)  # over keys
    p = jnp.where(ok, jnp.exp(s - m), 0.0)  # a query with no visible key: all zeros
    denom = jnp.maximum(jnp.sum(p, axis=2, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return _out(_weighted_values(p / denom, _finite_values(v)), t_q, q.dtype)


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
    t = k.shape[2]
    q_pos = jnp.asarray(q_start, jnp.int32)[:, None] + jnp.arange(t_q, dtype=jnp.int32)
    key_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return attention_with_positions(q, k, v, q_pos, key_pos, jnp.asarray(lead_pad, jnp.int32), window=window,
                                    scale=scale)


def gather_pages(
    k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array, first_page: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's pool ``[num_pages, Hkv, page_size, D]`` (or every layer's
    ``[L, num_pages, ...]`` and ``layer``: one gather reads that layer's pages only) read through
    ``block_table [B, M]`` (the row's logical pages ``first_page .. first_page + M - 1``):
    contiguous ``k, v [B, Hkv, M * page_size, D]`` and ``key_pos [B, M * page_size]`` (``-1``
    where the row owns no page; those slots read page 0 and must stay masked)."""
    bt = jnp.asarray(block_table, jnp.int32)
    safe = jnp.where(bt >= 0, bt, 0)
    b, mp = bt.shape
    hkv, ps, d = k_pages.shape[-3:]
    take = (lambda x: x[safe]) if layer is None else (lambda x: x[layer, safe])  # noqa: E731  [B, M, Hkv, ps, D]
    k = take(k_pages).transpose(0, 2, 1, 3, 4).reshape(b, hkv, mp * ps, d)
    v = take(v_pages).transpose(0, 2, 1, 3, 4).reshape(b, hkv, mp * ps, d)
    pos = first_page * ps + jnp.arange(mp * ps, dtype=jnp.int32).reshape(mp, ps)[None]
    key_pos = jnp.where((bt >= 0)[:, :, None], pos, -1).reshape(b, mp * ps)
    return k, v, key_pos


def ring_positions(lengths: jax.Array, t_q: int, size: int) -> jax.Array:
    """``[B, size]``: the absolute position each slot of a per-row ring of ``size`` slots holds
    once ``t_q`` tokens were written at ``lengths`` (``-1``: never written)."""
    hi = (jnp.asarray(lengths, jnp.int32) + t_q - 1)[:, None]
    s = jnp.arange(size, dtype=jnp.int32)[None]
    p = hi - jnp.mod(hi - s, size)
    return jnp.where(p >= 0, p, -1)


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

    ``read_block(j) -> (k, v [B, Hkv, block, D], key_pos [B, block])`` reads key block
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
    hkv = jax.eval_shape(read_block, jnp.int32(0))[0].shape[1]
    g = hq // hkv
    qg = _group(q.astype(jnp.float32), hkv)

    def body(j, carry):
        m_prev, l_prev, acc_prev = carry  # m, l [B, Hkv, 1, R] (key-major), acc [B, Hkv, R, D]
        k, v, key_pos = read_block(j)
        ok = _group_mask(visible(q_pos, key_pos, lead_pad, window), g)  # [B, 1, block, G * t_q]
        s = jnp.where(ok, _scores(qg, k.astype(jnp.float32), scale), MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=2, keepdims=True))
        p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + jnp.sum(p, axis=2, keepdims=True)
        acc_new = alpha.swapaxes(2, 3) * acc_prev + _weighted_values(p, _finite_values(v))
        return m_new, l_new, acc_new

    init = (
        jnp.full((b, hkv, 1, g * t_q), MASK_VALUE, jnp.float32),
        jnp.zeros((b, hkv, 1, g * t_q), jnp.float32),
        jnp.zeros((b, hkv, g * t_q, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first, stop, body, init)
    denom = denom.swapaxes(2, 3)
    o = jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0)
    return _out(o, t_q, q.dtype)

