"""Logit filtering and per-row, per-position randomness.

Sampling settings are per-row data (``RowSampling``: arrays ``[B]``), never compile-time
constants: a batch may mix greedy and sampled rows, and changing a temperature never
recompiles. A row with ``temperature == 0`` gets the one-hot argmax distribution, so the
sampling path reproduces greedy decoding exactly for it.

Every random draw of row ``b`` comes from ``key(seed_b)`` folded with the absolute
token position it decides and a purpose tag, never from the row's batch slot, so a
row's output does not depend on its neighbours.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass

__all__ = ["ACCEPT", "DRAFT", "SAMPLE", "TREE", "RowSampling", "derive_seed", "draft_token", "position_keys", "probs",
           "sample"]

ACCEPT, SAMPLE, DRAFT, TREE = 0, 1, 2, 3  # purpose tags (TREE: a tree node's acceptance test)


@pytree_dataclass
class RowSampling:
    """Per-row sampling settings, all ``[B]``."""

    temperature: jax.Array  # float32; 0: greedy (argmax) for this row
    top_k: jax.Array  # int32; 0: no top-k filter
    top_p: jax.Array  # float32 in (0, 1]; 1: no top-p filter

    @classmethod
    def rows(cls, temperature, top_k, top_p, *, host: bool = False) -> RowSampling:
        """From host lists (``None`` entries: filter off); ``host``: NumPy arrays (to place)."""
        put = np.asarray if host else jnp.asarray
        return cls(
            put(np.asarray(temperature, np.float32)),
            put(np.array([0 if k is None else k for k in top_k], np.int32)),
            put(np.array([1.0 if p is None else p for p in top_p], np.float32)),
        )


def _per_row(a: jax.Array, like: jax.Array) -> jax.Array:
    """``a [B]`` broadcastable against ``like [B, ..., V]``."""
    return a.reshape((a.shape[0],) + (1,) * (like.ndim - 1))


def _filter(x: jax.Array, sp: RowSampling) -> jax.Array:
    """Top-k then top-p on tempered logits ``x [B, ..., V]`` (one descending sort). Top-p keeps
    the smallest head of the sorted distribution whose mass reaches ``top_p`` (ties at the
    cut are kept)."""
    v = x.shape[-1]
    srt = -jnp.sort(-x, axis=-1)
    k = _per_row(sp.top_k, x)
    idx = jnp.broadcast_to(jnp.clip(k - 1, 0, v - 1), x.shape[:-1] + (1,))
    kth = jnp.where(k > 0, jnp.take_along_axis(srt, idx, axis=-1), -jnp.inf)
    srt = jnp.where(srt < kth, -jnp.inf, srt)
    p_sorted = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(p_sorted, axis=-1) - p_sorted  # mass strictly above each token
    top_p = _per_row(sp.top_p, x)
    keep = (before < top_p) | (top_p >= 1.0)  # a prefix of the sorted order, >= 1 token
    cut = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((x < cut) | (x < kth), -jnp.inf, x)


def probs(logits: jax.Array, sp: RowSampling) -> jax.Array:
    """Filtered distribution ``[B, ..., V]`` (float32) from ``logits [B, ..., V]`` under each
    row's settings. Greedy rows get one-hot argmax. The sort runs only when some row filters."""
    x = logits.astype(jnp.float32)
    t = _per_row(sp.temperature, x)
    greedy = t <= 0
    x = x / jnp.where(greedy, 1.0, t)
    filtering = jnp.any(sp.top_k > 0) | jnp.any(sp.top_p < 1.0)
    x = jax.lax.cond(filtering, lambda y: _filter(y, sp), lambda y: y, x)
    p = jax.nn.softmax(x, axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), x.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, onehot, p)


def position_keys(seeds: jax.Array, positions: jax.Array, purpose: int) -> jax.Array:
    """Keys ``[B, ...]`` from per-row ``seeds [B]`` and absolute ``positions [B, ...]``."""
    base = jax.vmap(jax.random.key)(seeds)

    def one(k, pos):
        return jax.vmap(lambda p: jax.random.fold_in(jax.random.fold_in(k, p), purpose))(pos.reshape(-1)).reshape(
            pos.shape
        )

    return jax.vmap(one)(base, positions)


def sample(keys: jax.Array, p: jax.Array) -> jax.Array:
    """One token per key from distributions ``p [..., V]`` (keys ``[...]``)."""
    flat_k = keys.reshape(-1)
    flat_p = p.reshape(-1, p.shape[-1])
    tok = jax.vmap(lambda k, q: jax.random.categorical(k, jnp.log(q)))(flat_k, flat_p)
    return tok.reshape(keys.shape).astype(jnp.int32)


def draft_token(logits: jax.Array, greedy: bool, seeds: jax.Array, sp: RowSampling,
                at: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """A draft per row from ``logits [B, V]`` for absolute position ``at [B]``: the argmax when
    ``greedy`` (probs ``None``), else a draw from the row's filtered ``probs [B, V]`` keyed by its
    seed and ``at`` (a row's drafts never depend on its batch)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    p = probs(logits, sp)
    return sample(position_keys(seeds, at[:, None], DRAFT)[:, 0], p), p


def derive_seed(base: int, key: object) -> int:
    """A row's seed from a base seed and what names the row (its index in ``generate``, its
    request id in ``batch_generate``): distinct keys give independent streams, and the
    same (base, key) always gives the same seed, wherever the row sits in a batch."""
    digest = hashlib.blake2b(f"{int(base)}|{type(key).__name__}|{key}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")
