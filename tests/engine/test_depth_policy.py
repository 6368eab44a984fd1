"""Load-adaptive depth in the simulator: estimates, cost tables, the policies' choices and
the crossover they must track (``specjax.auto.policy``, ``specjax.sim.simulate_policy``)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import ROOT

from specjax import cli
from specjax.auto.policy import (
    EARLY_VERDICTS,
    RELAX_EARLY,
    CostTable,
    DepthPolicy,
    choose,
    expected_max_normal,
    expected_tokens,
    max_normal_table,
    optimistic,
    pooled_acceptance,
    update_estimates,
    yield_variance,
)
from specjax.sim import Bernoulli, BetaRows, Matches, Trace, compare_policies, simulate_fixed, simulate_policy

WINDOWS = (1, 2, 4)
ROOFLINE = CostTable.roofline(1.0, 0.02, WINDOWS)  # memory-bound until rows * window passes 50


def _np_update(est, proposed, accepted, rate, prior, relax, seen=None, prior_weight=0.0, relax_early=0.0):
    out = est.copy()
    for i in range(est.shape[0]):
        for j in range(est.shape[1]):
            if j < min(accepted[i] + 1, proposed[i]):
                r = rate if seen is None else max(rate, 1.0 / (prior_weight + seen[i, j] + 1))
                out[i, j] = (1 - r) * est[i, j] + r * (1.0 if j < accepted[i] else 0.0)
            else:
                early = 0.0 if seen is None else relax_early * max(0.0, 1.0 - seen[i, j] / EARLY_VERDICTS)
                out[i, j] = est[i, j] + (relax + early) * (prior - est[i, j])
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_update_estimates_matches_numpy(b, d, seed):
    rng = np.random.default_rng(seed)
    est = rng.uniform(0, 1, (b, d)).astype(np.float32)
    proposed = rng.integers(0, d + 1, b)
    accepted = np.array([rng.integers(0, p + 1) for p in proposed])
    got = update_estimates(jnp.asarray(est), jnp.asarray(proposed, jnp.int32), jnp.asarray(accepted, jnp.int32),
                           0.2, 0.5, 0.05)
    np.testing.assert_allclose(np.asarray(got), _np_update(est, proposed, accepted, 0.2, 0.5, 0.05), atol=1e-6)
    seen = rng.integers(0, 2 * EARLY_VERDICTS, (b, d))
    got = update_estimates(jnp.asarray(est), jnp.asarray(proposed, jnp.int32), jnp.asarray(accepted, jnp.int32),
                           0.2, 0.5, 0.05, jnp.asarray(seen, jnp.int32), 1.5, 0.3)
    np.testing.assert_allclose(np.asarray(got), _np_update(est, proposed, accepted, 0.2, 0.5, 0.05, seen, 1.5, 0.3),
                               atol=1e-6)


def test_prior_weight_makes_the_first_verdicts_a_running_mean():
    """With the prior worth 2 verdicts, three rejections take 0.7 to 0.7 * 2/5 = 0.28 (a plain
    EMA at rate 0.1: 0.51); once the counts pass 1/rate the step is the EMA's again."""
    est, prop, acc = jnp.full((1, 1), 0.7), jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
    counted, plain, seen = est, est, jnp.zeros((1, 1), jnp.int32)
    for _ in range(3):
        counted = update_estimates(counted, prop, acc, 0.1, 0.7, 0.0, seen, 2.0)
        plain = update_estimates(plain, prop, acc, 0.1, 0.7, 0.0)
        seen = seen + 1
    np.testing.assert_allclose(float(counted[0, 0]), 0.28, rtol=1e-5)
    np.testing.assert_allclose(float(plain[0, 0]), 0.7 * 0.9**3, rtol=1e-5)
    late = update_estimates(est, prop, acc, 0.1, 0.7, 0.0, jnp.full((1, 1), 50), 2.0)
    np.testing.assert_allclose(float(late[0, 0]), 0.63, rtol=1e-5)


def test_expected_tokens():
    est = jnp.array([[0.5, 0.5, 0.5], [1.0, 0.0, 1.0]])
    np.testing.assert_allclose(np.asarray(expected_tokens(est, jnp.array([3, 3]))), [1.875, 2.0])
    np.testing.assert_allclose(np.asarray(expected_tokens(est, jnp.array([1, 0]))), [1.5, 1.0])


def test_cost_table_interpolates_and_validates(tmp_path):
    t = CostTable.create((1, 4), [1, 3], [[1.0, 2.0], [3.0, 8.0]])
    np.testing.assert_allclose(np.asarray(t.at(2)), [2.0, 5.0])
    np.testing.assert_allclose(np.asarray(t.at(9)), [3.0, 8.0])  # clamped past the last measured batch
    for active in (0, 1, 2, 2.5, 9):  # the host-side reading auto_state takes
        np.testing.assert_allclose(t.row(active), np.asarray(t.at(active)), rtol=1e-6)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"windows": [1, 4], "batches": [1, 3], "seconds": [[1, 2], [3, 8]]}))
    np.testing.assert_allclose(np.asarray(CostTable.load(path).seconds), np.asarray(t.seconds))
    with pytest.raises(ValueError, match=r"windows must be distinct ascending ints >= 1"):
        CostTable.create((4, 1), [1], [[1.0, 1.0]])
    with pytest.raises(ValueError, match=r"seconds must be positive with shape \[batches=2, windows=2\]"):
        CostTable.create((1, 4), [1, 3], [[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"cost table .*nope.json"):
        CostTable.load(tmp_path / "nope.json")


def test_a_tables_acceptance_is_validated_loaded_and_read_as_the_prior(tmp_path):
    plain = CostTable.create((1, 2, 4), [1], [[1.0, 2.0, 3.0]])
    assert plain.acceptance is None and plain.prior(0.7).tolist() == pytest.approx([0.7] * 3)
    t = CostTable.create((1, 2, 4), [1], [[1.0, 2.0, 3.0]], acceptance=[0.8, 0.9, 0.5])
    assert t.acceptance == (0.8, 0.9, 0.5) and t.prior(0.7).tolist() == pytest.approx([0.8, 0.9, 0.5])
    for bad in ([0.8, 0.9], [0.8, 0.9, 1.5], [0.8, -0.1, 0.5]):
        with pytest.raises(ValueError, match=r"acceptance must be 3 numbers in \[0, 1\]"):
            CostTable.create((1, 2, 4), [1], [[1.0, 2.0, 3.0]], acceptance=bad)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"windows": [1, 2, 4], "batches": [1], "seconds": [[1, 2, 3]],
                                "acceptance": [0.8, 0.9, 0.5]}))
    assert CostTable.load(path).acceptance == (0.8, 0.9, 0.5)
    path.write_text(json.dumps({"windows": [1, 2, 4], "batches": [1], "seconds": [[1, 2, 3]], "acceptance": [2]}))
    with pytest.raises(ValueError, match=r"cost table .*cost.json: acceptance must be 3 numbers"):
        CostTable.load(path)
    # pooled over rows: accepted / verdicts per position, the prior counted as one verdict
    assert pooled_acceptance([9, 0, 3], [10, 0, 4], 0.7) == pytest.approx(((9.7) / 11, 0.7, 3.7 / 5))


def test_goodput_picks_plain_when_drafting_is_a_loss_and_the_widest_when_it_is_free():
    est = jnp.full((8, 3), 0.6)
    live = jnp.ones(8, bool)
    free = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.0, 1.0]] * 2)
    linear = CostTable.create(WINDOWS, [1, 64], [[1.0, 2.0, 4.0]] * 2)  # cost grows with every token
    idx, drafts = choose(est, live, free, "goodput")
    assert WINDOWS[int(idx)] == 4 and (np.asarray(drafts) == 3).all()
    idx, drafts = choose(est, live, linear, "goodput")
    assert WINDOWS[int(idx)] == 1 and (np.asarray(drafts) == 0).all()
    idx, _ = choose(est, live, linear, "goodput", min_window=2)  # a cohort batch re-feeding 2 tokens
    assert WINDOWS[int(idx)] == 2


def test_rows_with_zero_acceptance_stop_drafting():
    est = jnp.array([[0.9, 0.9, 0.9], [0.0, 0.5, 0.5], [0.9, 0.01, 0.9]])
    free = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.0, 1.0]] * 2)
    idx, drafts = choose(est, jnp.ones(3, bool), free, "goodput")
    assert WINDOWS[int(idx)] == 4 and np.asarray(drafts).tolist() == [3, 0, 1]


def test_ema_takes_the_smallest_window_holding_the_longest_row():
    est = jnp.array([[0.9, 0.2, 0.9], [0.6, 0.1, 0.1], [0.9, 0.9, 0.9]])
    idx, drafts = choose(est, jnp.array([True, True, False]), ROOFLINE, "ema", threshold=0.5)
    assert WINDOWS[int(idx)] == 2 and np.asarray(drafts).tolist() == [1, 1, 1]  # row 2 is not live


@pytest.mark.parametrize("batch", [1, 8, 32, 64])
def test_goodput_tracks_the_crossover(batch):
    """Heterogeneous rows (Beta(2, 2) and low-acceptance Beta(0.5, 2)) under a roofline cost:
    the goodput policy stays within 5% of the best fixed window (plain included) at every
    batch size, drafts wide at B=1 when rows accept half their drafts, and not at all at B=64."""
    for acc in (BetaRows(2.0, 2.0), BetaRows(0.5, 2.0)):
        rows = {r["policy"]: r for r in compare_policies(batch, 300, acc, ROOFLINE)}
        auto = rows["goodput"]
        assert auto["vs_best_fixed"] >= 0.95, (acc, rows)
        assert auto["vs_plain"] >= 0.95, (acc, rows)
        if batch == 1 and acc.alpha == 2.0:  # a row accepting half its drafts: draft as deep as allowed
            assert auto["window_share"][-1] > 0.9
        if batch == 64:  # compute-bound: every draft costs more than it brings
            assert auto["window_share"][0] > 0.9


def test_makespan_follows_the_row_that_finishes_last():
    """A static batch ends with its slowest row: a row that never accepts keeps the window at
    1 while it has the most tokens left (goodput, summing over rows, drafts for the fast rows),
    and stops holding it back once it is nearly done."""
    est = jnp.asarray([[0.95] * 3] * 7 + [[0.0] * 3])
    live = jnp.ones(8, bool)
    cost = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.3, 1.9]] * 2)
    assert WINDOWS[int(choose(est, live, cost, "goodput")[0])] == 4
    idx, drafts = choose(est, live, cost, "makespan", remaining=jnp.full(8, 100))
    assert WINDOWS[int(idx)] == 1 and (np.asarray(drafts) == 0).all()
    idx, drafts = choose(est, live, cost, "makespan", remaining=jnp.asarray([100] * 7 + [5]))
    assert WINDOWS[int(idx)] == 4 and np.asarray(drafts).tolist() == [3] * 7 + [0]
    steep = CostTable.create(WINDOWS, [1, 64], [[1.0, 3.0, 9.0]] * 2)  # drafts shorten the run but cost more
    assert WINDOWS[int(choose(jnp.full((8, 3), 0.3), live, steep, "makespan", remaining=jnp.full(8, 100))[0])] == 1
    free = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.0, 1.0]] * 2)
    assert WINDOWS[int(choose(jnp.full((8, 3), 0.3), live, free, "makespan", remaining=jnp.full(8, 100))[0])] == 4
    # 31 alike rows and one whose estimate is low by noise: pooled half way to the batch mean it
    # does not hold the batch at window 1 (its own estimate alone would)
    alike = jnp.asarray([[0.85] * 3] * 31 + [[0.4] * 3])
    c32 = CostTable.create(WINDOWS, [1, 64], [[22.7, 33.9, 51.3]] * 2)
    left = jnp.full(32, 128)
    assert WINDOWS[int(choose(alike, jnp.ones(32, bool), c32, "makespan", remaining=left, shrink=0.0)[0])] == 1
    assert WINDOWS[int(choose(alike, jnp.ones(32, bool), c32, "makespan", remaining=left)[0])] == 2
    with pytest.raises(ValueError, match="'makespan' needs remaining="):
        choose(est, live, cost, "makespan")


def test_makespan_breaks_its_ties_by_the_tokens_a_window_emits():
    """Where the slowest row gains nothing from drafting, the makespan rule prices every window
    the same if the step costs the same (a flat stretch of the table): the window emitting the
    most tokens wins, not the narrowest. Where a wider window costs more, the slowest row still
    holds the batch at window 1."""
    est = jnp.asarray([[0.8] * 3] * 7 + [[0.01] * 3])  # the last row: under min_gain, it drafts none
    live, left = jnp.ones(8, bool), jnp.full(8, 100)
    flat = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.0, 1.0]] * 2)
    idx, drafts = choose(est, live, flat, "makespan", remaining=left, min_gain=0.02)
    assert WINDOWS[int(idx)] == 4 and np.asarray(drafts).tolist() == [3] * 7 + [0]
    rising = CostTable.create(WINDOWS, [1, 64], [[1.0, 1.01, 1.02]] * 2)
    assert WINDOWS[int(choose(est, live, rising, "makespan", remaining=left, min_gain=0.02)[0])] == 1
    nobody = jnp.full((8, 3), 0.01)  # no row drafts: every window emits the same, the narrowest wins
    assert WINDOWS[int(choose(nobody, live, flat, "makespan", remaining=left, min_gain=0.02)[0])] == 1


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_yield_variance_matches_the_distribution(b, d, seed):
    """``Var[accepted + 1]`` against the distribution written out: P(accepted = j) =
    reach_j - reach_{j+1} (reach_0 = 1) for j up to the row's draft count."""
    rng = np.random.default_rng(seed)
    est = rng.uniform(0, 1, (b, d)).astype(np.float32)
    drafts = rng.integers(0, d + 1, b)
    got = np.asarray(yield_variance(jnp.asarray(est), jnp.asarray(drafts, jnp.int32)))
    for i in range(b):
        reach = np.concatenate([[1.0], np.cumprod(est[i])[: drafts[i]], [0.0]])
        p = reach[:-1] - reach[1:]  # P(accepted = j), j = 0 .. drafts
        j = np.arange(len(p))
        want = np.sum(p * j**2) - np.sum(p * j) ** 2
        np.testing.assert_allclose(got[i], want, atol=1e-5)


@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
@settings(max_examples=20, deadline=None)
def test_optimistic_matches_a_reference(b, d, seed):
    """The lift is ``bonus`` standard errors of the verdicts the whole batch has had at each position."""
    rng = np.random.default_rng(seed)
    est = rng.uniform(0, 1, (b, d)).astype(np.float32)
    seen = rng.integers(0, 50, (b, d)).astype(np.int32)
    n = seen.sum(axis=0, keepdims=True)
    want = np.clip(est + 0.5 * np.sqrt(est * (1 - est) / (n + 2)), 0, 1)
    np.testing.assert_allclose(np.asarray(optimistic(jnp.asarray(est), jnp.asarray(seen), 0.5)), want, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(optimistic(jnp.asarray(est), jnp.asarray(seen), 0.0)), est)


def test_optimistic_keeps_drafting_until_the_verdicts_are_firm():
    """B=1 after one rejection (0.7 -> 0.35): on its estimates the makespan rule stops drafting
    for good (a window-1 step reveals nothing); on the upper bound it drafts again, and once the
    position has had many verdicts the estimate decides."""
    windows = (1, 2, 3, 4)
    cost = CostTable.create(windows, [1, 64], [[1.0, 1.45, 1.9, 2.2]] * 2)
    one = jnp.asarray([[0.35, 0.7, 0.7]])

    def pick(upper=None):
        idx, _ = choose(one, jnp.ones(1, bool), cost, "makespan", remaining=jnp.full(1, 100), upper=upper)
        return windows[int(idx)]
    assert pick() == 1
    assert pick(optimistic(one, jnp.asarray([[1, 0, 0]]), 0.5)) > 1
    assert pick(optimistic(one, jnp.full((1, 3), 400), 0.5)) == 1
    # the draft counts follow the estimates: a row that keeps failing stops whatever the bound says
    never = jnp.asarray([[0.01, 0.7, 0.7]])
    lifted = optimistic(never, jnp.asarray([[1, 0, 0]]), 0.5)
    assert float(lifted[0, 0]) > 0.02  # above min_gain (the engine's 0.02): drafts on the bound would not stop
    free = CostTable.create(windows, [1, 64], [[1.0] * 4] * 2)
    _, drafts = choose(never, jnp.ones(1, bool), free, "makespan", min_gain=0.02, remaining=jnp.full(1, 100),
                       upper=lifted)
    assert int(drafts[0]) == 0


def test_makespan_pools_rows_with_few_verdicts_towards_the_batch():
    """B=8 after one step of one draft each, 5 accepted and 3 rejected: the rejected rows'
    estimates (0.35) rest on one verdict; counted as such (``pool``) they sit near the batch
    mean and the batch drafts; with ``pool=0`` (or after 100 verdicts each) they hold it at window 1."""
    windows = (1, 2, 3, 4)
    cost = CostTable.create(windows, [1, 64], [[1.0, 1.56, 2.08, 2.34]] * 2)
    est = jnp.asarray([[0.85, 0.7, 0.7]] * 5 + [[0.35, 0.7, 0.7]] * 3)
    live = jnp.ones(8, bool)

    def pick(seen, pool):
        return windows[int(choose(est, live, cost, "makespan", remaining=jnp.full(8, 100), seen=seen, pool=pool)[0])]
    once = jnp.asarray([[1, 0, 0]] * 8)
    assert pick(once, 0.0) == 1
    assert pick(once, 8.0) > 1
    assert pick(jnp.full((8, 3), 100), 8.0) == 1


def test_expected_max_normal():
    draws = np.random.default_rng(0).standard_normal((20000, 64))
    for n in (2, 8, 64):
        assert abs(float(expected_max_normal(n)) - draws[:, :n].max(axis=1).mean()) < 0.05, n
    assert float(expected_max_normal(1)) == 0.0 and float(expected_max_normal(0)) == 0.0
    # the host table choose reads at the live-row count: the same figures at every count
    np.testing.assert_allclose(max_normal_table(70), [float(expected_max_normal(n)) for n in range(71)], atol=2e-5)


def test_makespan_counts_the_spread_of_the_slowest_row():
    """With ``spread=1``: drafting shortens a row's expected run but spreads it, plain decoding
    finishes every row on time. Alone a row drafts; the slowest of 64 alike rows lands late
    enough that plain wins. ``spread=0`` (the default) compares expected steps only."""
    windows = (1, 2)
    cost = CostTable.create(windows, [1, 64], [[1.0, 1.6]] * 2)  # 1.7 tokens for 1.6x a step: a 6% gain on average
    est = jnp.full((64, 1), 0.7)
    left = jnp.full(64, 20)
    one = choose(est[:1], jnp.ones(1, bool), cost, "makespan", remaining=left[:1], spread=1.0)
    many = choose(est, jnp.ones(64, bool), cost, "makespan", remaining=left, spread=1.0)
    assert windows[int(one[0])] == 2 and windows[int(many[0])] == 1
    assert windows[int(choose(est, jnp.ones(64, bool), cost, "makespan", remaining=left)[0])] == 2
    # the lateness is the live rows' (2 of 64 slots: about 0.59 sds, alone 0, all 64 about 2.4): at a
    # draft step of 1.65x one row drafts and two do not; at 1.5x two live rows draft and 64 do not
    two = jnp.arange(64) < 2
    for ratio, alone, pair, full in ((1.65, 2, 1, 1), (1.5, 2, 2, 1)):
        c = CostTable.create(windows, [64], [[1.0, ratio]])
        got = [windows[int(choose(est, live, c, "makespan", remaining=left, spread=1.0)[0])]
               for live in (jnp.arange(64) < 1, two, jnp.ones(64, bool))]
        assert got == [alone, pair, full], (ratio, got)


def test_ngram_auto_counts_the_lateness_of_the_slowest_row():
    """Half of 64 rows repeat their context (n-gram accepts 80% of first drafts), half do not
    (5%); a draft step costs 1.15x. The makespan of expected steps drafts (the slowest row,
    pulled half way to the mean, still gains 1.24 tokens a step); n-gram's ``DepthPolicy.auto``
    (``spread = 1``) sees that row land late and stays at plain decoding. MTP's keeps drafting."""
    cost = CostTable.create((1, 2), [64], [[1.0, 1.15]])
    est = jnp.concatenate([jnp.full((32, 1), 0.8), jnp.full((32, 1), 0.05)])
    live, left = jnp.ones(64, bool), jnp.full(64, 100)

    def window(always_offers: bool) -> int:
        p = DepthPolicy.auto(1, "makespan", always_offers=always_offers)
        idx, _ = choose(est, live, cost, p.rule, remaining=left, shrink=p.shrink, spread=p.spread)
        return p.windows[int(idx)]
    assert window(always_offers=False) == 1
    assert window(always_offers=True) == 2


def test_a_row_whose_first_drafts_fail_drafts_again_when_its_drafter_offers_every_draft():
    """The window-1 lock-in: a window-1 step reveals nothing, so a row that accepts no draft on
    its first two steps (and every draft after them) keeps a low estimate. Under the drift of a
    drafter that offers every draft (``DepthPolicy.auto(..., always_offers=True)``: MTP, a
    draft model) it drafts again and runs near the widest window's speed; under the slow drift
    (n-gram's) it stays at plain decoding's (measured: 1084 / 673 tok/s; the widest 1088)."""
    cpu_b1 = [1.47e-3, 2.50e-3, 2.99e-3, 3.46e-3]  # MTP's table at B=1 on the CI CPU
    table = CostTable.create((1, 2, 3, 4), [1], [cpu_b1])
    prefix = np.full((400, 1), 3, np.int32)
    prefix[:2] = 0
    widest = simulate_fixed(1, 400, Trace(prefix), table, tokens=128)[-1].tok_per_s  # window 4 alone

    def auto(always_offers: bool) -> float:
        knobs = DepthPolicy.auto(3, "makespan", always_offers=always_offers).knobs()
        return simulate_policy(1, 400, Trace(prefix), table, "makespan", tokens=128, **knobs).tok_per_s
    assert auto(True) >= 0.95 * widest
    assert auto(False) < 0.7 * widest  # locked in at window 1


@pytest.mark.parametrize("batch", [1, 8, 32, 64])
def test_makespan_tracks_the_crossover_of_a_static_batch(batch):
    """Every row emits 128 tokens and the batch runs until the slowest is done: makespan stays
    within 10% of the best fixed window and of plain at every batch size (measured: 0.918x at
    worst, B=32); at B=32 goodput, drafting for the rows that finish early, falls behind it."""
    for acc in (BetaRows(2.0, 2.0), BetaRows(0.5, 2.0)):
        rows = {r["policy"]: r for r in compare_policies(batch, 800, acc, ROOFLINE, tokens=128)}
        assert rows["makespan"]["vs_best_fixed"] >= 0.9, (acc, rows)
        assert rows["makespan"]["vs_plain"] >= 0.9, (acc, rows)
        if batch == 32:
            assert rows["goodput"]["tok_per_s"] < 0.98 * rows["makespan"]["tok_per_s"], rows


def test_simulate_policy_validates():
    with pytest.raises(ValueError, match=r"must be one of \['fixed', 'ema', 'goodput', 'makespan'\], got 'best'"):
        simulate_policy(4, 10, 0.5, ROOFLINE, "best")
    with pytest.raises(ValueError, match=r"'makespan' needs tokens="):
        simulate_policy(4, 10, 0.5, ROOFLINE, "makespan")
    with pytest.raises(ValueError, match=r"steps=10 is too few for every row to emit tokens=50"):
        simulate_policy(4, 10, 0.5, ROOFLINE, "fixed", tokens=50)
    with pytest.raises(ValueError, match=r"rate must lie in \[0.0, 1.0\], got 2"):
        simulate_policy(4, 10, 0.5, ROOFLINE, rate=2)
    with pytest.raises(ValueError, match=r"cost must be a CostTable"):
        simulate_policy(4, 10, 0.5, {"windows": [1]})
    with pytest.raises(ValueError, match=r"relax_early=0.02 needs prior_weight"):
        simulate_policy(4, 10, 0.5, ROOFLINE, relax_early=0.02)
    with pytest.raises(ValueError, match=r"relax_early must lie in \[0.0, 1.0\], got 2"):
        simulate_policy(4, 10, 0.5, ROOFLINE, relax_early=2, prior_weight=1.0)
    with pytest.raises(ValueError, match=r"prior must be a number in \[0, 1\] or 3 of them"):
        simulate_policy(4, 10, 0.5, ROOFLINE, prior=(0.5, 0.5))


def test_the_simulator_takes_a_prior_per_draft_position():
    """One prior per position (a measured table's acceptance) as the engine takes it: the same
    figures as one number where they are all equal; a batch of rows that pass the deeper drafts
    drafts sooner where those positions start high."""
    cost = CostTable.create((1, 2, 3, 4), [8], [[1.0, 2.0, 2.2, 2.4]])
    kw = dict(policy="makespan", tokens=64, **DepthPolicy.auto(3, always_offers=True).knobs())
    kw.pop("prior")
    one = simulate_policy(8, 200, BetaRows(8.0, 2.0), cost, prior=0.6, **kw)
    same = simulate_policy(8, 200, BetaRows(8.0, 2.0), cost, prior=(0.6, 0.6, 0.6), **kw)
    assert one == same
    deep = simulate_policy(8, 200, BetaRows(8.0, 2.0), cost, prior=(0.6, 0.95, 0.95), **kw)
    assert deep.window_share[-1] > one.window_share[-1] and deep.tok_per_s > one.tok_per_s


def test_cli_simulate_policies(capsys):
    assert cli.main(["simulate", "--batch", "64", "--steps", "50", "--cost", "roofline:1,0.02", "--json"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"plain", "depth 1", "depth 3", "ema", "goodput"}
    assert rows["goodput"]["window_share"][0] > 0.9
    assert cli.main(["simulate", "--batch", "4", "--steps", "20", "--policy", "auto", "--cost", "roofline:1,0"]) == 0
    assert "goodput" in capsys.readouterr().out
    assert cli.main(["simulate", "--batch", "32", "--steps", "300", "--tokens", "64", "--beta", "2", "2", "--cost",
                     "roofline:1,0.02", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["tokens"] == 64 and "makespan" in {r["policy"] for r in out["rows"]}
    assert cli.main(["simulate", "--policy", "ema"]) == 2
    assert "--policy needs --cost" in capsys.readouterr().err
    assert cli.main(["simulate", "--cost", "roofline:x", "--steps", "5"]) == 2
    assert "expected roofline:FLOOR,PER_TOKEN" in capsys.readouterr().err


def test_cli_simulate_auto_models_the_engine(capsys):
    """``--policy auto`` runs the engine's rule with the engine's knobs (DepthPolicy's defaults),
    not the simulator's: here they differ."""
    args = ["simulate", "--batch", "8", "--steps", "100", "--tokens", "32", "--beta", "2", "2",
            "--cost", "roofline:1,0.05", "--windows", "1,2,4", "--json"]
    assert cli.main(args + ["--policy", "auto"]) == 0
    out = json.loads(capsys.readouterr().out)
    knobs = DepthPolicy((1, 2, 4), "makespan", relax_early=RELAX_EARLY).knobs()
    assert out["config"]["knobs"] == knobs and out["rows"][0]["policy"] == "makespan"
    table, acc = CostTable.roofline(1.0, 0.05, (1, 2, 4)), BetaRows(2.0, 2.0)
    engine = simulate_policy(8, 100, acc, table, "makespan", tokens=32, **knobs)
    simulator = simulate_policy(8, 100, acc, table, "makespan", tokens=32)
    assert engine.tok_per_s != simulator.tok_per_s
    assert out["rows"][0]["tok_per_s"] == pytest.approx(engine.tok_per_s, rel=1e-6)
    assert cli.main(args + ["--policy", "makespan"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["knobs"] is None
    assert out["rows"][0]["tok_per_s"] == pytest.approx(simulator.tok_per_s, rel=1e-6)


def test_the_simulated_ngram_batch_looks_before_drafting():
    """As the engine: n-gram rows (which offer their drafts before the choice) take their first
    step at window 1, whose first-draft verdicts are free, even where drafting is free; then draft."""
    free = CostTable.create((1, 2, 3, 4), [64], [[1.0] * 4])
    rows, knobs = Matches(Bernoulli(0.9), 0.9, 12.0), DepthPolicy.auto(3, always_offers=False).knobs()
    assert simulate_policy(64, 1, rows, free, "goodput", **knobs).window_share == (1.0, 0.0, 0.0, 0.0)
    assert simulate_policy(64, 2, rows, free, "goodput", **knobs).window_share == (0.5, 0.0, 0.0, 0.5)
    assert simulate_policy(64, 1, BetaRows(9.0, 1.0), free, "goodput", **knobs).window_share[0] == 0.0  # no offers


def test_cli_simulate_auto_models_an_ngram_run_with_match(capsys):
    """``--match RATE`` simulates n-gram rows (``specjax.sim.Matches``), and ``--policy auto``
    then takes the engine's knobs for a drafter that offers only where it matches (spread on)."""
    args = ["simulate", "--batch", "8", "--steps", "200", "--beta", "2", "2", "--match", "0.4", "--burst", "4",
            "--cost", "roofline:1,0.05", "--windows", "1,2,4", "--json", "--policy", "auto"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    knobs = DepthPolicy.auto(3, "goodput", always_offers=False).knobs()
    assert out["config"]["knobs"] == knobs and knobs != DepthPolicy.auto(3, "goodput", always_offers=True).knobs()
    assert out["config"]["match"] == 0.4 and out["config"]["burst"] == 4.0
    acc, table = Matches(BetaRows(2.0, 2.0), 0.4, 4.0), CostTable.roofline(1.0, 0.05, (1, 2, 4))
    assert out["rows"][0]["tok_per_s"] == pytest.approx(simulate_policy(8, 200, acc, table, "goodput", **knobs)
                                                        .tok_per_s, rel=1e-6)
    assert cli.main(["simulate", "--steps", "5", "--burst", "3"]) == 2
    assert "pass --match" in capsys.readouterr().err


def test_the_knob_sweeps_hold_other_knobs_with_with(monkeypatch):
    """``--with k=v,...`` (benchmarks/_report.knob_args): other knobs held; the swept knob or an
    unknown one is a one-line exit."""
    import argparse
    import sys

    from specjax.auto.policy import KNOBS

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _report

    def parse(*argv):
        monkeypatch.setattr(sys, "argv", ["sweep", *argv])
        return _report.knob_args(argparse.ArgumentParser(), KNOBS, knob="rate", values="0.1", batches="8")

    a, values, batches = parse("--values", "0.1,none", "--with", "shrink=0.75, spread=1")
    assert a.fixed == {"shrink": 0.75, "spread": 1.0} and values == [0.1, None] and batches == [8]
    assert parse()[0].fixed == {}
    for bad in ("rate=0.2", "nope=1", "shrink"):
        with pytest.raises(SystemExit, match="--with"):
            parse("--with", bad)
