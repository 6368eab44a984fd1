"""What every KV cache kind shares: per-row status flags and small checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["CAPACITY_EXCEEDED", "OUT_OF_PAGES", "ROLLBACK_INVALID", "STATUS_OK", "describe_status", "positions"]

# Per-row status bits (sticky: OR-ed into ``cache.status [B]``). A row whose write
# or advance would pass its capacity is *not* written/advanced and gets a bit here;
# nothing relies on XLA's silent index clamping.
STATUS_OK = 0
CAPACITY_EXCEEDED = 1  # write/advance past the row's capacity (dense) or page budget (paged)
OUT_OF_PAGES = 2  # the shared page pool had no free page for this row
ROLLBACK_INVALID = 4  # rollback target outside [start, lengths] (or past a ring's slack)

_NAMES = {CAPACITY_EXCEEDED: "capacity exceeded", OUT_OF_PAGES: "out of pages", ROLLBACK_INVALID: "invalid rollback"}


def describe_status(status: jax.Array) -> dict[int, list[str]]:
    """Host-side: ``{row: [problem, ...]}`` for every row with a non-zero status."""
    out: dict[int, list[str]] = {}
    for row, s in enumerate(jax.device_get(status).tolist()):
        if s:
            out[row] = [name for bit, name in _NAMES.items() if s & bit]
    return out


def positions(lengths: jax.Array, t: int) -> jax.Array:
    """Absolute positions ``[B, t]`` of ``t`` new tokens appended at each row's length."""
    return lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


def as_rows(x: jax.Array | int, batch: int) -> jax.Array:
    """A per-row int32 ``[B]`` vector from a scalar or ``[B]`` input."""
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch,))
