"""The attention every kernel computes, in plain JAX: visibility, one masked pass, slot positions.

This module depends on JAX only; the kernels beside it and specjax (its caches, its XLA path
``specjax.attention``, the model) import it, never the reverse.

Visibility (one convention for every cache kind and kernel): query ``q`` of row ``b`` sits at
absolute position ``q_pos[b, q]``; key slot ``j`` holds position ``key_pos[b, j]`` (``-1``:
empty). The key is visible iff ``lead_pad[b] <= key_pos <= q_pos`` and, with a window ``W``,
``key_pos > q_pos - W``. Excluded keys get ``MASK_VALUE`` (finite: a fully masked query gives
no NaN, and returns zeros). Dead slots are excluded by the mask, never by zero-filling K/V.

Shapes: ``q [B, t_q, Hq, D]``, ``k, v [B, Hkv, T, D]`` (head-major, as the caches store them)
with ``Hq % Hkv == 0`` (GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``). Scores and
softmax run in float32 whatever the input dtype, scaled by ``scale`` (default ``D ** -0.5``).
A non-finite value in V (a model's NaN at a padding slot, seen by the padding queries after
it) is dropped, never multiplied by a zero weight (``0 * NaN`` is NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "online_softmax_step",
    "MASK_VALUE",
    "TreeMask",
    "attend_visible",
    "attention_with_positions",
    "check_shapes",
    "dense_reference",
    "finite_values",
    "finite_weighted_values",
    "gather_pages",
    "group_mask",
    "key_major_scores",
    "paged_reference",
    "ring_positions",
    "ring_reference",
    "stack_groups",
    "tree_mask_visible",
    "unstack_groups",
    "visible",
    "weighted_values",
]

MASK_VALUE = -1e30  # finite large negative: exp() underflows to exactly 0


def visible(q_pos: jax.Array, key_pos: jax.Array, lead_pad: jax.Array, window: int | None = None) -> jax.Array:
    """Boolean ``[B, t_q, T]``: may query ``q`` of row ``b`` (at ``q_pos [B, t_q]``) read key
    slot ``j`` (holding ``key_pos [B, T]``)."""
    kp = key_pos[:, None, :]
    qp = q_pos[:, :, None]
    ok = (kp >= lead_pad[:, None, None]) & (kp <= qp) & (kp >= 0)
    if window is not None:
        ok &= kp > qp - window
    return ok


class TreeMask(NamedTuple):
    """A token tree in a verify window: ``N`` nodes written at slots ``start .. start + N - 1``
    of each row (window order), each node running at its own position (its place on its
    branch). A query reads the committed prefix (slots before ``start``) by the usual rule at its
    tree position, and a window node only where ``anc`` allows (itself and its ancestors: never
    a sibling's branch). A chain (``anc`` lower-triangular, positions ``start + j``) is exactly
    the causal mask."""

    start: jax.Array  # int32 [B]: the window's first slot (the committed length)
    anc: jax.Array  # bool [B, t_q, N]: query i may read window node j
    q_pos: jax.Array  # int32 [B, t_q]: the queries' positions
    node_pos: jax.Array  # int32 [B, N]: the window nodes' positions


def tree_mask_visible(key_slot: jax.Array, key_pos: jax.Array, lead_pad: jax.Array, tree: TreeMask,
                      window: int | None = None) -> jax.Array:
    """Boolean ``[B, t_q, T]`` under a ``TreeMask``: key ``j`` sits at slot ``key_slot [B, T]``
    and holds ``key_pos [B, T]`` (``-1``: empty). Slots before ``tree.start`` by ``visible`` at the
    queries' tree positions; window slots by ``tree.anc`` (and, with a window ``W``, only nodes
    less than ``W`` positions up the branch); nothing past the window."""
    n = tree.anc.shape[2]
    prefix = visible(tree.q_pos, key_pos, lead_pad, window) & (key_slot < tree.start[:, None])[:, None, :]
    j = key_slot - tree.start[:, None]  # [B, T]: the window node a slot holds
    jc = jnp.clip(j, 0, n - 1)
    own = jnp.take_along_axis(tree.anc, jnp.broadcast_to(jc[:, None, :], (*tree.anc.shape[:2], jc.shape[1])), axis=2)
    own &= ((j >= 0) & (j < n))[:, None, :]
    if window is not None:
        node = jnp.take_along_axis(tree.node_pos, jc, axis=1)
        own &= tree.q_pos[:, :, None] - node[:, None, :] < window
    return prefix | own


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q [B, t, Hq, D], k, v [B, Hkv, T, D] must be rank 4; got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k{k.shape} v{v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q{q.shape} and k{k.shape} must agree on batch and head_dim")
    if q.shape[2] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[1]}")


def stack_groups(q: jax.Array, hkv: int) -> jax.Array:
    """``q [B, t_q, Hq, D]`` -> ``[B, Hkv, G * t_q, D]``: row ``g * t_q + t`` is query ``t`` of
    head ``h * G + g``, so each KV head's keys are read once for its whole group."""
    b, t_q, hq, d = q.shape
    groups = hq // hkv
    return q.reshape(b, t_q, hkv, groups, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, groups * t_q, d)


def unstack_groups(o: jax.Array, t_q: int, dtype) -> jax.Array:
    """``stack_groups``' inverse: ``[B, Hkv, G * t_q, D]`` -> ``[B, t_q, Hq, D]`` in ``dtype``."""
    b, hkv, r, d = o.shape
    groups = r // t_q
    return o.reshape(b, hkv, groups, t_q, d).transpose(0, 3, 1, 2, 4).reshape(b, t_q, hkv * groups, d).astype(dtype)


def key_major_scores(qg: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """``qg [B, Hkv, R, D]``, ``k [B, Hkv, T, D]`` -> float32 scores, key-major ``[B, Hkv, T, R]``.

    Key-major because XLA:CPU runs ``K @ q^T`` (a tall matrix times a few columns) about
    3x faster than ``q @ K^T`` for the few queries of a decode window."""
    return jnp.einsum("bhkd,bhqd->bhkq", k, qg, preferred_element_type=jnp.float32) * scale


def weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """``p [B, Hkv, T, R]`` (key-major) float32, ``v [B, Hkv, T, D]`` -> ``[B, Hkv, R, D]`` float32."""
    return jnp.einsum("bhqk,bhkd->bhqd", p.swapaxes(2, 3), v, preferred_element_type=jnp.float32)


def group_mask(ok: jax.Array, groups: int) -> jax.Array:
    """Visibility ``[B, t_q, T]`` -> key-major ``[B, 1, T, G * t_q]`` in ``stack_groups``' row order."""
    return jnp.tile(ok[:, None], (1, 1, groups, 1)).swapaxes(2, 3)


def finite_values(v: jax.Array) -> jax.Array:
    """``v`` as float32 with non-finite entries set to zero. A masked slot may hold anything,
    and its zero weight would not hide it (``0 * NaN`` is NaN). A real NaN still shows: the
    token that made it carries NaN in its own hidden state (and a NaN key it makes is a NaN score)."""
    v = v.astype(jnp.float32)
    return jnp.where(jnp.isfinite(v), v, 0.0)


def finite_weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """``weighted_values(p, finite_values(v))`` without a copy of ``v`` in the common case:
    ``p @ v`` as it is, and only where that is not finite (a non-finite value somewhere in
    ``v``) again over ``finite_values(v)``. The sanitized copy is ``v``-sized (a whole cache
    block per layer per step, in XLA:CPU's unfused form), so it runs only when needed."""
    out = weighted_values(p, v)
    return jax.lax.cond(jnp.all(jnp.isfinite(out)), lambda: out, lambda: weighted_values(p, finite_values(v)))


def online_softmax_step(m_prev: jax.Array, l_prev: jax.Array, s: jax.Array, ok: jax.Array,
                        axis: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One block of the online softmax, the one recurrence every blocked attention path runs
    (the kernels' ``block_update``, query-major; the model's ``live_attention``, key-major):
    scores ``s`` of one key block, keys along ``axis``, visible where ``ok``; the running max
    ``m_prev`` and sum ``l_prev`` (keepdims along ``axis``). Returns ``(m_new, l_new, p,
    alpha)``: the caller's accumulator becomes ``alpha * acc + p @ v``."""
    s = jnp.where(ok, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=axis, keepdims=True))
    p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    return m_new, alpha * l_prev + jnp.sum(p, axis=axis, keepdims=True), p, alpha


def attend_visible(q: jax.Array, k: jax.Array, v: jax.Array, ok: jax.Array, scale: float | None = None) -> jax.Array:
    """The core: one pass where boolean ``ok [B, t_q, T]`` (or broadcastable, e.g. ``[1, T, T]``
    for plain causal training) says which keys each query sees. ``k, v [B, Hkv, T, D]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    hkv, t_q = k.shape[1], q.shape[1]
    s = key_major_scores(stack_groups(q.astype(jnp.float32), hkv), k.astype(jnp.float32), scale)
    ok = group_mask(ok, q.shape[2] // hkv)
    s = jnp.where(ok, s, MASK_VALUE)
    m = jnp.max(s, axis=2, keepdims=True)  # over keys
    p = jnp.where(ok, jnp.exp(s - m), 0.0)  # a query with no visible key: all zeros
    denom = jnp.maximum(jnp.sum(p, axis=2, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return unstack_groups(finite_weighted_values(p / denom, v), t_q, q.dtype)


def attention_with_positions(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, key_pos: jax.Array,
                             lead_pad: jax.Array, *, window: int | None = None,
                             scale: float | None = None) -> jax.Array:
    """Slot ``j`` of row ``b`` holds absolute position ``key_pos[b, j]``; query ``t`` sits at ``q_pos[b, t]``."""
    return attend_visible(q, k, v, visible(q_pos, key_pos, lead_pad, window), scale)


def dense_reference(q: jax.Array, k: jax.Array, v: jax.Array, lead_pad: jax.Array, q_start: jax.Array, *,
                    window: int | None = None, scale: float | None = None,
                    tree: TreeMask | None = None) -> jax.Array:
    """Dense per-row layout: query ``t`` of row ``b`` sits at slot ``q_start[b] + t`` and sees
    slots ``[lead_pad[b], q_start[b] + t]`` (within ``window``); slot ``s`` holds position ``s``.
    ``tree``: the queries are token-tree nodes (``tree_mask_visible``)."""
    check_shapes(q, k, v)
    b, t_q = q.shape[:2]
    t = k.shape[2]
    key_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    lead = jnp.asarray(lead_pad, jnp.int32)
    if tree is not None:
        return attend_visible(q, k, v, tree_mask_visible(key_pos, key_pos, lead, tree, window), scale)
    q_pos = jnp.asarray(q_start, jnp.int32)[:, None] + jnp.arange(t_q, dtype=jnp.int32)
    return attention_with_positions(q, k, v, q_pos, key_pos, lead, window=window, scale=scale)


def ring_positions(lengths: jax.Array, t_q: int, size: int) -> jax.Array:
    """``[B, size]``: the absolute position each slot of a per-row ring of ``size`` slots holds
    once ``t_q`` tokens were written at ``lengths`` (``-1``: never written)."""
    hi = (jnp.asarray(lengths, jnp.int32) + t_q - 1)[:, None]
    s = jnp.arange(size, dtype=jnp.int32)[None]
    p = hi - jnp.mod(hi - s, size)
    return jnp.where(p >= 0, p, -1)


def ring_reference(q: jax.Array, k: jax.Array, v: jax.Array, lead_pad: jax.Array, lengths: jax.Array, *,
                   window: int, scale: float | None = None, tree: TreeMask | None = None) -> jax.Array:
    """A per-row ring of ``T`` slots (the rolling cache) whose newest queries sit at
    ``lengths + [0, t_q)``: every slot's position, then one masked pass. ``tree``: the queries
    are token-tree nodes (``tree_mask_visible``, a slot read as the position it holds)."""
    t_q = q.shape[1]
    if tree is not None:
        slot = ring_positions(lengths, t_q, k.shape[2])
        ok = tree_mask_visible(slot, slot, jnp.asarray(lead_pad, jnp.int32), tree, window)
        return attend_visible(q, k, v, ok, scale)
    q_pos = jnp.asarray(lengths, jnp.int32)[:, None] + jnp.arange(t_q, dtype=jnp.int32)
    key_pos = ring_positions(lengths, t_q, k.shape[2])
    return attention_with_positions(q, k, v, q_pos, key_pos, jnp.asarray(lead_pad, jnp.int32), window=window,
                                    scale=scale)


def gather_pages(k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array, first_page: jax.Array | int = 0,
                 layer: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
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


def paged_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array,
                    lead_pad: jax.Array, q_start: jax.Array, *, window: int | None = None,
                    scale: float | None = None, tree: TreeMask | None = None) -> jax.Array:
    """Each row's pages gathered into a contiguous ``[B, Hkv, max_pages * page, D]``, then the
    dense reference."""
    k, v, _ = gather_pages(k_pages, v_pages, block_table)
    return dense_reference(q, k, v, lead_pad, q_start, window=window, scale=scale, tree=tree)
