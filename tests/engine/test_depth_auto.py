"""depth="auto" in the engine: greedy tokens never change, the cost table steers the window
(window 1 when drafting is a loss, the widest when it is free), rows whose drafts are never
accepted stop drafting, each row's own draft count is applied, the table is measured once and
kept on disk, and nothing recompiles when the table or a data value changes."""

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_

from specjax import batch_generate, generate
from specjax.advance import kv_advance
from specjax.auto import AutoDepth, auto_state
from specjax.auto.cost import cost_cache_path, measure_cost, monotone_costs, placeholder_cost
from specjax.auto.policy import EARLY_VERDICTS, RELAX_EARLY, CostTable, DepthPolicy
from specjax.drafters import MtpDrafter, NgramDrafter
from specjax.engine import make_engine, prefill, request_capacity, step, step_window
from specjax.engine.loop import TRACES
from specjax.generation import compiled_loop, setup
from specjax.generation_config import GenerationConfig
from specjax.sampling import RowSampling
from specjax.streaming import stream
from specjax.validate import resolve_depth

from engine_models import GLOBAL, noisy, sharp

TARGET = sharp(GLOBAL)
DRAFT = noisy(TARGET, 0.3)  # accepts most drafts
WINDOWS = (1, 2, 3)
FREE = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.0, 1.0]] * 2)  # drafting costs nothing
STEEP = CostTable.create(WINDOWS, [1, 64], [[1.0, 3.0, 5.0]] * 2)  # every draft slot costs a whole step
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5], [7, 8, 9, 10], [4, 4, 4, 4, 4, 4], [11, 3], [2, 9, 2, 9, 2], [30, 1, 6]]
_PLAIN: dict = {}


def _plain(cache="dense"):
    if cache not in _PLAIN:
        _PLAIN[cache] = generate(TARGET, PROMPTS, max_new_tokens=20, drafter=None, cache=cache).tokens
    return _PLAIN[cache]


@pytest.mark.parametrize("drafter,rule,cache,cost", [
    ("draft_model", "per_sequence", "dense", FREE),
    ("draft_model", "cohort", "paged", STEEP),
    ("ngram", "per_sequence", "paged", None),
    ("ngram", "cohort", "dense", FREE),
    ("mtp", "cohort", "dense", FREE),
])
def test_auto_depth_changes_no_greedy_token(drafter, rule, cache, cost):
    r = generate(TARGET, PROMPTS, max_new_tokens=20, drafter=drafter, draft_model=DRAFT, depth="auto", max_depth=2,
                 kv_advance=rule, cache=cache, cost=cost)
    assert r.tokens == _plain(cache)
    assert r.metrics["depth"] == "auto" and r.metrics["windows"] == list(WINDOWS)
    assert abs(sum(r.metrics["window_share"]) - 1.0) < 1e-6


def test_the_cost_table_steers_the_window():
    """Free drafting: the widest window nearly always; drafting a loss: window 1, no drafts."""
    kw = dict(max_new_tokens=20, drafter="draft_model", draft_model=DRAFT, depth="auto", max_depth=2)
    free = generate(TARGET, PROMPTS, cost=FREE, **kw).metrics
    steep = generate(TARGET, PROMPTS, cost=STEEP, **kw).metrics
    assert free["window_share"][-1] > 0.8, free["window_share"]
    assert free["mean_proposed_drafts"] > 1.5
    assert steep["window_share"] == [1.0, 0.0, 0.0] and steep["proposed_drafts"] == 0
    assert steep["compiles"] == 0  # the table is data: the same compiled loop


def _stepper(draft, policy, batch=4, cost=FREE, greedy=True, drafter="draft_model", capacity=256, max_len=200):
    eng = make_engine(TARGET, drafter=drafter, draft_model=draft, depth=policy.windows[-1] - 1,
                      kv_advance_rule=kv_advance("per_sequence"), cache="dense", capacity=capacity,
                      controller=AutoDepth(policy),
                      greedy=greedy)
    params = {"target": TARGET.params} if draft is None else {"target": TARGET.params, "draft": draft.params}
    prompts = np.array([[1, 2, 3, 4]] * batch, np.int32)
    sampling = RowSampling.rows([0.0 if greedy else 1.0] * batch, [None] * batch, [None] * batch)
    st = prefill(eng, params, prompts, np.full(batch, 4, np.int32), np.full(batch, max_len, np.int32),
                 np.full(batch, -1, np.int32), np.arange(batch, dtype=np.uint32), sampling)
    return eng, params, eng.controller.init(eng, st, auto_state(eng, cost, batch))


def test_rows_whose_drafts_are_never_accepted_stop_drafting():
    """A draft model whose argmax is the target's argmin is never accepted: the estimates fall
    and, even with drafting free, the rows stop proposing (a rare probe aside)."""
    never = TARGET.replace(params={**TARGET.params, "lm_head": -TARGET.params["lm_head"]})
    eng, params, st = _stepper(never, DepthPolicy(WINDOWS))
    proposed = []
    for _ in range(70):
        st = step(eng, params, st)
        proposed.append(np.asarray(st.proposed).copy())
    per_step = np.diff(np.stack(proposed), axis=0, prepend=0)  # [steps, B]
    assert int(np.asarray(st.accepted).sum()) == 0
    assert per_step[0].min() == 2  # at the prior every row drafts the widest window
    seen, prop = np.asarray(st.seen_pos), np.asarray(st.prop_pos)
    assert (seen[:, 0] == prop[:, 0]).all() and (seen[:, 1:] == 0).all()  # only the first draft was ever judged
    # the prior counts as one verdict: 8 rejections take it to 0.7 / 9, the EMA then to 0.02 in ~13 more
    late = per_step[30:]
    assert late.mean() < 0.15, late.sum(axis=1)  # ... and later one probe in about ten steps
    assert np.asarray(st.est)[:, 0].max() < 0.1
    # one compiled loop (the choice kept in the state, made after each step): the same turn to window 1
    r = generate(TARGET, PROMPTS, max_new_tokens=56, drafter="draft_model", draft_model=never, depth="auto",
                 max_depth=2, cost=FREE)
    assert r.metrics["window_share"][0] > 0.5 and r.metrics["mean_proposed_drafts"] < 0.8, r.metrics["window_share"]


EMA = DepthPolicy(WINDOWS, rule="ema", threshold=0.5, fill=False)
SPLIT_EST = [[0.9, 0.9], [0.9, 0.1], [0.1, 0.9], [0.1, 0.1]]  # one row wants the widest window, one none


@pytest.mark.parametrize("greedy", [True, False])
def test_each_row_drafts_its_own_count(greedy):
    """Row estimates set per row (``fill=False``): the window holds the longest row, the others
    draft fewer and the verifier (greedy or rejection sampling) judges no draft past a row's count."""
    eng, params, st = _stepper(TARGET, EMA, greedy=greedy)  # the target drafts for itself: every draft passes
    st = step(eng, params, st.replace(est=jnp.asarray(SPLIT_EST, jnp.float32)))
    assert np.asarray(st.proposed).tolist() == [2, 1, 0, 0]
    assert np.asarray(st.auto.window_steps).tolist() == [0, 0, 1]
    assert np.asarray(st.accepted).tolist() == [2, 1, 0, 0]
    assert np.asarray(st.seen_pos).tolist() == [[1, 1], [1, 0], [0, 0], [0, 0]]


@pytest.mark.parametrize("greedy", [True, False])
def test_a_filled_window_verifies_every_draft_it_holds(greedy):
    """``fill`` (the default): the same estimates choose the same window, and every row verifies
    all its drafts (a slot the window computes anyway), so each gains the tokens its count left
    out; the estimates learn from all of them. Greedy tokens stay the target's own."""
    eng, params, st = _stepper(TARGET, dataclasses.replace(EMA, fill=True), greedy=greedy)
    st = step(eng, params, st.replace(est=jnp.asarray(SPLIT_EST, jnp.float32)))
    assert np.asarray(st.auto.window_steps).tolist() == [0, 0, 1]
    assert np.asarray(st.proposed).tolist() == [2, 2, 2, 2]
    assert np.asarray(st.accepted).tolist() == [2, 2, 2, 2]
    assert np.asarray(st.emitted).tolist() == [3, 3, 3, 3]
    assert np.asarray(st.seen_pos).tolist() == [[1, 1]] * 4
    kw = dict(max_new_tokens=20, drafter="ngram", depth="auto", max_depth=2, cost=FREE)
    own = generate(TARGET, PROMPTS, **{**kw, "depth": DepthPolicy(WINDOWS, rule="makespan", fill=False)})
    filled = generate(TARGET, PROMPTS, **{**kw, "depth": DepthPolicy(WINDOWS, rule="makespan")})
    assert filled.tokens == own.tokens == _plain()


def test_the_step_judges_windows_on_what_its_verdicts_support():
    """Estimates resting on few verdicts do not stop a batch drafting: the step judges windows
    on their upper bound (``explore``: a window-1 step reveals nothing, so a batch stopped by
    unlucky first verdicts never learned otherwise), and under the makespan rule a row's own
    estimate counts as its verdicts do (``pool``). Once the verdicts are many, the estimates decide."""
    pick = lambda eng, st: WINDOWS[int(eng.controller.choose(eng, st).auto.pick)]  # noqa: E731
    cost = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.45, 1.9]] * 2)
    eng, _, st = _stepper(DRAFT, DepthPolicy(WINDOWS, rule="makespan"), cost=cost)
    low = st.replace(est=jnp.tile(jnp.asarray([[0.35, 0.7]], jnp.float32), (4, 1)))
    assert pick(eng, low) == 2
    assert pick(eng, low.replace(seen_pos=jnp.full_like(low.seen_pos, 400))) == 1
    lean = AutoDepth(DepthPolicy(WINDOWS, rule="makespan", explore=0.0))
    assert pick(dataclasses.replace(eng, controller=lean), low) == 1

    cost = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.56, 2.08]] * 2)
    eng, _, st = _stepper(DRAFT, DepthPolicy(WINDOWS, rule="makespan", explore=0.0, pool=8.0), cost=cost)
    split = st.replace(est=jnp.asarray([[0.85, 0.7]] * 2 + [[0.35, 0.7]] * 2, jnp.float32),
                       seen_pos=jnp.asarray([[1, 0]] * 4, jnp.int32))  # one verdict each: 2 passed, 2 failed
    assert pick(eng, split) == 2
    assert pick(eng, split.replace(seen_pos=jnp.full_like(split.seen_pos, 100))) == 1
    assert pick(dataclasses.replace(eng, controller=lean), split) == 1


def test_a_forced_window_runs_with_every_row_drafting():
    """Cost measurement forces a window: it runs whatever the policy would choose."""
    eng, params, st = _stepper(TARGET, EMA)
    st = st.replace(est=jnp.zeros_like(st.est))  # the policy alone would not draft
    st = step(eng, params, st.replace(auto=st.auto.replace(force=jnp.int32(2))))
    assert np.asarray(st.auto.window_steps).tolist() == [0, 0, 1]
    assert np.asarray(st.proposed).tolist() == [2, 2, 2, 2]
    st = step(eng, params, st.replace(est=jnp.zeros_like(st.est), auto=st.auto.replace(force=jnp.int32(-1))))
    assert np.asarray(st.auto.window_steps).tolist() == [1, 0, 1]


def _offer_ref(seq: np.ndarray, known: int, n: int, depth: int) -> tuple[int, int]:
    """What an n-gram row can offer: the known tokens after the latest earlier occurrence of
    its last ``n`` (one that leaves at least one known token after it), at most ``depth``, and
    the first of them (0 and -1 without a match)."""
    if known < n:
        return 0, -1
    tail = list(seq[known - n:known])
    starts = [s for s in range(known - n) if list(seq[s:s + n]) == tail]
    return (min(known - starts[-1] - n, depth), int(seq[starts[-1] + n])) if starts else (0, -1)


@settings(max_examples=60, deadline=None)
@given(st_.integers(1, 6), st_.integers(1, 3), st_.integers(0, 3), st_.data())
def test_ngram_offer_matches_a_reference(batch, n, depth, data):
    width = 12
    seq = np.asarray(data.draw(st_.lists(st_.lists(st_.integers(0, 2), min_size=width, max_size=width),
                                         min_size=batch, max_size=batch)), np.int32)
    known = np.asarray(data.draw(st_.lists(st_.integers(0, width), min_size=batch, max_size=batch)), np.int32)
    eng, rows = SimpleNamespace(depth=depth), SimpleNamespace(seq=jnp.asarray(seq), known=jnp.asarray(known))
    count, first = NgramDrafter(n=n).offer(eng, rows)
    want = [_offer_ref(seq[i], int(known[i]), n, depth) for i in range(batch)]
    assert np.asarray(count).tolist() == [c for c, _ in want]
    assert np.asarray(first).tolist() == [f for _, f in want]
    assert np.asarray(NgramDrafter(n=n).available(eng, rows)).tolist() == [c for c, _ in want]


_NGRAM_ENG = make_engine(TARGET, drafter="ngram", draft_model=None, depth=2,
                         kv_advance_rule=kv_advance("per_sequence"), cache="dense", capacity=64,
                         controller=AutoDepth(DepthPolicy(WINDOWS)), greedy=True)


def _ngram_rows(rows: list[int], fresh: bool = False):
    """An n-gram engine under depth="auto" and prefilled rows, each row's known tokens (8: the
    prompt and the first token g) rewritten to: 0, a match 5 back (2 drafts to offer, the first
    19); 1, none; 2, a match 1 back (1 draft, g); 3, a match 5 back (2, the first 12). The
    lookup reads only these tokens. Unless ``fresh``, every row has had one verdict at draft
    position 0 (past a run's first step, which looks before drafting)."""
    eng, params, b = _NGRAM_ENG, {"target": TARGET.params}, len(rows)
    prompts = np.asarray([[5, 6, 7, 8, 9, 10, 11]] * b, np.int32)
    st = prefill(eng, params, prompts, np.full(b, 7, np.int32), np.full(b, 40, np.int32),
                 np.full(b, -1, np.int32), np.arange(b, dtype=np.uint32),
                 RowSampling.rows([0.0] * b, [None] * b, [None] * b))
    g = np.asarray(st.seq)[:, 7]
    seq = np.asarray(st.seq).copy()
    known = {0: [1, 2, -1, 7, 7, 1, 2, -1], 1: [5, 6, 7, 8, 9, 10, 11, -1], 2: [1, 2, 3, 0, -1, -1, -1, -1],
             3: [3, 4, -1, 0, 0, 3, 4, -1]}
    for i, r in enumerate(rows):
        seq[i, :8] = [g[i] if t == -1 else 12 + t for t in known[r]]  # (vocab 31)
    seen = st.seen_pos if fresh else st.seen_pos.at[:, 0].set(1)
    st = st.replace(seq=jnp.asarray(seq), seen_pos=seen)
    return eng, params, eng.controller.init(eng, st, auto_state(eng, FREE, b))


def test_ngram_rows_without_a_match_offer_no_drafts():
    """Under depth="auto" an n-gram row offers only the drafts its match holds: none without one
    (its estimate still counts the policy's drafts, the missing ones as rejected), and a step
    where no row has a match runs at window 1 however cheap drafting is."""
    eng, params, st = _ngram_rows([0, 1, 2, 3])
    start = lambda rows: _ngram_rows(rows)[2]  # noqa: E731
    assert np.asarray(eng.drafter.available(eng, st)).tolist() == [2, 0, 1, 2]
    st = step(eng, params, st)
    assert np.asarray(st.auto.window_steps).tolist() == [0, 0, 1]
    assert np.asarray(st.proposed).tolist() == [2, 0, 1, 2]
    assert np.asarray(st.prop_pos)[1].tolist() == [1, 1]  # the policy's two drafts, unoffered: judged rejected
    assert np.asarray(st.seen_pos)[1].tolist() == [2, 0] and float(np.asarray(st.est)[1, 0]) < 0.5  # one more
    alone = step(eng, params, start([1]))
    assert np.asarray(alone.auto.window_steps).tolist() == [1, 0, 0] and int(alone.proposed[0]) == 0
    pair = step(eng, params, start([1, 2]))  # window 2 holds row 2's one draft; row 1 still offers none
    assert np.asarray(pair.auto.window_steps).tolist() == [0, 1, 0]
    assert np.asarray(pair.proposed).tolist() == [0, 1]


def test_an_ngram_batch_looks_before_drafting():
    """Before any verdict the step runs at window 1, where every n-gram row's first draft is
    judged for free, even with drafting free (the same rows with one verdict each draft the
    widest window: ``test_ngram_rows_without_a_match_offer_no_drafts``). MTP, whose window-1
    steps judge nothing, drafts from its first step."""
    eng, params, st = _ngram_rows([0, 1, 2, 3], fresh=True)
    st = step(eng, params, st)
    assert np.asarray(st.auto.window_steps).tolist() == [1, 0, 0] and int(np.asarray(st.proposed).sum()) == 0
    assert (np.asarray(st.seen_pos)[:, 0] == 1).all()
    r = generate(TARGET, PROMPTS, max_new_tokens=2, drafter="mtp", depth="auto", max_depth=2, cost=FREE)
    assert r.metrics["window_share"][0] == 0.0


def test_a_window_1_step_judges_an_ngram_rows_first_draft_for_free():
    """At window 1 nothing is drafted, but an n-gram row's first draft was known before the
    target ran (``_pick`` keeps it): the estimates learn whether the target's token is that
    draft. A row whose draft was the token rises, one whose draft was not falls, and so does a
    row without a match (its unoffered draft counts as rejected, as in a drafting window: the
    estimates stay long-run rates); later positions and the draft counts stay untouched."""
    eng, params, st = _ngram_rows([0, 1, 2, 3], fresh=True)  # no verdict yet
    g = int(np.asarray(st.seq)[2, 7])
    assert np.asarray(eng.controller.choose(eng, st).auto.first).tolist() == [19, -1, g, 12]  # offer's, kept

    def at_window_1(first):
        s = st.replace(auto=st.auto.replace(first=jnp.asarray(first)))
        out, verdicts = step_window(eng, params, s, 1, eng.controller.drafts(eng, s, 1))
        return eng.controller.observe(eng, s, out, verdicts, 1)

    prior = float(np.asarray(st.est)[0, 0])  # every estimate starts there
    assert (np.asarray(st.est) == prior).all()
    blind = at_window_1([-1] * 4)  # no row with a match: every row's first draft judged rejected
    seen, est = np.asarray(blind.seen_pos), np.asarray(blind.est)
    assert (seen[:, 0] == 1).all() and (seen[:, 1:] == 0).all()
    assert (est[:, 0] < prior).all() and (est[:, 1:] == prior).all()
    nxt = np.asarray(blind.seq)[:, 8]  # the target's tokens (greedy)
    told = at_window_1([int(nxt[0]), -1, (int(nxt[2]) + 1) % 31, int(nxt[3])])
    np.testing.assert_array_equal(told.seq, blind.seq)  # the tokens are the target's alone
    est, seen = np.asarray(told.est), np.asarray(told.seen_pos)
    assert seen[:, 0].tolist() == [1, 1, 1, 1] and (seen[:, 1] == 0).all()
    assert est[0, 0] > prior and est[3, 0] > prior and est[2, 0] < prior
    assert est[1, 0] == est[2, 0]  # no match and a wrong draft: the same rejection
    assert (est[:, 1] == prior).all()
    for name in ("prop_pos", "acc_pos", "proposed", "accepted"):  # nothing was drafted: no draft counted
        assert (np.asarray(getattr(told, name)) == 0).all(), name


@pytest.mark.parametrize("greedy", [True, False])
def test_mtp_deferred_over_window_1_equals_running_it_every_step(greedy):
    """Window-1 steps defer the MTP block (``settle`` runs it over the pending positions in
    one call, before a drafting window or when ``R`` are pending): the tokens, the accepted
    counts and the block's own state equal running the block on every step."""
    r = 8  # a short backlog (the default is 64): the same code, fewer steps
    schedule = [0] * 3 + [2] * 2 + [0] * (r + 3) + [1, 0, 2, 2]  # window indices: settles of 3, R (full), 3 and 1

    def run(drafter):
        eng, params, st = _stepper(None, EMA, greedy=greedy, drafter=drafter)
        for k in schedule:
            st = step(eng, params, st.replace(auto=st.auto.replace(force=jnp.int32(k))))
        return st

    deferred = run(MtpDrafter(backlog_limit=r))
    assert deferred.dstate.pending.shape[1] == r
    eager = run(MtpDrafter(backlog_limit=0))  # no backlog: the block runs on every commit
    assert eager.dstate.pending.shape[1] == 0
    for name in ("seq", "known", "trace", "accepted", "proposed"):
        np.testing.assert_array_equal(getattr(deferred, name), getattr(eager, name), err_msg=name)
    assert np.asarray(deferred.auto.window_steps).tolist() == [r + 7, 1, 4]
    d, e = deferred.dstate, eager.dstate
    np.testing.assert_array_equal(d.cache.lengths, e.cache.lengths)
    np.testing.assert_array_equal(d.cache.lengths, deferred.cache.lengths)  # the block caught up with the target
    np.testing.assert_array_equal(d.first, e.first)
    np.testing.assert_allclose(np.asarray(d.h, np.float32), np.asarray(e.h, np.float32), atol=1e-5)
    if not greedy:
        np.testing.assert_allclose(d.first_probs, e.first_probs, atol=1e-5)
    n = int(np.min(e.cache.lengths))
    for a, b in ((d.cache.k, e.cache.k), (d.cache.v, e.cache.v)):
        a, b = (np.asarray(x[0] if isinstance(x, tuple | list) else x, np.float32) for x in (a, b))
        np.testing.assert_allclose(a[..., :n, :], b[..., :n, :], atol=1e-5)


def test_the_deferred_block_needs_no_room_past_the_targets_cache():
    """The block's cache is the target's size: a settle writes only the pending slots, so one
    that lands near the end of the capacity (the row done, 8 pending, R = 16 wide) writes
    nothing past it and flags nothing, and the run equals the block on every commit."""
    r, width, new_tokens = 16, 4, 40
    capacity = request_capacity(width, new_tokens, 2, bucket=False)  # 49: no slot to spare

    def run(drafter):
        eng, params, st = _stepper(None, EMA, batch=2, drafter=drafter, capacity=capacity, max_len=width + new_tokens)
        for k in [0] * new_tokens + [2]:  # settles at 16 and 32 pending, then 8 before the drafting step
            st = step(eng, params, st.replace(auto=st.auto.replace(force=jnp.int32(k))))
        return st

    deferred, eager = run(MtpDrafter(backlog_limit=r)), run(MtpDrafter(backlog_limit=0))
    assert deferred.dstate.cache.capacity == capacity
    assert np.asarray(deferred.done).all() and np.asarray(deferred.cache.lengths).tolist() == [capacity - 6] * 2
    np.testing.assert_array_equal(deferred.dstate.cache.status, 0)
    np.testing.assert_array_equal(deferred.dstate.cache.lengths, eager.dstate.cache.lengths)
    np.testing.assert_array_equal(deferred.seq, eager.seq)
    np.testing.assert_array_equal(deferred.dstate.first, eager.dstate.first)


def test_the_measured_table_is_kept_on_disk_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    kw = dict(max_new_tokens=12, drafter="ngram", depth="auto", max_depth=2)
    first = generate(TARGET, PROMPTS[:3], **kw)
    assert first.metrics["cost_source"] == "measured"
    stored = json.loads(cost_cache_path().read_text())
    (entry,) = stored.values()
    assert entry["windows"] == list(WINDOWS) and len(entry["seconds"][0]) == 3
    assert all(b >= a > 0 for a, b in zip(entry["seconds"][0], entry["seconds"][0][1:], strict=False))
    again = generate(TARGET, PROMPTS[:3], **kw)
    assert again.metrics["cost_source"] == "cached" and again.metrics["compiles"] == 0
    np.testing.assert_allclose(again.metrics["cost_seconds"], entry["seconds"][0], rtol=1e-6)
    assert again.tokens == first.tokens
    # another process rewrites the entry (drafting now a loss): the next call reads the file again
    (name,) = stored
    stored[name]["seconds"] = [[1.0, 9.0, 9.0]]
    cost_cache_path().write_text(json.dumps(stored))
    rewritten = generate(TARGET, PROMPTS[:3], **kw)
    assert rewritten.metrics["cost_source"] == "cached" and rewritten.metrics["cost_seconds"] == [1.0, 9.0, 9.0]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"windows": [1, 2, 3], "batches": [1], "seconds": [[1, 9, 9]]}))
    given = generate(TARGET, PROMPTS[:3], cost=str(path), **kw)
    assert given.metrics["cost_source"] == "given" and given.metrics["window_share"] == [1.0, 0.0, 0.0]
    np.testing.assert_allclose(given.metrics["acceptance_prior"], [0.7, 0.7])  # none given: DepthPolicy.prior


def test_a_tables_acceptance_is_where_the_estimates_start_and_drift_back_to():
    """A table's acceptance, not DepthPolicy.prior, starts every row's estimates and is what an
    unrevealed position drifts back to; it steers the first step (data: no recompile)."""
    table = CostTable.create(WINDOWS, [1, 64], [[1.0, 3.0, 5.0]] * 2, acceptance=(0.9, 0.3))
    policy = DepthPolicy(WINDOWS, prior=0.7, relax=1.0)  # relax 1: an unrevealed position jumps to its prior
    eng, params, st = _stepper(DRAFT, policy, cost=table)
    st = eng.controller.init(eng, st, st.auto)
    np.testing.assert_allclose(np.asarray(st.est), [[0.9, 0.3]] * 4)
    st = step(eng, params, st.replace(est=jnp.zeros_like(st.est)))  # drafting a loss: window 1, nothing revealed
    assert np.asarray(st.auto.window_steps).tolist() == [1, 0, 0]
    np.testing.assert_allclose(np.asarray(st.est), [[0.9, 0.3]] * 4, rtol=1e-6)
    kw = dict(max_new_tokens=2, drafter="draft_model", draft_model=DRAFT, depth="auto", max_depth=2)
    cheap = [[1.0, 1.6, 2.2]] * 2  # drafting pays only where drafts pass often
    high = generate(TARGET, PROMPTS, cost=CostTable.create(WINDOWS, [1, 64], cheap, (0.95, 0.95)), **kw).metrics
    low = generate(TARGET, PROMPTS, cost=CostTable.create(WINDOWS, [1, 64], cheap, (0.05, 0.05)), **kw).metrics
    assert high["window_share"][0] == 0.0 and low["window_share"] == [1.0, 0.0, 0.0]
    assert low["compiles"] == 0


def test_the_cost_measurement_interleaves_windows_and_keeps_each_ones_fastest():
    """A slow spell over three calls and a slow first call of every round: each window (and the
    baseline, subtracted) still has a clean run in another round, in another place of its
    order, and the table comes out exact."""
    true, base = [1e-3, 1.5e-3, 2.5e-3], 0.05
    calls = []

    def timed(k, warm, n):
        slow = len(calls) in (1, 2, 3) or len(calls) % 4 == 0  # 4 calls a round: the baseline and 3 windows
        calls.append((k, n))
        return (base + true[k] * n) * (3.0 if slow else 1.0), n

    table = measure_cost(SimpleNamespace(windows=WINDOWS), 8, timed, warm=2, budget_s=0.0)
    assert len(calls) == 12  # 3 rounds
    np.testing.assert_allclose(np.asarray(table.seconds)[0], true, rtol=1e-4)
    assert np.asarray(table.batches).tolist() == [8.0]


def test_a_drafting_window_slow_in_every_round_takes_a_wider_ones_figure():
    """Window 2 runs slow in every round (its fastest is inflated, as a shared machine makes it):
    the table prices it at window 3's figure instead of pricing windows 3-4 at its own (the old
    upward flattening: 3e-3 everywhere, drafting 3x plain). Plain decoding keeps its figure and
    no drafting window goes under it."""
    true = [1e-3, 2e-3, 2.1e-3, 2.2e-3]

    def timed(k, warm, n, slow=(1,)):
        return (0.05 + true[k] * n * (1.5 if k in slow else 1.0)), n

    table = measure_cost(SimpleNamespace(windows=(1, 2, 3, 4)), 8, timed, warm=2, budget_s=0.0)
    np.testing.assert_allclose(np.asarray(table.seconds)[0], [1e-3, 2.1e-3, 2.1e-3, 2.2e-3], rtol=1e-4)
    np.testing.assert_allclose(monotone_costs([3.0, 2.0, 2.5, 2.4]), [3.0] * 4)
    np.testing.assert_allclose(monotone_costs([1.0, 2.0, 3.0, 2.9]), [1.0, 2.0, 2.9, 2.9])


def test_stream_and_batch_jobs_run_auto_depth():
    """A static batch (generate, stream) chooses by makespan, a batch job by goodput."""
    kw = dict(max_new_tokens=20, drafter="draft_model", draft_model=DRAFT, depth="auto", max_depth=2)
    chunks = list(stream(TARGET, PROMPTS, cost=FREE, **kw))
    assert chunks[-1].result.tokens == _plain()
    assert chunks[-1].result.metrics["depth_rule"] == "makespan"
    assert resolve_depth("auto", 2, "mtp")[1].rule == "goodput"  # what batch_generate resolves
    done = list(batch_generate(TARGET, PROMPTS, slots=3, **kw))
    out = {c.id: c.tokens for c in done}
    assert [out[i] for i in range(len(PROMPTS))] == _plain()
    for c in done:  # the cost table's timed steps (tokens kept) are on the job's timeline too
        m = c.metrics
        assert len(m["itl_s"]) == m["steps"] and 0 <= m["queue_s"] <= m["ttft_s"] <= m["e2e_s"]


def test_auto_estimates_drift_faster_for_drafters_that_offer_every_draft():
    """MTP, a draft model and a user's drafter offer every draft asked, so a low estimate is a
    low acceptance rate, and one resting on few verdicts drifts back to the prior faster
    (``RELAX_EARLY``: the window-1 lock-in, ``test_depth_policy``); a low n-gram estimate mostly
    means no match: no faster drift. n-gram rows also differ truly (a context repeats or not),
    so a static batch's makespan counts the slowest row's expected lateness (``spread = 1``,
    ``test_depth_policy``); the others keep the makespan of expected steps."""
    for drafter in ("mtp", "draft_model", MtpDrafter(), SimpleNamespace(propose=None)):
        policy = resolve_depth("auto", 2, drafter)[1]
        assert policy.relax_early == RELAX_EARLY > 0 and policy.spread == 0.0, drafter
    for drafter in ("ngram", NgramDrafter(4)):
        policy = resolve_depth("auto", 2, drafter)[1]
        assert policy.relax_early == 0.0 and policy.spread == 1.0, drafter


def test_a_row_at_window_1_forgets_an_estimate_resting_on_few_verdicts():
    """The engine's update: an unrevealed position (every one, at window 1) drifts back to the
    prior by ``relax + relax_early`` while it has had no verdict, by ``relax`` alone once it has
    had ``EARLY_VERDICTS``."""
    policy = DepthPolicy(WINDOWS, relax_early=0.25)
    eng, params, st = _stepper(DRAFT, policy, cost=STEEP)  # drafting a loss: window 1
    low = jnp.full_like(st.est, 0.1)
    firm = st.replace(est=low, seen_pos=jnp.full_like(st.seen_pos, EARLY_VERDICTS))
    firm = step(eng, params, jax.tree.map(jnp.copy, firm))  # the step donates its input
    fresh = step(eng, params, st.replace(est=low))
    assert int(np.asarray(fresh.proposed).sum()) == 0 and int(np.asarray(firm.proposed).sum()) == 0
    np.testing.assert_allclose(np.asarray(fresh.est), 0.1 + (policy.relax + 0.25) * 0.6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(firm.est), 0.1 + policy.relax * 0.6, rtol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(depth="deep"), r"depth='deep' is invalid: must be an int in \[1, 8\], 'auto' or a DepthPolicy"),
    (dict(depth="auto", max_depth=0), r"max_depth=0 is invalid: must be an int in \[1, 8\]"),
    (dict(depth=2, cost=FREE), r"cost=CostTable\(windows=\(1, 2, 3\), batches=\[1.0, 64.0\]\) is invalid: is the "
                                 r"step-cost table of depth='auto'"),
    (dict(depth="auto", max_depth=3, cost=FREE), r"cost='windows \[1, 2, 3\]' is invalid: must be depth='auto''s "
                                                  r"windows \[1, 2, 3, 4\]"),
    (dict(depth=DepthPolicy((1, 2, 2))), r"DepthPolicy.windows=\(1, 2, 2\) is invalid"),
    (dict(depth=DepthPolicy((1, 3), rule="greedy")), r"DepthPolicy.rule='greedy' is invalid"),
    (dict(depth=DepthPolicy((1, 3), rate=2.0)), r"DepthPolicy.rate=2.0 is invalid: must lie in \[0, 1\]"),
    (dict(depth=DepthPolicy((1, 3), relax_early=-0.1)), r"DepthPolicy.relax_early=-0.1 is invalid: must lie in \[0"),
    (dict(depth=DepthPolicy((1, 3), fill=0.5)), r"DepthPolicy.fill=0.5 is invalid: must be True or False"),
])
def test_bad_depth_settings_are_rejected_before_compile(kwargs, match):
    before = TRACES["generate"]
    with pytest.raises(ValueError, match=match):
        generate(TARGET, PROMPTS, max_new_tokens=4, drafter="ngram", **kwargs)
    assert TRACES["generate"] == before


def test_the_auto_loop_updates_the_caches_in_place():
    """The window dispatch copies no KV cache per step: the compiled auto loop holds no more
    cache-sized copies than a fixed depth's (a ``lax.switch`` dispatch held 20 against 4 here)."""
    import re

    def copies(depth):
        cfg = GenerationConfig(max_new_tokens=20, drafter="ngram", depth=depth, attention_impl="xla", max_depth=2)
        eng, params, args = setup(TARGET, PROMPTS, cfg)
        auto = None if eng.controller is None else auto_state(eng, placeholder_cost(eng, len(PROMPTS)), len(PROMPTS))
        text = compiled_loop(eng, params, (*args, auto, jnp.int32(eng.max_steps)))[0].as_text()
        shape = f"[{len(PROMPTS)},{TARGET.config.n_kv_heads},{eng.capacity},{TARGET.config.head_dim}]"
        return len(re.findall(rf"= f32{re.escape(shape)}\S* copy\(", text))

    assert copies("auto") <= copies(2)
