"""Continuous batching: refilled slots give every request exactly what it gets alone.

Few slots, many requests of mixed lengths, so rows are refilled many times; each request's
greedy tokens must equal ``generate`` on it alone, for every drafter, both rules, dense and
paged caches (a paged pool smaller than slots x max pages included).
"""

import numpy as np
import pytest
from batch_models import DRAFT, EOS, MODEL, SLIDING_MODEL, alone, alone_run, make_requests

import specjax.batch.job as job_mod
import specjax.batch.scheduler as batch_mod
import specjax.batch.slots as slots_mod
from specjax import Request, batch_generate, generate


@pytest.mark.parametrize("drafter", ["mtp", "draft_model", "ngram"])
@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_refilled_rows_equal_generate_alone(drafter, cache):
    reqs = make_requests(9, seed=len(drafter) + len(cache))
    kw = dict(drafter=drafter, depth=3, cache=cache, eos_id=EOS, ngram_n=2,
              draft_model=DRAFT if drafter == "draft_model" else None)
    for rule in ("per_sequence", "cohort"):
        out = list(batch_generate(MODEL, reqs, slots=3, refill_rows=2, kv_advance=rule, **kw))
        assert sorted(c.id for c in out) == sorted(r.id for r in reqs)  # every request exactly once
        got = {c.id: c for c in out}
        for r in reqs:
            c = got[r.id]
            alone = alone_run(MODEL, r, kv_advance=rule, **kw)
            assert c.tokens == alone.tokens[0], (rule, r)
            if rule == "per_sequence":  # the drafter state was refilled too: the same drafts were accepted
                assert c.metrics["accepted_trace"] == alone.metrics["row_accepted_trace"][0], (rule, r)
            assert c.finish_reason == ("eos" if c.tokens[-1] == EOS else "length")
            assert c.metrics["num_tokens"] == len(c.tokens) <= r.max_new_tokens
        # completion order, not submission order: short requests overtake long ones
        assert [c.id for c in out] != [r.id for r in reqs]


def test_sliding_window_rows_refill_their_rings():
    reqs = make_requests(7, seed=3)
    out = {c.id: c.tokens for c in batch_generate(SLIDING_MODEL, reqs, slots=2, drafter="ngram", ngram_n=2)}
    for r in reqs:
        assert out[r.id] == alone(SLIDING_MODEL, r, drafter="ngram", ngram_n=2)


def test_a_paged_pool_smaller_than_every_slot_makes_requests_wait_not_fail():
    """7 pages for 4 slots whose long requests need 3 pages each (every slot's full capacity
    would be 4 x 8 pages): requests wait for pages; every request still equals its alone run."""
    reqs = [Request(prompt=[1, 2, 3], id=i, max_new_tokens=n) for i, n in enumerate([30, 30, 30, 30, 30, 4, 8, 20])]
    out = {c.id: c.tokens for c in batch_generate(MODEL, reqs, slots=4, cache="paged", pages=7, drafter="mtp")}
    for r in reqs:
        assert out[r.id] == alone(MODEL, r, drafter="mtp", cache="paged")


def test_admits_fill_each_slot_group_from_its_own_pool():
    """One pool per data shard: ``_pick`` gives each slot group at most ``ceil(refill / groups)``
    rows per admit, sends the head to the group with the most free slots whose pool fits its
    worst case, and keeps FIFO order when no group can take it."""
    import collections

    row = lambda i, pages: batch_mod.Row(i, [1], 4, 0.0, None, None, 0, (), pages)  # noqa: E731
    held = [None] * 4  # groups: slots 0-1 and 2-3, each with a pool of 6 / 2 = 3 pages
    queue = collections.deque([row("a", 3), row("b", 1), row("c", 1)])
    got = batch_mod._pick(held, queue, refill=2, pool=6, groups=2)[0]
    assert [[(s, r.id) for s, r in g] for g in got] == [[(0, "a")], [(2, "b")]] and len(queue) == 1
    held[0], held[2] = got[0][0][1], got[1][0][1]
    queue.append(row("d", 3))
    got = batch_mod._pick(held, queue, refill=2, pool=6, groups=2)[0]  # "c" fits only group 1's pool (1 + 1 <= 3)
    assert [[(s, r.id) for s, r in g] for g in got] == [[], [(3, "c")]] and [r.id for r in queue] == ["d"]
    held[3] = got[1][0][1]
    assert batch_mod._pick(held, queue, refill=2, pool=6, groups=2)[0] == [[], []]  # "d" waits: no pool has 3 free
    rows = np.asarray(batch_mod.admit_inputs([[(1, row("x", 1)), (0, row("y", 1))], []], 4, 4)[0])
    np.testing.assert_array_equal(rows, [1, 0, 4, 4])  # group-major, each group padded to the fullest's 2 rows
    rows = np.asarray(batch_mod.admit_inputs([[(1, row("x", 1))], []], 4, 4)[0])
    np.testing.assert_array_equal(rows, [1, 4])  # one request per group: one row each


def test_slot_groups_with_their_own_pools_give_every_request_its_alone_tokens(monkeypatch):
    """The engine of a data-parallel mesh on one device: 4 slots in 2 groups, each with its own
    pool of 4 pages, where long requests need 3; every request still equals its alone run."""
    import functools

    monkeypatch.setattr(job_mod, "make_engine", functools.partial(job_mod.make_engine, pool_groups=2))
    reqs = [Request(prompt=[1, 2, 3], id=i, max_new_tokens=n) for i, n in enumerate([30, 30, 30, 30, 4, 8, 20])]
    out = {c.id: c.tokens for c in batch_generate(MODEL, reqs, slots=4, cache="paged", pages=8, drafter="mtp")}
    for r in reqs:
        assert out[r.id] == alone(MODEL, r, drafter="mtp", cache="paged")


def test_an_admit_prefills_one_prompt_bucket_with_rows_that_follow_its_requests(monkeypatch):
    """Short prompts are never padded to a long one's width (an admit holds one bucket; FIFO
    otherwise), and an admit of n requests prefills the next power of two >= n rows, not
    ``refill_rows``: the prefill's work follows the requests admitted."""
    seen = []
    real_admit = batch_mod.admit

    def spy(eng, c, params, st, idle, rows, prompts, prompt_len, *rest):
        live = np.asarray(rows) < st.seq.shape[0]
        seen.append((prompts.shape[1], np.asarray(prompt_len)[live].tolist(), len(rows)))
        return real_admit(eng, c, params, st, idle, rows, prompts, prompt_len, *rest)

    monkeypatch.setattr(batch_mod, "admit", spy)
    lens = [3, 20, 4, 5, 6, 30, 2, 7, 9]
    reqs = [Request(list(range(1, n + 1)), id=i, max_new_tokens=4 + i) for i, n in enumerate(lens)]
    out = {c.id: c.tokens for c in batch_generate(MODEL, reqs, slots=4, refill_rows=4, drafter="ngram", ngram_n=2)}
    assert sorted(n for _, real, _ in seen for n in real) == sorted(lens)  # each request admitted once
    for width, real, rows in seen:
        assert {max(8, 1 << (n - 1).bit_length()) for n in real} == {width}, seen
        assert rows == 1 << (len(real) - 1).bit_length(), seen
    assert [n for _, real, _ in seen for n in real] == lens  # first come, first admitted
    for r in reqs:
        assert out[r.id] == alone(MODEL, r, drafter="ngram", ngram_n=2)


def test_admit_returns_the_pages_of_every_idle_slot():
    """A refill gives back the pages of every idle slot, not only of the slots it refills."""
    from specjax.advance import KvAdvance
    from specjax.engine import make_engine

    eng = make_engine(MODEL, drafter=None, draft_model=None, depth=3, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="paged", capacity=128, num_pages=40)
    params = {"target": MODEL.params}
    st = batch_mod.empty_state(eng, 4, 8)
    first = [(s, batch_mod.Row(s, [1, 2, 3, 4, 5], 20, 0.0, None, None, 0, (), 2)) for s in range(4)]
    st = batch_mod.admit(eng, None, params, st, np.ones(4, bool), *batch_mod.admit_inputs([first], 4, 4))
    assert int(st.cache.global_kv.num_free) == 40 - 4  # one 16-token page per 8-token prefill
    one = [(0, batch_mod.Row("new", [1, 2], 20, 0.0, None, None, 0, (), 2))]
    st = batch_mod.admit(eng, None, params, st, np.ones(4, bool), *batch_mod.admit_inputs([one], 4, 4))
    assert int(st.cache.global_kv.num_free) == 40 - 1
    np.testing.assert_array_equal(np.asarray(st.live), [True, False, False, False])


def test_a_refilled_slot_holds_exactly_a_fresh_prefill_of_its_request():
    """Per-row reset on refill: lengths, tokens, budget, MTP hidden state and first draft of the
    refilled slot are those of the request prefilled alone; the neighbour is untouched."""
    from specjax.advance import KvAdvance
    from specjax.engine import make_engine, prefill

    eng = make_engine(MODEL, drafter="mtp", draft_model=None, depth=3, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="dense", capacity=128)
    params = {"target": MODEL.params}
    row = lambda rid, prompt, n: batch_mod.Row(rid, prompt, n, 0.0, None, None, 0, (), 1)  # noqa: E731
    st = batch_mod.empty_state(eng, 2, 8)
    old = [(0, row("a", [3, 1, 4, 1, 5, 9, 2], 30)), (1, row("b", [2, 7, 1, 8], 30))]
    st = batch_mod.admit(eng, None, params, st, np.ones(2, bool), *batch_mod.admit_inputs([old], 2, 2))
    st = batch_mod.decode(eng, params, st, np.int32(2), st.i + 3)  # both rows move on
    before = np.asarray(st.dstate.h[0]).copy(), int(st.known[0])
    new = [(1, row("c", [6, 6], 12))]
    st = batch_mod.admit(eng, None, params, st, np.array([False, True]), *batch_mod.admit_inputs([new], 2, 2))
    ref = prefill(eng, params, np.array([[6, 6, 0, 0, 0, 0, 0, 0]], np.int32), np.array([2], np.int32),
                  np.array([14], np.int32), np.array([-1], np.int32), np.array([0], np.uint32))
    assert int(st.cache.lengths[1]) == 2 and int(st.known[1]) == 3 and int(st.max_len[1]) == 14
    assert int(st.seq[1, 2]) == int(ref.seq[0, 2]) and not bool(st.done[1])
    np.testing.assert_allclose(np.asarray(st.dstate.h[1]), np.asarray(ref.dstate.h[0]), rtol=1e-5, atol=1e-5)
    assert int(st.dstate.first[1]) == int(ref.dstate.first[0])
    assert int(st.dstate.cache.lengths[1]) == 2
    np.testing.assert_array_equal(np.asarray(st.dstate.h[0]), before[0])  # the neighbour is untouched
    assert int(st.known[0]) == before[1]


def test_a_refilled_row_starts_at_the_tables_acceptance():
    """Under depth="auto" a refilled row's estimates start at the table's acceptance (a prior
    per draft position), not at DepthPolicy.prior; the neighbour's are untouched."""
    from specjax.advance import KvAdvance
    from specjax.auto import AutoDepth, CostTable, DepthPolicy, auto_state
    from specjax.engine import make_engine

    policy = DepthPolicy((1, 2, 3, 4), prior=0.7)
    eng = make_engine(MODEL, drafter="mtp", draft_model=None, depth=3, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="dense", capacity=128, controller=AutoDepth(policy))
    params = {"target": MODEL.params}
    table = CostTable.create((1, 2, 3, 4), [2], [[1.0, 2.0, 3.0, 4.0]], acceptance=(0.8, 0.9, 0.6))
    st = batch_mod.empty_state(eng, 2, 8)
    st = st.replace(auto=auto_state(eng, table, 2), est=st.est.at[0].set(0.1))
    row = batch_mod.Row("a", [3, 1, 4], 12, 0.0, None, None, 0, (), 1)
    st = batch_mod.admit(eng, None, params, st, np.array([False, True]), *batch_mod.admit_inputs([[(1, row)]], 2, 2))
    np.testing.assert_allclose(np.asarray(st.est), [[0.1] * 3, [0.8, 0.9, 0.6]], rtol=1e-6)


def test_a_request_that_can_never_get_its_pages_is_refused_before_compile():
    with pytest.raises(ValueError, match=r"requests\[0\] \(id 0\)='3 \+ 40 tokens' is invalid: needs 4 pages"):
        batch_generate(MODEL, [Request([1, 2, 3], max_new_tokens=40)], cache="paged", pages=3)


def test_seeded_sampled_request_is_itself_in_any_batch_and_slot():
    target = MODEL
    mine = Request(prompt=[1, 2, 3], id="mine", max_new_tokens=20, temperature=1.0, seed=1234)
    alone = list(batch_generate(target, [mine], slots=1, drafter="draft_model", draft_model=DRAFT))[0].tokens
    crowd = make_requests(5, seed=11, prefix="a") + [mine] + make_requests(3, seed=12, prefix="b")
    for slots in (2, 3):
        got = {c.id: c.tokens for c in batch_generate(target, crowd, slots=slots, drafter="draft_model",
                                                      draft_model=DRAFT, temperature=0.7)}
        assert got["mine"] == alone
    # the same request through generate with the same explicit seed: the same sampler, same tokens
    gen = generate(target, [[1, 2, 3]], max_new_tokens=20, drafter="draft_model", draft_model=DRAFT,
                   temperature=1.0, seed=[1234])
    assert gen.tokens[0] == alone


def test_unseeded_copies_of_a_prompt_differ_and_their_seed_follows_the_id():
    reqs = [Request(prompt=[1, 2], id=i, max_new_tokens=12, temperature=1.0) for i in range(6)]
    out = {c.id: c.tokens for c in batch_generate(MODEL, reqs, slots=2, drafter="mtp")}
    assert len({tuple(t) for t in out.values()}) > 1
    # a request's derived seed comes from (seed, id), not from its slot: alone it is the same
    alone = list(batch_generate(MODEL, [reqs[4]], slots=1, drafter="mtp"))[0].tokens
    assert alone == out[4]
    # generate(seed=int) derives a distinct seed per row too
    many = generate(MODEL, [[1, 2]] * 6, max_new_tokens=12, temperature=1.0, seed=0, drafter="mtp")
    assert len({tuple(t) for t in many.tokens}) > 1


def test_greedy_rows_in_a_sampling_job_stay_exactly_greedy():
    reqs = make_requests(6, seed=21)
    mixed = reqs[:3] + [Request(prompt=[4, 4], id="hot", max_new_tokens=10, temperature=0.9, top_k=5, top_p=0.8)]
    out = {c.id: c.tokens for c in batch_generate(MODEL, iter(mixed), slots=2, max_new_tokens=30, drafter="mtp")}
    for r in reqs[:3]:
        assert out[r.id] == alone(MODEL, r, drafter="mtp")


def test_changing_sampling_settings_seeds_or_lengths_never_recompiles():
    reqs = make_requests(6, seed=31)
    list(batch_generate(MODEL, iter(reqs), slots=2, max_new_tokens=30, drafter="mtp"))
    before = dict(slots_mod._TRACES)
    again = [Request(r.prompt, id=r.id, max_new_tokens=max(1, r.max_new_tokens - 2), temperature=0.5 + 0.1 * i,
                     top_p=0.9, top_k=3 + i, seed=i) for i, r in enumerate(reqs)]
    list(batch_generate(MODEL, iter(again), slots=2, max_new_tokens=30, drafter="mtp", temperature=0.3))
    assert slots_mod._TRACES == before


@pytest.mark.parametrize("requests,kw,match", [
    ([[1, 2], [3, 40]], {}, r"requests\[1\] \(id 1\)\.prompt\[1\]=40 is invalid: token ids must lie in \[0, 31\)"),
    ([{"prompt": [1], "id": "a"}, {"prompt": [2], "id": "a"}], {}, r"requests\[1\]\.id='a' is invalid: duplicate id"),
    ([{"prompt": [1], "temprature": 1.0}], {}, r"unknown field"),
    ([{"id": 3}], {}, r"has no 'prompt'"),
    ([Request([1], temperature=-1.0)], {}, r"requests\[0\] \(id 0\)\.temperature=-1\.0 is invalid"),
    ([Request([1], top_p=1.5)], {}, r"\.top_p=1\.5 is invalid: must lie in \(0, 1\]"),
    ([Request([1] * 60, max_new_tokens=10)], {}, r"at most 54 prompt tokens fit"),
    ([[1]], {"slots": 0}, r"slots=0 is invalid"),
    ([[1]], {"pages": 4, "cache": "dense"}, r"pages=4 is invalid: is the paged pool's size"),
    ([[1]], {"refill_rows": 5, "slots": 4}, r"refill_rows=5 is invalid"),
])
def test_bad_requests_are_refused_before_compile(requests, kw, match):
    before = dict(slots_mod._TRACES)
    with pytest.raises(ValueError, match=match):
        batch_generate(MODEL, requests, drafter="mtp", **{"max_new_tokens": 10, **kw})
    assert slots_mod._TRACES == before


def test_stop_ends_the_job_between_rounds():
    reqs = make_requests(8, seed=41)
    seen = []
    out = list(batch_generate(MODEL, reqs, slots=2, drafter="mtp", stop=lambda: len(seen) > 0 or seen.append(1)))
    assert len(out) < len(reqs)
