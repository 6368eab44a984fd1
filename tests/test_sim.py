"""Simulator: no ratchet (with its control), saturation, batch invariance, figures."""

import numpy as np
import pytest

from specjax.plan import plan_cohort_step
from specjax.sim import Bernoulli, BetaRows, PositionDecay, Trace, simulate, simulate_alone

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
        (dict(acceptance=Trace(np.full((10, 4), 9, np.int32))), r"\[0, depth=3\]"),
        (dict(acceptance="high"), r"acceptance must be a float p"),
        (dict(rule="min"), r"rule must be one of"),
    ],
)
def test_simulate_validation(kwargs, match):
    args = dict(batch=4, depth=3, steps=10, acceptance=0.5, rule="cohort") | kwargs
    with pytest.raises(ValueError, match=match):
        simulate(**args)
