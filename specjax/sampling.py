"""Logit filtering and per-row, per-position randomness.

Every random draw of row ``b`` comes from ``key(seed_b)`` folded with the absolute
token position it decides and a purpose tag, never from the row's batch slot, so a
row's output does not depend on its neighbours.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["ACCEPT", "DRAFT", "SAMPLE", "SamplingParams", "position_keys", "probs", "sample"]

ACCEPT, SAMPLE, DRAFT = 0, 1, 2  # purpose tags


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0``: greedy. ``top_k``/``top_p`` apply to target and draft alike."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Filtered distribution ``[..., V]`` (float32) for temperature/top-k/top-p sampling."""
    x = logits.astype(jnp.float32) / sp.temperature
    if sp.top_k is not None and sp.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sp.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    p = jax.nn.softmax(x, axis=-1)
    if sp.top_p is not None and sp.top_p < 1.0:
        order = jnp.argsort(-p, axis=-1)
        sorted_p = jnp.take_along_axis(p, order, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        keep_sorted = before < sp.top_p  # smallest prefix reaching top_p (always >= 1 token)
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # undo the sort
        p = jnp.where(keep, p, 0.0)
        p = p / jnp.sum(p, axis=-1, keepdims=True)
    return p


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
