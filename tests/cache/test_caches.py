"""Dense, rolling and paged caches against NumPy references and against each other."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.cache import (
    CAPACITY_EXCEEDED,
    OUT_OF_PAGES,
    POOL_GROUP_MISMATCH,
    ROLLBACK_INVALID,
    DenseKVCache,
    PagedKVCache,
    RollingKVCache,
    cache_supports_per_sequence_advance,
    describe_status,
    front_align_batch,
    front_pad_kv_cache,
)
from specjax.plan import plan_cohort_step, plan_per_sequence_step

from refs import ref_attention

B, L, HKV, HQ, D = 4, 2, 2, 4, 8
CAP = 48
W_VERIFY = 4  # verify window w = depth + 1
SLIDE = 6  # sliding window W
PAGE = 4


def _tok_major(x):
    """A stored K buffer ``[L, B|P, Hkv, T|page, D]`` (head-major) as ``[L, B|P, T|page, Hkv, D]``."""
    return np.asarray(x).swapaxes(2, 3)


def _dense():
    return DenseKVCache.create(L, B, CAP, HKV, D)


@functools.partial(jax.jit, static_argnums=1)
def _write(cache, layer, k, v):
    return cache.write(layer, k, v)


# ---------------------------------------------------------------- dense vs NumPy


@given(
    start=st.lists(st.integers(0, 6), min_size=B, max_size=B),
    grow=st.lists(st.lists(st.integers(0, 4), min_size=B, max_size=B), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_dense_write_advance_rollback_matches_numpy(start, grow, seed):
    rng = np.random.default_rng(seed)
    start = np.array(start, np.int32)
    cache = _dense().replace(lengths=jnp.asarray(start), start=jnp.asarray(start))
    ref_k = np.zeros((L, B, CAP, HKV, D), np.float32)
    ref_len = start.copy()
    for g in grow:
        kn = rng.standard_normal((B, W_VERIFY, HKV, D)).astype(np.float32)
        layer = int(rng.integers(0, L))
        cache = _write(cache, layer, kn, kn)
        for b in range(B):  # reference: a loop over rows, each at its own offset
            ref_k[layer, b, ref_len[b] : ref_len[b] + W_VERIFY] = kn[b]
        adv = np.array(g, np.int32)
        cache = cache.advance(adv)
        ref_len += adv
        back = np.maximum(ref_len - rng.integers(0, 3, B), start).astype(np.int32)
        cache = cache.rollback(back)
        ref_len = back
    assert (np.asarray(cache.status) == 0).all()
    np.testing.assert_array_equal(np.asarray(cache.lengths), ref_len)
    live = np.arange(CAP)[None] < (ref_len[:, None] + W_VERIFY)  # what the last write touched
    for b in range(B):
        np.testing.assert_array_equal(_tok_major(cache.k)[:, b, live[b]], ref_k[:, b, live[b]])


@pytest.mark.parametrize("stacked", [False, True])
def test_one_row_one_token_write_matches_numpy_and_drops_past_capacity(stacked):
    """A batch of one writing one token takes ``set_rows``' one-entry path: the entry lands at
    the row's length; at capacity nothing is written and the row is flagged."""
    cache = DenseKVCache.create(L, 1, CAP, HKV, D, stacked=stacked)
    kn = jnp.arange(HKV * D, dtype=jnp.float32).reshape(1, 1, HKV, D) + 1
    for length, layer in ((7, 1), (0, 0), (CAP - 1, 1)):
        out = _write(cache.replace(lengths=jnp.array([length], jnp.int32)), layer, kn, 2 * kn)
        want = np.zeros((L, 1, CAP, HKV, D), np.float32)
        want[layer, 0, length] = np.asarray(kn[0, 0])
        np.testing.assert_array_equal(_tok_major(out.k), want)
        np.testing.assert_array_equal(_tok_major(out.v), 2 * want)
        assert int(out.status[0]) == 0
    full = _write(cache.replace(lengths=jnp.array([CAP], jnp.int32)), 1, kn, kn)
    assert not _tok_major(full.k).any() and int(full.status[0]) == CAPACITY_EXCEEDED


def test_dense_write_is_per_row_not_shared_offset():
    cache = _dense().replace(lengths=jnp.array([0, 5, 9, 30], jnp.int32))
    kn = jnp.ones((B, 2, HKV, D)) * jnp.arange(1, B + 1, dtype=jnp.float32)[:, None, None, None]
    out = _write(cache, 1, kn, kn)
    k = _tok_major(out.k)
    for b, off in enumerate([0, 5, 9, 30]):
        written = np.nonzero(k[1, b, :, 0, 0])[0]
        np.testing.assert_array_equal(written, [off, off + 1])
        assert (k[1, b, off : off + 2] == b + 1).all()
    assert not k[0].any()  # other layer untouched


def test_dense_capacity_guard_reports_and_never_clamps():
    cache = _dense().replace(lengths=jnp.array([0, CAP - 2, CAP - 3, 10], jnp.int32))
    kn = jnp.ones((B, 3, HKV, D))
    out = _write(cache, 0, kn, kn)
    st_ = np.asarray(out.status)
    np.testing.assert_array_equal(st_, [0, CAPACITY_EXCEEDED, 0, 0])
    assert not _tok_major(out.k)[0, 1].any()  # the overflowing row wrote nothing (no clamped write)
    assert describe_status(out.status) == {1: ["capacity exceeded"]}
    adv = out.advance(jnp.array([1, 1, 4, 1]))
    np.testing.assert_array_equal(np.asarray(adv.lengths), [1, CAP - 1, CAP - 3, 11])
    assert np.asarray(adv.status)[2] == CAPACITY_EXCEEDED
    bad = _dense().replace(lengths=jnp.full(B, 5, jnp.int32)).rollback(jnp.array([6, 5, 4, -1]))
    np.testing.assert_array_equal(np.asarray(bad.lengths), [5, 5, 4, 5])
    np.testing.assert_array_equal(np.asarray(bad.status), [ROLLBACK_INVALID, 0, 0, ROLLBACK_INVALID])


@given(lengths=st.lists(st.integers(0, CAP), min_size=B, max_size=B),
       count=st.lists(st.integers(0, 4), min_size=B, max_size=B), seed=st.integers(0, 1000))
def test_a_bounded_write_needs_room_for_its_count_only(lengths, count, seed):
    """``write(..., count)``: each row's first ``count`` tokens land at its length, the rest are
    dropped; the row fits when ``length + count <= capacity`` (not ``+ t``: an MTP settle's
    padded backlog), else nothing is written and it is flagged."""
    t = 4
    lengths, count = np.array(lengths, np.int32), np.array(count, np.int32)
    kn = np.random.default_rng(seed).standard_normal((B, t, HKV, D)).astype(np.float32)
    out = jax.jit(lambda c, k, n: c.write(1, k, -k, n))(
        _dense().replace(lengths=jnp.asarray(lengths)), kn, jnp.asarray(count))
    want = np.zeros((L, B, CAP, HKV, D), np.float32)
    fits = lengths + count <= CAP
    for b in range(B):  # reference: a loop over rows
        if fits[b]:
            want[1, b, lengths[b] : lengths[b] + count[b]] = kn[b, : count[b]]
    np.testing.assert_array_equal(_tok_major(out.k), want)
    np.testing.assert_array_equal(_tok_major(out.v), -want)
    np.testing.assert_array_equal(np.asarray(out.status), np.where(fits, 0, CAPACITY_EXCEEDED))


def test_plan_driven_advance_gives_expected_lengths():
    u = np.array([1, 1, 1, 1], np.int32)
    a = np.array([3, 0, 2, 1], np.int32)
    base = jnp.array([10, 3, 7, 0], jnp.int32)
    cache = _dense().replace(lengths=base)
    ps = cache.apply_plan(plan_per_sequence_step(u, a, W_VERIFY))
    co = cache.apply_plan(plan_cohort_step(u, a, W_VERIFY))
    np.testing.assert_array_equal(np.asarray(ps.lengths), np.asarray(base) + u + a)
    np.testing.assert_array_equal(np.asarray(co.lengths), np.asarray(base) + 1)  # min committed = 1


# ------------------------------------------------------- engine-like random flows


def _flow(steps, seed, t=W_VERIFY):
    """Per step: per-row k/v for ``t`` new tokens, queries, and committed counts."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        kv = rng.standard_normal((2, B, t, HKV, D)).astype(np.float32)
        q = rng.standard_normal((B, t, HQ, D)).astype(np.float32)
        committed = rng.integers(1, t + 1, B).astype(np.int32)
        yield kv, q, committed


def _step_impl(cache, kv, q, committed, window):
    cache = cache.write(1, kv[0], kv[1])
    out = cache.attend(q, 1, window=window)
    return cache.advance(committed), out


_step = jax.jit(_step_impl, static_argnums=4)


def _rolling():
    return RollingKVCache.create(L, B, SLIDE, W_VERIFY, HKV, D)


@given(seed=st.integers(0, 10_000))
def test_rolling_matches_dense_windowed_attention(seed):
    dense, ring = _dense(), _rolling()
    for kv, q, n in _flow(8, seed):
        dense, od = _step(dense, kv, q, n, SLIDE)
        ring, orr = _step(ring, kv, q, n, None)
        np.testing.assert_allclose(np.asarray(orr), np.asarray(od), atol=1e-5)
    assert (np.asarray(ring.status) == 0).all()


def test_rolling_matches_numpy_reference_after_wraparound():
    ring = _rolling()
    hist_k = [[] for _ in range(B)]
    hist_v = [[] for _ in range(B)]
    for kv, q, n in _flow(10, 7):
        lens = np.asarray(ring.lengths)
        ring, out = _step(ring, kv, q, n, None)
        for b in range(B):  # reference keeps the full history per row
            hist_k[b] = hist_k[b][: lens[b]] + list(kv[0, b])
            hist_v[b] = hist_v[b][: lens[b]] + list(kv[1, b])
        t_max = max(len(h) for h in hist_k)
        kk = np.zeros((B, t_max, HKV, D), np.float32)
        vv = np.zeros_like(kk)
        for b in range(B):
            kk[b, : len(hist_k[b])] = hist_k[b]
            vv[b, : len(hist_v[b])] = hist_v[b]
        q_pos = lens[:, None] + np.arange(W_VERIFY)[None]
        kk, vv = kk.swapaxes(1, 2), vv.swapaxes(1, 2)  # head-major, as ref_attention takes them
        ref = ref_attention(q, kk, vv, q_pos, np.broadcast_to(np.arange(t_max), (B, t_max)), np.zeros(B), SLIDE)
        np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)
    assert int(np.asarray(ring.lengths).max()) > SLIDE + W_VERIFY  # the ring wrapped


def test_rolling_rollback_keeps_every_in_window_entry():
    """Advance-then-rollback: write w tokens, advance by w, roll back the rejected tail."""
    ring, dense = _rolling(), _dense()
    rng = np.random.default_rng(11)
    for kv, _q, n in _flow(9, 3):
        ring = ring.write(0, kv[0], kv[1]).advance(W_VERIFY)
        dense = dense.write(0, kv[0], kv[1]).advance(W_VERIFY)
        keep = np.asarray(ring.lengths) - (W_VERIFY - n)  # reject up to w - 1 tokens
        ring, dense = ring.rollback(keep), dense.rollback(keep)
        # a decode query right after the rollback sees exactly the dense window
        q1 = rng.standard_normal((B, 1, HQ, D)).astype(np.float32)
        kv1 = rng.standard_normal((2, B, 1, HKV, D)).astype(np.float32)
        a = ring.write(0, kv1[0], kv1[1]).attend(q1, 0)
        b_ = dense.write(0, kv1[0], kv1[1]).attend(q1, 0, window=SLIDE)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-5)
    assert (np.asarray(ring.status) == 0).all()
    too_far = ring.rollback(ring.lengths - (W_VERIFY + 1))
    assert (np.asarray(too_far.status) == ROLLBACK_INVALID).all()
    np.testing.assert_array_equal(np.asarray(too_far.lengths), np.asarray(ring.lengths))
    with pytest.raises(ValueError, match="slack >= t"):
        ring.write(0, jnp.zeros((B, W_VERIFY + 1, HKV, D)), jnp.zeros((B, W_VERIFY + 1, HKV, D)))


def _paged(num_pages=40, max_pages=12):
    return PagedKVCache.create(L, B, num_pages, PAGE, max_pages, HKV, D)


_paged_step = jax.jit(lambda c, kv, q, n: _step_impl(c.reserve(kv.shape[2]), kv, q, n, None))


@given(seed=st.integers(0, 10_000))
def test_paged_matches_dense(seed):
    dense, paged = _dense(), _paged()
    rng = np.random.default_rng(seed)
    for kv, q, n in _flow(8, seed):
        dense, od = _step(dense, kv, q, n, None)
        paged, op = _paged_step(paged, kv, q, n)
        np.testing.assert_allclose(np.asarray(op), np.asarray(od), atol=1e-5)
        back = np.maximum(np.asarray(paged.lengths) - rng.integers(0, 6, B), 0).astype(np.int32)
        paged, dense = paged.rollback(back), dense.rollback(back)
        _check_page_accounting(paged)
    assert (np.asarray(paged.status) == 0).all()


def _check_page_accounting(c):
    bt = np.asarray(c.block_table)
    held = np.asarray(c.pages_held)
    nf = int(c.num_free)
    owned = np.concatenate([bt[b, : held[b]] for b in range(B)])
    assert (bt[np.arange(bt.shape[1])[None] >= held[:, None]] == -1).all()
    free = np.asarray(c.free_pages)[:nf]
    assert len(owned) + nf == c.num_pages  # conservation
    assert len(set(owned.tolist()) | set(free.tolist())) == c.num_pages  # no page twice
    assert (np.ceil(np.asarray(c.lengths) / PAGE) <= held).all()


def test_paged_rollback_returns_pages_and_reuse_never_corrupts_another_row():
    c = _paged(num_pages=10, max_pages=6)
    kv = jnp.ones((B, 8, HKV, D))
    c = c.reserve(8)  # 2 pages per row
    vals = kv * jnp.arange(1, B + 1.0)[:, None, None, None]  # row b's keys and values all equal b + 1
    c = c.write(0, vals, vals).advance(8)
    assert int(c.num_free) == 2
    _check_page_accounting(c)
    before = np.asarray(c.attend(jnp.ones((B, 1, HQ, D)), 0))
    # each row reads only its own pages: its output is its own value (another row's page would mix in)
    np.testing.assert_allclose(before, np.broadcast_to(np.arange(1, B + 1.0)[:, None, None, None], before.shape))
    c = c.rollback(jnp.array([0, 8, 8, 3]))  # row 0 frees 2 pages, row 3 frees 1
    assert int(c.num_free) == 5
    _check_page_accounting(c)
    # row 1 grows into the freed pages; rows 1-3 keep reading their own data
    c = c.reserve(4)  # every row takes one page; freed ones are reused
    assert int(c.num_free) == 1 and (np.asarray(c.status) == 0).all()
    c = c.write(0, kv[:, :4] * 100, kv[:, :4]).advance(jnp.array([0, 4, 0, 0]))
    _check_page_accounting(c)
    k = np.asarray(c.gather(0)[0]).swapaxes(1, 2)  # [B, T, Hkv, D]
    np.testing.assert_array_equal(k[2, :8, 0, 0], 3.0)
    np.testing.assert_array_equal(k[3, :3, 0, 0], 4.0)
    np.testing.assert_array_equal(k[1, :8, 0, 0], 2.0)
    np.testing.assert_array_equal(k[1, 8:12, 0, 0], 100.0)


def test_paged_out_of_pages_sets_status_and_writes_nothing():
    c = _paged(num_pages=5, max_pages=3)
    c = c.reserve(8)  # needs 2 pages per row: rows 0, 1 served, rows 2, 3 refused
    np.testing.assert_array_equal(np.asarray(c.status), [0, 0, OUT_OF_PAGES, OUT_OF_PAGES])
    np.testing.assert_array_equal(np.asarray(c.pages_held), [2, 2, 0, 0])
    k_before = _tok_major(c.k).copy()
    c = c.write(0, jnp.full((B, 8, HKV, D), 7.0), jnp.ones((B, 8, HKV, D)))
    k = _tok_major(c.k)
    owned = np.asarray(c.block_table)[:2, :2].ravel()
    assert (k[0, owned] == 7.0).all()
    unowned = sorted(set(range(5)) - set(owned.tolist()))
    np.testing.assert_array_equal(k[0, unowned], k_before[0, unowned])
    np.testing.assert_array_equal(np.asarray(c.status)[2:], OUT_OF_PAGES | CAPACITY_EXCEEDED)
    big = _paged(num_pages=40, max_pages=3).reserve(13)  # 13 tokens > 3 pages * 4
    assert (np.asarray(big.status) == CAPACITY_EXCEEDED).all() and int(big.num_free) == 40


def test_tight_pool_serves_every_row_that_fits():
    """A row needing no page is never refused, and a refused bigger request does not block
    a smaller one behind it (grants go smallest first while the pool lasts)."""
    c = _paged(num_pages=4, max_pages=3)  # PAGE = 4 tokens
    c = c.reserve(8, jnp.array([False, False, False, True]))  # row 3 holds 2 pages
    c = c.reserve(4, jnp.array([False, True, False, False]))  # row 1 holds 1; 1 page left
    c = c.reserve(8)  # needs 2, 1, 2, 0 new pages with 1 free
    np.testing.assert_array_equal(np.asarray(c.status), [OUT_OF_PAGES, 0, OUT_OF_PAGES, 0])
    np.testing.assert_array_equal(np.asarray(c.pages_held), [0, 2, 0, 2])
    assert int(c.num_free) == 0
    _check_page_accounting(c)


def test_rows_view_and_put_rows_refill_rows_and_reuse_their_pages():
    c = _paged(num_pages=10, max_pages=3).reserve(8)  # every row holds 2 pages; 2 free
    kept = np.asarray(c.block_table)[[1, 3]].copy()
    rows = jnp.array([2, 0, B])  # refill rows 2 and 0; the last entry is padding
    view = c.rows_view(rows, 4)
    assert int(view.num_free) == 6  # rows 2 and 0 gave their pages back
    view = view.reserve(12, jnp.array([True, True, False]))  # 3 pages each for the new rows, none for padding
    c = c.put_rows(rows, view)
    np.testing.assert_array_equal(np.asarray(c.pages_held), [3, 2, 3, 2])
    np.testing.assert_array_equal(np.asarray(c.status), 0)
    np.testing.assert_array_equal(np.asarray(c.block_table)[[1, 3]], kept)  # other rows untouched
    assert int(c.num_free) == 0
    _check_page_accounting(c)


def test_release_returns_all_pages_of_finished_rows():
    c = _paged().reserve(9)
    c = c.write(0, jnp.ones((B, 9, HKV, D)), jnp.ones((B, 9, HKV, D))).advance(9)
    c = c.release(jnp.array([True, False, True, False]))
    np.testing.assert_array_equal(np.asarray(c.pages_held), [0, 3, 0, 3])
    assert int(c.num_free) == 40 - 6
    _check_page_accounting(c)


_G_RESERVE = jax.jit(lambda c, live, t: c.reserve(t, live), static_argnums=2)
_G_WRITE = jax.jit(lambda c, x, n: c.write(1, x, -x).advance(n))
_G_ATTEND = jax.jit(lambda c, q: (c.attend(q, 1), c.gather(1)))
_G_ROLLBACK = jax.jit(lambda c, n: c.rollback(n))
_G_RELEASE = jax.jit(lambda c, done: c.release(done))
_G_REFILL = jax.jit(lambda c, rows, live: c.put_rows(rows, c.rows_view(rows, 4).reserve(6, live)))


@settings(max_examples=10)
@given(seed=st.integers(0, 10_000), groups=st.sampled_from([2, 4]), stacked=st.booleans())
def test_a_pool_split_in_groups_is_its_groups_pools_side_by_side(seed, groups, stacked):
    """One pool per data shard (``split_pool``): a grouped cache behaves exactly as ``groups``
    separate caches over its row blocks, each with ``1/groups`` of the pages. A tight pool runs
    one group out of pages without touching another; a row never owns another group's page;
    attention, refills and rollbacks agree block by block."""
    rng = np.random.default_rng(seed)
    pages, mp, per = 4 * groups, 5, B // groups  # tight: 4 pages per group for its rows of up to 5 pages
    big = PagedKVCache.create(L, B, pages, PAGE, mp, HKV, D, stacked=stacked, groups=groups)
    assert big.groups == groups and np.asarray(big.num_free).tolist() == [4] * groups
    parts = [PagedKVCache.create(L, per, pages // groups, PAGE, mp, HKV, D, stacked=stacked) for _ in range(groups)]
    block = lambda x, i: x[i * per : (i + 1) * per]  # noqa: E731  (group i's rows)

    def both(fn, *rows):
        nonlocal big, parts
        big = fn(big, *rows)
        parts = [fn(c, *[block(r, i) for r in rows]) for i, c in enumerate(parts)]

    for _ in range(6):
        t = int(rng.integers(1, 7))
        both(lambda c, live, t=t: _G_RESERVE(c, live, t), jnp.asarray(rng.random(B) < 0.8))
        both(_G_WRITE, jnp.asarray(rng.normal(size=(B, t, HKV, D)), jnp.float32),
             jnp.asarray(rng.integers(0, t + 1, B), jnp.int32))
        q = jnp.asarray(rng.normal(size=(B, 2, HQ, D)), jnp.float32)
        out, (k, _, pos) = _G_ATTEND(big, q)
        for i, c in enumerate(parts):
            out_i, (k_i, _, pos_i) = _G_ATTEND(c, block(q, i))
            np.testing.assert_allclose(block(np.asarray(out), i), np.asarray(out_i), atol=1e-5)
            np.testing.assert_array_equal(block(np.asarray(pos), i), np.asarray(pos_i))
            owned = (np.asarray(pos_i) >= 0)[:, None, :, None]  # the pages the row owns (the rest is never read)
            np.testing.assert_array_equal(np.where(owned, block(np.asarray(k), i), 0), np.where(owned, k_i, 0))
        if rng.random() < 0.5:
            both(_G_ROLLBACK, jnp.maximum(big.lengths - jnp.asarray(rng.integers(0, 5, B)), 0))
        else:
            both(_G_RELEASE, jnp.asarray(rng.random(B) < 0.3))
        # a group-major refill: group g's block lists one of its own rows, or padding (index B)
        rows = np.array([g * per + rng.integers(per) if rng.random() < 0.5 else B for g in range(groups)])
        big = _G_REFILL(big, jnp.asarray(rows), jnp.asarray(rows < B))
        parts = [_G_REFILL(c, jnp.asarray([rows[i] - i * per if rows[i] < B else per]), jnp.asarray([rows[i] < B]))
                 for i, c in enumerate(parts)]
        for name in ("block_table", "pages_held", "lengths", "status"):
            np.testing.assert_array_equal(np.asarray(getattr(big, name)),
                                          np.concatenate([np.asarray(getattr(c, name)) for c in parts]), err_msg=name)
        assert np.asarray(big.num_free).tolist() == [int(c.num_free) for c in parts]
        np.testing.assert_array_equal(np.asarray(big.free_pages).reshape(groups, -1),
                                      np.stack([np.asarray(c.free_pages) for c in parts]))
        assert (np.asarray(big.block_table) < pages // groups).all()  # group-local page ids


def test_rows_view_flags_a_row_listed_in_another_groups_block():
    """A refill must list each group's rows in that group's block of the view: a row put in
    another block would take its pages from another data shard's pool, so it is flagged."""
    c = PagedKVCache.create(L, B, 8, PAGE, 3, HKV, D, groups=2)  # rows 0-1: group 0, rows 2-3: group 1
    ok = c.rows_view(jnp.array([1, B, 2, 3]), 4)
    np.testing.assert_array_equal(np.asarray(ok.status), 0)
    bad = c.rows_view(jnp.array([2, 0, 1, B]), 4)  # row 2 in group 0's block, row 1 in group 1's
    np.testing.assert_array_equal(np.asarray(bad.status), [POOL_GROUP_MISMATCH, 0, POOL_GROUP_MISMATCH, 0])
    assert describe_status(c.put_rows(jnp.array([2, 0, 1, B]), bad).status) == {
        1: ["refilled from another pool group"], 2: ["refilled from another pool group"]}
    with pytest.raises(ValueError, match="pool groups"):
        c.rows_view(jnp.array([0, 1, 2]), 4)
    with pytest.raises(ValueError, match="num_pages=9 is invalid for groups=2"):
        PagedKVCache.create(L, B, 9, PAGE, 3, HKV, D, groups=2)


# ---------------------------------------------------------------- alignment


def test_front_align_batch():
    tokens, lead = front_align_batch([[1, 2, 3], [4], [5, 6]], pad_id=0)
    np.testing.assert_array_equal(tokens, [[1, 2, 3], [0, 0, 4], [0, 5, 6]])
    np.testing.assert_array_equal(lead, [0, 2, 1])
    with pytest.raises(ValueError, match="non-empty"):
        front_align_batch([])


def test_front_pad_kv_cache_preserves_attention():
    rng = np.random.default_rng(5)
    c = _dense()
    kv = rng.standard_normal((2, B, 10, HKV, D)).astype(np.float32)
    c = c.write(0, kv[0], kv[1]).advance(jnp.array([10, 4, 7, 1]))
    aligned = front_pad_kv_cache(c)
    assert len(set(np.asarray(aligned.lengths).tolist())) == 1
    np.testing.assert_array_equal(np.asarray(aligned.start), [0, 6, 3, 9])
    q = rng.standard_normal((B, 2, HQ, D)).astype(np.float32)
    kn = rng.standard_normal((2, B, 2, HKV, D)).astype(np.float32)
    a = c.write(0, kn[0], kn[1]).attend(q, 0)
    b_ = aligned.write(0, kn[0], kn[1]).attend(q, 0)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-6)


# ---------------------------------------------------------------- capability


def test_capability_check():
    assert cache_supports_per_sequence_advance(_dense()) is None
    assert cache_supports_per_sequence_advance({"local": _rolling(), "global": [_paged(), _dense()]}) is None

    class SharedLen:
        def __init__(self):
            self.k = jnp.zeros((2, 4))
            self.length = jnp.int32(3)

    msg = cache_supports_per_sequence_advance({"global": _dense(), "local": [_rolling(), SharedLen()]})
    assert msg is not None and "cache['local'][1] (SharedLen)" in msg and "'length'" in msg and "()" in msg

    class ScalarLengths:
        lengths = jnp.int32(0)

    assert "shape ()" in cache_supports_per_sequence_advance([ScalarLengths()])
    assert "no per-row 'lengths'" in cache_supports_per_sequence_advance(object())
    mismatch = [_dense(), DenseKVCache.create(1, B + 1, 4, 1, 2)]
    assert "rows" in cache_supports_per_sequence_advance(mismatch)


@pytest.mark.parametrize("head_dim", [D, 128])  # 128: one index per head (cache.base.per_head)
@pytest.mark.parametrize("stacked", [False, True])
def test_row_writes_and_slot_moves_match_numpy(head_dim, stacked):
    """``set_rows`` and ``move_slots`` against NumPy in both layouts and both index forms: each
    ``(row, slot)`` entry gets its ``[Hkv, head_dim]`` value, out-of-range entries are dropped,
    a move reads every source before it writes."""
    from specjax.cache.base import layer_buffers, move_slots, set_rows

    rng = np.random.default_rng(head_dim + stacked)
    shape = (B, HKV, CAP, head_dim)
    base = rng.standard_normal((L, *shape)).astype(np.float32)
    buf = jnp.asarray(base) if stacked else tuple(jnp.asarray(x) for x in base)
    assert type(buf) is type(layer_buffers(L, shape, jnp.float32, stacked))
    t = 3
    rows = np.repeat(np.arange(B)[:, None], t, axis=1)
    slots = np.stack([rng.choice(CAP, t, replace=False) for _ in range(B)]).astype(np.int32)
    slots[1, 2] = CAP  # out of range: dropped
    value = rng.standard_normal((B, t, HKV, head_dim)).astype(np.float32)
    want = base.copy()
    for b in range(B):
        for j in range(t):
            if slots[b, j] < CAP:
                want[1, b, :, slots[b, j]] = value[b, j]
    got = set_rows(buf, 1, (jnp.asarray(rows), slice(None), jnp.asarray(slots)), jnp.asarray(value))
    np.testing.assert_array_equal(np.stack(got) if not stacked else got, want)

    frm_slots = np.stack([rng.choice(CAP, 2, replace=False) for _ in range(B)]).astype(np.int32)
    to_slots = (frm_slots + 1) % CAP
    to_rows = np.repeat(np.arange(B)[:, None], 2, axis=1)
    to_rows[2, 0] = B  # out of range: dropped
    moved = move_slots(got, (jnp.asarray(rows[:, :2]), jnp.asarray(frm_slots)),
                       (jnp.asarray(to_rows), jnp.asarray(to_slots)))
    src = want[:, np.arange(B)[:, None], :, frm_slots]  # [B, 2, L, Hkv, D]: every source first
    for b in range(B):
        for j in range(2):
            if to_rows[b, j] < B:
                want[:, to_rows[b, j], :, to_slots[b, j]] = src[b, j]
    np.testing.assert_array_equal(np.stack(moved) if not stacked else moved, want)
