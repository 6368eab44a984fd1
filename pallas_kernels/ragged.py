"""Pallas kernels: ragged masked attention over a dense per-row KV layout or a per-row ring.

Semantics are those of ``pallas_kernels.reference`` (the oracle: ``dense_reference`` and
``ring_reference``): query ``t`` of row ``b`` sits at position
``q_start[b] + t`` and sees keys at positions ``[lead_pad[b], q_start[b] + t]`` (within
``window`` if given); GQA; float32 accumulation; a query with no visible key returns zeros.
In the dense layout slot ``s`` holds position ``s``; in a ring of ``S`` slots (the rolling
cache) slot ``s`` holds the newest position ``p <= q_start + t_q - 1`` with ``p % S == s``.

Two kernel bodies share the online-softmax step (``_online_softmax``):

* ``"grid"`` (TPU / Mosaic layout): grid ``(B, num_kv_blocks)``, the KV block axis is
  the sequential reduction axis; ``lead_pad``/``q_start`` (and a paged block table)
  are scalar-prefetch operands; the K/V ``index_map`` clamps the block index into the
  row's live range, so a skipped block re-uses the block already resident and issues
  no copy, and ``pl.when`` skips its compute. Accumulators live in VMEM scratch.
* ``"loop"`` (GPU / Triton style): grid ``(B, Hkv)``; ``lead_pad``/``q_start`` are plain
  inputs; each program loops over *only* its live KV blocks with ``fori_loop``, its queries
  stacked outside the kernel (``stack_query_rows``) so it slices no value.

On CPU both run in interpret mode (``interpret=True``; the grid body also under the
TPU interpreter, ``pltpu.InterpretParams``). K/V are head-major like the caches
(``[B, Hkv, T, D]``); a block carries all KV heads (``[Hkv, block, D]``), its last two
dims ``(block, D)`` as Mosaic tiles them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._online_softmax import (
    MASK_VALUE,
    block_update,
    finalize,
    group_queries,
    init_carry,
    key_positions,
    live_block_range,
    query_rows,
    stack_query_rows,
    stack_tree_rows,
    target_platform,
    unstack_query_rows,
)
from pallas_kernels.reference import TreeMask, dense_reference, ring_reference

__all__ = ["BODIES", "check_tree", "ragged_attention", "ragged_attention_reference", "ring_attention",
           "ring_attention_reference", "stacked"]

BODIES = ("grid", "loop")
_TPU_PARAMS = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams", None)
try:  # the loop body names Pallas's Triton backend (else a GPU picks by jax_pallas_use_mosaic_gpu)
    from jax.experimental.pallas import triton as _pltriton

    _TRITON_PARAMS = _pltriton.CompilerParams
except ImportError:  # a jax without the Triton backend: the loop body runs interpreted only
    _TRITON_PARAMS = None


# ----------------------------------------------------------------------------- bodies


def _block_range(lead, qs, *, t_q, window, block, num_keys, ring):
    """Live KV blocks of a row; a ring's slots are all visited (it holds only ~window keys)."""
    if ring is not None:
        return jnp.int32(0), jnp.int32(num_keys // block - 1)
    return live_block_range(lead, qs, t_q, window, block, num_keys)


def grid_kernel(*refs, n_prefetch, t_q, hkv, groups, block, window, scale, num_keys, ring=None, tree=False):
    """Body for grid ``(B, num_blocks)``. Refs: ``lead, q_start[, block_table], layer[, tree_start]``
    (scalar prefetch), ``q [t_q, Hq, D]``, ``k, v [Hkv, block, D]``, ``[anc [t_q, N]]``, ``o``,
    scratch ``m, l, acc``. ``tree``: the queries are token-tree nodes (``block_update``)."""
    lead_ref, qs_ref = refs[0], refs[1]
    b, j = pl.program_id(0), pl.program_id(1)
    if tree:
        q_ref, k_ref, v_ref, anc_ref, o_ref, m_sc, l_sc, acc_sc = refs[n_prefetch:]
        tree_arg = (refs[n_prefetch - 1][b], jnp.concatenate([anc_ref[...].astype(jnp.float32)] * groups, axis=0))
    else:
        q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc = refs[n_prefetch:]
        tree_arg = None
    lead, qs = lead_ref[b], qs_ref[b]
    first, last = _block_range(lead, qs, t_q=t_q, window=window, block=block, num_keys=num_keys, ring=ring)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when((j >= first) & (j <= last))
    def _compute():
        q = q_ref[...]
        key_pos = key_positions(j, block, qs, t_q, ring)
        for h in range(hkv):
            m, denom, acc = block_update(
                (m_sc[h], l_sc[h], acc_sc[h]), group_queries(q, h, groups), k_ref[h], v_ref[h],
                key_pos, qs, lead, t_q, window, scale, tree_arg,
            )
            m_sc[h], l_sc[h], acc_sc[h] = m, denom, acc

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        for h in range(hkv):
            out = finalize(l_sc[h], acc_sc[h])
            for g in range(groups):
                o_ref[:, h * groups + g, :] = out[g * t_q : (g + 1) * t_q].astype(o_ref.dtype)


def loop_kernel(lead_ref, qs_ref, *refs, paged, t_q, block, window, scale, num_keys, ring=None, tree=False):
    """Body for grid ``(B, Hkv)``: one row's queries of one KV head, looping over the row's
    live KV blocks only. Refs: ``lead [B]``, ``q_start [B]``, ``[block_table [B, M]]``, ``layer
    [1]``, ``[tree_start [B]]``, ``q [R, D]`` (the head's queries stacked, ``stack_query_rows``),
    ``k``, ``v`` (every layer's buffer, ``[L, B, Hkv, T, D]`` or the page pool ``[L, P, Hkv,
    page, D]``: this layer's rows are read in place), ``[anc [R, N']]`` (``stack_tree_rows``),
    ``o [R, D]``. Every load is a 2-D power-of-two block and no value is sliced: the body
    lowers to Triton (GPU) as well as to the interpreter."""
    refs = list(refs)
    bt_ref = refs.pop(0) if paged else None
    layer_ref = refs.pop(0)
    start_ref = refs.pop(0) if tree else None
    q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    anc_ref = refs.pop(0) if tree else None
    (o_ref,) = refs
    b, h = pl.program_id(0), pl.program_id(1)
    lead, qs, layer = lead_ref[b], qs_ref[b], layer_ref[0]
    tree_arg = (start_ref[b], anc_ref[...]) if tree else None
    first, last = _block_range(lead, qs, t_q=t_q, window=window, block=block, num_keys=num_keys, ring=ring)
    qg = q_ref[...]  # [R, D]

    def body(j, carry):
        if paged:
            page = bt_ref[b, j]
            k, v = k_ref[layer, page, h], v_ref[layer, page, h]
        else:
            k, v = k_ref[layer, b, h, pl.ds(j * block, block), :], v_ref[layer, b, h, pl.ds(j * block, block), :]
        key_pos = key_positions(j, block, qs, t_q, ring)
        return block_update(carry, qg, k, v, key_pos, qs, lead, t_q, window, scale, tree_arg)

    _, denom, acc = jax.lax.fori_loop(first, last + 1, body, init_carry(*qg.shape))
    o_ref[...] = finalize(denom, acc).astype(o_ref.dtype)


# the most keys the loop body takes a step: a Triton program holds its K and V blocks (float32 in the
# dot) in shared memory, staged several deep (256 keys x head_dim 128 is 128 KB a block)
LOOP_BLOCK = 64


def loop_block(block: int) -> int:
    """The loop body's step: ``block`` keys, or ``LOOP_BLOCK`` when that divides it (the live
    range is then skipped in finer steps; the same keys are read)."""
    return LOOP_BLOCK if block > LOOP_BLOCK and block % LOOP_BLOCK == 0 else block


def loop_call(static: dict, *, q, scalars: tuple, k, v, interpret, paged: bool, anc=None) -> jax.Array:
    """``loop_kernel`` over grid ``(B, Hkv)`` (a program per row and KV head): ``q [B, t_q, Hq,
    D]`` -> ``[B, t_q, Hq, D]``, the rows stacked per KV head around the call. ``scalars``
    (``lead, q_start[, block_table], layer[, tree_start]``) and ``k, v`` (every layer's buffer or
    page pool) go in whole; the body indexes them. ``anc [B, t_q, N]``: a token tree's
    ancestor rows (``block_update``), stacked like the queries."""
    bsz, t_q, hq, d = q.shape
    hkv = static["hkv"]
    rows = query_rows(t_q, static["groups"])
    row_spec = pl.BlockSpec((None, None, rows, d), lambda b, h: (b, h, 0, 0))
    tree_in, tree_specs = (), []
    if anc is not None:
        tree_in = (stack_tree_rows(anc, static["groups"], rows),)
        tree_specs = [pl.BlockSpec((None, rows, tree_in[0].shape[2]), lambda b, h: (b, 0, 0))]

    def whole(x):
        return pl.BlockSpec(x.shape, lambda b, h: (0,) * x.ndim)

    extra = {}
    if not interpret and _TRITON_PARAMS is not None and target_platform() != "tpu":
        extra["compiler_params"] = _TRITON_PARAMS()  # Triton's defaults; the body is written for it
    body = {k: x for k, x in static.items() if k not in ("hkv", "groups")}  # the grid and row stacking carry them
    call = pl.pallas_call(
        functools.partial(loop_kernel, paged=paged, tree=anc is not None, **body),
        grid=(bsz, hkv),
        in_specs=[*(whole(x) for x in scalars), row_spec, whole(k), whole(v), *tree_specs],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct((bsz, hkv, rows, d), q.dtype),
        interpret=interpret,
        **extra,
    )
    return unstack_query_rows(call(*scalars, stack_query_rows(q, hkv, rows), k, v, *tree_in), t_q, hq)


def grid_call(static: dict, *, n_prefetch: int, grid: tuple[int, int], kv_spec, q, interpret, tree_nodes=None):
    """``pallas_call`` of ``grid_kernel``: q/out blocks are whole rows, K/V blocks follow
    ``kv_spec`` (whose index map receives the scalar-prefetch refs), accumulators in VMEM scratch.
    ``tree_nodes``: ``N`` of a token tree's ``anc [B, t_q, N]`` (one more input, a row a block)."""
    _, t_q, hq, d = q.shape
    rows = static["groups"] * t_q
    row_spec = pl.BlockSpec((None, t_q, hq, d), lambda b, j, *_: (b, 0, 0, 0))
    tree_specs = [] if tree_nodes is None else [pl.BlockSpec((None, t_q, tree_nodes), lambda b, j, *_: (b, 0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=n_prefetch,
        grid=grid,
        in_specs=[row_spec, kv_spec, kv_spec, *tree_specs],
        out_specs=row_spec,
        scratch_shapes=[
            pltpu.VMEM((static["hkv"], rows, 1), jnp.float32),
            pltpu.VMEM((static["hkv"], rows, 1), jnp.float32),
            pltpu.VMEM((static["hkv"], rows, d), jnp.float32),
        ],
    )
    extra = {}
    if _TPU_PARAMS is not None and target_platform() == "tpu":
        extra["compiler_params"] = _TPU_PARAMS(dimension_semantics=("parallel", "arbitrary"))
    return pl.pallas_call(
        functools.partial(grid_kernel, n_prefetch=n_prefetch, tree=tree_nodes is not None, **static),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        **extra,
    )


def clamp_block(j, lead, qs, *, t_q, window, block, num_keys, num_blocks):
    """Block index a grid step reads: ``j`` clamped into the live range (skipped steps
    repeat a resident block, so the pipeline issues no new copy)."""
    first, last = live_block_range(lead, qs, t_q, window, block, num_keys)
    return jnp.clip(jnp.minimum(jnp.maximum(j, first), last), 0, num_blocks - 1)


def interpret_arg(interpret: bool | str | None):
    """``None``: interpret on CPU only; ``"tpu"``: the TPU interpreter where available."""
    if interpret == "tpu":
        return pltpu.InterpretParams() if hasattr(pltpu, "InterpretParams") else True
    if interpret is None:
        return target_platform() == "cpu"
    return bool(interpret)


def default_body() -> str:
    return "loop" if target_platform() == "gpu" else "grid"


# ----------------------------------------------------------------------------- checks


def check_static(q, k, v, lead_pad, q_start, body: str, block: int, what: str = "k") -> None:
    """Shape/dtype/head checks that need no values; ``ValueError`` naming the argument."""
    if body not in BODIES:
        raise ValueError(f"body must be one of {list(BODIES)}, got {body!r}")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, t_q, Hq, D], got shape {q.shape}")
    if k.shape != v.shape:
        raise ValueError(f"{what} and v must have the same shape, got {k.shape} and {v.shape}")
    if k.ndim != 4 or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{what} must be rank 4 (head-major) with head_dim {q.shape[-1]}, got shape {k.shape}")
    if q.shape[2] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[2]} must be a multiple of {what} heads {k.shape[1]} (GQA)")
    for name, x in (("q", q), (what, k), ("v", v)):
        if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    b = q.shape[0]
    for name, x in (("lead_pad", lead_pad), ("q_start", q_start)):
        if np.shape(x) != (b,):
            raise ValueError(f"{name} must have shape [B]=({b},), got {np.shape(x)}")
    if block < 1:
        raise ValueError(f"block size must be >= 1, got {block}")


def check_dynamic(lead_pad, q_start, t_q: int, num_keys: int) -> None:
    """Value checks, run on the host when the inputs are concrete (skipped under a trace)."""
    if isinstance(lead_pad, jax.core.Tracer) or isinstance(q_start, jax.core.Tracer):
        return
    lp, qs = np.asarray(lead_pad), np.asarray(q_start)
    bad = np.nonzero((qs < 0) | (qs + t_q > num_keys))[0]
    if len(bad):
        raise ValueError(
            f"q_start + t_q must lie in [t_q, {num_keys}]; "
            f"rows {bad[:16].tolist()} have q_start={qs[bad][:16].tolist()}"
        )
    bad = np.nonzero(lp < 0)[0]
    if len(bad):
        raise ValueError(f"lead_pad must be >= 0; rows {bad[:16].tolist()} have {lp[bad][:16].tolist()}")


# ----------------------------------------------------------------------------- dense and ring


@functools.partial(jax.jit, static_argnames=("window", "scale", "block_k", "body", "interpret", "ring"))
def _ragged_attention(q, k, v, lead_pad, q_start, layer, tree_start=None, tree_anc=None, *, window, scale, block_k,
                      body, interpret, ring):
    """``k, v [L, B, Hkv, T, D]`` (every layer's buffer), ``layer int32 [1]``: the one read;
    ``tree_start [B]``, ``tree_anc [B, t_q, N]``: a token tree (``block_update``), or None."""
    bsz, t_q, hq, d = q.shape
    hkv, num_keys = k.shape[2], k.shape[3]
    groups = hq // hkv
    nb = num_keys // block_k
    static = dict(t_q=t_q, hkv=hkv, groups=groups, block=block_k, window=window, scale=scale, num_keys=num_keys,
                  ring=num_keys if ring else None)
    lead_pad = lead_pad.astype(jnp.int32)
    q_start = q_start.astype(jnp.int32)
    tree = () if tree_anc is None else (tree_start.astype(jnp.int32),)
    if body == "loop":
        static["block"] = loop_block(block_k)
        return loop_call(static, q=q, scalars=(lead_pad, q_start, layer, *tree), k=k, v=v, interpret=interpret,
                         paged=False, anc=tree_anc)

    if ring:
        def kv_map(b, j, lead_ref, qs_ref, layer_ref, *_):
            return layer_ref[0], b, 0, j, 0
    else:
        clamp = functools.partial(
            clamp_block, t_q=t_q, window=window, block=block_k, num_keys=num_keys, num_blocks=nb
        )

        def kv_map(b, j, lead_ref, qs_ref, layer_ref, *_):
            return layer_ref[0], b, 0, clamp(j, lead_ref[b], qs_ref[b]), 0

    kv_spec = pl.BlockSpec((None, None, hkv, block_k, d), kv_map)
    call = grid_call(static, n_prefetch=3 + len(tree), grid=(bsz, nb), kv_spec=kv_spec, q=q, interpret=interpret,
                     tree_nodes=None if tree_anc is None else tree_anc.shape[2])
    anc = () if tree_anc is None else (tree_anc.astype(jnp.float32),)
    return call(lead_pad, q_start, layer, *tree, q, k, v, *anc)


def stacked(k: jax.Array, v: jax.Array, layer, what: str = "k") -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(k, v, layer int32 [1])`` with ``k, v`` stacked per layer (rank 5): one layer's buffer
    (rank 4, ``layer`` None) gains a unit layer axis; a stacked one needs ``layer``, a
    Python int in range or a traced int32 scalar (a traced index cannot be checked: keep it
    in range)."""
    if np.ndim(k) == 4 and layer is None:
        return k[None], v[None], jnp.zeros((1,), jnp.int32)
    if np.ndim(k) != 5:
        raise ValueError(f"{what} must be one layer [.., Hkv, T, D] (rank 4) or a per-layer stack (rank 5) with "
                         f"layer=, got shape {np.shape(k)} and layer={layer!r}")
    if layer is None:
        raise ValueError(f"{what} is a per-layer stack of {k.shape[0]} layers: pass layer= (which one to read)")
    if isinstance(layer, int | np.integer) and not 0 <= layer < k.shape[0]:
        raise ValueError(f"layer={layer} is out of range for {what} stacking {k.shape[0]} layers")
    if np.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar, got shape {np.shape(layer)}")
    return k, v, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def one_layer(x: jax.Array) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one layer of a per-layer stack (for the checks; no slice is taken)."""
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)


def _validate_dense(q, k, v, lead_pad, q_start, window, block_k, body):
    check_static(q, k, v, lead_pad, q_start, body, block_k)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch {k.shape[0]} must equal q's batch {q.shape[0]}")
    if k.shape[2] % block_k:
        raise ValueError(f"block_k={block_k} must divide the key length T={k.shape[2]}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    return k.shape[2]


def ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lead_pad: jax.Array,
    q_start: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
    block_k: int = 128,
    body: str | None = None,
    interpret: bool | str | None = None,
    layer: int | jax.Array | None = None,
    tree: TreeMask | None = None,
) -> jax.Array:
    """Ragged masked attention. ``q [B, t_q, Hq, D]``, ``k, v [B, Hkv, T, D]`` (or every
    layer's ``[L, B, Hkv, T, D]`` with ``layer``: read in place, no slice copy),
    ``lead_pad, q_start int32 [B]`` -> ``[B, t_q, Hq, D]``.

    ``block_k`` must divide ``T``; ``body``: ``"grid"`` (TPU) or ``"loop"`` (GPU),
    default by backend; ``interpret``: ``None`` = on CPU only, ``"tpu"`` = the TPU interpreter.
    ``tree``: the queries are nodes of a token tree (``reference.TreeMask``: ``start [B]``,
    ``anc [B, t_q, N]``; a ``window`` of at least ``t_q``): keys before ``start`` by the usual
    rule at each node's branch position, window slot ``start + n`` only where ``anc`` allows.
    """
    body = default_body() if body is None else body
    k, v, layer = stacked(k, v, layer)
    num_keys = _validate_dense(q, one_layer(k), one_layer(v), lead_pad, q_start, window, block_k, body)
    check_dynamic(lead_pad, q_start, q.shape[1], num_keys)
    check_tree(tree, q, window)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    start, anc = (None, None) if tree is None else (jnp.asarray(tree.start), jnp.asarray(tree.anc))
    return _ragged_attention(
        q, k, v, jnp.asarray(lead_pad), jnp.asarray(q_start), layer, start, anc, window=window, scale=scale,
        block_k=block_k, body=body, interpret=interpret_arg(interpret), ring=False,
    )


def check_tree(tree: TreeMask | None, q: jax.Array, window: int | None) -> None:
    """A kernel's token tree: ``start [B]``, ``anc [B, t_q, N]``, and a sliding window (if any)
    of at least ``t_q`` keys (so every ancestor of a node is inside it: the kernels check the
    window on the committed prefix only)."""
    if tree is None:
        return
    b, t_q = q.shape[:2]
    if window is not None and window < t_q:
        raise ValueError(f"tree attention with window={window} needs window >= t_q={t_q} (a node's ancestors "
                         "inside its window); a narrower window runs on the XLA path")
    if np.shape(tree.start) != (b,):
        raise ValueError(f"tree.start must have shape [B]=({b},), got {np.shape(tree.start)}")
    if np.ndim(tree.anc) != 3 or np.shape(tree.anc)[:2] != (b, t_q):
        raise ValueError(f"tree.anc must have shape [B, t_q, N]=({b}, {t_q}, N), got {np.shape(tree.anc)}")


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lead_pad: jax.Array,
    lengths: jax.Array,
    *,
    window: int,
    scale: float | None = None,
    block_k: int | None = None,
    body: str | None = None,
    interpret: bool | str | None = None,
    layer: int | jax.Array | None = None,
    tree: TreeMask | None = None,
) -> jax.Array:
    """Sliding-window attention over a per-row ring (``specjax.cache.RollingKVCache``).

    ``k, v [B, Hkv, S, D]`` (or ``[L, B, Hkv, S, D]`` with ``layer``): position ``p`` of
    row ``b`` lives in slot ``p % S``; queries sit at absolute ``lengths[b] + [0, t_q)``
    and were just written, so ``S >= window + t_q - 1`` keeps every visible key alive.
    ``block_k`` (default: ``S``) must divide ``S``. ``tree``: the queries are token-tree nodes
    written at ``lengths + [0, t_q)`` (``tree.start == lengths``; ``window >= t_q``): the
    prefix within the window of each node's branch position, and its own ancestors.
    """
    body = default_body() if body is None else body
    k, v, layer = stacked(k, v, layer)
    size = k.shape[3]
    block_k = size if block_k is None else block_k
    _validate_dense(q, one_layer(k), one_layer(v), lead_pad, lengths, window, block_k, body)
    if window is None:
        raise ValueError("window must be an int >= 1 for a ring")
    if size < window + q.shape[1] - 1:
        raise ValueError(f"ring of {size} slots cannot hold window={window} plus t_q={q.shape[1]} new keys")
    check_tree(tree, q, window)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    start, anc = (None, None) if tree is None else (jnp.asarray(tree.start), jnp.asarray(tree.anc))
    return _ragged_attention(
        q, k, v, jnp.asarray(lead_pad), jnp.asarray(lengths), layer, start, anc, window=window, scale=scale,
        block_k=block_k, body=body, interpret=interpret_arg(interpret), ring=True,
    )


# the XLA oracles the dense and ring kernels are tested against (``pallas_kernels.reference``)
ragged_attention_reference = dense_reference
ring_attention_reference = ring_reference
