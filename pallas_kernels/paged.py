"""Pallas kernel: ragged masked attention reading K/V through a block table.

Same semantics as ``ragged_attention`` with key slot ``j`` of row ``b`` living in pool
page ``block_table[b, j // page_size]`` at offset ``j % page_size``. One KV block is
one page. The grid body (TPU) takes the block table as a third scalar-prefetch
operand and clamps the page index into the row's live range (skipped pages issue no
copy); the loop body (GPU) visits only live pages. Reference: gather through the
block table, then the XLA oracle (``paged_attention_reference``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._online_softmax import live_block_range
from pallas_kernels.ragged import (
    check_dynamic,
    check_static,
    check_tree,
    clamp_block,
    default_body,
    grid_call,
    interpret_arg,
    loop_call,
    one_layer,
    stacked,
)
from pallas_kernels.reference import TreeMask, paged_reference

__all__ = ["paged_attention", "paged_attention_reference"]


@functools.partial(jax.jit, static_argnames=("window", "scale", "body", "interpret"))
def _paged_attention(q, k_pages, v_pages, block_table, lead_pad, q_start, layer, tree_start=None, tree_anc=None, *,
                     window, scale, body, interpret):
    """``k_pages, v_pages [L, P, Hkv, page, D]`` (every layer's pool), ``layer int32 [1]``;
    ``tree_start [B]``, ``tree_anc [B, t_q, N]``: a token tree, or None."""
    bsz, t_q, hq, d = q.shape
    _, _, hkv, page, _ = k_pages.shape
    max_pages = block_table.shape[1]
    num_keys = max_pages * page
    groups = hq // hkv
    static = dict(t_q=t_q, hkv=hkv, groups=groups, block=page, window=window, scale=scale, num_keys=num_keys)
    lead_pad, q_start = lead_pad.astype(jnp.int32), q_start.astype(jnp.int32)
    block_table = block_table.astype(jnp.int32)
    tree = () if tree_anc is None else (tree_start.astype(jnp.int32),)
    if body == "loop":
        return loop_call(static, q=q, scalars=(lead_pad, q_start, block_table, layer, *tree), k=k_pages, v=v_pages,
                         interpret=interpret, paged=True, anc=tree_anc)

    clamp = functools.partial(
        clamp_block, t_q=t_q, window=window, block=page, num_keys=num_keys, num_blocks=max_pages
    )

    def kv_map(b, j, lead_ref, qs_ref, bt_ref, layer_ref, *_):  # this layer's whole page, all heads
        return layer_ref[0], jnp.maximum(bt_ref[b, clamp(j, lead_ref[b], qs_ref[b])], 0), 0, 0, 0

    kv_spec = pl.BlockSpec((None, None, hkv, page, d), kv_map)
    call = grid_call(static, n_prefetch=4 + len(tree), grid=(bsz, max_pages), kv_spec=kv_spec, q=q,
                     interpret=interpret, tree_nodes=None if tree_anc is None else tree_anc.shape[2])
    anc = () if tree_anc is None else (tree_anc.astype(jnp.float32),)
    return call(lead_pad, q_start, block_table, layer, *tree, q, k_pages, v_pages, *anc)


def _check_pages(block_table, lead_pad, q_start, t_q: int, window: int | None, page: int, num_pages: int) -> None:
    """Every page a row reads must be owned (``0 <= id < num_pages``); host-side, concrete only."""
    if any(isinstance(x, jax.core.Tracer) for x in (block_table, lead_pad, q_start)):
        return
    # on the host, in NumPy: no device op, none staged into a caller's trace (indexing a concrete
    # jax array inside a jit would be), none on a compile-only client's device
    bt, lead, start = np.asarray(block_table), np.asarray(lead_pad), np.asarray(q_start)
    for b in range(bt.shape[0]):
        first, last = (int(x) for x in live_block_range(
            int(lead[b]), int(start[b]), t_q, window, page, bt.shape[1] * page, xp=np))
        ids = bt[b, first : last + 1]
        if ((ids < 0) | (ids >= num_pages)).any():
            raise ValueError(
                f"block_table row {b} has pages {ids.tolist()} for its live logical pages {first}..{last}; "
                f"each must lie in [0, {num_pages})"
            )


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    lead_pad: jax.Array,
    q_start: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
    body: str | None = None,
    interpret: bool | str | None = None,
    layer: int | jax.Array | None = None,
    tree: TreeMask | None = None,
) -> jax.Array:
    """``q [B, t_q, Hq, D]``; ``k_pages, v_pages [num_pages, Hkv, page_size, D]`` (one
    layer of the pool, or every layer's ``[L, num_pages, Hkv, page_size, D]`` with ``layer``);
    ``block_table int32 [B, max_pages]`` (``-1`` = none); ``lead_pad, q_start int32 [B]``
    -> ``[B, t_q, Hq, D]``. ``tree``: token-tree queries (``ragged_attention``)."""
    body = default_body() if body is None else body
    k_pages, v_pages, layer = stacked(k_pages, v_pages, layer, what="k_pages")
    check_static(q, one_layer(k_pages), one_layer(v_pages), lead_pad, q_start, body, k_pages.shape[3],
                 what="k_pages")
    if np.ndim(block_table) != 2 or np.shape(block_table)[0] != q.shape[0]:
        raise ValueError(f"block_table must be [B={q.shape[0]}, max_pages], got shape {np.shape(block_table)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    page, num_pages = k_pages.shape[3], k_pages.shape[1]
    check_dynamic(lead_pad, q_start, q.shape[1], np.shape(block_table)[1] * page)
    _check_pages(block_table, lead_pad, q_start, q.shape[1], window, page, num_pages)
    check_tree(tree, q, window)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    start, anc = (None, None) if tree is None else (jnp.asarray(tree.start), jnp.asarray(tree.anc))
    return _paged_attention(
        q, k_pages, v_pages, jnp.asarray(block_table), jnp.asarray(lead_pad), jnp.asarray(q_start), layer, start, anc,
        window=window, scale=scale, body=body, interpret=interpret_arg(interpret),
    )


# the XLA oracle: each row's pages gathered into a contiguous layout, then the dense reference
paged_attention_reference = paged_reference
