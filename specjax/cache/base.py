"""What every KV cache kind shares: per-row status flags and small checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "ATTENTION_IMPLS", "CAPACITY_EXCEEDED", "OUT_OF_PAGES", "ROLLBACK_INVALID", "STATUS_OK", "describe_status",
    "positions", "resolve_attention_impl",
]

# How a cache's ``attend`` runs: "xla" (specjax.attention.live_attention), "pallas"
# (pallas_kernels, interpret mode on CPU) or "auto" (Pallas on TPU/GPU, XLA on CPU).
ATTENTION_IMPLS = ("xla", "pallas", "auto")
XLA_SINGLE_PASS = 512  # up to this many key slots the XLA path is one fused pass (no loop)

# Per-row status bits (sticky: OR-ed into ``cache.status [B]``). A row whose write
# or advance would pass its capacity is *not* written/advanced and gets a bit here;
# nothing relies on XLA's silent index clamping.
STATUS_OK = 0
CAPACITY_EXCEEDED = 1  # write/advance past the row's capacity (dense) or page budget (paged)
OUT_OF_PAGES = 2  # the shared page pool had no free page for this row
ROLLBACK_INVALID = 4  # rollback target outside [start, lengths] (or past a ring's slack)

UNBOUNDED = 2**30  # a write bound (``bound_write``) that is not set

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


def replace_layer(buffers: tuple, layer: int, new: jax.Array) -> tuple:
    """Per-layer buffers with layer ``layer`` swapped for ``new``."""
    return (*buffers[:layer], new, *buffers[layer + 1 :])


def resolve_attention_impl(impl: str) -> str:
    """``"auto"`` -> ``"pallas"`` on TPU/GPU, ``"xla"`` on CPU; a bad name is a ``ValueError``."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is invalid: must be one of {list(ATTENTION_IMPLS)}")
    if impl == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    return impl


def key_block(n: int, candidates: tuple[int, ...] = (512, 256, 128)) -> int:
    """Key block size for ``n`` slots: ``n`` itself when small (one pass), else the largest
    candidate dividing ``n`` (request-sized capacities are multiples of 128), else ``n``."""
    if n <= XLA_SINGLE_PASS:
        return n
    return next((c for c in candidates if n % c == 0), n)


def kernel_block(n: int) -> int:
    """Pallas key block: the largest of 256, 128, ..., 1 dividing ``n``."""
    return next(c for c in (256, 128, 64, 32, 16, 8, 4, 2, 1) if n % c == 0)
