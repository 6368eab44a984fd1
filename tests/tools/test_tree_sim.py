"""Acceptance per branch: what a tree step reveals per draft level and sibling rank (NumPy
walk), the engine's counters (they add up to the per-position counts; chain steps add
nothing), ``specjax.sim.TreeAcceptance`` learned from a run (it predicts the run's own
tok/step; a chain of first children is a chain), and ``specjax simulate --tree``."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_cases import verified_trees

from specjax import cli, generate, load_model
from specjax.auto.policy import CostTable
from specjax.sim import Bernoulli, TreeAcceptance, simulate
from specjax.tree import branch_verdicts

from engine_models import GLOBAL, noisy, sharp

MODEL = sharp(GLOBAL)
DRAFT = noisy(MODEL, 0.3)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5], [7, 8, 9, 10], [4, 4, 4, 4, 4, 4], [11, 3], [2, 9, 2, 9, 2]]


def _walk(parents, u, path, a, d, k):
    """NumPy reference of ``branch_verdicts`` for one row: each level's children in window
    order, tested until the one the path took (or all of them where the walk stopped)."""
    tested, took = np.zeros((d, k), np.int32), np.zeros((d, k), np.int32)
    cur = u - 1
    for j in range(d):
        if j > a:
            break
        kids = [n for n in range(u, len(parents)) if parents[n] == cur]
        if j < a:
            r = kids.index(int(path[j]))
            tested[j, : min(r + 1, k)] = 1
            if r < k:
                took[j, r] = 1
            cur = int(path[j])
        else:
            tested[j, : min(len(kids), k)] = 1
    return tested, took


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 10), vocab=st.integers(2, 4), k=st.integers(1, 4))
def test_branch_verdicts_match_a_walk(seed, n, vocab, k):
    parents, u, _, a, path = verified_trees(seed, n, vocab)
    b = len(u)
    tested, took = branch_verdicts(jnp.asarray(parents), jnp.asarray(u), path, a, k)
    d = path.shape[1]
    for r in range(b):
        want = _walk(parents[r], int(u[r]), np.asarray(path[r]), int(a[r]), d, k)
        np.testing.assert_array_equal(np.asarray(tested[r]), want[0], err_msg=f"row {r}")
        np.testing.assert_array_equal(np.asarray(took[r]), want[1], err_msg=f"row {r}")


@pytest.mark.parametrize("depth,cost", [(3, None), ("auto", CostTable.create((1, 2, 3, 4, 7), [1, 64],
                                                                               [[1.0, 1.0, 1.0, 1.0, 1.15]] * 2))])
def test_branch_counts_add_up_to_the_per_position_counts(depth, cost):
    """Each level's accepted children are its accepted drafts; chain steps (under depth="auto")
    count none, tree steps test a first child at every level they reach."""
    m = generate(MODEL, PROMPTS, max_new_tokens=24, drafter="draft_model", draft_model=DRAFT, tree="dynamic:6,2",
                 depth=depth, max_depth=3, cost=cost).metrics
    tested, took = np.asarray(m["branch_tested_count"]), np.asarray(m["branch_accepted_count"])
    assert tested.shape == took.shape == (3, 2)
    if depth == 3:
        np.testing.assert_array_equal(took.sum(axis=1), m["accepted_per_position_count"])
        assert tested[0, 0] == m["total_row_steps"]  # every tree step tests a first draft
    else:
        # the tree's lift learned near its cost: some steps were chains, which tested no branch
        assert 0 < tested[0, 0] < m["total_row_steps"]
        assert (took.sum(axis=1) <= np.asarray(m["accepted_per_position_count"])).all()
    assert (took <= tested).all() and took[:, 1].sum() > 0  # a second child was accepted somewhere
    np.testing.assert_allclose(m["acceptance_per_branch"], took / np.maximum(tested, 1))


def test_a_learned_tree_predicts_its_own_run():
    """The bundled MTP head's 2x2x1 tree: the levels' learned acceptance gives the run's own
    tok/step (1 + sum of the running products), and so does the simulator."""
    bundle = load_model()
    prompts = bundle.encode_prompts(["def parse_args(", "class Stack:", "import os\n", "for i in range("])
    m = generate(bundle.model, prompts, max_new_tokens=64, drafter="mtp", tree=(2, 2, 1)).metrics
    acc = TreeAcceptance.learn(m, (2, 2, 1))
    p = np.asarray(acc.probs(None, 3))
    assert 1 + np.cumprod(p).sum() == pytest.approx(m["tok_per_step"], rel=0.05)
    sim = simulate(4, 3, 2000, acc, "per_sequence").tok_per_step
    assert sim == pytest.approx(m["tok_per_step"], rel=0.05)
    chain = TreeAcceptance.learn(m, (1, 1, 1))  # the first children: below the tree
    assert simulate(4, 3, 2000, chain, "per_sequence").tok_per_step < sim


def test_a_chain_of_first_children_is_a_chain():
    rates = np.array([[0.6, 0.5], [0.6, 0.5], [0.6, 0.5]], np.float32)
    chain = TreeAcceptance(rates, (1, 1, 1))
    tree = TreeAcceptance(rates, (2, 1, 2))
    np.testing.assert_allclose(chain.probs(None, 3), [0.6, 0.6, 0.6])
    np.testing.assert_allclose(tree.probs(None, 3), [0.8, 0.6, 0.8], rtol=1e-6)  # 1 - 0.4 * 0.5
    for rule in ("cohort", "per_sequence"):  # the same draws as a Bernoulli chain
        assert simulate(16, 3, 50, chain, rule).tok_per_step == simulate(16, 3, 50, Bernoulli(0.6), rule).tok_per_step
        assert simulate(16, 3, 50, tree, rule).tok_per_step > simulate(16, 3, 50, chain, rule).tok_per_step


def test_learning_fills_untested_branches_from_the_level_above():
    m = {"branch_tested_count": [[10, 4], [8, 0], [0, 0]], "branch_accepted_count": [[8, 2], [6, 0], [0, 0]]}
    np.testing.assert_allclose(TreeAcceptance.learn(m, (2, 2, 2)).rates, [[0.8, 0.5], [0.75, 0.5], [0.75, 0.5]])
    np.testing.assert_allclose(TreeAcceptance.learn({"metrics": m}, (1, 1)).rates, [[0.8], [0.75]])
    with pytest.raises(ValueError, match=r"tree=\[2, 2, 2, 1\] needs 4 levels and 2 ranks; the run measured 3"):
        TreeAcceptance.learn(m, (2, 2, 2, 1))
    with pytest.raises(ValueError, match="no acceptance per branch"):
        TreeAcceptance.learn({"tok_per_step": 2.0}, (2, 1))
    with pytest.raises(ValueError, match=r"TreeAcceptance.children=\[2, 1\] has 2 levels but depth=3"):
        simulate(4, 3, 10, TreeAcceptance(np.ones((3, 2), np.float32), (2, 1)), "cohort")


def test_simulate_tree_cli(capsys, tmp_path):
    assert cli.main(["simulate", "--tree", "2x1", "--branch-acceptance", "0.6,0.5;0.7", "--batch", "8", "--steps",
                     "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["tree"] == [2, 1] and out["config"]["rates"] == [[0.6, 0.5], [0.7, 0.5]]
    tree = {r["rule"]: r["tok_per_step"] for r in out["rows"]}
    chain = {r["rule"]: r["tok_per_step"] for r in out["chain_rows"]}
    assert tree["per_sequence"] > chain["per_sequence"] and tree["cohort"] <= tree["per_sequence"]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"metrics": {"branch_tested_count": [[10, 5]], "branch_accepted_count": [[5, 1]]}}))
    assert cli.main(["simulate", "--tree", "2", "--branch-acceptance", str(run), "--steps", "20"]) == 0
    assert "tree / chain" in capsys.readouterr().out


@pytest.mark.parametrize("argv,match", [
    (["--tree", "2x1"], "--tree and --branch-acceptance go together"),
    (["--tree", "dynamic:6,2", "--branch-acceptance", "0.5"], "the simulator takes a preset"),
    (["--tree", "2x1", "--branch-acceptance", "0.5,x"], "is invalid: a tree run's JSON file, or rates per level"),
    (["--tree", "2x1", "--branch-acceptance", "0.5;0.4", "--cost", "roofline:1,0"], "--cost does not apply"),
    (["--tree", "2x2x1", "--branch-acceptance", "0.5,0.4;0.3,0.2"], r"needs 3 levels and 2 ranks; the run measured 2"),
])
def test_simulate_tree_errors_are_one_line(capsys, argv, match):
    assert cli.main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specjax simulate: error:") and match in err and err.count("\n") == 1
