"""A token tree under depth="auto": each step verifies the tree, a chain or nothing, as the
step-cost table prices them (the node budget as a per-step choice). A tree step's main branch
reveals the chain's verdicts (NumPy walk; the same state's chain step), the tree's lift over
its chain is learned and priced, greedy tokens equal plain decoding for every drafter under
both rules and cache kinds, sampling stays lossless, nothing recompiles, bad settings are
refused before compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_cases import verified_trees

from specjax import generate, load_model
from specjax.advance import kv_advance
from specjax.auto import AutoDepth, auto_state
from specjax.auto.policy import CostTable, DepthPolicy, choose, learn, learn_lift
from specjax.engine import make_engine, prefill, step_window
from specjax.engine.loop import TRACES
from specjax.generation_config import GenerationConfig
from specjax.sampling import RowSampling
from specjax.tree import DynamicTree, first_child_verdicts, tree_window

from engine_models import GLOBAL, TINY, chi2_pvalue, exact_continuations, noisy, sharp

MODEL = sharp(GLOBAL)
DRAFT = noisy(MODEL, 0.3)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5], [7, 8, 9, 10], [4, 4, 4, 4, 4, 4], [11, 3], [2, 9, 2, 9, 2]]
TREE, DEPTH = "dynamic:6,2", 2
WINDOWS = (1, 2, 3, 7)  # plain, the chains to depth 2, the 6-node tree


def _table(tree_cost: float) -> CostTable:
    return CostTable.create(WINDOWS, [1, 64], [[1.0, 1.1, 1.2, tree_cost]] * 2)


CHEAP_TREE = _table(1.2)  # the tree costs what the widest chain does: it yields more, so it wins
FREE = CostTable.create(WINDOWS, [1, 64], [[1.0] * 4] * 2)  # drafting costs nothing (n-gram rows rarely match)
DEAR_TREE = _table(50.0)  # never worth it
_PLAIN: dict = {}


def _plain(cache="dense"):
    if cache not in _PLAIN:
        _PLAIN[cache] = generate(MODEL, PROMPTS, max_new_tokens=20, drafter=None, cache=cache).tokens
    return _PLAIN[cache]


def _walk(parents, u, path, a):
    """NumPy reference of ``first_child_verdicts`` for one row: follow first children from the
    last known node; count the accepted path's leading nodes on that branch."""
    n, main, cur = len(parents), [], u - 1
    while True:
        kids = [j for j in range(u, n) if parents[j] == cur]
        if not kids:
            break
        cur = kids[0]
        main.append(cur)
    acc = 0
    while acc < min(a, len(main)) and path[acc] == main[acc]:
        acc += 1
    return len(main), acc


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 10), vocab=st.integers(2, 4))
def test_first_child_verdicts_match_a_walk(seed, n, vocab):
    parents, u, anc, a, path = verified_trees(seed, n, vocab)
    b = len(u)
    asked, acc = first_child_verdicts(jnp.asarray(parents), jnp.asarray(u), path, a, anc)
    for r in range(b):
        assert (int(asked[r]), int(acc[r])) == _walk(parents[r], int(u[r]), np.asarray(path[r]), int(a[r])), r


def _engine(model, draft, drafter, tree, depth, prompts):
    policy = DepthPolicy.auto(depth, tree_window=tree_window(tree, depth))
    eng = make_engine(model, drafter=drafter, draft_model=draft, depth=depth,
                      kv_advance_rule=kv_advance("per_sequence"), cache="dense", capacity=128,
                      controller=AutoDepth(policy), tree=tree)
    params = {"target": model.params} if draft is None else {"target": model.params, "draft": draft.params}
    b, width = len(prompts), max(len(p) for p in prompts)
    toks, lens = np.zeros((b, width), np.int32), np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    sampling = RowSampling.rows([0.0] * b, [None] * b, [None] * b)
    st_ = prefill(eng, params, toks, lens, lens + 48, np.full((b, 4), -1, np.int32), np.arange(b, dtype=np.uint32),
                  sampling)
    table = CostTable.create(eng.windows, [1, 64], [[1.0] * len(eng.windows)] * 2)
    return eng, params, eng.controller.init(eng, st_, auto_state(eng, table, b))


_step = jax.jit(step_window, static_argnums=(0, 3))


@pytest.mark.parametrize("drafter,tree", [("mtp", DynamicTree(6, 2)), ("mtp", (2, 2, 1)),
                                          ("draft_model", DynamicTree(6, 2))])
def test_a_tree_step_reveals_the_chain_verdicts(drafter, tree):
    """From the same state, the tree step's main branch says what the depth-3 chain step
    accepts (as far as the branch reaches), step after step. MTP: the bundled model's trained
    head (a random one accepts nothing)."""
    if drafter == "mtp":
        bundle = _bundle()
        model, draft, prompts = bundle.model, None, bundle.encode_prompts(["def parse_args(", "class Stack:",
                                                                           "import numpy as np\n"])
    else:
        model, draft, prompts = MODEL, DRAFT, PROMPTS[:5]
    depth = 3
    eng, params, st_ = _engine(model, draft, drafter, tree, depth, prompts)
    chain_w, tree_w = depth + 1, eng.windows[-1]
    full, accepted = 0, 0
    for _ in range(6):
        _, chain = _step(eng, params, st_, chain_w)
        st_, v = _step(eng, params, st_, tree_w)
        live = ~np.asarray(st_.done)
        asked, acc = np.asarray(v.chain_asked), np.asarray(v.chain_accepted)
        want = np.minimum(np.asarray(chain.accepted), asked)
        np.testing.assert_array_equal(acc[live], want[live])
        assert (asked <= depth).all() and (acc <= np.asarray(v.accepted)).all()
        full += int((asked[live] == depth).sum())
        accepted += int(np.asarray(chain.accepted)[live].sum())
    assert full > 0 and accepted > 0  # the comparison had full branches and accepted drafts to compare


def test_tree_steps_teach_the_chain_estimates_and_the_lift():
    """After a tree step the rows' chain estimates learn the main branch's verdicts (not the
    tree's own, which overstate a chain), and the lift the tree's yield over that branch."""
    eng, params, st_ = _engine(MODEL, DRAFT, "draft_model", DynamicTree(6, 2), 3, PROMPTS[:5])
    ctl, tree_w = eng.controller, eng.windows[-1]
    differed = False
    for i in range(6):
        after, v = _step(eng, params, st_, tree_w)
        out = ctl.observe(eng, st_, after, v, tree_w)
        live = ~st_.done
        want = learn(ctl.policy, st_.est, v.chain_asked, v.chain_accepted, st_.auto.prior, st_.seen_pos)
        np.testing.assert_allclose(np.asarray(out.est)[live], np.asarray(want)[live], rtol=1e-6)
        own = learn(ctl.policy, st_.est, v.asked, v.accepted, st_.auto.prior, st_.seen_pos)
        differed |= not np.allclose(np.asarray(own)[live], np.asarray(want)[live])
        lift, seen = learn_lift(ctl.policy, st_.auto.lift, st_.auto.lift_seen, live, v.accepted, v.chain_accepted)
        assert float(out.auto.lift) == pytest.approx(float(lift)) and int(out.auto.lift_seen) == i + 1 == int(seen)
        st_ = out
    assert differed  # the tree's own verdicts would have taught something else


_BUNDLE = []


def _bundle():
    if not _BUNDLE:
        _BUNDLE.append(load_model())
    return _BUNDLE[0]


@pytest.mark.parametrize("drafter,rule,cache,cheap_table,share", [
    ("mtp", "per_sequence", "dense", CHEAP_TREE, 0.5),
    ("mtp", "cohort", "paged", CHEAP_TREE, 0.5),
    ("draft_model", "per_sequence", "paged", CHEAP_TREE, 0.5),
    ("ngram", "per_sequence", "dense", FREE, 0.2),  # (cohort re-feeds keep a tree's window for their own sake)
])
def test_the_table_sets_the_budget_and_tokens_never_change(drafter, rule, cache, cheap_table, share):
    kw = dict(max_new_tokens=20, drafter=drafter, draft_model=DRAFT, tree=TREE, depth="auto", max_depth=DEPTH,
              kv_advance=rule, cache=cache)
    cheap = generate(MODEL, PROMPTS, cost=cheap_table, **kw)
    dear = generate(MODEL, PROMPTS, cost=DEAR_TREE, **kw)
    assert cheap.tokens == _plain(cache) and dear.tokens == _plain(cache)
    assert cheap.metrics["windows"] == list(WINDOWS)
    assert cheap.metrics["window_share"][-1] > share  # the tree where it costs what a chain does
    assert dear.metrics["window_share"][-1] == 0.0  # never at 50 steps' price
    assert dear.metrics["tree_lift"] == DepthPolicy.lift  # no tree step: the prior stays
    if drafter != "ngram":
        assert cheap.metrics["tree_lift"] != DepthPolicy.lift and cheap.metrics["tree_lift"] >= 1.0


def test_the_tree_is_priced_by_its_lift():
    """The widest window is the tree: its rows yield ``lift`` times the widest chain's."""
    est = jnp.full((4, 2), 0.6, jnp.float32)
    live = jnp.ones((4,), bool)
    table = _table(1.2 * 1.3)  # the tree costs 1.3x the widest chain
    for rule in ("goodput", "makespan"):
        kw = dict(remaining=jnp.full((4,), 20))
        low, _ = choose(est, live, table, rule, lift=jnp.float32(1.2), **kw)
        high, _ = choose(est, live, table, rule, lift=jnp.float32(1.4), **kw)
        assert (int(low), int(high)) == (2, 3), rule
    assert int(choose(est, live, table, "goodput")[0]) == 2  # no lift: the widest yields the chain's, dearer
    assert int(choose(est, live, table, "ema", lift=jnp.float32(4.0))[0]) == 2  # ema never picks the tree


def test_the_lift_is_a_running_mean_then_an_ema():
    policy = DepthPolicy.auto(2, tree_window=7)
    live = jnp.array([True, True, False])
    lift, seen = jnp.float32(policy.lift), jnp.int32(0)
    lift, seen = learn_lift(policy, lift, seen, live, jnp.array([3, 1, 9]), jnp.array([1, 1, 0]))
    assert int(seen) == 1 and float(lift) == pytest.approx((1.25 + 6 / 4) / 2)  # the prior counts as one step
    lift2, seen2 = learn_lift(policy, lift, seen, jnp.zeros(3, bool), jnp.array([3, 1, 9]), jnp.array([1, 1, 0]))
    assert (float(lift2), int(seen2)) == (float(lift), 1)  # no live row: nothing learned
    low, _ = learn_lift(policy, jnp.float32(1.0), jnp.int32(100), live, jnp.array([0, 0, 0]), jnp.array([0, 0, 0]))
    assert float(low) >= 1.0


def test_tree_budget_sampling_matches_the_target_distribution():
    """Steps that switch between the tree and chains stay lossless (chi-square, exact)."""
    tiny = sharp(TINY, seed=3, s_emb=2.0, s_head=6.0)
    prompt = [1, 2, 0]
    exact = exact_continuations(tiny, prompt, 3, 1.0, 1.0)
    # the prior's optimism buys a tree step first; what it reveals sends the rows to plain decoding
    table = CostTable.create((1, 2, 3, 5), [1, 4096], [[1.0, 2.0, 2.2, 2.3]] * 2)
    rows, calls = 2000, 5
    samples, shares = [], []
    for c in range(calls):
        r = generate(tiny, [prompt] * rows, max_new_tokens=3, drafter="mtp", tree="dynamic:4,2", depth="auto",
                     max_depth=2, temperature=1.0, seed=list(range(c * rows, (c + 1) * rows)), cost=table)
        samples += r.tokens
        shares.append(r.metrics["window_share"])
    assert r.metrics["accepted_drafts"] > 0
    assert all(share[0] > 0 and share[-1] > 0 for share in shares)  # both kinds of step ran in each call
    assert chi2_pvalue(samples, exact) > 1e-3


def test_one_compile_for_any_table_and_data():
    kw = dict(max_new_tokens=12, drafter="mtp", tree=TREE, depth="auto", max_depth=DEPTH)
    generate(MODEL, PROMPTS[:4], cost=CHEAP_TREE, **kw)
    before = TRACES["generate"]
    generate(MODEL, PROMPTS[2:], cost=DEAR_TREE, seed=5, eos_id=7, **kw)  # another table, new data
    assert TRACES["generate"] == before


@pytest.mark.parametrize("kwargs,match", [
    (dict(tree="dynamic:2,2", depth="auto", max_depth=2),
     r"tree='dynamic:2,2' is invalid: holds no more nodes than the depth-2 chain"),
    (dict(tree=(1, 1, 1), depth="auto"), r"tree=\[1, 1, 1\] is invalid: holds no more nodes than the depth-3 chain"),
    (dict(tree=(2, 1), depth=DepthPolicy.auto(2)), r"does not combine with depth=DepthPolicy"),
    (dict(depth=DepthPolicy.auto(2, tree_window=5)), r"depth='DepthPolicy\(tree=True\)' is invalid: needs a tree"),
])
def test_bad_tree_budget_settings_are_refused_before_compile(kwargs, match):
    before = TRACES["generate"]
    with pytest.raises(ValueError, match=match):
        generate(MODEL, [[1, 2]], max_new_tokens=4, drafter="mtp", **kwargs)
    assert TRACES["generate"] == before
    with pytest.raises(ValueError, match=match):
        GenerationConfig(drafter="mtp", **kwargs)
