"""The interface every KV cache kind implements (``KVCache``), and the one commit rule they
share (``CommitsPlans``: a step plan commits each row by its own ``plan.advance``).

Every cache is an immutable pytree whose rows carry their own ``lengths [B]`` and a sticky
``status [B]`` (``specjax.cache.base``'s bits): a write, advance or rollback that cannot be
done leaves the row as it was and sets a bit, never an out-of-bounds index. ``ModelCache``
(a model's caches, one per kind of layer) maps the commit, rollback, compaction and row
operations over its parts.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

__all__ = ["CommitsPlans", "KVCache"]


@runtime_checkable
class KVCache(Protocol):
    """A per-row KV cache. ``lengths`` int32 ``[B]``: committed tokens per row; ``status`` int32
    ``[B]``: sticky per-row flags."""

    lengths: jax.Array
    status: jax.Array

    def write(self, layer: Any, k_new: jax.Array, v_new: jax.Array) -> KVCache:
        """K/V ``[B, t, Hkv, D]`` of layer ``layer`` written at each row's own ``lengths``
        (uncommitted until ``advance``)."""

    def advance(self, n: jax.Array | int) -> KVCache:
        """Commit ``n [B]`` tokens per row (each row its own count)."""

    def apply_plan(self, plan: Any) -> KVCache:
        """Commit a step plan (``specjax.plan``): each row by its ``plan.advance``."""

    def rollback(self, new_lengths: jax.Array | int) -> KVCache:
        """Each row back to ``new_lengths [B]`` (within what the kind can undo; rejected slots
        are masked, never zeroed)."""

    def compact(self, src: jax.Array) -> KVCache:
        """A verify window's accepted path moved into place: slot ``lengths + k`` takes slot
        ``lengths + src[b, k]``."""

    def put_rows(self, rows: jax.Array, sub: Any) -> KVCache:
        """Rows ``rows [R]`` replaced by ``sub``'s (an admit's prefilled rows)."""


class CommitsPlans:
    """``apply_plan`` as every cache kind commits a plan: ``advance(plan.advance)``, each row by
    its own count under both rules (the cohort rule's plan already holds the batch minimum)."""

    def apply_plan(self, plan):
        return self.advance(plan.advance)
