"""Plan functions: the cohort/per-sequence invariant, validation, no retrace."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specjax import plan as plan_mod
from specjax.plan import (
    CohortStepPlan,
    PerSeqStepPlan,
    accepted_from_prefix,
    plan_cohort_step,
    plan_per_sequence_step,
    plan_step,
)


def ref_plan(u: np.ndarray, a: np.ndarray, window: int, rule: str) -> dict:
    """Plain NumPy loop reference for both rules."""
    committed = [int(ui + ai) for ui, ai in zip(u, a, strict=True)]
    keep = min(committed)
    out = {k: [] for k in ("proposed", "committed", "advance", "next_uncached", "emitted")}
    for ui, ai, ci in zip(u, a, committed, strict=True):
        adv = ci if rule == "per_sequence" else keep
        out["proposed"].append(window - ui)
        out["committed"].append(ci)
        out["advance"].append(adv)
        out["next_uncached"].append(ci - adv + 1)
        out["emitted"].append(ai + 1)
    return {k: np.array(v) for k, v in out.items()} | {"keep": keep}


@st.composite
def batches(draw):
    depth = draw(st.integers(1, 6))
    w = depth + 1
    b = draw(st.sampled_from([1, 2, 3, 8, 33]))
    u = draw(st.lists(st.integers(1, w), min_size=b, max_size=b))
    a = [draw(st.integers(0, w - ui)) for ui in u]
    return np.array(u, np.int32), np.array(a, np.int32), w


@given(batches())
def test_invariant_and_reference(case):
    u, a, w = case
    ps = plan_per_sequence_step(u, a, w)
    co = plan_cohort_step(u, a, w)
    assert int(co.keep[0]) == int(np.min(np.asarray(ps.committed)))
    for rule, p in (("per_sequence", ps), ("cohort", co)):
        ref = ref_plan(u, a, w, rule)
        for k in ("proposed", "committed", "advance", "next_uncached", "emitted"):
            np.testing.assert_array_equal(np.asarray(getattr(p, k)), ref[k], err_msg=f"{rule}.{k}")
        np.testing.assert_array_equal(np.asarray(p.uncached), u)
        np.testing.assert_array_equal(np.asarray(p.accepted), a)
    # The rules share everything except advance / next_uncached.
    for k in ("uncached", "proposed", "accepted", "committed", "emitted"):
        np.testing.assert_array_equal(np.asarray(getattr(ps, k)), np.asarray(getattr(co, k)))
    np.testing.assert_array_equal(np.asarray(ps.next_uncached), 1)
    assert (np.asarray(co.next_uncached) >= 1).all() and (np.asarray(co.next_uncached) <= w).all()


def test_plan_types_and_dtypes():
    u = jnp.array([1, 2, 4], jnp.int32)
    a = jnp.array([3, 0, 0], jnp.int32)
    ps, co = plan_per_sequence_step(u, a, 4), plan_cohort_step(u, a, 4)
    assert isinstance(ps, PerSeqStepPlan) and isinstance(co, CohortStepPlan)
    for leaf in jax.tree.leaves((ps, co)):
        chex.assert_type(leaf, jnp.int32)
    chex.assert_shape(co.keep, (1,))
    assert plan_step(u, a, 4, "cohort").keep.shape == (1,)
    assert isinstance(plan_step(u, a, 4, "per_sequence"), PerSeqStepPlan)


def test_saturated_row_proposes_zero():
    u = jnp.array([4, 1], jnp.int32)
    ps = plan_per_sequence_step(u, jnp.array([0, 2]), 4)
    assert int(ps.proposed[0]) == 0 and int(ps.proposed[1]) == 3
    # however long the matched prefix, a saturated row accepts nothing
    np.testing.assert_array_equal(accepted_from_prefix(jnp.array([3, 3]), ps.proposed), [0, 3])


def test_vmappable_over_leading_axis():
    rng = np.random.default_rng(0)
    u = rng.integers(1, 5, size=(5, 7)).astype(np.int32)
    a = np.array([[rng.integers(0, 5 - x) for x in row] for row in u], np.int32)
    batched = jax.vmap(lambda uu, aa: plan_cohort_step(uu, aa, 4))(u, a)
    for i in range(5):
        one = plan_cohort_step(u[i], a[i], 4)
        np.testing.assert_array_equal(batched.keep[i], one.keep)
        np.testing.assert_array_equal(batched.next_uncached[i], one.next_uncached)


def test_no_retrace_for_new_values_of_same_shape():
    u = np.ones(16, np.int32)
    plan_per_sequence_step(u, np.zeros(16, np.int32), 4)
    plan_cohort_step(u, np.zeros(16, np.int32), 4)
    before = (plan_mod.trace_count("per_sequence"), plan_mod.trace_count("cohort"))
    rng = np.random.default_rng(1)
    for _ in range(5):
        uu = rng.integers(1, 5, 16).astype(np.int32)
        aa = np.array([rng.integers(0, 5 - x) for x in uu], np.int32)
        plan_per_sequence_step(uu, aa, 4)
        plan_cohort_step(uu, aa, 4)
    assert (plan_mod.trace_count("per_sequence"), plan_mod.trace_count("cohort")) == before
    plan_cohort_step(np.ones(17, np.int32), np.zeros(17, np.int32), 4)  # new shape: one trace
    assert plan_mod.trace_count("cohort") == before[1] + 1


@pytest.mark.parametrize(
    "u,a,w,match",
    [
        ([1, 2, 3], [3, 3, 0], 4, r"a must lie in \[0, window - u\]; bad rows \[1\]"),
        ([0, 2], [0, 0], 4, r"u must lie in \[1, window=4\]; bad rows \[0\]"),
        ([1, 5], [0, 0], 4, r"bad rows \[1\]"),
        ([1, 1], [0, -1], 4, r"a must lie.*bad rows \[1\]"),
        ([1, 1], [0], 4, r"same shape"),
        ([1, 1], [0, 0], 0, r"window must be an int >= 1"),
        ([1.0, 1.0], [0, 0], 4, r"u must be an integer array"),
    ],
)
def test_validation_names_argument_and_rows(u, a, w, match):
    for fn in (plan_per_sequence_step, plan_cohort_step):
        with pytest.raises(ValueError, match=match):
            fn(np.array(u), np.array(a), w)


def test_plan_step_rejects_unknown_rule():
    with pytest.raises(ValueError, match=r"kv_advance must be one of \['cohort', 'per_sequence'\]"):
        plan_step(np.ones(2, np.int32), np.zeros(2, np.int32), 4, "lockstep")
