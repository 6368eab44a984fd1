"""Left alignment, for callers that want one shared append offset.

specjax's own engine never needs this: every cache kind appends per row. It exists
for code written against a single-offset layout (e.g. a kernel with one ``q_start``).

Cost: ``front_pad_kv_cache`` rewrites the whole cache, ``O(layers * B * capacity *
Hkv * D)`` reads and writes (a gather), against ``O(B * t)`` for a per-row write.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache.dense import DenseKVCache

__all__ = ["front_align_batch", "front_pad_kv_cache"]


def front_align_batch(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists to a common end column.

    Returns ``tokens int32 [B, T]`` (``T`` = longest prompt) and ``lead_pad int32 [B]``
    (pad tokens before each prompt; mask slots ``< lead_pad``).
    """
    if len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token lists")
    lens = np.array([len(p) for p in prompts], np.int32)
    t = int(lens.max())
    tokens = np.full((len(prompts), t), pad_id, np.int32)
    for i, p in enumerate(prompts):  # host-side data preparation, not a step function
        if len(p):
            tokens[i, t - len(p) :] = np.asarray(p, np.int32)
    return tokens, (t - lens).astype(np.int32)


def front_pad_kv_cache(cache: DenseKVCache) -> DenseKVCache:
    """Move each row's live run ``[start, lengths)`` so every row ends at ``max(lengths)``.

    Afterwards all rows share one append offset (``lengths`` equal) and ``start``
    records each row's lead pad. Slots before ``start`` hold stale data and are
    excluded by the mask, never zeroed.
    """
    end = jnp.max(cache.lengths)
    shift = end - cache.lengths  # [B] >= 0
    new_start = cache.start + shift
    j = jnp.arange(cache.capacity, dtype=jnp.int32)[None]
    src = j - shift[:, None]  # [B, capacity]
    live = src >= cache.start[:, None]
    src = jnp.where(live, src, 0)  # dead slots read slot 0; masked by the new start
    rows = jnp.arange(cache.batch)[:, None]
    # x[rows, :, src] is [B, capacity, Hkv, D]: back to head-major [B, Hkv, capacity, D]
    move = lambda x: x[rows, :, src].transpose(0, 2, 1, 3)  # noqa: E731
    each = lambda buf: tuple(move(x) for x in buf) if isinstance(buf, tuple) else jax.vmap(move)(buf)  # noqa: E731
    return cache.replace(
        k=each(cache.k),
        v=each(cache.v),
        lengths=jnp.full_like(cache.lengths, end),
        start=new_start,
    )
