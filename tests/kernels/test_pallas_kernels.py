"""Pallas kernels vs the XLA oracle, in interpret mode on CPU.

Tolerances (max abs error vs the float32 oracle): float32 inputs 2e-5;
bfloat16 inputs 3e-2 (inputs rounded to bf16, output stored as bf16).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged import paged_attention, paged_attention_reference
from pallas_kernels.ragged import (
    ragged_attention,
    ragged_attention_reference,
    ring_attention,
    ring_attention_reference,
)
from specjax.cache import DenseKVCache, PagedKVCache, RollingKVCache

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
B = 4


def _rows(rng, t_q, num_keys, window):
    """Ragged rows: one with no live key (lead pad past its queries), one at full capacity."""
    q_start = rng.integers(0, num_keys - t_q + 1, B).astype(np.int32)
    q_start[1] = num_keys - t_q  # queries end at the last slot: full capacity
    lead = np.minimum(rng.integers(0, 9, B), q_start).astype(np.int32)
    lead[1] = 0
    lead[2] = q_start[2] + t_q  # no visible key: must return zeros
    return lead, q_start


def _data(rng, t_q, hq, hkv, d, num_keys, dtype):
    """q ``[B, t_q, Hq, D]``; k, v head-major ``[B, Hkv, T, D]`` (the cache layout)."""
    q = rng.standard_normal((B, t_q, hq, d)).astype(np.float32)
    k = rng.standard_normal((B, hkv, num_keys, d)).astype(np.float32)
    v = rng.standard_normal((B, hkv, num_keys, d)).astype(np.float32)
    return (jnp.asarray(x, dtype) for x in (q, k, v))


# (t_q, Hq, Hkv, head_dim, block_k, num_keys, window, dtype)
DENSE_CASES = [
    (1, 4, 4, 64, 16, 64, None, jnp.float32),
    (4, 4, 1, 64, 32, 64, None, jnp.float32),
    (8, 8, 2, 128, 16, 48, None, jnp.float32),
    (4, 4, 1, 128, 16, 64, 12, jnp.float32),
    (1, 2, 2, 64, 8, 32, 5, jnp.float32),
    (4, 4, 1, 64, 16, 64, None, jnp.bfloat16),
    (8, 2, 2, 128, 32, 64, 20, jnp.bfloat16),
    (4, 4, 2, 64, 256, 256, 40, jnp.float32),  # the loop body steps 64 keys at a time (LOOP_BLOCK)
]


@pytest.mark.parametrize("body", ["grid", "loop"])
@pytest.mark.parametrize("t_q,hq,hkv,d,block,num_keys,window,dtype", DENSE_CASES)
def test_ragged_kernel_matches_reference(body, t_q, hq, hkv, d, block, num_keys, window, dtype):
    rng = np.random.default_rng(t_q * 1000 + hq * 10 + d + block)
    q, k, v = _data(rng, t_q, hq, hkv, d, num_keys, dtype)
    lead, qs = _rows(rng, t_q, num_keys, window)
    out = ragged_attention(q, k, v, lead, qs, window=window, block_k=block, body=body)
    ref = ragged_attention_reference(q, k, v, lead, qs, window=window)
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[2], 0.0)


def test_ragged_grid_body_under_tpu_interpreter():
    rng = np.random.default_rng(9)
    q, k, v = _data(rng, 4, 4, 2, 64, 64, jnp.float32)
    lead, qs = _rows(rng, 4, 64, None)
    out = ragged_attention(q, k, v, lead, qs, block_k=16, body="grid", interpret="tpu")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ragged_attention_reference(q, k, v, lead, qs)), atol=2e-5)


@pytest.mark.parametrize("window", [None, 5, 30])
def test_live_block_range_is_exactly_the_blocks_a_row_sees(window):
    """``(first, last)`` are the first and last key blocks holding a key visible to some query
    of the row (``first > last`` when none): the kernels skip every other block. Skipping is
    invisible in the output (a masked block's values are dropped, even NaN), so it is checked
    here, against the visibility of every slot."""
    from pallas_kernels._online_softmax import live_block_range

    block, num_keys, t_q = 8, 64, 3
    for q_start in range(0, num_keys - t_q + 1, 5):
        for lead in range(0, q_start + t_q + 2, 3):
            pos = np.arange(num_keys)
            seen = np.zeros(num_keys, bool)
            for t in range(t_q):
                q = q_start + t
                seen |= (pos >= lead) & (pos <= q) & ((pos > q - window) if window else True)
            first, last = (int(x) for x in live_block_range(lead, q_start, t_q, window, block, num_keys))
            blocks = np.nonzero(seen)[0] // block
            if len(blocks):
                assert (first, last) == (blocks.min(), blocks.max()), (q_start, lead, window)
            else:
                assert first > last, (q_start, lead, window)


@pytest.mark.parametrize("body", ["grid", "loop"])
def test_blocks_outside_the_live_range_are_never_read(body):
    """NaN in every block wholly outside a row's live range: the output stays finite and exact.
    (A masked value is dropped even where read, so which blocks are visited is checked by
    ``test_live_block_range_is_exactly_the_blocks_a_row_sees``.)"""
    rng = np.random.default_rng(4)
    t_q, block, num_keys = 4, 16, 96
    q, k, v = (np.array(x) for x in _data(rng, t_q, 4, 2, 64, num_keys, jnp.float32))
    lead = np.array([20, 0, 33, 50], np.int32)
    qs = np.array([40, 10, 60, 90], np.int32)
    window = None
    for b in range(B):
        first, last = lead[b] // block, (qs[b] + t_q - 1) // block
        for j in range(num_keys // block):
            if j < first or j > last:
                k[b, :, j * block : (j + 1) * block] = np.nan
                v[b, :, j * block : (j + 1) * block] = np.nan
    out = np.asarray(ragged_attention(q, k, v, lead, qs, window=window, block_k=block, body=body))
    assert np.isfinite(out).all()
    kk, vv = np.nan_to_num(k), np.nan_to_num(v)
    np.testing.assert_allclose(out, np.asarray(ragged_attention_reference(q, kk, vv, lead, qs)), atol=2e-5)


# (t_q, Hq, Hkv, head_dim, page, max_pages, window, dtype)
PAGED_CASES = [
    (1, 4, 4, 64, 8, 6, None, jnp.float32),
    (4, 4, 1, 128, 16, 4, None, jnp.float32),
    (8, 8, 2, 64, 8, 8, 10, jnp.float32),
    (4, 4, 1, 64, 16, 4, None, jnp.bfloat16),
]


@pytest.mark.parametrize("body", ["grid", "loop"])
@pytest.mark.parametrize("t_q,hq,hkv,d,page,max_pages,window,dtype", PAGED_CASES)
def test_paged_kernel_matches_reference(body, t_q, hq, hkv, d, page, max_pages, window, dtype):
    rng = np.random.default_rng(page * 100 + t_q + d)
    num_keys = page * max_pages
    num_pages = B * max_pages + 3
    q = jnp.asarray(rng.standard_normal((B, t_q, hq, d)), dtype)
    kp = jnp.asarray(rng.standard_normal((num_pages, hkv, page, d)), dtype)
    vp = jnp.asarray(rng.standard_normal((num_pages, hkv, page, d)), dtype)
    lead, qs = _rows(rng, t_q, num_keys, window)
    bt = rng.permutation(num_pages)[: B * max_pages].reshape(B, max_pages).astype(np.int32)  # shuffled
    # pages past each row's last query are unowned (-1)
    for b in range(B):
        bt[b, (qs[b] + t_q - 1) // page + 1 :] = -1
    out = paged_attention(q, kp, vp, bt, lead, qs, window=window, body=body)
    ref = paged_attention_reference(q, kp, vp, bt, lead, qs, window=window)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[2], 0.0)


# (t_q, Hq, Hkv, head_dim, ring size, block, window, dtype)
RING_CASES = [
    (1, 4, 2, 64, 16, None, 8, jnp.float32),
    (4, 4, 1, 64, 24, 8, 12, jnp.float32),
    (8, 2, 2, 128, 32, 16, 20, jnp.bfloat16),
]


@pytest.mark.parametrize("body", ["grid", "loop"])
@pytest.mark.parametrize("t_q,hq,hkv,d,size,block,window,dtype", RING_CASES)
def test_ring_kernel_matches_reference(body, t_q, hq, hkv, d, size, block, window, dtype):
    """Per-row rings at different absolute lengths: short rows (slots never written) and rows
    that wrapped around several times."""
    rng = np.random.default_rng(size + t_q + d)
    q, k, v = _data(rng, t_q, hq, hkv, d, size, dtype)
    lengths = np.array([0, 3, 5 * size + 7, 2 * size], np.int32)
    lead = np.array([0, 0, 4 * size, 2 * size + t_q], np.int32)  # row 3: lead past its queries -> zeros
    out = ring_attention(q, k, v, lead, lengths, window=window, block_k=block, body=body)
    ref = ring_attention_reference(q, k, v, lead, lengths, window=window)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[3], 0.0)


@pytest.mark.parametrize("kind", ["dense", "paged", "ring"])
def test_cache_attend_pallas_matches_xla(kind):
    """Every cache kind's ``attend(impl="pallas")`` (interpret mode here) equals its XLA path."""
    rng = np.random.default_rng(3)
    layers, hkv, d, t = 2, 2, 32, 4
    if kind == "dense":
        c = DenseKVCache.create(layers, B, 64, hkv, d)
    elif kind == "paged":
        c = PagedKVCache.create(layers, B, 40, 8, 8, hkv, d)
    else:
        c = RollingKVCache.create(layers, B, 6, 10, hkv, d)
    lengths = np.array([0, 9, 30, 17], np.int32)
    for layer in range(layers):  # fill, then position every row at its own length
        for lo in range(0, 36, t):
            c = c.replace(lengths=jnp.full((B,), lo, jnp.int32))
            if kind == "paged":
                c = c.reserve(t)
            kv = rng.standard_normal((2, B, t, hkv, d)).astype(np.float32)
            c = c.write(layer, jnp.asarray(kv[0]), jnp.asarray(kv[1]))
    c = c.replace(lengths=jnp.asarray(lengths))
    if kind == "dense":
        c = c.replace(start=jnp.asarray([0, 2, 5, 0], jnp.int32))
    q = jnp.asarray(rng.standard_normal((B, t, 4, d)), jnp.float32)
    for layer in range(layers):
        a = c.attend(q, layer, impl="pallas")
        b = c.attend(q, layer, impl="xla")
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


@pytest.mark.parametrize("body", ["grid", "loop"])
@pytest.mark.parametrize("kind", ["dense", "ring", "paged"])
def test_stacked_layers_read_the_traced_layer(kind, body):
    """Every layer's buffer ``[L, ...]`` and a layer index traced under ``jit`` (as in the
    model's layer scan) read exactly that layer: the result equals the one-layer call."""
    import jax

    rng = np.random.default_rng(11)
    layers, t_q, hq, hkv, d = 3, 4, 4, 2, 32
    q = jnp.asarray(rng.standard_normal((B, t_q, hq, d)), jnp.float32)
    lead = np.array([0, 2, 0, 5], np.int32)
    if kind == "paged":
        page, max_pages = 8, 4
        kp, vp = (jnp.asarray(rng.standard_normal((layers, B * max_pages, hkv, page, d)), jnp.float32)
                  for _ in range(2))
        bt = rng.permutation(B * max_pages).reshape(B, max_pages).astype(np.int32)
        qs = np.array([3, 20, 28, 9], np.int32)
        fn = lambda k, v, layer: paged_attention(q, k, v, bt, lead, qs, body=body, layer=layer)  # noqa: E731
        one = lambda i: paged_attention(q, kp[i], vp[i], bt, lead, qs, body=body)  # noqa: E731
    else:
        size = 32
        kp, vp = (jnp.asarray(rng.standard_normal((layers, B, hkv, size, d)), jnp.float32) for _ in range(2))
        if kind == "ring":
            qs = np.array([3, 40, 70, 9], np.int32)
            fn = lambda k, v, layer: ring_attention(q, k, v, lead, qs, window=12, body=body, layer=layer)  # noqa: E731
            one = lambda i: ring_attention(q, kp[i], vp[i], lead, qs, window=12, body=body)  # noqa: E731
        else:
            qs = np.array([3, 20, 28, 9], np.int32)
            fn = lambda k, v, layer: ragged_attention(q, k, v, lead, qs, block_k=8, body=body, layer=layer)  # noqa: E731
            one = lambda i: ragged_attention(q, kp[i], vp[i], lead, qs, block_k=8, body=body)  # noqa: E731
    jitted = jax.jit(fn)
    outs = [np.asarray(jitted(kp, vp, jnp.int32(i))) for i in range(layers)]
    for i in range(layers):
        np.testing.assert_allclose(outs[i], np.asarray(one(i)), atol=2e-5)
    assert not np.allclose(outs[0], outs[1])  # the layers differ: reading the wrong one would show


def test_stacked_bad_layer():
    q = np.zeros((B, 4, 4, 64), np.float32)
    k = np.zeros((3, B, 2, 64, 64), np.float32)
    lead = qs = np.zeros(B, np.int32)
    with pytest.raises(ValueError, match=r"per-layer stack of 3 layers: pass layer="):
        ragged_attention(q, k, k, lead, qs, block_k=16)
    with pytest.raises(ValueError, match=r"layer=3 is out of range for k stacking 3 layers"):
        ragged_attention(q, k, k, lead, qs, block_k=16, layer=3)
    with pytest.raises(ValueError, match=r"k must be one layer .* or a per-layer stack \(rank 5\)"):
        ragged_attention(q, k[0, 0], k[0, 0], lead, qs, block_k=16)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_k=24), r"block_k=24 must divide the key length T=64"),
        (dict(body="cuda"), r"body must be one of \['grid', 'loop'\]"),
        (dict(k=np.zeros((B, 3, 64, 64), np.float32)), r"q heads 4 must be a multiple of k heads 3"),
        (dict(q=np.zeros((B, 4, 4, 64), np.int32)), r"q dtype must be float32"),
        (dict(qs=np.array([0, 0, 0, 61], np.int32)), r"q_start \+ t_q must lie in \[t_q, 64\]; rows \[3\]"),
        (dict(lead=np.array([0, -1, 0, 0], np.int32)), r"lead_pad must be >= 0; rows \[1\]"),
        (dict(lead=np.zeros(3, np.int32)), r"lead_pad must have shape \[B\]"),
    ],
)
def test_kernel_bad_input(kwargs, match):
    args = dict(q=np.zeros((B, 4, 4, 64), np.float32), k=np.zeros((B, 2, 64, 64), np.float32),
                lead=np.zeros(B, np.int32), qs=np.zeros(B, np.int32), block_k=16, body="grid") | kwargs
    with pytest.raises(ValueError, match=match):
        ragged_attention(args["q"], args["k"], args["k"], args["lead"], args["qs"], block_k=args["block_k"],
                         body=args["body"])


@pytest.mark.parametrize("body", ["grid", "loop"])
def test_paged_kernel_under_jit_with_a_concrete_block_table(body):
    """A concrete block table closed over by a jitted caller is still checked on the host
    (the check's bounds are evaluated now, not staged into the trace), and the call runs."""
    import jax

    rng = np.random.default_rng(8)
    q = jnp.asarray(rng.standard_normal((B, 2, 2, 32)), jnp.float32)
    kp, vp = (jnp.asarray(rng.standard_normal((12, 2, 8, 32)), jnp.float32) for _ in range(2))
    bt = np.arange(12, dtype=np.int32).reshape(B, 3)
    lead, qs = np.zeros(B, np.int32), np.array([0, 5, 10, 22], np.int32)
    out = jax.jit(lambda q: paged_attention(q, kp, vp, bt, lead, qs, body=body))(q)
    np.testing.assert_allclose(np.asarray(out), np.asarray(paged_attention_reference(q, kp, vp, bt, lead, qs)),
                               atol=2e-5)
    bad = bt.copy()
    bad[3, 2] = 40
    with pytest.raises(ValueError, match=r"block_table row 3 has pages \[9, 10, 40\]"):
        jax.jit(lambda q: paged_attention(q, kp, vp, bad, lead, qs, body=body))(q)


def test_paged_bad_block_table():
    q = np.zeros((B, 1, 2, 64), np.float32)
    kp = np.zeros((5, 2, 8, 64), np.float32)
    bt = np.full((B, 2), -1, np.int32)
    with pytest.raises(ValueError, match=r"block_table row 0 has pages \[-1\]"):
        paged_attention(q, kp, kp, bt, np.zeros(B, np.int32), np.zeros(B, np.int32))


def test_query_rows_stack_per_kv_head_and_back():
    """The loop body's query layout: KV head ``h``'s rows are ``group_queries``' (row ``g * t_q +
    t`` is token ``t`` of head ``h * G + g``), zero-padded to a power of two >= 16; unstacking
    gives ``q`` back exactly."""
    from pallas_kernels._online_softmax import group_queries, query_rows, stack_query_rows, unstack_query_rows

    assert [query_rows(t, g) for t, g in ((1, 4), (3, 4), (4, 4), (3, 8), (8, 8))] == [16, 16, 16, 32, 64]
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 8, 16)), jnp.float32)
    rows = query_rows(3, 4)
    x = stack_query_rows(q, 2, rows)
    assert x.shape == (2, 2, rows, 16)
    for b in range(2):
        for h in range(2):
            np.testing.assert_array_equal(x[b, h, :12], group_queries(q[b], h, 4))
            np.testing.assert_array_equal(x[b, h, 12:], 0.0)
    np.testing.assert_array_equal(unstack_query_rows(x, 3, 8), q)


def _random_tree_mask(rng, n, t_q, num_keys):
    """A ``TreeMask`` per row: ``n`` window nodes of random shape at a random start, the
    queries its last ``t_q`` nodes (all of them: a verify window; some: one depth of a drafting
    tree), ``q_start`` their first slot."""
    from specjax.tree import TreeMask, ancestors

    parents = np.array([[-1] + [int(rng.integers(0, j)) for j in range(1, n)] for _ in range(B)], np.int32)
    start = rng.integers(0, num_keys - n + 1, B).astype(np.int32)
    anc = np.asarray(ancestors(jnp.asarray(parents)))[:, n - t_q:]
    pos = jnp.asarray(start[:, None] + np.arange(n - t_q, n)[None], jnp.int32)  # (no window: positions unused)
    return TreeMask(jnp.asarray(start), jnp.asarray(anc), pos, pos), start + n - t_q


@pytest.mark.parametrize("body", ["grid", "loop"])
@pytest.mark.parametrize("kernel", ["dense", "paged"])
@pytest.mark.parametrize("seed", range(3))
def test_tree_mask_in_the_kernels_matches_the_oracle(kernel, body, seed):
    """Random token trees (each row its own shape, start and lead pad): a node reads the
    committed prefix and its own ancestors only, in both bodies of the dense and paged kernels,
    as the oracle (``reference.tree_mask_visible``) says."""
    rng = np.random.default_rng(seed)
    n, hq, hkv, d, num_keys = int(rng.integers(2, 12)), 4, 2, 64, 64
    t_q = int(rng.integers(1, n + 1))
    tree, q_start = _random_tree_mask(rng, n, t_q, num_keys)
    q, k, v = _data(rng, t_q, hq, hkv, d, num_keys, jnp.float32)
    lead = np.minimum(rng.integers(0, 6, B), np.asarray(tree.start)).astype(np.int32)
    if kernel == "dense":
        got = ragged_attention(q, k, v, lead, q_start, block_k=16, body=body, tree=tree)
        want = ragged_attention_reference(q, k, v, lead, q_start, tree=tree)
    else:
        page = 8
        pool_k, pool_v, table = _pages(rng, k, v, page)
        got = paged_attention(q, pool_k, pool_v, table, lead, q_start, body=body, tree=tree)
        want = paged_attention_reference(q, pool_k, pool_v, table, lead, q_start, tree=tree)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL[jnp.float32])
    # a sibling's branch matters: the chain's causal mask over the same window gives another answer
    causal = ragged_attention_reference(q, k, v, lead, q_start) if kernel == "dense" else None
    if causal is not None and not np.all(np.tril(np.ones((n, n), bool))[n - t_q:] == np.asarray(tree.anc)):
        assert np.abs(np.asarray(causal) - np.asarray(want)).max() > 1e-4


@pytest.mark.parametrize("body", ["grid", "loop"])
@pytest.mark.parametrize("kernel", ["dense", "ring"])
@pytest.mark.parametrize("seed", range(3))
def test_tree_mask_with_a_sliding_window_matches_the_oracle(kernel, body, seed):
    """Token trees on sliding-window layers: each node reads the committed prefix within the
    window counted from its own branch position, and its ancestors, in both bodies of the dense
    kernel and of the ring kernel (a ring that wrapped around), as the oracle says."""
    from specjax.tree import TreeMask, ancestors

    rng = np.random.default_rng(seed)
    n, hq, hkv, d = int(rng.integers(2, 9)), 4, 2, 64
    parents = np.array([[-1] + [int(rng.integers(0, j)) for j in range(1, n)] for _ in range(B)], np.int32)
    anc = np.asarray(ancestors(jnp.asarray(parents)))
    window = int(rng.integers(n, n + 10))
    if kernel == "dense":
        num_keys = 64
        start = rng.integers(0, num_keys - n + 1, B).astype(np.int32)
    else:
        num_keys = 32  # ring slots >= window + t_q - 1
        start = rng.integers(0, 90, B).astype(np.int32)  # rows whose ring wrapped, and rows that did not
    pos = jnp.asarray(start[:, None] + anc.sum(axis=2) - 1, jnp.int32)
    tree = TreeMask(jnp.asarray(start), jnp.asarray(anc), pos, pos)
    q, k, v = _data(rng, n, hq, hkv, d, num_keys, jnp.float32)
    lead = np.minimum(rng.integers(0, 6, B), start).astype(np.int32)
    if kernel == "dense":
        got = ragged_attention(q, k, v, lead, start, window=window, block_k=16, body=body, tree=tree)
        want = ragged_attention_reference(q, k, v, lead, start, window=window, tree=tree)
        wide = ragged_attention_reference(q, k, v, lead, start, tree=tree)
    else:
        got = ring_attention(q, k, v, lead, start, window=window, block_k=16, body=body, tree=tree)
        want = ring_attention_reference(q, k, v, lead, start, window=window, tree=tree)
        wide = ring_attention_reference(q, k, v, lead, start, window=num_keys - n + 1, tree=tree)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL[jnp.float32])
    if (start - window > lead).any():  # the window hides keys the wider one shows
        assert np.abs(np.asarray(wide) - np.asarray(want)).max() > 1e-4


def _pages(rng, k, v, page):
    """``k, v [B, Hkv, T, D]`` scattered into a shuffled page pool: ``(pool_k, pool_v, table)``."""
    b, hkv, t, d = k.shape
    m = t // page
    perm = rng.permutation(b * m).astype(np.int32)
    table = perm.reshape(b, m)
    pool_k = np.zeros((b * m, hkv, page, d), np.float32)
    pool_v = np.zeros_like(pool_k)
    kk, vv = np.asarray(k).reshape(b, hkv, m, page, d), np.asarray(v).reshape(b, hkv, m, page, d)
    for r in range(b):
        for j in range(m):
            pool_k[table[r, j]], pool_v[table[r, j]] = kk[r, :, j], vv[r, :, j]
    return jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table)


def test_kernel_tree_mask_bad_input():
    from specjax.tree import TreeMask

    q = jnp.zeros((2, 3, 4, 16))
    kv = jnp.zeros((2, 2, 32, 16))
    zeros = jnp.zeros((2,), jnp.int32)
    good = TreeMask(zeros, jnp.ones((2, 3, 3), bool), jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"tree attention with window=2 needs window >= t_q=3"):
        ragged_attention(q, kv, kv, zeros, zeros, window=2, block_k=16, tree=good)
    with pytest.raises(ValueError, match=r"tree.anc must have shape \[B, t_q, N\]=\(2, 3, N\), got \(2, 4, 3\)"):
        ragged_attention(q, kv, kv, zeros, zeros, block_k=16, tree=good._replace(anc=jnp.ones((2, 4, 3), bool)))


def _lower_for_cuda(fn, q) -> str:
    """``fn(q)`` lowered for CUDA from this CPU machine, with Pallas's Mosaic GPU switched on:
    the loop body asks for Triton itself, even where Mosaic GPU is jax's default."""
    import jax

    flag = "jax_pallas_use_mosaic_gpu"
    before = getattr(jax.config, flag, None)
    if before is not None:
        jax.config.update(flag, True)
    try:
        return jax.jit(fn).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        if before is not None:
            jax.config.update(flag, before)


# (kernel, t_q, Hq, Hkv, dtype): decode and verify windows (t_q 3: G * t_q not a power of two)
GPU_CASES = [("dense", 1, 8, 2, jnp.bfloat16), ("dense", 3, 8, 1, jnp.float32), ("ring", 4, 4, 4, jnp.float32),
             ("paged", 3, 8, 2, jnp.bfloat16), ("paged", 1, 4, 1, jnp.float32)]


@pytest.mark.parametrize("kernel,t_q,hq,hkv,dtype", GPU_CASES)
def test_loop_body_lowers_for_gpu(kernel, t_q, hq, hkv, dtype):
    """The GPU body lowers to Triton: lowered for CUDA from this CPU machine (no GPU needed); it
    names Pallas's Triton backend itself (``jax_pallas_use_mosaic_gpu`` aside). Triton takes no
    value slice and only power-of-two loads (jax 0.11 on an H200 failed every kernel on the
    first: 'Unimplemented primitive in Pallas Triton lowering: slice'). Compiling and running
    there is ``benchmarks/gpu_check.py``'s job."""

    pytest.importorskip("jax.experimental.pallas.triton")  # a jax built without Pallas's Triton backend

    b, d, num_keys, layers = 2, 64, 256, 3
    q = jnp.zeros((b, t_q, hq, d), dtype)
    lead, qs = jnp.zeros((b,), jnp.int32), jnp.full((b,), 100, jnp.int32)
    kv = jnp.zeros((layers, b, hkv, num_keys, d), dtype)
    pages = jnp.zeros((layers, 20, hkv, 16, d), dtype)
    table = jnp.zeros((b, num_keys // 16), jnp.int32)
    fn = {
        "dense": lambda q: ragged_attention(q, kv, kv, lead, qs, block_k=64, body="loop", interpret=False, layer=1),
        "ring": lambda q: ring_attention(q, kv, kv, lead, qs, window=100, body="loop", interpret=False, layer=2),
        "paged": lambda q: paged_attention(q, pages, pages, table, lead, qs, body="loop", interpret=False, layer=0),
    }[kernel]
    assert "triton" in _lower_for_cuda(fn, q).lower()


@pytest.mark.parametrize("kernel", ["dense", "paged", "ring"])
def test_tree_kernels_lower_for_gpu(kernel):
    """The loop body with a token tree's mask (its one-hot dot included) lowers to Triton."""

    pytest.importorskip("jax.experimental.pallas.triton")
    from specjax.tree import TreeMask

    b, t_q, hq, hkv, d, num_keys, layers = 2, 7, 8, 2, 64, 256, 2
    q = jnp.zeros((b, t_q, hq, d), jnp.bfloat16)
    lead, qs = jnp.zeros((b,), jnp.int32), jnp.full((b,), 100, jnp.int32)
    tree = TreeMask(qs, jnp.ones((b, t_q, t_q), bool), jnp.zeros((b, t_q), jnp.int32), jnp.zeros((b, t_q), jnp.int32))
    kv = jnp.zeros((layers, b, hkv, num_keys, d), jnp.bfloat16)
    pages = jnp.zeros((layers, 40, hkv, 16, d), jnp.bfloat16)
    table = jnp.zeros((b, num_keys // 16), jnp.int32)
    fn = {
        "dense": lambda q: ragged_attention(q, kv, kv, lead, qs, block_k=64, body="loop", interpret=False, layer=1,
                                            tree=tree),
        "paged": lambda q: paged_attention(q, pages, pages, table, lead, qs, body="loop", interpret=False, layer=0,
                                           tree=tree),
        "ring": lambda q: ring_attention(q, kv, kv, lead, qs, window=100, block_k=64, body="loop", interpret=False,
                                         layer=1, tree=tree),
    }[kernel]
    assert "triton" in _lower_for_cuda(fn, q).lower()


@pytest.mark.parametrize("cache,sliding,tree", [("dense", False, None), ("paged", False, None),
                                               ("dense", True, None), ("paged", False, "dynamic:6,2"),
                                               ("dense", True, "dynamic:6,2")])
def test_engine_with_pallas_attention_lowers_for_gpu(cache, sliding, tree, monkeypatch):
    """The whole generate loop (depth="auto", n-gram) with ``attention_impl="pallas"`` lowers
    for CUDA from this CPU machine: every layer's kernel is the loop body in Triton (as on a
    GPU: the body and interpret mode follow the backend, here patched to a GPU's choice); with
    sliding-window layers, their rings' kernel too; with a token tree (the MTP drafter, depth
    3), the tree step's kernels (the target's and the MTP block's) too."""
    import jax

    pytest.importorskip("jax.experimental.pallas.triton")

    import pallas_kernels.paged as paged_module
    import pallas_kernels.ragged as ragged_module
    from specjax.auto import auto_state
    from specjax.auto.cost import placeholder_cost
    from specjax.engine import generate_loop
    from specjax.generation import setup
    from specjax.generation_config import GenerationConfig
    from specjax.model import ModelConfig, init_model

    for module in (ragged_module, paged_module):
        monkeypatch.setattr(module, "default_body", lambda: "loop")
        monkeypatch.setattr(module, "interpret_arg", lambda interpret: False)
    cfg = ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
                      tie_embeddings=False, sliding_window=30 if sliding else None, global_every=2 if sliding else 0)
    settings = GenerationConfig(max_new_tokens=8, drafter="ngram", depth="auto", cache=cache, attention_impl="pallas")
    if tree:
        settings = settings.replace(drafter="mtp", depth=3, tree=tree)
    eng, params, args = setup(init_model(cfg), [[1, 2, 3], [4, 5]], settings)
    if sliding and not tree:  # a ring of 30 + 2w + 2 = 40 slots held in 48, read in blocks of 16 (a dot's N >= 16)
        assert eng.new_cache(eng.target, 2).local_kv.size == 48
    auto = None if tree else auto_state(eng, placeholder_cost(eng, 2), 2)
    lowered = jax.jit(generate_loop, static_argnums=0).trace(
        eng, params, *args, auto, np.int32(eng.max_steps)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


@pytest.mark.parametrize("kernel", ["dense", "paged", "ring"])
@pytest.mark.parametrize("body", ["grid", "loop"])
def test_non_finite_values_in_unseen_slots_never_reach_a_row(kernel, body):
    """NaN / Inf in every slot inside the live blocks that no query of its row sees (before the
    lead pad, past the last query, outside the window): the output is what zeros there give."""
    from specjax.attention import ring_positions

    rng = np.random.default_rng(12)
    t_q, hq, hkv, d, block, window = 4, 4, 2, 32, 16, 10
    lead = np.array([3, 0, 20, 7], np.int32)
    qs = np.array([10, 27, 40, 5], np.int32)
    q = jnp.asarray(rng.standard_normal((B, t_q, hq, d)), jnp.float32)

    def seen(pos):  # [B, T] positions -> visible to some query of the row
        lo = np.maximum(lead, qs - window + 1)[:, None]
        return (pos >= 0) & (pos >= lo) & (pos <= (qs + t_q - 1)[:, None])

    if kernel == "ring":
        size = 16
        pos = np.asarray(ring_positions(jnp.asarray(qs), t_q, size))
        k, v = (rng.standard_normal((B, hkv, size, d)).astype(np.float32) for _ in range(2))
        run = lambda k, v: ring_attention(q, k, v, lead, qs, window=window, block_k=8, body=body)  # noqa: E731
        poison = ~seen(pos)[:, None, :, None]
    elif kernel == "dense":
        k, v = (rng.standard_normal((B, hkv, 64, d)).astype(np.float32) for _ in range(2))
        run = lambda k, v: ragged_attention(q, k, v, lead, qs, window=window, block_k=block, body=body)  # noqa: E731
        poison = ~seen(np.broadcast_to(np.arange(64), (B, 64)))[:, None, :, None]
    else:
        page, pages = 8, 6
        bt = np.arange(B * pages, dtype=np.int32).reshape(B, pages)
        k, v = (rng.standard_normal((B * pages, hkv, page, d)).astype(np.float32) for _ in range(2))
        run = lambda k, v: paged_attention(q, k, v, bt, lead, qs, window=window, body=body)  # noqa: E731
        slot_seen = seen(np.broadcast_to(np.arange(pages * page), (B, pages * page)))  # row b owns pages bt[b]
        poison = ~slot_seen.reshape(B * pages, 1, page, 1)
    clean = np.asarray(run(np.where(poison, 0, k), np.where(poison, 0, v)))
    for value in (np.nan, np.inf):
        out = np.asarray(run(np.where(poison, value, k), np.where(poison, value, v)))
        assert np.isfinite(out).all(), (kernel, body, value)
        np.testing.assert_allclose(out, clean, atol=2e-5)
