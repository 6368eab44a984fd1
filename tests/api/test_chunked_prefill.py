"""Chunked prefill: a prompt prefilled ``c`` tokens at a time, from each row's own cache length.

The reference is the whole prefill: after every chunk has run, each row's caches (target,
MTP block, draft model), its first token, MTP hidden state and first draft must equal what
one ``prefill_rows`` over the whole prompt leaves, for rows whose prompts end in different
chunks. In a batch job (``prefill_chunk``), every request's greedy tokens (and, under
per-sequence, its accepted drafts) equal ``generate`` alone, and a long prompt is prefilled
one chunk between every two decode steps, so the running rows wait for one chunk at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batch_models import DRAFT, EOS, MODEL, SLIDING_MODEL, alone_run

import specjax
import specjax.batch.scheduler as batch_mod
import specjax.batch.slots as slots_mod
import specjax.latency as latency
from specjax import Request, batch_generate
from specjax.engine import make_engine, pending_rows, prefill_chunk, prefill_rows, request_capacity
from specjax.sampling import RowSampling

WIDTH, LENS = 28, [28, 3, 15, 7, 1, 14]  # prompts ending in the first, a middle and the last chunk


def _prefilled(drafter, c):
    """``(whole, chunked)`` prefill states of ``LENS`` prompts (``c=None``: no chunked one)."""
    eng = make_engine(MODEL, drafter=drafter, draft_model=DRAFT if drafter == "draft_model" else None, depth=3,
                      kv_advance_rule=specjax.kv_advance("per_sequence"), cache="dense",
                      capacity=request_capacity(WIDTH, 8, 3))
    params = {"target": MODEL.params, **({"draft": DRAFT.params} if drafter == "draft_model" else {})}
    b = len(LENS)
    rng = np.random.default_rng(1)
    prompts = np.zeros((b, WIDTH), np.int32)
    for i, n in enumerate(LENS):
        prompts[i, :n] = rng.integers(0, 31, n)
    plen = np.array(LENS, np.int32)
    args = (prompts, plen, plen + 8, np.full((b, 1), -1, np.int32), np.arange(b, dtype=np.uint32),
            RowSampling.rows([0.0] * b, [None] * b, [None] * b))

    def fresh():
        return eng.new_cache(eng.target, b), eng.drafter.empty(eng, b, WIDTH), np.ones(b, bool)

    whole = prefill_rows(eng, params, *args, *fresh())
    st = pending_rows(eng, *args, *fresh())
    assert np.all(np.asarray(st.done))  # pending: nothing to decode yet
    for _ in range(-(-WIDTH // c)):
        st = prefill_chunk(eng, params, st, c)
    return whole, st


def _same_live_kv(got, want, lengths, what):
    for layer, (gk, wk, gv, wv) in enumerate(zip(got.k, want.k, got.v, want.v, strict=True)):
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(gk)[i, :, :n], np.asarray(wk)[i, :, :n], atol=1e-4,
                                       err_msg=f"{what} layer {layer} row {i}")
            np.testing.assert_allclose(np.asarray(gv)[i, :, :n], np.asarray(wv)[i, :, :n], atol=1e-4,
                                       err_msg=f"{what} layer {layer} row {i}")


@pytest.mark.parametrize("drafter,c", [("mtp", 1), ("mtp", 4), ("draft_model", 7), ("ngram", 7)])
def test_chunks_leave_exactly_what_the_whole_prefill_leaves(drafter, c):
    whole, st = _prefilled(drafter, c)
    for f in ("seq", "known", "done"):
        np.testing.assert_array_equal(np.asarray(getattr(st, f)), np.asarray(getattr(whole, f)), err_msg=f)
    lengths = np.asarray(whole.cache.lengths)
    np.testing.assert_array_equal(np.asarray(st.cache.lengths), lengths)
    np.testing.assert_array_equal(lengths, LENS)
    _same_live_kv(st.cache.global_kv, whole.cache.global_kv, lengths, "target")
    if drafter == "mtp":
        s, w = st.dstate, whole.dstate
        np.testing.assert_array_equal(np.asarray(s.cache.lengths), np.asarray(w.cache.lengths))
        _same_live_kv(s.cache, w.cache, np.asarray(w.cache.lengths), "MTP block")
        np.testing.assert_allclose(np.asarray(s.h), np.asarray(w.h), atol=1e-4)
        np.testing.assert_array_equal(np.asarray(s.first), np.asarray(w.first))
    if drafter == "draft_model":
        np.testing.assert_array_equal(np.asarray(st.dstate.lengths), lengths)
        _same_live_kv(st.dstate.global_kv, whole.dstate.global_kv, lengths, "draft model")


def make_requests(seed):
    rng = np.random.default_rng(seed)
    return [Request(prompt=rng.integers(0, 31, int(rng.integers(2, 30))).tolist(), id=i,
                    max_new_tokens=int(rng.integers(3, 30))) for i in range(7)]


@pytest.mark.parametrize("drafter,c,cache,mixed", [
    ("mtp", 1, "dense", True), ("mtp", 7, "dense", True), ("draft_model", 7, "dense", True),
    ("ngram", 3, "dense", True), ("mtp", 4, "paged", True), ("draft_model", 5, "paged", True),
    ("draft_model", 5, "paged", False)])
def test_chunked_jobs_give_every_request_its_alone_tokens(monkeypatch, drafter, c, cache, mixed):
    """Paged: the pool has one owner, the live state, which lends a pending admit its rows'
    entries and the pool for each chunk (the draft model's pool too), so pending and running
    rows never take the same page. Mixed (the default): each chunk in a decode step's forward;
    else each chunk its own call (as under ``depth="auto"``)."""
    monkeypatch.setattr(batch_mod, "MIXED_STEP", mixed)
    reqs = make_requests(seed=c)
    kw = dict(drafter=drafter, depth=3, eos_id=EOS, ngram_n=2, draft_model=DRAFT if drafter == "draft_model" else None,
              cache=cache)
    for rule in ("per_sequence", "cohort"):
        out = {x.id: x for x in batch_generate(MODEL, reqs, slots=3, refill_rows=2, prefill_chunk=c, kv_advance=rule,
                                               **kw)}
        assert sorted(out) == [r.id for r in reqs]
        for r in reqs:
            alone = alone_run(MODEL, r, kv_advance=rule, **kw)
            assert out[r.id].tokens == alone.tokens[0], (rule, r.id)
            if rule == "per_sequence":  # the drafter state came out of the chunks whole
                assert out[r.id].metrics["accepted_trace"] == alone.metrics["row_accepted_trace"][0], r.id
    assert slots_mod._TRACES["chunk_step" if mixed else "chunk"] > 0
    before = dict(slots_mod._TRACES)  # lengths and budgets are data: the same job again compiles nothing
    again = [Request(r.prompt, id=r.id, max_new_tokens=max(1, r.max_new_tokens - 1)) for r in reqs]
    list(batch_generate(MODEL, again, slots=3, refill_rows=2, prefill_chunk=c, kv_advance="cohort", **kw))
    assert slots_mod._TRACES == before


def test_chunked_paged_jobs_share_a_tight_pool_with_the_running_rows():
    """A pool of 10 pages for 3 slots whose requests need up to 5 each: pending admits and
    running rows take pages from the one pool, requests wait for pages, every request gets
    its alone tokens, and every page is back at the end (``_check_pool``)."""
    rng = np.random.default_rng(11)
    reqs = [Request(prompt=rng.integers(0, 31, int(rng.integers(12, 30))).tolist(), id=i,
                    max_new_tokens=int(rng.integers(8, 30))) for i in range(7)]
    out = {x.id: x.tokens for x in batch_generate(MODEL, reqs, slots=3, refill_rows=2, prefill_chunk=4, cache="paged",
                                                  pages=10, drafter="mtp", depth=3)}
    for r in reqs:
        assert out[r.id] == alone_run(MODEL, r, drafter="mtp", depth=3).tokens[0], r.id


def test_sliding_window_rows_take_their_prompts_in_chunks():
    reqs = make_requests(seed=5)
    out = {x.id: x.tokens for x in batch_generate(SLIDING_MODEL, reqs, slots=2, prefill_chunk=3, drafter="mtp")}
    for r in reqs:
        assert out[r.id] == alone_run(SLIDING_MODEL, r, drafter="mtp").tokens[0]


@pytest.mark.parametrize("chunk,mixed", [(None, True), (8, True), (8, False)])
def test_a_long_prompt_stalls_the_running_rows_one_chunk_at_a_time(monkeypatch, chunk, mixed):
    """The clock moves only by prefill work: an admit by its prompt width, a chunk by its size.
    Unchunked, a row running while the 40-token prompt (width 64) is admitted waits >= 64; in
    chunks of 8, every wait holds one chunk and at most the short admits of one round. Mixed
    (the default), each chunk runs in a decode step's forward (``_chunk_step``: one step, no
    other decode call between two chunks); else between two chunks runs exactly one decode
    call of one step."""
    clock, events = [0.0], []
    admit, chunk_fn, chunk_step, decode = batch_mod.admit, batch_mod.chunk_alone, batch_mod.chunk_step, batch_mod.decode

    def timed_admit(eng, c, params, st, idle, rows, prompts, *rest):
        clock[0] += prompts.shape[1]
        return admit(eng, c, params, st, idle, rows, prompts, *rest)

    def timed_chunk(eng, params, st, sub, rows, c):
        clock[0] += c
        events.append("chunk")
        return chunk_fn(eng, params, st, sub, rows, c)

    def timed_chunk_step(eng, params, st, sub, rows, c):
        clock[0] += c
        events.append("chunk")
        i = int(st.i)
        st, sub = chunk_step(eng, params, st, sub, rows, c)
        assert int(st.i) == i + 1  # one step of the running rows
        return st, sub

    def counted_decode(eng, params, st, target, stop_i):
        events.append(int(stop_i - st.i))
        return decode(eng, params, st, target, stop_i)

    monkeypatch.setattr(batch_mod, "MIXED_STEP", mixed)
    monkeypatch.setattr(latency, "now", lambda: clock[0])
    monkeypatch.setattr(batch_mod, "admit", timed_admit)
    monkeypatch.setattr(batch_mod, "chunk_alone", timed_chunk)
    monkeypatch.setattr(batch_mod, "chunk_step", timed_chunk_step)
    monkeypatch.setattr(batch_mod, "decode", counted_decode)
    reqs = [Request([1, 2, 3], id="s0", max_new_tokens=30), Request([i % 29 + 1 for i in range(40)], id="long",
                                                                       max_new_tokens=8)]
    reqs += [Request([4, 5, 6], id=f"s{i}", max_new_tokens=12) for i in range(1, 4)]
    out = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, refill_rows=1, prefill_chunk=chunk,
                                           drafter="ngram", ngram_n=2)}
    wait = max(max(c.metrics["itl_s"], default=0.0) for k, c in out.items() if k != "long")
    if chunk is None:
        assert wait >= 64
    else:
        assert 8 <= wait <= 8 + 3 * 8, wait
        chunks = [i for i, e in enumerate(events) if e == "chunk"]
        assert len(chunks) == 5  # 40 tokens in chunks of 8
        for a, b in zip(chunks, chunks[1:], strict=False):
            assert events[a + 1 : b] == ([] if mixed else [1]), events
    for r in reqs:
        assert out[r.id].tokens == alone_run(MODEL, r, drafter="ngram", ngram_n=2).tokens[0]


@pytest.mark.parametrize("drafter,cache", [("mtp", "dense"), ("draft_model", "paged")])
def test_auto_depth_times_its_table_on_running_rows_not_pending_ones(monkeypatch, drafter, cache):
    """Every prompt is longer than a chunk, so the first rounds hold pending rows only: the
    step-cost table of ``depth="auto"`` waits for rows that decode (timing steps of a batch
    with nothing running would measure nothing, and the table is kept on disk). Each chunk
    rides in the step the controller chose (``step_and_chunk``), never its own call."""
    seen, calls = [], {"chunk": 0, "chunk_step": 0}
    real, chunk, chunk_step = batch_mod._set_cost, batch_mod.chunk_alone, batch_mod.chunk_step

    def spy(eng, params, st, *rest):
        seen.append(bool(np.any(~np.asarray(st.done))))
        return real(eng, params, st, *rest)

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(batch_mod, "_set_cost", spy)
    monkeypatch.setattr(batch_mod, "chunk_alone", counted("chunk", chunk))
    monkeypatch.setattr(batch_mod, "chunk_step", counted("chunk_step", chunk_step))
    rng = np.random.default_rng(3)
    reqs = [Request(prompt=rng.integers(0, 31, int(rng.integers(10, 30))).tolist(), id=i,
                    max_new_tokens=int(rng.integers(3, 30))) for i in range(4)]
    kw = dict(drafter=drafter, draft_model=DRAFT if drafter == "draft_model" else None, cache=cache)
    out = {x.id: x.tokens for x in batch_generate(MODEL, reqs, slots=2, refill_rows=2, prefill_chunk=4,
                                                  depth="auto", max_depth=3, **kw)}
    assert seen == [True]
    assert calls["chunk"] == 0 and calls["chunk_step"] > 0
    for r in reqs:
        assert out[r.id] == alone_run(MODEL, r, depth=3, **kw).tokens[0]


@pytest.mark.parametrize("kw,match", [
    ({"prefill_chunk": 0}, r"prefill_chunk=0 is invalid: must be an int >= 1"),
])
def test_bad_chunk_settings_are_refused_before_compile(kw, match):
    before = dict(slots_mod._TRACES)
    with pytest.raises(ValueError, match=match):
        batch_generate(MODEL, [[1, 2]], max_new_tokens=4, **kw)
    assert slots_mod._TRACES == before


def _cache_after(model, kind, lens, seed):
    """A cache of ``len(lens)`` rows holding random prompts of ``lens`` tokens (capacity 48)."""
    dec, params = model.decoder, model.params
    b, width = len(lens), max(lens)
    cache = dec.init_cache(b, 48, kind=kind, slack=8, page_size=16, num_pages=None)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 31, (b, width)), jnp.int32)
    n = jnp.asarray(lens, jnp.int32)
    _, cache = dec.forward_hidden(params, tokens, jnp.arange(width, dtype=jnp.int32)[None].repeat(b, 0),
                                  cache.reserve(n).bound_write(n), attention_impl="xla")
    return cache.advance(n)


def _window(cache, t, seed):
    """``t`` random tokens per row at each row's length: ``(tokens, positions)``."""
    b = cache.lengths.shape[0]
    pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    return jnp.asarray(np.random.default_rng(seed).integers(0, 31, (b, t)), jnp.int32), pos


@pytest.mark.parametrize("model,kind,impl", [(MODEL, "paged", "xla"), (MODEL, "paged", "pallas"),
                                             (MODEL, "dense", "xla"), (SLIDING_MODEL, "dense", "xla")])
def test_a_mixed_forward_equals_each_group_alone(model, kind, impl):
    """``forward_mixed`` of a decode window (4 rows x 4 tokens) and a prefill chunk (2 rows x 9
    tokens; the reference: the window's forward, then the chunk's over the pool it left): each
    group's hidden state and caches equal its own. Paged, the groups are two views of one pool
    and row 3 is in both (a pending row the live state holds done): the chunk's K/V win there."""
    dec, params = model.decoder, model.params
    if kind == "paged":
        full = _cache_after(model, kind, [12, 5, 9, 3, 7], seed=0)
        full = full.reserve(jnp.asarray([4, 4, 4, 9, 9], jnp.int32))  # both groups' pages, from one free stack
        g = full.global_kv
        a = full.replace(global_kv=g.take_rows(jnp.arange(4)))
        b = full.replace(global_kv=g.take_rows(jnp.asarray([3, 4]))).bound_write(jnp.asarray([9, 6], jnp.int32))
    else:
        a, b = _cache_after(model, kind, [12, 5, 9, 3], seed=0), _cache_after(model, kind, [3, 7], seed=1)
        b = b.bound_write(jnp.asarray([9, 6], jnp.int32))
    (tok_a, pos_a), (tok_b, pos_b) = _window(a, 4, seed=2), _window(b, 9, seed=3)
    (h_a, out_a), (h_b, out_b) = dec.forward_mixed(params, [(tok_a, pos_a, a, None), (tok_b, pos_b, b, None)],
                                                   attention_impl=impl)
    ref_h_a, ref_a = dec.forward_hidden(params, tok_a, pos_a, a, attention_impl=impl)
    ref_h_b, ref_b = dec.forward_hidden(params, tok_b, pos_b, b.on_pool_of(ref_a), attention_impl=impl)
    np.testing.assert_allclose(np.asarray(h_b), np.asarray(ref_h_b), atol=1e-5)
    keep = np.arange(4) != 3  # row 3 reads the chunk's K/V where the reference window read its own
    np.testing.assert_allclose(np.asarray(h_a)[keep], np.asarray(ref_h_a)[keep], atol=1e-5)
    for got, want in ((out_a, ref_a.on_pool_of(ref_b)), (out_b, ref_b)):  # paged: both on the final pool
        for part_got, part_want in zip(got.parts, want.parts, strict=True):
            for x, y in zip(jax.tree.leaves(part_got), jax.tree.leaves(part_want), strict=True):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)
