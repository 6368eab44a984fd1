"""Shared pieces of the ragged attention kernels: live-block bounds and one
online-softmax update over a KV block, for all query heads of every KV head group.

Query rows of one KV head ``h`` are stacked as ``[G * t_q, D]`` (row ``r`` is query
token ``r % t_q`` of head ``h * G + r // t_q``) so each K/V block is read once per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import MASK_VALUE, online_softmax_step

__all__ = ["MASK_VALUE", "block_update", "finalize", "group_queries", "init_carry", "key_positions",
           "live_block_range", "query_rows", "stack_query_rows", "stack_tree_rows", "unstack_query_rows"]


def target_platform() -> str:
    """The platform programs are built for: the default device's (``jax_default_device``, which a
    compile-only TPU client sets while ``jax.default_backend()`` stays ``"cpu"``), else jax's
    default backend. Picks the kernel body and interpret mode."""
    dev = jax.config.jax_default_device
    if dev is None:
        return jax.default_backend()
    return dev if isinstance(dev, str) else dev.platform


def live_block_range(
    lead: jax.Array, q_start: jax.Array, t_q: int, window: int | None, block: int, num_keys: int, xp=jnp
) -> tuple[jax.Array, jax.Array]:
    """``(first, last)`` KV block indices that hold any key visible to this row's queries
    (``first > last`` when none). Blocks outside are skipped: no compute, no new copy.
    ``xp=numpy``: on host integers (a check outside any trace, no device op)."""
    hi = xp.minimum(q_start + t_q - 1, num_keys - 1)
    lo = lead if window is None else xp.maximum(lead, q_start - window + 1)
    lo = xp.maximum(lo, 0)
    return lo // block, xp.where(hi >= lo, hi // block, lo // block - 1)


def key_positions(j: jax.Array, block: int, q_start: jax.Array, t_q: int, ring: int | None) -> jax.Array:
    """Absolute positions ``[block]`` held by key block ``j``. Dense and paged layouts: slot
    ``s`` holds position ``s``. A ring of ``ring`` slots whose newest query sits at
    ``q_start + t_q - 1``: slot ``s`` holds ``hi - (hi - s) mod ring`` (``-1``: never written)."""
    s = j * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    if ring is None:
        return s
    hi = q_start + t_q - 1
    p = hi - jax.lax.rem(jax.lax.rem(hi - s, ring) + ring, ring)
    return jnp.where(p >= 0, p, -1)


def group_queries(q: jax.Array, h: int, groups: int) -> jax.Array:
    """``q [t_q, Hq, D]`` -> ``[G * t_q, D]`` for KV head ``h``."""
    return jnp.concatenate([q[:, h * groups + g, :] for g in range(groups)], axis=0)


def query_rows(t_q: int, groups: int) -> int:
    """Rows of one KV head's query block in the loop body: ``G * t_q`` rounded up to a power
    of two, at least 16 (Triton tiles: every loaded block a power of two, a dot's M >= 16)."""
    return max(16, 1 << (groups * t_q - 1).bit_length())


def stack_query_rows(q: jax.Array, hkv: int, rows: int) -> jax.Array:
    """``q [B, t_q, Hq, D]`` -> ``[B, Hkv, rows, D]``: KV head ``h``'s ``group_queries`` rows
    (row ``g * t_q + t``), zero-padded to ``rows``. Done outside the kernel, so its body reads
    one 2-D block per KV head and slices no values (Triton lowers no value slice)."""
    b, t_q, hq, d = q.shape
    g = hq // hkv
    x = q.reshape(b, t_q, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t_q, d)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - g * t_q), (0, 0)))


def stack_tree_rows(anc: jax.Array, groups: int, rows: int) -> jax.Array:
    """A tree's ``anc [B, t_q, N]`` as float32 ``[B, rows, N']`` in ``stack_query_rows``' row
    order (row ``g * t_q + t`` is query ``t``'s, for every KV head: they share it), zero-padded
    to ``rows`` and to ``N'``, a power of two >= 16 (Triton tiles)."""
    b, t_q, n = anc.shape
    x = jnp.concatenate([anc.astype(jnp.float32)] * groups, axis=1)
    cols = max(16, 1 << (n - 1).bit_length())
    return jnp.pad(x, ((0, 0), (0, rows - groups * t_q), (0, cols - n)))


def unstack_query_rows(o: jax.Array, t_q: int, hq: int) -> jax.Array:
    """``stack_query_rows``' inverse: ``o [B, Hkv, rows, D]`` -> ``[B, t_q, Hq, D]`` (padding dropped)."""
    b, hkv, _, d = o.shape
    g = hq // hkv
    return o[:, :, : g * t_q].reshape(b, hkv, g, t_q, d).transpose(0, 3, 1, 2, 4).reshape(b, t_q, hq, d)


def block_update(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    qg: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_pos: jax.Array,
    q_start: jax.Array,
    lead: jax.Array,
    t_q: int,
    window: int | None,
    scale: float,
    tree: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash step. ``carry = (m [R, 1], l [R, 1], acc [R, D])`` float32, ``qg [R, D]``,
    ``k, v [bk, D]``, ``key_pos [bk]`` absolute positions (``-1`` = empty slot).

    ``tree = (start, anc [R, N])``: the queries are token-tree nodes (``reference.TreeMask``):
    a key before slot ``start`` by the usual rule at the query's branch position (``start`` plus
    its window ancestors, itself excluded: ``sum(anc[r]) - 1``; with a ``window``, only keys less
    than ``window`` positions up), window slot ``start + n`` where ``anc[r, n]`` (float 0/1; a
    window of at least ``t_q`` keeps every ancestor: the callers check). The row's ``anc``
    entries are picked by a one-hot matmul, not a gather (Mosaic and Triton lower a dot; a
    value gather they may not)."""
    m_prev, l_prev, acc_prev = carry
    s = jax.lax.dot_general(
        qg.astype(jnp.float32), k.astype(jnp.float32), (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    ) * scale
    rows = qg.shape[0]
    kp = key_pos[None, :]
    if tree is None:
        q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) % t_q
        ok = (kp >= lead) & (kp <= q_pos) & (kp >= 0)
        if window is not None:
            ok &= kp > q_pos - window
    else:
        start, anc = tree
        n, bk = anc.shape[1], key_pos.shape[0]
        node = jax.lax.broadcasted_iota(jnp.int32, (n, bk), 0)
        onehot = (key_pos[None, :] - start == node).astype(jnp.float32)  # [N, bk]: the window node a key holds
        own = jax.lax.dot_general(anc.astype(jnp.float32), onehot, (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32) > 0.5
        prefix = (kp < start) & (kp >= lead) & (kp >= 0)
        if window is not None:  # the window counted from each node's branch position
            q_pos = start + jnp.sum(anc, axis=1, keepdims=True).astype(jnp.int32) - 1  # [R, 1]
            prefix &= kp > q_pos - window
        ok = prefix | own
    m_new, l_new, p, alpha = online_softmax_step(m_prev, l_prev, s, ok, axis=1)
    # a masked slot may hold anything (a model's NaN at a padding position, seen by the padding
    # queries after it): its weight is 0, but 0 * NaN is NaN, so non-finite values are dropped
    v = v.astype(jnp.float32)
    v = jnp.where(jnp.isfinite(v), v, 0.0)
    acc_new = alpha * acc_prev + jax.lax.dot_general(
        p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_new, l_new, acc_new


def finalize(denom: jax.Array, acc: jax.Array) -> jax.Array:
    """``acc / denom``; rows that saw no visible key (``denom == 0``) give zeros."""
    return jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0)


def init_carry(rows: int, d: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )
