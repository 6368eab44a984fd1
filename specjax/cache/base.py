"""What every KV cache kind shares: per-row status flags and small checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._online_softmax import target_platform

__all__ = [
    "ATTENTION_IMPLS", "CAPACITY_EXCEEDED", "OUT_OF_PAGES", "POOL_GROUP_MISMATCH", "ROLLBACK_INVALID", "STATUS_OK",
    "describe_status", "positions", "resolve_attention_impl",
]

# How a cache's ``attend`` runs: "xla" (specjax.attention.live_attention), "pallas"
# (pallas_kernels, interpret mode on CPU) or "auto" (Pallas on TPU, XLA on GPU and CPU).
ATTENTION_IMPLS = ("xla", "pallas", "auto")
# The Pallas kernels keep a row's queries whole in VMEM (no query blocking): a verify window,
# a tree, a prefill chunk. A longer forward (a whole prompt) takes the XLA path: compiled for
# TPU v5e, a 640-query prefill of llama3.1-8b asked 30 MB of a 16 MB scoped VMEM.
KERNEL_MAX_QUERIES = 128
CAPACITY_BLOCK = 128  # request-sized capacities are multiples of this (kernel key blocks divide them)
XLA_SINGLE_PASS = 512  # up to this many key slots the XLA path is one fused pass (no loop)

# Per-row status bits (sticky: OR-ed into ``cache.status [B]``). A row whose write
# or advance would pass its capacity is *not* written/advanced and gets a bit here;
# nothing relies on XLA's silent index clamping.
STATUS_OK = 0
CAPACITY_EXCEEDED = 1  # write/advance past the row's capacity (dense) or page budget (paged)
OUT_OF_PAGES = 2  # the shared page pool had no free page for this row
ROLLBACK_INVALID = 4  # rollback target outside [start, lengths] (or past a ring's slack)
POOL_GROUP_MISMATCH = 8  # a paged row refilled through another pool group's view (rows_view)

UNBOUNDED = 2**30  # a write bound (``bound_write``) that is not set

_NAMES = {CAPACITY_EXCEEDED: "capacity exceeded", OUT_OF_PAGES: "out of pages", ROLLBACK_INVALID: "invalid rollback",
          POOL_GROUP_MISMATCH: "refilled from another pool group"}


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


# Per-layer buffers come in two layouts (one per layer loop of ``specjax.model``): a tuple of
# one buffer per layer (the unrolled loop: a layer's attention reads its own buffer, a write
# updates it in place) or one stack ``[L, ...]`` (the layer scan: ``layer`` may be traced; a
# write scatters into the stack in place, the XLA path slices only the key blocks it reads,
# the Pallas kernels read the layer in place). The helpers below take either.
Layers = tuple | jax.Array


def layer_buffers(layers: int, shape: tuple, dtype, stacked: bool) -> Layers:
    """Zeroed per-layer buffers of ``shape``: a ``[layers, *shape]`` stack or a tuple."""
    if stacked:
        return jnp.zeros((layers, *shape), dtype)
    return tuple(jnp.zeros(shape, dtype) for _ in range(layers))


def layer_spec(buf: Layers) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one layer's buffer (no slice is taken)."""
    return jax.ShapeDtypeStruct(buf[0].shape, buf[0].dtype) if isinstance(buf, tuple) else \
        jax.ShapeDtypeStruct(buf.shape[1:], buf.dtype)


def is_stacked(buf: Layers) -> bool:
    return not isinstance(buf, tuple)


def per_head(idx: tuple, heads: int) -> tuple:
    """``(a, :, b)`` (a layer's first and third axes, ``[B, t]`` or broadcasting) as one index
    per head, ``(a[..., None], arange(heads), b[..., None])``: the same entries, each a
    ``head_dim`` row. Why: the window of an ``(a, :, b)`` scatter, ``[heads, head_dim]``, is
    strided in the cache's ``[.., heads, slots, head_dim]`` layout. Where XLA:TPU may choose a
    cache's layout (one written several times in a step, as the MTP block's is), it then picks
    slot-major for the scatter and copies the cache to the kernels' layout and back around
    every write. A ``head_dim`` row is contiguous in the kernels' layout: no copy."""
    a, _, b = idx
    return jnp.asarray(a)[..., None], jnp.arange(heads, dtype=jnp.int32), jnp.asarray(b)[..., None]


def lane_dense(buf: Layers) -> bool:
    """Whether one head's ``head_dim`` row fills whole TPU lane tiles (a multiple of 128): the
    cache is then laid out ``head_dim``-minor, the kernels' layout, and a row is contiguous.
    At head_dim 64 XLA:TPU lays a cache out slot-minor instead (no lane padding) and every
    write relayouts it either way (docs/usage/tpu-compile.md)."""
    return layer_spec(buf).shape[-1] % 128 == 0


def set_rows(buf: Layers, layer: int | jax.Array, idx: tuple, value: jax.Array) -> Layers:
    """``buf[layer][idx] = value`` (out-of-range indices dropped), in place in either layout.
    ``idx = (a, :, b)`` indexes a layer's first and third axes; the view it names, and
    ``value``, are ``[*broadcast(a, b), heads, head_dim]``."""
    if len(idx) == 3 and isinstance(idx[1], slice) and np.size(idx[0]) == 1 and np.size(idx[2]) == 1:
        # one token of one row: XLA rewrites a scatter of one entry (one head) into a dynamic
        # update slice, which its fusion then duplicates into the attention that reads the
        # buffer, copying every layer's K and V each step. A second entry, out of range
        # (dropped), keeps it a scatter
        spare = layer_spec(buf).shape[2]
        idx = (jnp.concatenate([jnp.reshape(idx[0], (1, 1))] * 2, axis=1), idx[1],
               jnp.concatenate([jnp.reshape(idx[2], (1, 1)), jnp.full((1, 1), spare, jnp.int32)], axis=1))
        value = jnp.concatenate([jnp.reshape(value, (1, 1, *value.shape[-2:]))] * 2, axis=1)
    if value.shape[1] <= KERNEL_MAX_QUERIES and lane_dense(buf):
        # a step's few tokens a row, one index per head (``per_head``). Not a whole prompt: its
        # write, so indexed, tripled the prefill's temporaries (llama3.1-8b, 32 rows of 640,
        # v5e, 1x4 mesh: 1.3 -> 4.0 GiB a chip), and a prefill writes a fresh cache once
        idx = per_head(idx, layer_spec(buf).shape[1])
    if isinstance(buf, tuple):
        new = buf[layer].at[idx].set(value.astype(buf[layer].dtype), mode="drop")
        return (*buf[:layer], new, *buf[layer + 1 :])
    return buf.at[(layer, *idx)].set(value.astype(buf.dtype), mode="drop")


def set_all_layers(big: Layers, idx: tuple, small: Layers) -> Layers:
    """``big[l][idx] = small[l]`` for every layer (out-of-range indices dropped)."""
    if isinstance(big, tuple):
        return tuple(b.at[idx].set(s, mode="drop") for b, s in zip(big, small, strict=True))
    return big.at[(slice(None), *idx)].set(small, mode="drop")


def move_slots(buf: Layers, frm: tuple[jax.Array, jax.Array], to: tuple[jax.Array, jax.Array]) -> Layers:
    """Every layer's ``[to[0], :, to[1]] = [frm[0], :, frm[1]]``: ``frm`` and ``to`` index a
    layer's first and third axes (a row and its slot, or a pool page and its offset; ``[B, N]``
    or broadcasting), an out-of-range ``to`` dropped. One gather and one scatter of ``B * N``
    entries a layer (a token tree's compaction)."""
    dense = lane_dense(buf)
    frm, to = (per_head((a, None, b), layer_spec(buf).shape[1]) if dense else (a, slice(None), b)
               for a, b in (frm, to))  # D-rows where lane-dense: set_rows
    if isinstance(buf, tuple):
        return tuple(x.at[to].set(x[frm], mode="drop") for x in buf)
    # lane-dense, the stack's layer is an index too (a slice over it copied the whole stack to a
    # layer-minor layout and back: XLA:TPU, a tree's compaction after the layer scan)
    lead = jnp.arange(buf.shape[0], dtype=jnp.int32).reshape((-1,) + (1,) * to[0].ndim) if dense else slice(None)
    return buf.at[(lead, *to)].set(buf[(lead, *frm)], mode="drop")


def layer_block(buf: Layers, layer: int | jax.Array, start: jax.Array | int, size: int, axis: int) -> jax.Array:
    """Layer ``layer``'s buffer restricted to ``[start, start + size)`` along ``axis`` (an axis
    of one layer's buffer): the buffer itself when that is all of it (tuple layout), else one
    dynamic slice (of the stack: never a copy of the whole layer)."""
    if isinstance(buf, tuple):
        x = buf[layer]
        return x if size == x.shape[axis] else jax.lax.dynamic_slice_in_dim(x, start, size, axis)
    idx = [jnp.int32(0)] * buf.ndim
    idx[0], idx[axis + 1] = jnp.asarray(layer, jnp.int32), jnp.asarray(start, jnp.int32)
    sizes = list(buf.shape)
    sizes[0], sizes[axis + 1] = 1, size
    return jax.lax.dynamic_slice(buf, idx, sizes)[0]


def kernel_operands(
    k: Layers, v: Layers, layer: int | jax.Array
) -> tuple[jax.Array, jax.Array, int | jax.Array | None]:
    """``(k, v, layer)`` for a Pallas kernel: one layer's buffers (``layer=None``) or the whole
    stacks and the layer to read in place."""
    return (k[layer], v[layer], None) if isinstance(k, tuple) else (k, v, layer)


def resolve_attention_impl(impl: str) -> str:
    """``"auto"`` -> ``"pallas"`` on TPU, ``"xla"`` elsewhere; a bad name is a ``ValueError``.

    Not Pallas on GPU: the kernels' bodies once sliced values, which JAX 0.11's Triton lowering
    rejects (``NotImplementedError: Unimplemented primitive in Pallas Triton lowering: slice``, an
    H200 run of ``benchmarks/gpu_check.py``), so "auto" there crashed every generate. The loop
    body lowers to Triton now (``tests/kernels/test_pallas_kernels.py``) but has not been compiled or
    run on a GPU."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is invalid: must be one of {list(ATTENTION_IMPLS)}")
    if impl == "auto":
        return "pallas" if target_platform() == "tpu" else "xla"
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
