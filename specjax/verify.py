"""Verification of a draft window against the target: greedy and lossless rejection sampling.

Window layout, per row: slots ``0 .. u-1`` hold known tokens (not yet cached), slots
``u .. w-1`` hold ``proposed = w - u`` drafts. Target logits at slot ``j`` predict the
token after slot ``j``, so draft ``k`` (slot ``u + k``) is checked against slot
``u - 1 + k``. Returns the accepted count ``a [B]`` and the token that follows the
accepted prefix (``bonus [B]``: the correction on a rejection, else the bonus).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import ACCEPT, SAMPLE, RowSampling, position_keys, probs, sample

__all__ = ["greedy_verify", "rejection_verify"]


def _slots(u: jax.Array, d: int, w: int) -> jax.Array:
    """Window slot whose logits judge draft ``k``: ``[B, d]``."""
    return jnp.clip(u[:, None] - 1 + jnp.arange(d, dtype=jnp.int32)[None], 0, w - 1)


def _leading(ok: jax.Array) -> jax.Array:
    """Length of the all-true prefix of ``ok [B, d]``."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def greedy_verify(logits: jax.Array, drafts: jax.Array, u: jax.Array,
                  proposed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Longest prefix of drafts equal to the target's argmax, plus the target's next token.

    ``logits [B, w, V]``, ``drafts [B, d]`` with ``d = w - 1``, ``u [B]``; ``proposed [B]``:
    drafts each row offers (default ``w - u``, every slot; fewer leave the rest unjudged).
    """
    b, w, _ = logits.shape
    d = drafts.shape[1]
    tgt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, w]
    proposed = w - u if proposed is None else proposed
    k = jnp.arange(d, dtype=jnp.int32)[None]
    ok = (drafts == jnp.take_along_axis(tgt, _slots(u, d, w), axis=1)) & (k < proposed[:, None])
    a = _leading(ok)
    bonus = jnp.take_along_axis(tgt, (u - 1 + a)[:, None], axis=1)[:, 0]
    return a, bonus


def rejection_verify(
    logits: jax.Array,
    drafts: jax.Array,
    draft_probs: jax.Array | None,
    u: jax.Array,
    positions: jax.Array,
    seeds: jax.Array,
    sp: RowSampling,
    proposed: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Lossless speculative sampling.

    Accept draft ``x`` with ``min(1, p(x) / q(x))``; at the first rejection sample from
    ``norm(max(0, p - q))``; if all proposed drafts pass, sample the bonus from ``p``.
    ``draft_probs [B, d, V]`` (``None``: the drafter is deterministic, ``q`` one-hot).
    ``positions [B]``: absolute position of window slot 0 (keys use absolute positions).
    ``proposed [B]``: drafts each row offers (default ``w - u``); when a row offers fewer and
    all pass, its bonus is sampled from ``p`` right after them: still lossless.
    """
    b, w, v = logits.shape
    d = drafts.shape[1]
    proposed = w - u if proposed is None else proposed
    p_all = probs(logits, sp)  # [B, w, V]
    p = jnp.take_along_axis(p_all, _slots(u, d, w)[:, :, None], axis=1)  # [B, d, V]
    q = jax.nn.one_hot(drafts, v, dtype=jnp.float32) if draft_probs is None else draft_probs
    px = jnp.take_along_axis(p, drafts[:, :, None], axis=2)[:, :, 0]
    qx = jnp.take_along_axis(q, drafts[:, :, None], axis=2)[:, :, 0]
    draft_pos = positions[:, None] + u[:, None] + jnp.arange(d, dtype=jnp.int32)[None]  # [B, d]
    uni = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(position_keys(seeds, draft_pos, ACCEPT))
    k = jnp.arange(d, dtype=jnp.int32)[None]
    ok = (uni * qx < px) & (k < proposed[:, None])  # uni < p/q without dividing by q
    a = _leading(ok)
    rejected = a < proposed
    slot = u - 1 + a
    p_next = jnp.take_along_axis(p_all, slot[:, None, None], axis=1)[:, 0]
    q_rej = jnp.take_along_axis(q, jnp.minimum(a, max(d - 1, 0))[:, None, None], axis=1)[:, 0] if d else p_next
    resid = jnp.maximum(p_next - q_rej, 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_next)
    final = jnp.where(rejected[:, None], resid, p_next)
    next_pos = positions + u + a  # absolute position of the token being decided
    bonus = sample(position_keys(seeds, next_pos[:, None], SAMPLE)[:, 0], final)
    return a, bonus
