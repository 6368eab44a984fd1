"""A model's per-row KV caches (``init_cache``): one cache per kind of layer, global (dense or
paged), sliding-window (rings) and compressed memory, laid out per layer or stacked for the
layer scan."""

from __future__ import annotations

import jax.numpy as jnp

from specjax.cache import CompressedKVCache, RollingKVCache
from specjax.cache.model_cache import ModelCache, global_cache
from specjax.model.config import ModelConfig

__all__ = ["RING_ALIGN", "init_cache"]


# a sliding-window layer's ring holds a multiple of this many slots (its rollback room, ``slack``, grows
# by under RING_ALIGN): the Pallas kernel reads it in blocks of a power of two (kernel_block)
RING_ALIGN = 16


def init_cache(
    config: ModelConfig,
    batch: int,
    capacity: int,
    *,
    kind: str = "dense",
    slack: int = 8,
    reach: int | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    dtype=jnp.float32,
    stacked: bool = False,
) -> ModelCache:
    """Empty per-row caches for ``batch`` rows of up to ``capacity`` tokens.

    ``kind``: ``"dense"`` or ``"paged"`` for global layers. Sliding-window layers use the
    rolling cache and compressed-memory layers the compressed cache; their slack is ``reach``
    (default ``slack``): how far a write reaches past the committed length (a wider write, the
    prefill, is bounded per row by ``bound_write`` and attends through ``write_attend``); a ring's
    slack is rounded up so it holds a multiple of ``RING_ALIGN`` slots.
    ``stacked``: each kind's layers in one ``[L, ...]`` buffer, for params laid out for the
    layer scan (``with_layer_loop(model, "scan")``); else a tuple of per-layer buffers.
    """
    if kind not in ("dense", "paged"):
        raise ValueError(f"cache kind must be 'dense' or 'paged', got {kind!r}")
    n_g, n_l = len(config.global_layers), len(config.local_layers)
    hkv, hd = config.n_kv_heads, config.head_dim
    glob = None
    if n_g:
        glob = global_cache(kind, n_g, batch, capacity, hkv, hd, page_size=page_size, num_pages=num_pages,
                            dtype=dtype, stacked=stacked)
    reach = slack if reach is None else reach
    loc = None
    if n_l:  # each ring rounded up to a multiple of RING_ALIGN slots (a Triton kernel loads power-of-two blocks)
        ring = -(-(config.sliding_window + reach) // RING_ALIGN) * RING_ALIGN
        loc = RollingKVCache.create(n_l, batch, config.sliding_window, ring - config.sliding_window, hkv, hd, dtype,
                                    stacked)
    n_m = len(config.compressed_layers)
    mem = CompressedKVCache.create(n_m, batch, capacity, config.compress_window, config.compress_block,
                                   reach, hkv, hd, dtype, stacked) if n_m else None
    return ModelCache(glob, loc, mem)
