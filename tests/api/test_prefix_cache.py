"""The prefix cache: rows start on pool pages other rows wrote, and read them, never write them.

Cache level: reference counts, a shared page's content kept bit for bit, pages back to the
pool only with their last row, cached pages evicted last (least recently released first, a
prefix's tail before its head), against a NumPy model of the pool. Host level: chain keys
and the map. Batch level: every request's tokens equal ``generate`` alone whatever it
shares (nothing, part of a page, several pages, all but the last token of its prompt), for
every drafter that shares and both rules; a pool too small for every prefix evicts and
recomputes; every page is back in the pool at the end of a job (``_check_pool``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batch_models import DRAFT, EOS, MODEL, SLIDING_MODEL, alone_run
from hypothesis import given, settings
from hypothesis import strategies as st

import specjax.batch.scheduler as batch_mod
from specjax import Request, batch_generate
from specjax.cache import PagedKVCache
from specjax.prefix_cache import PrefixCache, page_keys

B, L, HKV, D, PAGE = 3, 2, 1, 2, 4
_RESERVE = jax.jit(lambda c, t, live: c.reserve(t, live))
_WRITE = jax.jit(lambda c, x, n: c.bound_write(n).write(0, x, -x).write(1, x, -x).advance(n))
_RELEASE = jax.jit(lambda c, done: c.release(done))
_REGISTER = jax.jit(lambda c, upto: c.register(upto))
_VIEW = jax.jit(lambda c, rows, pages, count: c.rows_view(rows, 8, (pages, count)))
_PUT = jax.jit(lambda c, rows, sub: c.put_rows(rows, sub))


def _cache(num_pages=12, max_pages=4, groups=1):
    return PagedKVCache.create(L, B, num_pages, PAGE, max_pages, HKV, D, groups=groups)


def _fill(c, row, tokens, value):
    """Row ``row`` writes ``tokens`` more tokens of K = ``value + position``."""
    live = jnp.arange(B) == row
    n = jnp.where(live, tokens, 0).astype(jnp.int32)
    c = _RESERVE(c, n, live)
    pos = np.asarray(c.lengths)[:, None] + np.arange(16)[None]
    x = jnp.asarray(np.broadcast_to((value + pos)[:, :, None, None], (B, 16, HKV, D)), jnp.float32)
    return _WRITE(c, x, n)


def _keys(c, row):
    """Row ``row``'s K through its block table, layer 0, by position ``[T]``."""
    return np.asarray(c.gather(0)[0])[row, 0, : int(c.lengths[row]), 0]


def _share(c, row, pages):
    """Refill ``row`` starting on ``pages`` (a one-row view)."""
    mp = c.max_pages
    table = np.full((1, mp), -1, np.int32)
    table[0, : len(pages)] = pages
    view = _VIEW(c, jnp.array([row]), jnp.asarray(table), jnp.array([len(pages)], jnp.int32))
    return _PUT(c, jnp.array([row]), view)


def test_a_sharing_row_reads_the_shared_pages_and_writes_only_its_own():
    c = _fill(_cache(), 0, 10, 100.0)  # row 0: 10 tokens, 3 pages (two full)
    c = _REGISTER(c, jnp.array([2, 0, 0]))
    pool_before = np.asarray(c.k[0]).copy()
    shared = np.asarray(c.block_table)[0, :2]
    c = _share(c, 1, shared)
    assert int(c.lengths[1]) == 8 and int(c.pages_held[1]) == 2
    np.testing.assert_array_equal(np.asarray(c.refs)[shared], 2)
    c = _fill(c, 1, 3, 500.0)  # row 1's own tokens 8..10, on its own page
    own = np.asarray(c.block_table)[1, 2]
    assert own not in np.asarray(c.block_table)[0]
    k = np.asarray(c.k[0])
    np.testing.assert_array_equal(k[shared], pool_before[shared])  # the shared pages: bit for bit
    np.testing.assert_array_equal(_keys(c, 1), np.r_[100.0 + np.arange(8), 500.0 + np.arange(8, 11)])
    np.testing.assert_array_equal(_keys(c, 0), 100.0 + np.arange(10))
    assert (np.asarray(c.status) == 0).all()


def test_a_shared_page_returns_to_the_pool_only_with_its_last_row():
    c = _REGISTER(_fill(_cache(), 0, 9, 0.0), jnp.array([2, 0, 0]))
    shared = np.asarray(c.block_table)[0, :2]
    c = _fill(_share(_share(c, 1, shared), 2, shared[:1]), 2, 2, 0.0)
    np.testing.assert_array_equal(np.asarray(c.refs)[shared], [3, 2])
    free0 = int(c.num_free)
    c = _RELEASE(c, jnp.array([True, False, False]))  # row 0 gives back its third page only
    assert int(c.num_free) == free0 + 1
    np.testing.assert_array_equal(np.asarray(c.refs)[shared], [2, 1])
    c = _RELEASE(c, jnp.array([False, True, True]))
    assert int(c.num_free) == c.num_pages and not np.asarray(c.refs).any()
    np.testing.assert_array_equal(np.asarray(c.cached)[shared], True)  # still cached: kept for reuse


def test_cached_pages_are_evicted_last_least_recently_released_first_tail_before_head():
    c = _cache(num_pages=8, max_pages=4)
    c = _REGISTER(_fill(_fill(c, 0, 8, 0.0), 1, 8, 50.0), jnp.array([2, 2, 0]))
    first, second = np.asarray(c.block_table)[0, :2], np.asarray(c.block_table)[1, :2]
    c = _RELEASE(c, jnp.array([True, False, False]))  # row 0's prefix released first
    c = _RELEASE(c, jnp.array([False, True, False]))
    stack = np.asarray(c.free_pages)[: int(c.num_free)]
    # bottom of the stack (popped last): the newest prefix, head deepest; then the older one
    np.testing.assert_array_equal(stack[:4], [second[0], second[1], first[0], first[1]])
    c = _fill(c, 2, 16, 0.0)  # 4 pages: exactly the uncached ones
    assert set(np.asarray(c.block_table)[2].tolist()).isdisjoint({*first, *second})
    c = _RELEASE(c, jnp.array([False, False, True]))
    c = _fill(c, 2, 16, 0.0)  # uncached again first: the 4 pages it just gave back
    c = _RELEASE(c, jnp.array([False, False, True]))
    c = _fill(_fill(c, 0, 16, 0.0), 1, 4, 0.0)  # 5 pages: 4 uncached, then the older prefix's tail
    taken = set(np.asarray(c.block_table)[:2].ravel().tolist()) - {-1}
    assert first[1] in taken and first[0] not in taken and not taken & set(second.tolist())
    cached = np.asarray(c.cached)
    assert not cached[first[1]] and cached[first[0]] and cached[second].all()  # the evicted page is forgotten


def test_a_cached_page_no_row_holds_leaves_the_free_stack_when_shared():
    c = _REGISTER(_fill(_cache(num_pages=6), 0, 8, 7.0), jnp.array([2, 0, 0]))
    shared = np.asarray(c.block_table)[0, :2]
    c = _RELEASE(c, jnp.array([True, False, False]))  # unreferenced, cached, on the stack
    assert int(c.num_free) == 6
    c = _share(c, 1, shared)
    assert int(c.num_free) == 4 and set(shared.tolist()).isdisjoint(np.asarray(c.free_pages)[:4].tolist())
    c = _fill(c, 2, 16, 0.0)  # every free page: none of the shared ones
    assert int(c.num_free) == 0 and set(np.asarray(c.block_table)[2].tolist()).isdisjoint(shared.tolist())
    np.testing.assert_array_equal(_keys(c, 1), 7.0 + np.arange(8))


def test_a_bounded_write_touches_no_page_but_the_rows_own():
    """A prefill's padding past a row's prompt is not written: not past its length inside its
    own last page, and not through the table's empty entries (``-1`` would wrap to the last
    page of the pool, another row's)."""
    c = _fill(_fill(_cache(num_pages=6), 0, 16, 10.0), 1, 8, 50.0)  # row 1 holds pages 4 and 5
    before = np.asarray(c.k[0]).copy()
    c = _fill(c, 2, 0, 0.0)  # a padding row: no page, nothing real to write
    c = _fill(_RELEASE(c, jnp.array([True, False, False])), 2, 3, 90.0)  # 3 real tokens, 13 of padding
    np.testing.assert_array_equal(np.asarray(c.k[0])[np.asarray(c.block_table)[1, :2]],
                                  before[np.asarray(c.block_table)[1, :2]])
    page = np.asarray(c.block_table)[2, 0]
    np.testing.assert_array_equal(np.asarray(c.k[0])[page, 0, 3:], before[page, 0, 3:])  # past its length
    np.testing.assert_array_equal(_keys(c, 2), 90.0 + np.arange(3))


def test_a_draft_models_view_starts_on_its_own_pools_pages():
    """Each pool names a prefix by its own page ids: a request sharing a prefix in the target's
    pool and in a draft model's starts on the draft pool's pages there, even where the two
    pools' ids differ."""
    from specjax.advance import KvAdvance
    from specjax.engine import make_engine

    eng = make_engine(MODEL, drafter="draft_model", draft_model=DRAFT, depth=2, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="paged", capacity=64)
    params = {"target": MODEL.params, "draft": DRAFT.params}
    row = lambda rid, prompt: batch_mod.Row(rid, prompt, 6, 0.0, None, None, 0, (), 8)  # noqa: E731
    st = batch_mod.empty_state(eng, 2, 32)
    st = st.replace(dstate=st.dstate.reserve(16, jnp.array([False, True])))  # the draft pool's first page taken
    a, b = row("a", list(range(1, 21))), row("b", list(range(1, 18)))
    shared = lambda pages, count: (jnp.asarray(pages), jnp.array([count], jnp.int32), jnp.array([1], jnp.int32))  # noqa: E731
    none = np.full((2, 1, eng.capacity // 16), -1, np.int32)
    st = batch_mod.admit(eng, None, params, st, np.array([True, False]), *batch_mod.admit_inputs([[(0, a)]], 1, 2),
                          shared(none, 0))
    t_page, d_page = int(st.cache.global_kv.block_table[0, 0]), int(st.dstate.global_kv.block_table[0, 0])
    assert t_page != d_page
    pages = none.copy()
    pages[:, 0, 0] = t_page, d_page
    st = batch_mod.admit(eng, 16, params, st, np.array([False, True]), *batch_mod.admit_inputs([[(1, b)]], 1, 2),
                          shared(pages, 1))
    assert int(st.dstate.global_kv.block_table[1, 0]) == d_page and int(st.cache.global_kv.block_table[1, 0]) == t_page
    assert int(st.dstate.global_kv.refs[d_page]) == 2 and int(st.cache.global_kv.refs[t_page]) == 2


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), groups=st.sampled_from([1, 3]))
def test_reference_counts_follow_a_numpy_model_of_the_pool(seed, groups):
    """Random shares, writes, rollbacks and releases (one pool or one per row group): every
    page is referenced exactly as often as rows hold it, a page is free exactly when nothing
    holds it, no row holds a page of another group, and a shared page's K never changes."""
    rng = np.random.default_rng(seed)
    c = _cache(num_pages=12, max_pages=4, groups=groups)
    per, npg = B // groups, 12 // groups
    written = {}  # (group, page) -> its K when registered
    roll = jax.jit(lambda c, n: c.rollback(n))
    for _ in range(10):
        row = int(rng.integers(B))
        g = row // per
        op = rng.random()
        if op < 0.3:  # share a registered prefix of another row of this group, if any
            donors = [r for r in range(g * per, (g + 1) * per) if r != row and int(c.pages_held[r]) >= 1
                      and np.asarray(c.cached)[g * npg + np.asarray(c.block_table)[r, 0]]]
            if donors:
                d = donors[0]
                full = int(np.asarray(c.cached)[g * npg + np.asarray(c.block_table)[d, : int(c.pages_held[d])]].sum())
                k = int(rng.integers(1, full + 1))
                c = _share(c, row, np.asarray(c.block_table)[d, :k])
                continue
        if op < 0.6:
            c = _fill(c, row, int(rng.integers(1, 6)), float(rng.integers(100)))
            full = int(c.lengths[row]) // PAGE
            if full and rng.random() < 0.7:
                c = _REGISTER(c, jnp.asarray(np.where(np.arange(B) == row, full, 0), jnp.int32))
                for p in np.asarray(c.block_table)[row, :full]:
                    written[(g, int(p))] = np.asarray(c.k[0])[g * npg + p].copy()
        elif op < 0.8:
            c = _RELEASE(c, jnp.asarray(np.arange(B) == row))
        else:  # a rollback never crosses a row's registered pages (as the engine's never crosses its prompt)
            ids = np.asarray(c.block_table)[row, : int(c.pages_held[row])]
            lead = int(np.argmin(np.r_[np.asarray(c.cached)[g * npg + ids], False]))  # leading cached pages
            new = np.asarray(c.lengths).copy()
            new[row] = max(lead * PAGE, new[row] - int(rng.integers(0, 5)))
            c = roll(c, jnp.asarray(new, jnp.int32))
        bt, held = np.asarray(c.block_table), np.asarray(c.pages_held)
        refs = np.asarray(c.refs).reshape(groups, npg)
        free = np.asarray(c.free_pages).reshape(groups, npg)
        nf = np.asarray(c.num_free).reshape(groups)
        for gg in range(groups):
            count = np.zeros(npg, int)
            for r in range(gg * per, (gg + 1) * per):
                assert (bt[r, : held[r]] >= 0).all() and (bt[r, : held[r]] < npg).all()
                assert (bt[r, held[r] :] == -1).all()
                np.add.at(count, bt[r, : held[r]], 1)
            np.testing.assert_array_equal(refs[gg], count)
            stack = free[gg, : nf[gg]]
            assert len(set(stack.tolist())) == len(stack)
            assert set(stack.tolist()) == set(np.nonzero(count == 0)[0].tolist())
        k = np.asarray(c.k[0])
        cached = np.asarray(c.cached)
        for (gg, p), val in written.items():
            if cached[gg * npg + p] and refs[gg, p] > 0:
                np.testing.assert_array_equal(k[gg * npg + p], val)


# ----------------------------------------------------------------------------- host side


def test_chain_keys_name_a_page_and_everything_before_it():
    a = page_keys(list(range(10)), 4)
    assert len(a) == 2
    assert page_keys(list(range(8)) + [99], 4) == a  # the partial page has no key
    b = page_keys([7] + list(range(1, 10)), 4)
    assert b[0] != a[0] and b[1] != a[1]  # same second page's tokens, another head: another key
    pc = PrefixCache(4)
    pc.add(a, np.array([[5], [6]]))
    assert pc.match(a, 10) == [(5,), (6,)]
    assert pc.match(a, 8) == [(5,)]  # the last prompt token is always computed
    assert pc.match(b, 10) == []
    pc.forget([np.array([True] * 5 + [True, False] + [True] * 5)])  # page 6 evicted
    assert pc.match(a, 10) == [(5,)] and pc.size == 1
    pc.add(a[1:], np.array([[5]]))  # page 5 now holds another prefix page: its old key goes
    assert pc.match(a, 10) == [] and pc.size == 1


def test_a_key_stays_only_while_every_pool_holds_its_page():
    pc = PrefixCache(4, pools=2)
    keys = page_keys(list(range(9)), 4)
    pc.add(keys, np.array([[0, 3], [1, 2]]))
    assert pc.match(keys, 9) == [(0, 3), (1, 2)]
    pc.forget([np.ones(4, bool), np.array([True, True, False, True])])  # the draft pool evicted page 2
    assert pc.match(keys, 9) == [(0, 3)]


# ----------------------------------------------------------------------------- batch jobs

_HEAD = np.random.default_rng(0).integers(0, 31, 40).tolist()


def _sharing_requests():
    """Prompts over one 40-token head: the whole head, part of a page of it, several pages,
    all but the last token of a prompt, and one sharing nothing."""
    rng = np.random.default_rng(1)
    cut = [40, 40, 6, 16, 33, 40, 32, 37, 0]
    tails = [[3, 4], [9], [1, 2, 3], [5], [8, 8], [], [2], [6], [4, 4, 4]]
    return [Request(prompt=_HEAD[:n] + t, id=i, max_new_tokens=int(rng.integers(3, 15)))
            for i, (n, t) in enumerate(zip(cut, tails, strict=True))]


# cached tokens per request, in the order admitted (slots=3, refill_rows=2): request 1 waits one
# admit for request 0's pages; request 6 (33 tokens) computes only its last token
_CACHED = {0: 0, 1: 32, 2: 0, 3: 16, 4: 32, 5: 32, 6: 32, 7: 32, 8: 0}


# the MTP block's entry at a position reads the next token: its keys cover one token past each
# page, so request 3 (the head's first page, then a token of its own) shares a page less;
# request 6's own token after two pages happens to be the head's next one: it shares both
_CACHED_MTP = {**_CACHED, 3: 0}


@pytest.mark.parametrize("drafter", [None, "ngram", "draft_model", "mtp"])
def test_rows_sharing_prefixes_equal_generate_alone(drafter):
    reqs = _sharing_requests()
    assert _HEAD[16] != 5 and _HEAD[32] == 2  # what _CACHED_MTP assumes
    kw = dict(drafter=drafter, cache="paged", eos_id=EOS, ngram_n=2,
              draft_model=DRAFT if drafter == "draft_model" else None, **({"depth": 3} if drafter else {}))
    alone = {r.id: alone_run(MODEL, r, **kw) for r in reqs}  # greedy: the same tokens under either rule
    for rule in ("per_sequence", "cohort"):
        out = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, refill_rows=2, kv_advance=rule, **kw)}
        for r in reqs:
            assert out[r.id].tokens == alone[r.id].tokens[0], (rule, r.id)
            if drafter and rule == "per_sequence":
                assert out[r.id].metrics["accepted_trace"] == alone[r.id].metrics["row_accepted_trace"][0], r.id
        assert {i: c.metrics["cached_tokens"] for i, c in out.items()} == \
            (_CACHED_MTP if drafter == "mtp" else _CACHED), rule


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "mtp"])
def test_chunked_prefills_start_past_their_cached_pages(drafter):
    """With ``prefill_chunk``, a pending admit's rows start on their cached pages too (chunks
    of 4 tokens from the end of the shared ones) and register their full prompt pages when
    their prompts are in: every request's tokens and accepted trace equal alone."""
    reqs = _sharing_requests()
    kw = dict(drafter=drafter, depth=3, ngram_n=2, cache="paged",
              draft_model=DRAFT if drafter == "draft_model" else None)
    out = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, refill_rows=2, prefill_chunk=4, **kw)}
    # request 1 computes the header too: request 0's pages are registered only when its prompt is in
    assert {i: c.metrics["cached_tokens"] for i, c in out.items()} == \
        {**(_CACHED_MTP if drafter == "mtp" else _CACHED), 1: 0}
    for r in reqs:
        alone = alone_run(MODEL, r, **kw)
        assert out[r.id].tokens == alone.tokens[0], r.id
        assert out[r.id].metrics["accepted_trace"] == alone.metrics["row_accepted_trace"][0], r.id


def test_seeded_sampled_rows_sharing_prefixes_equal_alone():
    reqs = [Request(prompt=r.prompt, id=r.id, max_new_tokens=r.max_new_tokens, seed=40 + r.id,
                    temperature=0.9, top_p=0.9) for r in _sharing_requests()]
    out = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, refill_rows=2, drafter="ngram", depth=2,
                                           cache="paged", ngram_n=2)}
    assert sum(c.metrics["cached_tokens"] for c in out.values()) > 0
    for r in reqs:
        alone = alone_run(MODEL, r, drafter="ngram", depth=2, cache="paged", ngram_n=2, seed=[r.seed],
                           temperature=0.9, top_p=0.9)
        assert out[r.id].tokens == alone.tokens[0], r.id


def test_a_small_pool_evicts_cached_prefixes_and_recomputes_them():
    """Six distinct 3-page heads, each used twice far apart, through a pool that holds about
    two requests: heads are evicted before their second use (which then computes them again),
    nothing is ever read from an evicted page, and every request equals its alone run."""
    rng = np.random.default_rng(5)
    heads = [rng.integers(0, 31, 48).tolist() for _ in range(6)]
    order = [0, 1, 0, 2, 3, 4, 5, 1, 2, 3]
    reqs = [Request(prompt=heads[h] + [i % 31, 7], id=i, max_new_tokens=6) for i, h in enumerate(order)]
    out = {c.id: c for c in batch_generate(MODEL, reqs, slots=2, refill_rows=1, drafter="ngram", depth=2,
                                           ngram_n=2, cache="paged", pages=10)}
    for r in reqs:
        alone = alone_run(MODEL, r, drafter="ngram", depth=2, ngram_n=2, cache="paged")
        assert out[r.id].tokens == alone.tokens[0], r.id
    cached = [out[i].metrics["cached_tokens"] for i in range(len(order))]
    assert cached[2] == 48 and cached[7:] == [0, 0, 0], cached  # head 0 reused; heads 1-3 evicted by then


def test_auto_depth_jobs_share_prefixes_and_keep_the_greedy_tokens():
    """depth="auto" (a given cost table: nothing timed) over shared prefixes, n-gram drafts:
    every request's plain greedy tokens."""
    from specjax.auto import CostTable

    reqs = _sharing_requests()[:6]
    cost = CostTable.create((1, 2, 3), [1, 64], [[1.0, 1.0, 1.0]] * 2)  # drafting costs nothing
    out = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, refill_rows=2, drafter="ngram", ngram_n=2,
                                           depth="auto", max_depth=2, cost=cost, cache="paged")}
    assert {i: c.metrics["cached_tokens"] for i, c in out.items()} == {i: _CACHED[i] for i in range(6)}
    for r in reqs:
        assert out[r.id].tokens == alone_run(MODEL, r, drafter=None).tokens[0], r.id


def test_prefix_cache_off_computes_every_prompt_and_gives_the_same_tokens():
    reqs = _sharing_requests()
    on = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, refill_rows=2, drafter="ngram", cache="paged")}
    off = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, refill_rows=2, drafter="ngram", cache="paged",
                                           prefix_cache=False)}
    assert {i: c.tokens for i, c in on.items()} == {i: c.tokens for i, c in off.items()}
    assert not any(c.metrics["cached_tokens"] for c in off.values())
    assert all(c.metrics["prompt_tokens"] == len(reqs[i].prompt) for i, c in on.items())


@pytest.mark.parametrize(("model", "kw", "match"), [
    (MODEL, dict(cache="dense"), "cache='paged'"),
    (SLIDING_MODEL, dict(cache="paged"), "all global"),
    (MODEL, dict(cache="paged", prefix_cache="yes"), "True, False or None"),
])
def test_a_prefix_cache_that_cannot_apply_is_refused_before_compile(model, kw, match):
    kw.setdefault("prefix_cache", True)
    with pytest.raises(ValueError, match=match):
        batch_generate(model, [[1, 2, 3]], max_new_tokens=4, **kw)


def test_a_job_that_leaks_a_page_reference_is_caught_at_its_end(monkeypatch):
    """``_check_pool``: a release that keeps one reference too many leaves a page held at the end."""
    real = PagedKVCache._release

    def leaky(self, done):
        out = real(self, done)
        return out.replace(refs=out.refs.at[0].add(jnp.any(done).astype(jnp.int32)))

    monkeypatch.setattr(PagedKVCache, "_release", leaky)
    jax.clear_caches()  # no jitted admit traced before the patch
    try:
        with pytest.raises(RuntimeError, match="page accounting leaked"):
            list(batch_generate(MODEL, [[1, 2, 3, 4, 5]] * 3, slots=2, drafter="ngram", cache="paged",
                                max_new_tokens=4))
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # nor after it


def test_the_mtp_block_keeps_its_entries_of_cached_pages_and_a_sharing_row_starts_with_them():
    """``MtpDrafter.keep_prefix`` stores the block's K/V of each row's registered pages under
    the target's page ids (a padding row stores nothing); ``rows_view(shared=...)`` starts a
    row with its cached pages' entries and its length at their end."""
    import specjax as sj
    from specjax.engine import make_engine

    eng = make_engine(MODEL, drafter="mtp", draft_model=None, depth=2, kv_advance_rule=sj.kv_advance("per_sequence"),
                      cache="paged", capacity=48)
    d = eng.drafter
    s = d.empty(eng, 3, 48)
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.normal(size=s.cache.k[0].shape), jnp.float32) for _ in range(2))
    s = d.with_prefix_store(eng, s.replace(cache=s.cache.replace(k=(k,), v=(v,))), num_pages=8, page_size=16)
    table = jnp.asarray([[5, 2, 7], [1, 3, -1], [0, 4, -1]], jnp.int32)
    s = d.keep_prefix(eng, s, jnp.asarray([0, 1, 3]), table, jnp.asarray([2, 1, 2], jnp.int32))  # row 3: padding
    store = np.asarray(s.prefix[0])
    for page, row, at in ((5, 0, 0), (2, 0, 16), (1, 1, 0)):
        np.testing.assert_array_equal(store[page], np.asarray(k)[row, :, at : at + 16])
    assert not store[[0, 3, 4, 6, 7]].any()  # unregistered pages and the padding row's: nothing stored
    view = d.rows_view(eng, s, jnp.asarray([0, 1]), 40, (jnp.asarray([[5, 2, -1], [1, -1, -1]], jnp.int32),
                                                         jnp.asarray([2, 1], jnp.int32)))
    np.testing.assert_array_equal(np.asarray(view.cache.lengths), [32, 16])
    got_k, got_v = np.asarray(view.cache.k[0]), np.asarray(view.cache.v[0])
    np.testing.assert_array_equal(got_k[0, :, :32], np.asarray(k)[0, :, :32])
    np.testing.assert_array_equal(got_v[1, :, :16], np.asarray(v)[1, :, :16])
    assert not got_k[1, :, 16:].any() and not got_k[0, :, 32:].any()  # past the cached pages: empty
    # two pool groups (a mesh's data shards): slots 2, 3 are group 1's, whose local page ids
    # index the store's second half
    eng2 = make_engine(MODEL, drafter="mtp", draft_model=None, depth=2, kv_advance_rule=sj.kv_advance("per_sequence"),
                       cache="paged", capacity=48, pool_groups=2)
    s2 = d.empty(eng2, 4, 48)
    k4 = jnp.asarray(rng.normal(size=s2.cache.k[0].shape), jnp.float32)
    s2 = d.with_prefix_store(eng2, s2.replace(cache=s2.cache.replace(k=(k4,), v=(k4,))), num_pages=8, page_size=16)
    s2 = d.keep_prefix(eng2, s2, jnp.asarray([3]), jnp.zeros((4, 3), jnp.int32).at[3, 0].set(1), jnp.asarray([1]))
    np.testing.assert_array_equal(np.asarray(s2.prefix[0])[4 + 1], np.asarray(k4)[3, :, :16])
    view = d.rows_view(eng2, s2, jnp.asarray([2]), 40, (jnp.asarray([[1, -1, -1]], jnp.int32), jnp.asarray([1])))
    np.testing.assert_array_equal(np.asarray(view.cache.k[0])[0, :, :16], np.asarray(k4)[3, :, :16])


def test_a_job_hands_a_sharing_row_the_mtp_entries_its_cached_pages_were_written_with(monkeypatch):
    """A batch job with the MTP drafter (run op by op, so the drafter's calls can be read): the
    first request's admit stores its block entries of its registered pages (``keep_prefix``),
    and a later row starting on those pages starts its block cache with exactly them."""
    from specjax.drafters import MtpDrafter

    stored, started = [], []
    keep, view = MtpDrafter.keep_prefix, MtpDrafter.rows_view

    def spy_keep(self, eng, dstate, rows, table, upto):
        row = int(rows[0])
        if row < dstate.cache.k[0].shape[0] and int(upto[0]) > 0:
            stored.append(np.asarray(dstate.cache.k[0])[row, :, : int(upto[0]) * 16])
        return keep(self, eng, dstate, rows, table, upto)

    def spy_view(self, eng, dstate, rows, width, shared=None):
        out = view(self, eng, dstate, rows, width, shared)
        if shared is not None:
            for r, n in enumerate(np.asarray(shared[1])):
                if n:
                    started.append(np.asarray(out.cache.k[0])[r, :, : int(n) * 16])
        return out

    monkeypatch.setattr(MtpDrafter, "keep_prefix", spy_keep)
    monkeypatch.setattr(MtpDrafter, "rows_view", spy_view)
    reqs = [Request(prompt=_HEAD[:40] + t, id=i, max_new_tokens=2) for i, t in enumerate([[3], [4, 5], [6]])]
    with jax.disable_jit():
        out = list(batch_generate(MODEL, reqs, slots=1, refill_rows=1, drafter="mtp", depth=2, cache="paged"))
    assert [c.metrics["cached_tokens"] for c in out] == [0, 32, 32]
    assert stored and len(started) == 2
    for got in started:
        np.testing.assert_array_equal(got, stored[0][:, : got.shape[1]])
