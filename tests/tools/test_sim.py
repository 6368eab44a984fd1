"""Simulator: no ratchet (with its control), saturation, batch invariance, figures; n-gram
rows that draft only where they match (``Matches``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sim
from specjax.advance import KvAdvance
from specjax.auto.policy import CostTable, DepthPolicy
from specjax.plan import plan_cohort_step
from specjax.sim import Bernoulli, BetaRows, Matches, PositionDecay, Trace, simulate, simulate_alone, simulate_policy

B, D, STEPS, P = 128, 3, 200, 0.33


@pytest.fixture(scope="module")
def runs():
    return {
        "per_sequence": simulate(B, D, STEPS, P, "per_sequence", seed=0),
        "cohort": simulate(B, D, STEPS, P, "cohort", seed=0),
        "alone": simulate_alone(B, D, STEPS, P, seed=0),
    }


def test_per_sequence_equals_alone_at_b128(runs):
    ps, alone = runs["per_sequence"], runs["alone"]
    assert abs(ps.tok_per_step - alone.tok_per_step) < 1e-9
    np.testing.assert_array_equal(ps.row_tok_per_step, alone.row_tok_per_step)
    np.testing.assert_array_equal(ps.row_accepted, alone.row_accepted)


def test_per_sequence_matches_closed_form(runs):
    expected = 1 + P + P**2 + P**3  # 1.4749
    assert abs(runs["per_sequence"].tok_per_step - expected) < 0.03
    assert runs["per_sequence"].accept_rate == pytest.approx(
        runs["per_sequence"].accepted / runs["per_sequence"].proposed
    )


def test_cohort_loses_about_a_fifth_at_b128(runs):
    rel = runs["cohort"].tok_per_step / runs["alone"].tok_per_step - 1
    assert -0.30 < rel < -0.10, rel


def test_row_is_batch_invariant_under_per_sequence(runs):
    small = simulate(32, D, STEPS, P, "per_sequence", seed=0)
    np.testing.assert_array_equal(small.uncached, runs["per_sequence"].uncached[:, :32])
    np.testing.assert_array_equal(small.row_accepted, runs["per_sequence"].row_accepted[:32])


def test_trace_from_recorded_rows():
    t = Trace.from_rows([[1, 2, 3], [0, 3]])  # rows ran 3 and 2 steps: the common 2 are kept
    np.testing.assert_array_equal(t.prefix, [[1, 0], [2, 3]])
    assert t.prefix.dtype == np.int32
    with pytest.raises(ValueError, match="at least one step for every row"):
        Trace.from_rows([[1], []])
    # steps=: each row's own counts repeated in order, however long it ran
    np.testing.assert_array_equal(Trace.from_rows([[1, 2, 3], [0, 3]], steps=5).prefix,
                                  [[1, 0], [2, 3], [3, 0], [1, 3], [2, 0]])
    with pytest.raises(ValueError, match=r"steps=0 is invalid: must be None or an int >= 1"):
        Trace.from_rows([[1]], steps=0)


def test_a_deeper_trace_replays_at_a_shallower_depth():
    """A run recorded at depth 3 replays at depth 1: a row accepts every draft it proposed where
    the recorded prefix is longer (before, the trace was refused above the simulated depth, so
    ``compare_policies`` could not replay a recorded run at windows 1-3)."""
    prefix = np.random.default_rng(5).integers(0, 4, size=(40, 6)).astype(np.int32)
    shallow = simulate(6, 1, 40, Trace(prefix), "per_sequence")
    np.testing.assert_array_equal(shallow.row_accepted, np.minimum(prefix, 1).sum(axis=0))


def test_no_ratchet_with_control():
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, D + 1, size=(60, 16)).astype(np.int32)
    fixture = Trace(prefix)
    ps = simulate(16, D, 60, fixture, "per_sequence")
    co = simulate(16, D, 60, fixture, "cohort")
    assert (ps.uncached == 1).all()
    # control: the identical fixture must still ratchet under the cohort rule
    assert (co.uncached > 1).any()
    assert co.tok_per_step < ps.tok_per_step
    # and per-sequence used the fixture exactly: accepted == prefix when u == 1
    np.testing.assert_array_equal(ps.row_accepted, prefix.sum(axis=0))


def test_saturation_resets_rather_than_latches():
    w = D + 1
    co = plan_cohort_step(np.full(8, w, np.int32), np.zeros(8, np.int32), w)
    np.testing.assert_array_equal(np.asarray(co.proposed), 0)
    np.testing.assert_array_equal(np.asarray(co.next_uncached), 1)
    # over a run with high acceptance, rows reach u = w and always leave it
    run = simulate(8, D, 200, 0.9, "cohort", seed=1)
    u = run.uncached
    assert (u == w).any()
    runs_at_w = max(
        max((len(s) for s in "".join("x" if x == w else "." for x in u[:, i]).split(".")), default=0)
        for i in range(8)
    )
    assert runs_at_w <= 3
    assert not (u[1:] == w).all(axis=1).any()  # never the whole batch parked at w after step 0


def test_saturated_rows_propose_nothing_in_sim():
    co = simulate(8, D, 100, 0.9, "cohort", seed=1)
    # proposed total equals sum over steps of (w - u)
    assert co.proposed == int((D + 1 - co.uncached).sum())


def test_acceptance_models():
    decay = simulate(64, D, 100, PositionDecay(0.8, 0.5), "per_sequence")
    flat = simulate(64, D, 100, Bernoulli(0.8), "per_sequence")
    assert decay.tok_per_step < flat.tok_per_step
    het = simulate(64, D, 100, BetaRows(1.0, 1.0), "per_sequence")
    assert np.std(het.row_tok_per_step) > np.std(flat.row_tok_per_step)
    het_alone = simulate_alone(64, D, 100, BetaRows(1.0, 1.0))
    np.testing.assert_array_equal(het.row_tok_per_step, het_alone.row_tok_per_step)
    assert simulate(4, D, 10, 0.0, "cohort").tok_per_step == 1.0
    assert simulate(4, D, 10, 1.0, "cohort").tok_per_step == D + 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch=0), r"batch must be an int >= 1, got 0"),
        (dict(depth=0), r"depth must be an int >= 1"),
        (dict(steps=1.5), r"steps must be an int >= 1"),
        (dict(acceptance=1.5), r"p must lie in \[0, 1\], got 1.5"),
        (dict(acceptance=BetaRows(0.0, 1.0)), r"Beta alpha must be > 0"),
        (dict(acceptance=Trace(np.zeros((3, 4), np.int32))), r"steps=10, batch=4 need"),
        (dict(acceptance=Trace(np.full((10, 4), -1, np.int32))), r"Trace.prefix values must be >= 0"),
        (dict(acceptance="high"), r"acceptance must be a float p"),
        (dict(acceptance=Matches(Bernoulli(0.5), 1.5)), r"Matches.rate must lie in \[0, 1\], got 1.5"),
        (dict(acceptance=Matches(Bernoulli(0.5), 0.3, 0.5)), r"Matches.burst must be >= 1"),
        (dict(acceptance=Matches(Bernoulli(0.5), 0.9, 2.0)), r"needs burst >= rate / \(1 - rate\) = 9"),
        (dict(acceptance=Matches(Bernoulli(0.5), 0.3, 1.0, -1.0)), r"Matches.concentration must be >= 0"),
        (dict(acceptance=Matches(Bernoulli(1.5), 0.3)), r"p must lie in \[0, 1\], got 1.5"),
        (dict(acceptance=Matches(Trace(np.zeros((10, 4), np.int32)), 0.3)), r"Matches.accept must be a Bernoulli"),
        (dict(rule="min"), r"rule must be one of"),
    ],
)
def test_simulate_validation(kwargs, match):
    args = dict(batch=4, depth=3, steps=10, acceptance=0.5, rule="cohort") | kwargs
    with pytest.raises(ValueError, match=match):
        simulate(**args)


def _matched(rate: float, burst: float, rows: int = 128, steps: int = 400) -> np.ndarray:
    """bool ``[steps, rows]``: where each row offered drafts (every draft accepted where it did,
    so each step re-feeds one token and offers the whole window)."""
    outs = sim._run_jit(Matches(Bernoulli(1.0), rate, burst), jnp.uint32(0), jnp.arange(rows, dtype=jnp.int32),
                        depth=D, steps=steps, rule=KvAdvance.PER_SEQUENCE)
    proposed = np.asarray(jax.device_get(outs["proposed"]))
    assert set(np.unique(proposed)) <= {0, D}
    return proposed == D


@pytest.mark.parametrize("rate,burst", [(0.3, 1.0), (0.3, 6.0), (0.6, 3.0)])
def test_matches_share_and_run_length(rate, burst):
    m = _matched(rate, burst)
    assert abs(m.mean() - rate) < 0.03, m.mean()
    starts = m[0].sum() + (m[1:] & ~m[:-1]).sum()  # runs of matched steps
    assert abs(m.sum() / starts - burst) < 0.15 * burst, m.sum() / starts


def test_rows_without_a_match_draft_nothing():
    none = simulate(16, D, 50, Matches(Bernoulli(1.0), 0.0), "per_sequence")
    assert none.proposed == 0 and none.tok_per_step == 1.0
    assert _matched(1.0, 1.0, rows=8, steps=50).all()  # a row that always matches never stops


def test_matches_keep_rows_batch_invariant():
    acc = Matches(BetaRows(2.0, 2.0), 0.4, 4.0, 2.0)
    together = simulate(64, D, 120, acc, "per_sequence")
    alone = simulate_alone(64, D, 120, acc)
    np.testing.assert_array_equal(together.row_tok_per_step, alone.row_tok_per_step)
    np.testing.assert_array_equal(together.row_proposed, alone.row_proposed)
    shares = together.row_proposed / (D * 120)  # each row its own share (concentration 2)
    assert shares.min() < 0.15 and shares.max() > 0.7, shares


def test_policy_narrows_to_what_rows_offer():
    """As ``AutoDepth.choose``: drafting is free (one cost for every window), so rows that offer
    every draft run the widest window from the first step; rows that never match run window 1
    from the first step (their estimates have not learned it yet: the offer narrows it)."""
    flat = CostTable.create((1, 2, 4), [8], [[1.0, 1.0, 1.0]])
    knobs = DepthPolicy.auto(3, "goodput", always_offers=False).knobs()
    never = simulate_policy(8, 40, Matches(Bernoulli(0.9), 0.0), flat, "goodput", **knobs)
    assert never.window_share == (1.0, 0.0, 0.0) and never.mean_drafts == 0.0
    always = simulate_policy(8, 40, Matches(Bernoulli(0.9), 1.0), flat, "goodput", **knobs)
    assert always.window_share[-1] > 0.9 and always.tok_per_step > 3.0
    # one row: the window opens at its matches only (a batch opens while any row matches)
    some = simulate_policy(1, 600, Matches(Bernoulli(0.9), 0.3, 8.0), flat, "goodput", **knobs)
    assert 0.2 < some.window_share[-1] < 0.4 and some.window_share[0] > 0.55, some.window_share


def test_window_1_steps_judge_a_matching_rows_first_draft():
    """As the engine's n-gram rows: a window-1 step still judges a matched row's first draft
    (free), so a row that starts at window 1 (drafting priced as a loss at the prior) learns that
    its drafts are always accepted and opens the window; one whose drafts fail stays at window 1."""
    knobs = DepthPolicy.auto(3, "goodput", always_offers=False).knobs()
    table = CostTable.create((1, 4), [1], [[1.0, 3.5]])  # window 4 pays only at near-certain acceptance
    good = simulate_policy(1, 300, Matches(Bernoulli(1.0), 1.0), table, "goodput", **knobs)
    assert good.window_share[0] > 0 and good.window_share[1] > 0.9, good.window_share
    bad = simulate_policy(1, 300, Matches(Bernoulli(0.2), 1.0), table, "goodput", **knobs)
    assert bad.window_share[0] > 0.9, bad.window_share


def test_a_filled_window_proposes_every_draft_it_holds():
    """``fill`` (the engine's default, in ``DepthPolicy.knobs``): the same windows, every row
    proposing all the drafts they hold, and more tokens for the same steps' cost; off, rows with
    low estimates propose fewer. A fill that is not 0 or 1 is refused."""
    table = CostTable.roofline(1.0, 0.02, (1, 2, 4))
    knobs = DepthPolicy.auto(3, "goodput", always_offers=True).knobs()
    assert knobs["fill"] == 1.0
    filled = simulate_policy(8, 200, BetaRows(0.5, 2.0), table, "goodput", **knobs)
    own = simulate_policy(8, 200, BetaRows(0.5, 2.0), table, "goodput", **{**knobs, "fill": False})
    assert own.window_share == filled.window_share == (0.0, 0.0, 1.0)
    assert filled.mean_drafts == 3.0 and own.mean_drafts < 2.0
    assert filled.tok_per_s > own.tok_per_s
    with pytest.raises(ValueError, match=r"fill must be True or False, got 0.5"):
        simulate_policy(8, 20, 0.5, table, "goodput", fill=0.5)
