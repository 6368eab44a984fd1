"""Token trees (``specjax.tree``) against NumPy references over random trees: ancestors and
depths, the tree attention mask (each node sees the committed prefix and its own branch, never
a sibling's), greedy verification by walking the tree, and the compaction sources; a chain is
exactly what the chain engine computes."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.reference import attend_visible, visible
from specjax.tree import (
    accepted_sources,
    ancestors,
    chain_parents,
    depths,
    preset_parents,
    tree_greedy_verify,
    tree_positions,
    tree_rejection_verify,
    tree_visible,
)
from specjax.verify import greedy_verify


@st.composite
def trees(draw, max_rows=4, max_nodes=9):
    """(parents [B, N], u [B], valid [B, N]): topological trees whose first u nodes are a chain;
    a node is in use only if its parent is."""
    b = draw(st.integers(1, max_rows))
    n = draw(st.integers(1, max_nodes))
    parents = np.full((b, n), -1, np.int32)
    valid = np.zeros((b, n), bool)
    u = np.zeros(b, np.int32)
    for r in range(b):
        u[r] = draw(st.integers(1, n))
        valid[r, 0] = True
        for j in range(1, n):
            parents[r, j] = j - 1 if j < u[r] else draw(st.integers(0, j - 1))
            valid[r, j] = valid[r, parents[r, j]]
        cut = draw(st.integers(u[r], n))  # nodes past the row's tree: unused
        for j in range(cut, n):
            valid[r, j] = False
        for j in range(1, n):
            valid[r, j] &= valid[r, parents[r, j]]
    return parents, u, valid


def ancestors_ref(parents):
    b, n = parents.shape
    out = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            p = i
            while p >= 0:
                out[r, i, p] = True
                p = parents[r, p]
    return out


def walk_ref(tgt, tokens, parents, u, valid):
    """The greedy walk, one row at a time."""
    b, n = tokens.shape
    a, paths, bonus = [], [], []
    for r in range(b):
        cur, path = u[r] - 1, []
        while True:
            kids = [j for j in range(u[r], n) if valid[r, j] and parents[r, j] == cur and tokens[r, j] == tgt[r, cur]]
            if not kids:
                break
            cur = kids[0]
            path.append(cur)
        a.append(len(path))
        paths.append(path + [-1] * (n - 1 - len(path)))
        bonus.append(tgt[r, cur])
    return np.array(a), np.array(paths, np.int32).reshape(b, n - 1), np.array(bonus)


@settings(max_examples=25, deadline=None)
@given(trees())
def test_ancestors_and_depths_match_the_walk_up(tree):
    parents, _, _ = tree
    anc = np.asarray(ancestors(jnp.asarray(parents)))
    np.testing.assert_array_equal(anc, ancestors_ref(parents))
    np.testing.assert_array_equal(np.asarray(depths(jnp.asarray(parents))), anc.sum(axis=2) - 1)


@settings(max_examples=25, deadline=None)
@given(trees(), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_greedy_walk_matches_the_reference(tree, vocab_extra, seed):
    parents, u, valid = tree
    b, n = parents.shape
    rng = np.random.default_rng(seed)
    v = 2 + vocab_extra  # a small vocabulary: many matches
    tokens = rng.integers(0, v, (b, n)).astype(np.int32)
    logits = rng.normal(size=(b, n, v)).astype(np.float32)
    a, path, bonus = tree_greedy_verify(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents),
                                        jnp.asarray(u), jnp.asarray(valid))
    ra, rpath, rbonus = walk_ref(logits.argmax(-1), tokens, parents, u, valid)
    np.testing.assert_array_equal(np.asarray(a), ra)
    np.testing.assert_array_equal(np.asarray(path), rpath)
    np.testing.assert_array_equal(np.asarray(bonus), rbonus)


def test_greedy_verification_follows_the_first_matching_sibling_only():
    """Two siblings carry the target's token: the first (window order) is taken, and the walk
    goes on below it only, even where the second's subtree matches deeper."""
    parents = np.array([[-1, 0, 0, 2, 1]], np.int32)  # nodes 1, 2 both children of the root
    tokens = np.array([[0, 1, 1, 2, 3]], np.int32)
    tgt = np.array([[1, 3, 2, 0, 0]], np.int32)  # after the root: 1; after node 1: 3; after node 2: 2
    logits = np.eye(4, dtype=np.float32)[tgt]
    a, path, bonus = tree_greedy_verify(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents),
                                        jnp.asarray([1]))
    assert int(a[0]) == 2 and path.tolist() == [[1, 4, -1, -1]] and int(bonus[0]) == 0
    ra, rpath, rbonus = walk_ref(tgt, tokens, parents, np.array([1]), np.ones((1, 5), bool))
    assert int(ra[0]) == 2 and rpath.tolist() == [[1, 4, -1, -1]]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(2, 7), st.integers(0, 2**31 - 1))
def test_a_chain_is_what_the_chain_engine_computes(b, w, seed):
    """Greedy verification, the mask and the compaction of a chain are the chain engine's."""
    rng = np.random.default_rng(seed)
    u = rng.integers(1, w + 1, b).astype(np.int32)
    tokens = rng.integers(0, 3, (b, w)).astype(np.int32)
    logits = rng.normal(size=(b, w, 3)).astype(np.float32)
    parents = chain_parents(b, w)
    a, path, bonus = tree_greedy_verify(jnp.asarray(logits), jnp.asarray(tokens), parents, jnp.asarray(u))
    drafts = np.stack([np.concatenate([tokens[r, u[r]:], np.zeros(u[r] - 1, np.int32)]) for r in range(b)])
    ca, cbonus = greedy_verify(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(u))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(ca))
    np.testing.assert_array_equal(np.asarray(bonus), np.asarray(cbonus))
    np.testing.assert_array_equal(np.asarray(accepted_sources(path, jnp.asarray(u), w)), np.tile(np.arange(w), (b, 1)))
    lengths = jnp.asarray(rng.integers(0, 6, b).astype(np.int32))
    t = int(np.max(np.asarray(lengths))) + w + 2
    key_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # slot s holds position s
    lead = jnp.zeros((b,), jnp.int32)
    q_pos = tree_positions(lengths, parents)
    np.testing.assert_array_equal(np.asarray(q_pos), np.asarray(lengths)[:, None] + np.arange(w))
    got = tree_visible(q_pos, key_pos, lead, lengths, parents, window=3)
    want = visible(q_pos, key_pos, lead, window=3) & (key_pos[:, None, :] < (lengths[:, None] + w)[:, :, None])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@settings(max_examples=20, deadline=None)
@given(trees(max_rows=3, max_nodes=7), st.integers(0, 2**31 - 1))
def test_each_node_attends_to_the_prefix_and_its_own_branch(tree, seed):
    """Tree attention equals, node by node, plain attention over the committed prefix and the
    node's own ancestors: a sibling's K/V (even a NaN one) never reaches it."""
    parents, _, _ = tree
    b, n = parents.shape
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, b).astype(np.int32)
    lead = np.array([rng.integers(0, length) for length in lengths], np.int32)
    t = int(lengths.max()) + n + 1
    hq, hkv, d = 2, 1, 4
    q = rng.normal(size=(b, n, hq, d)).astype(np.float32)
    k = rng.normal(size=(b, hkv, t, d)).astype(np.float32)
    v = rng.normal(size=(b, hkv, t, d)).astype(np.float32)
    key_pos = np.full((b, t), -1, np.int32)
    dep = ancestors_ref(parents).sum(axis=2) - 1
    for r in range(b):
        key_pos[r, : lengths[r]] = np.arange(lengths[r])
        key_pos[r, lengths[r] : lengths[r] + n] = lengths[r] + dep[r]
    q_pos = np.asarray(tree_positions(jnp.asarray(lengths), jnp.asarray(parents)))
    ok = tree_visible(jnp.asarray(q_pos), jnp.asarray(key_pos), jnp.asarray(lead), jnp.asarray(lengths),
                      jnp.asarray(parents))
    anc = ancestors_ref(parents)
    got = np.asarray(attend_visible(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ok))
    scale = d ** -0.5
    for r in range(b):
        for i in range(n):
            keys = list(range(lead[r], lengths[r])) + [lengths[r] + j for j in range(n) if anc[r, i, j]]
            s = np.einsum("hd,td->ht", q[r, i], k[r, 0, keys]) * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            want = (p / p.sum(axis=1, keepdims=True)) @ v[r, 0, keys]
            np.testing.assert_allclose(got[r, i], want, rtol=1e-5, atol=1e-5)
    # a sibling branch's K/V poisoned: no node that does not own it changes
    for r in range(b):
        for j in range(1, n):
            poisoned_k, poisoned_v = k.copy(), v.copy()
            poisoned_k[r, :, lengths[r] + j] = np.nan
            poisoned_v[r, :, lengths[r] + j] = np.nan
            out = np.asarray(attend_visible(jnp.asarray(q), jnp.asarray(poisoned_k), jnp.asarray(poisoned_v), ok))
            others = [i for i in range(n) if not anc[r, i, j]]
            np.testing.assert_allclose(out[r, others], got[r, others], rtol=1e-6, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_compaction_puts_the_accepted_path_after_the_known_nodes(b, n, seed):
    rng = np.random.default_rng(seed)
    u = rng.integers(1, n + 1, b).astype(np.int32)
    d = n - 1
    path = np.full((b, d), -1, np.int32)
    for r in range(b):
        a = rng.integers(0, n - u[r] + 1)
        path[r, :a] = np.sort(rng.choice(np.arange(u[r], n), a, replace=False)) if a else []
    got = np.asarray(accepted_sources(jnp.asarray(path), jnp.asarray(u), n))
    for r in range(b):
        want = list(range(n))
        for i, node in enumerate(p for p in path[r] if p >= 0):
            want[u[r] + i] = node
        assert got[r].tolist() == want


def test_presets():
    np.testing.assert_array_equal(preset_parents((1, 1, 1)), np.asarray(chain_parents(1, 4))[0])
    p = preset_parents((2, 2, 1))
    assert p.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6]
    assert np.asarray(depths(jnp.asarray(p)[None]))[0].tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    with pytest.raises(ValueError, match=r"branching=\(2, 0\) is invalid"):
        preset_parents((2, 0))


@pytest.mark.parametrize("greedy_first", [False, True])
def test_tree_rejection_sampling_is_lossless(greedy_first):
    """The emitted tokens of a tree step (accepted path, then one draw from the residual) are
    distributed as the target's own: first token ~ p(root), and after a token some child holds,
    the next ~ p(that child). Chi-square over 40,000 rows (alpha = 1e-3, fixed seeds). With
    ``greedy_first`` the candidates are the root's top-3 (as a top-k drafter offers them)."""
    import jax
    from scipy.stats import chisquare

    v, rows = 4, 40000
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(v), size=6).astype(np.float32)  # node j's target distribution
    first = np.argsort(-p[0])[:3] if greedy_first else np.array([0, 1, 2])
    parents = np.array([-1, 0, 0, 0, 1, 2], np.int32)
    tokens = np.array([0, *first, 3, 0], np.int32)
    key = jax.random.PRNGKey(1)
    ku, ks = jax.random.split(key)
    uniform = jax.random.uniform(ku, (rows, 6))
    bcast = lambda x: jnp.broadcast_to(jnp.asarray(x), (rows, *np.shape(x)))  # noqa: E731
    a, path, r = tree_rejection_verify(bcast(p), bcast(tokens), bcast(parents), jnp.ones((rows,), jnp.int32), uniform)
    last = np.asarray(jax.random.categorical(ks, jnp.log(jnp.maximum(r, 1e-30))))
    a, path = np.asarray(a), np.asarray(path)
    seqs = [tuple(tokens[path[i, :a[i]]]) + (int(last[i]),) for i in range(rows)]
    child = {int(tokens[j]): j for j in (1, 2, 3)}
    counts, expect = {}, {}
    for t1 in range(v):
        if t1 in child:
            for t2 in range(v):
                expect[(t1, t2)] = p[0, t1] * p[child[t1], t2]
        else:
            expect[(t1,)] = p[0, t1]
    for s in seqs:
        key2 = s[:2]
        counts[key2] = counts.get(key2, 0) + 1
    assert set(counts) <= set(expect), set(counts) - set(expect)
    keys = sorted(expect)
    obs = np.array([counts.get(k, 0) for k in keys], np.float64)
    exp = np.array([expect[k] for k in keys], np.float64)
    exp = exp / exp.sum() * obs.sum()
    assert chisquare(obs, exp).pvalue > 1e-3
    assert (a >= 1).mean() > 0.3  # the tree does accept drafts
