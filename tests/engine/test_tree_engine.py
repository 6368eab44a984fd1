"""Tree verification in the engine: the target's tree forward equals each branch run alone
(dense and paged), compaction against a NumPy reference, greedy tokens equal plain decoding
for random tree shapes under both rules and both cache kinds, a chain preset is the chain,
sampled trees match the target's exact distribution (chi-square), rows are batch invariant,
one compile per static configuration, and bad settings are refused before compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.cache import DenseKVCache, PagedKVCache
from specjax.engine.loop import TRACES
from specjax.generation import generate
from specjax.model import forward_hidden, head, init_cache, logits
from specjax.tree import TreeMask, ancestors, depths

from engine_models import GLOBAL, SLIDING, TINY, chi2_pvalue, exact_continuations, sharp

MODEL = sharp(GLOBAL)
SLIDING_MODEL = sharp(SLIDING, seed=1)


def _random_parents(rng, n):
    return np.array([-1] + [int(rng.integers(0, j)) for j in range(1, n)], np.int32)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["dense", "paged"]), sliding=st.booleans())
def test_tree_forward_equals_each_branch_alone(seed, kind, sliding):
    """Every node's logits from one tree forward equal the last logits of the plain forward over
    the row's prefix and the node's own branch: no node sees a sibling's branch, and each runs
    at its branch position (with sliding-window layers, its window counted along its branch).
    Rows have different prefix lengths and different trees."""
    rng = np.random.default_rng(seed)
    b, n, width = 3, int(rng.integers(2, 8)), 12
    model = SLIDING_MODEL if sliding else MODEL
    cfg = model.config
    prompt = rng.integers(0, cfg.vocab_size, (b, width)).astype(np.int32)
    lengths = rng.integers(1, width + 1, b).astype(np.int32)
    parents = np.stack([_random_parents(rng, n) for _ in range(b)])
    tokens = rng.integers(0, cfg.vocab_size, (b, n)).astype(np.int32)

    cache = init_cache(cfg, b, 32, kind=kind, page_size=4, slack=16)
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
    if kind == "paged":
        cache = cache.reserve(width + n)
    _, cache = forward_hidden(model.params, cfg, jnp.asarray(prompt), pos, cache)
    cache = cache.advance(width).rollback(jnp.asarray(lengths))  # rows of their own lengths
    if kind == "paged":
        cache = cache.reserve(n)
    tpos = jnp.asarray(lengths)[:, None] + depths(jnp.asarray(parents))
    mask = TreeMask(jnp.asarray(lengths), ancestors(jnp.asarray(parents)), tpos, tpos)
    hidden, _ = forward_hidden(model.params, cfg, jnp.asarray(tokens), tpos, cache, tree=mask)
    got = np.asarray(head(model.params, cfg, hidden))

    # the oracle: one plain causal forward over every (row, node)'s prefix + branch, each padded
    # to one width (a causal forward's logits at a position ignore what follows it: one compile)
    seqs, ends = [], []
    for r in range(b):
        for i in range(n):
            branch, p = [], i
            while p >= 0:
                branch.append(int(tokens[r, p]))
                p = parents[r, p]
            seq = list(prompt[r, : lengths[r]]) + branch[::-1]
            ends.append(len(seq) - 1)
            seqs.append(seq + [0] * (width + 8 - len(seq)))
    want = np.asarray(logits(model, np.array(seqs, np.int32)))[np.arange(len(seqs)), ends]
    for r in range(b):
        for i in range(n):
            np.testing.assert_allclose(got[r, i], want[r * n + i], rtol=2e-4, atol=2e-4, err_msg=f"row {r} node {i}")


def _compact_ref(buf, lengths, src, capacity):
    """Slot lengths + k takes slot lengths + src[k] (a copy of the buffer before the moves)."""
    out = buf.copy()
    for r in range(buf.shape[0]):
        for k, s in enumerate(src[r]):
            if lengths[r] + k < capacity:
                out[r, :, lengths[r] + k] = buf[r, :, min(lengths[r] + s, capacity - 1)]
    return out


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_compact_moves_the_path_into_place(kind, stacked):
    rng = np.random.default_rng(1)
    b, n, cap, hkv, d, layers = 3, 5, 16, 2, 4, 2
    lengths = np.array([0, 6, 11], np.int32)
    src = np.stack([np.arange(n)] * b).astype(np.int32)
    src[0, 1:3] = [3, 4]
    src[1, 2:4] = [4, 2]
    src[2, 1] = 4
    if kind == "dense":
        cache = DenseKVCache.create(layers, b, cap, hkv, d, stacked=stacked)
    else:
        cache = PagedKVCache.create(layers, b, b * cap // 4, 4, cap // 4, hkv, d, stacked=stacked).reserve(cap)
    cache = cache.advance(jnp.asarray(lengths))
    full = rng.normal(size=(layers, b, cap, hkv, d)).astype(np.float32)
    written = cache.with_lengths(jnp.zeros(b, jnp.int32)) if hasattr(cache, "with_lengths") else \
        cache.replace(lengths=jnp.zeros(b, jnp.int32))
    for layer in range(layers):
        written = written.write(layer, jnp.asarray(full[layer]), jnp.asarray(-full[layer]))
    cache = written.replace(lengths=jnp.asarray(lengths)).compact(jnp.asarray(src))

    def rows(c, layer):  # [B, Hkv, cap, D] per row, in logical slot order
        if kind == "dense":
            return np.asarray(c.k[layer])
        return np.asarray(c.gather(layer)[0])

    for layer in range(layers):
        want = _compact_ref(full[layer].transpose(0, 2, 1, 3), lengths, src, cap)
        np.testing.assert_array_equal(rows(cache, layer), want)


def _prompts(b, seed, vocab=31):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, 9))).tolist() for _ in range(b)]


_PLAIN = {}


def _plain(prompts, n):
    key = (str(prompts), n)
    if key not in _PLAIN:
        _PLAIN[key] = generate(MODEL, prompts, max_new_tokens=n, drafter=None).tokens
    return _PLAIN[key]


@pytest.mark.parametrize("tree,rule,cache", [
    ((2, 2, 1), "per_sequence", "dense"),
    ((3, 1, 2), "cohort", "dense"),
    ((1, 2, 1, 2), "per_sequence", "paged"),
    ((4,), "cohort", "paged"),
    ((2, 3), "per_sequence", "dense"),
    ((2, 2, 2), "cohort", "paged"),
])
def test_greedy_tree_equals_plain(tree, rule, cache):
    prompts = _prompts(5, seed=len(tree) + sum(tree))
    got = generate(MODEL, prompts, max_new_tokens=20, drafter="mtp", tree=tree, kv_advance=rule, cache=cache)
    assert got.tokens == _plain(prompts, 20)
    m = got.metrics
    assert m["depth"] == len(tree) and m["kv_advance"] == rule
    assert m["tok_per_step"] >= 1.0


@pytest.mark.parametrize("rule", ["per_sequence", "cohort"])
def test_a_chain_preset_is_the_chain(rule):
    """``tree=(1, 1, 1)`` runs the tree path (tree mask, compaction, tree verification) and
    must do exactly what the chain engine does at depth 3: same tokens, same acceptance."""
    prompts = _prompts(6, seed=4)
    chain = generate(MODEL, prompts, max_new_tokens=24, drafter="mtp", depth=3, kv_advance=rule)
    tree = generate(MODEL, prompts, max_new_tokens=24, drafter="mtp", tree=(1, 1, 1), kv_advance=rule)
    assert tree.tokens == chain.tokens
    for k in ("accepted_drafts", "total_row_steps", "acceptance_per_position"):
        assert tree.metrics[k] == chain.metrics[k], k


def test_a_wider_tree_accepts_more():
    """On the bundled-like sharp model the first draft misses often: siblings catch some."""
    prompts = _prompts(8, seed=11)
    chain = generate(MODEL, prompts, max_new_tokens=24, drafter="mtp", depth=2)
    tree = generate(MODEL, prompts, max_new_tokens=24, drafter="mtp", tree=(4, 2))
    assert tree.metrics["accepted_drafts"] > chain.metrics["accepted_drafts"]
    assert tree.metrics["proposed_drafts"] > chain.metrics["proposed_drafts"]  # a tree's nodes count as offered


@pytest.fixture(scope="module")
def tiny():
    return sharp(TINY, seed=3, s_emb=2.0, s_head=6.0)


@pytest.mark.parametrize("tree,rule,top_p", [
    ((2, 1), "per_sequence", None),
    ((3,), "per_sequence", 0.9),
    ((2, 2), "cohort", None),
    ((1, 1), "per_sequence", None),
    ((2, 2, 1), "cohort", 0.9),
])
def test_tree_sampling_matches_the_target_distribution(tiny, tree, rule, top_p):
    """Chi-square over 10,000 3-token continuations vs the exact enumerated distribution
    (alpha = 1e-3, fixed seeds: deterministic)."""
    prompt = [1, 2, 0]
    exact = exact_continuations(tiny, prompt, 3, 1.0, top_p or 1.0)
    rows, calls = 2000, 5
    samples = []
    for c in range(calls):
        r = generate(tiny, [prompt] * rows, max_new_tokens=3, drafter="mtp", tree=tree, kv_advance=rule,
                     temperature=1.0, top_p=top_p, seed=list(range(c * rows, (c + 1) * rows)))
        samples += r.tokens
    assert r.metrics["accepted_drafts"] > 0  # the tree's nodes were accepted, not only bonus tokens
    assert chi2_pvalue(samples, exact) > 1e-3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_rows_are_batch_invariant(temperature):
    prompts = _prompts(5, seed=2)
    kw = dict(max_new_tokens=16, drafter="mtp", tree=(2, 2, 1), temperature=temperature)
    batch = generate(MODEL, prompts, seed=[11, 12, 13, 14, 15], **kw)
    for i in (0, 3):
        alone = generate(MODEL, [prompts[i]], seed=[11 + i], **kw)
        assert alone.tokens[0] == batch.tokens[i]


def test_one_compile_per_tree_configuration():
    kw = dict(max_new_tokens=12, drafter="mtp", tree=(2, 1))
    generate(MODEL, _prompts(4, seed=5), **kw)
    before = TRACES["generate"]
    generate(MODEL, _prompts(4, seed=6), seed=3, eos_id=7, **kw)  # new data, same shapes
    assert TRACES["generate"] == before


@pytest.mark.parametrize("kwargs,match", [
    (dict(tree="2x0"), r"tree='2x0' is invalid: must be 1 \.\. 8 ints >= 1"),
    (dict(tree="two"), r"tree='two' is invalid: must be children per depth"),
    (dict(tree=[8, 8, 8]), r"tree=\[8, 8, 8\] is invalid: holds more than 64 draft nodes"),
    (dict(tree=(2, 1), drafter=None), r"tree=\[2, 1\] needs a drafter that proposes trees \('mtp', 'draft_model', "
     r"'ngram'\); drafter 'none' drafts chains only"),
    (dict(tree=(2, 1), drafter="ngram"), r"tree=\[2, 1\] is a preset; drafter 'ngram' drafts dynamic trees only"),
])
def test_bad_tree_settings_are_refused_before_compile(kwargs, match):
    before = TRACES["generate"]
    with pytest.raises(ValueError, match=match):
        generate(MODEL, [[1, 2]], max_new_tokens=4, **kwargs)
    assert TRACES["generate"] == before


@pytest.mark.parametrize("tree,rule,cache", [((2, 2, 1), "per_sequence", "dense"), ("dynamic:8,2", "cohort", "paged")])
def test_sliding_window_models_verify_trees(tree, rule, cache):
    """Sliding-window layers (a ring of window + slack slots): the tree's nodes see the prefix
    within the window counted along their own branch; tokens equal plain decoding."""
    model = SLIDING_MODEL
    prompts = _prompts(5, seed=7, vocab=31)
    want = generate(model, prompts, max_new_tokens=20, drafter=None, cache=cache).tokens
    got = generate(model, prompts, max_new_tokens=20, drafter="mtp", tree=tree, depth=4 if isinstance(tree, str) else 3,
                   kv_advance=rule, cache=cache)
    assert got.tokens == want
    assert got.metrics["accepted_drafts"] > 0
    # a tree wider than the window (11 or 9 nodes, window 6): its ring layers take the XLA path under Pallas
    pallas = generate(model, prompts[:2], max_new_tokens=20, drafter="mtp", tree=tree,
                      depth=4 if isinstance(tree, str) else 3, kv_advance=rule, cache=cache, attention_impl="pallas")
    assert pallas.tokens == want[:2]


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_sliding_window_trees_run_in_the_ring_kernel(cache, monkeypatch):
    """A tree that fits the window (5 of 6): the ring kernel takes its mask; tokens equal plain."""
    import specjax.cache.rolling as rolling

    calls = []
    kernel = rolling.ring_attention
    monkeypatch.setattr(rolling, "ring_attention", lambda *a, **kw: calls.append(kw.get("tree")) or kernel(*a, **kw))
    prompts = _prompts(3, seed=8, vocab=31)
    want = generate(SLIDING_MODEL, prompts, max_new_tokens=16, drafter=None, cache=cache).tokens
    got = generate(SLIDING_MODEL, prompts, max_new_tokens=16, drafter="mtp", tree="dynamic:4,2", depth=2,
                   cache=cache, attention_impl="pallas")
    assert got.tokens == want
    assert any(t is not None for t in calls)  # the tree step's ring layers ran the kernel with the tree


def test_tree_generation_config_parses_strings():
    from specjax import GenerationConfig

    assert GenerationConfig(tree="2x2x1").tree == (2, 2, 1)
    assert GenerationConfig(tree=[3, 1]).tree == (3, 1)
    assert jax.tree.leaves(GenerationConfig().tree) == []


def _engine_and_state(tree, cache="dense", steps=2, b=4, seed=8, width=16, new=24, depth=None):
    import specjax
    from specjax.engine import make_engine, prefill, request_capacity, step
    from specjax.tree import tree_window

    depth = len(tree) if depth is None else depth
    eng = make_engine(MODEL, drafter="mtp", draft_model=None, depth=depth,
                      kv_advance_rule=specjax.kv_advance("per_sequence"), cache=cache,
                      capacity=request_capacity(2 * width, new, tree_window(tree, depth) - 1), tree=tree)
    params = {"target": MODEL.params}
    prompts = _prompts(b, seed=seed)
    toks = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    st = prefill(eng, params, toks, plen, plen + new, np.full(b, -1, np.int32), np.arange(b, dtype=np.uint32))
    for _ in range(steps):
        st = step(eng, params, st)
    return eng, params, st


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_after_tree_steps_the_caches_hold_what_a_fresh_prefill_holds(cache):
    """After tree steps (accepted paths compacted, rejected branches left past the length), the
    target's live K/V and the MTP block's state (cache, hidden, first draft) equal a fresh
    prefill of the row's tokens: no rejected node reached anything a later step reads."""
    from specjax.engine import prefill

    eng, params, st = _engine_and_state((3, 2, 2), cache, steps=3)
    assert int(np.sum(np.asarray(st.accepted))) > 0
    seq, known = np.asarray(st.seq), np.asarray(st.known)
    b, width = len(known), 32
    toks = np.zeros((b, width), np.int32)
    for i in range(b):
        toks[i, : known[i] - 1] = seq[i, : known[i] - 1]
    fresh = prefill(eng, params, toks, known - 1, known - 1 + 8, np.full(b, -1, np.int32),
                    np.arange(b, dtype=np.uint32))
    np.testing.assert_array_equal(np.asarray(fresh.seq)[np.arange(b), known - 1], seq[np.arange(b), known - 1])
    lengths = np.asarray(st.cache.lengths)
    np.testing.assert_array_equal(lengths, known - 1)
    np.testing.assert_array_equal(np.asarray(fresh.cache.lengths), lengths)

    def kv(c, layer):
        g = c.global_kv
        return (np.asarray(g.k[layer]), np.asarray(g.v[layer])) if cache == "dense" else \
            tuple(np.asarray(x) for x in g.gather(layer)[:2])

    for layer in range(MODEL.config.n_layers):
        for got, want in zip(kv(st.cache, layer), kv(fresh.cache, layer), strict=True):
            for i in range(b):
                np.testing.assert_allclose(got[i, :, : lengths[i]], want[i, :, : lengths[i]], atol=1e-4,
                                           err_msg=f"layer {layer} row {i}")
    s, f = st.dstate, fresh.dstate
    np.testing.assert_array_equal(np.asarray(s.cache.lengths), np.asarray(f.cache.lengths))
    for i in range(b):
        n = int(s.cache.lengths[i])
        np.testing.assert_allclose(np.asarray(s.cache.k[0])[i, :, :n], np.asarray(f.cache.k[0])[i, :, :n], atol=1e-4)
    np.testing.assert_allclose(np.asarray(s.h), np.asarray(f.h), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(s.first), np.asarray(f.first))


def test_mtp_tree_drafts_each_branch_as_its_own_chain():
    """``MtpDrafter.propose_tree`` (one block call per depth, a tree mask over its scratch slots)
    against the chain's own machinery run once per branch: feed the branch's tokens one at a
    time at slots ``base + k - 1``, then take the top-k of the block's head."""
    from specjax.protocols import reachable_positions
    from specjax.tree import preset_parents

    tree = (3, 2, 2)
    eng, params, st = _engine_and_state(tree, steps=2)
    tokens = np.asarray(eng.drafter.propose_tree(eng, params, st)[0])  # (tokens, parents, dstate)
    dec, tp, s = eng.target, params["target"], st.dstate
    preset = preset_parents(tree)
    base = st.known - 1

    def top(h, k):
        logits, _ = dec.mtp_head(tp, h)
        return np.asarray(jax.lax.top_k(logits, k)[1])

    np.testing.assert_array_equal(tokens[:, :3], top(s.h, 3))
    for x in range(1, len(preset)):
        branch, p = [], x
        while p > 0:
            branch.append(p)
            p = preset[p]
        branch = branch[::-1]
        if len(branch) == len(tree):
            continue  # a leaf: no children
        h, cache = s.h, s.cache
        for k, node in enumerate(branch, start=1):
            at = base + k - 1
            out, cache = dec.mtp_hidden(tp, h[:, None], jnp.asarray(tokens[:, node - 1])[:, None],
                                        reachable_positions(at[:, None], st.max_len), cache.replace(lengths=at))
            h = out[:, 0]
        kids = [j for j in range(1, len(preset)) if preset[j] == x]
        np.testing.assert_array_equal(tokens[:, np.array(kids) - 1], top(h, tree[len(branch)]), err_msg=f"node {x}")


def test_mtp_dynamic_tree_is_eagle2_expansion_of_each_branch():
    """``DynamicTree`` drafting against a plain reference: every beam node's block output comes
    from the chain's machinery run along its own branch; candidates, beams and the kept nodes
    are chosen in NumPy by cumulative log-probability (stable: ties keep the earlier)."""
    from specjax.protocols import reachable_positions
    from specjax.tree import DynamicTree

    n_keep, k, depth = 9, 3, 4
    eng, params, st = _engine_and_state(DynamicTree(n_keep, k), steps=2, depth=depth)
    tokens, parents, _ = eng.drafter.propose_tree(eng, params, st)
    tokens, parents = np.asarray(tokens), np.asarray(parents)
    dec, tp, s = eng.target, params["target"], st.dstate
    base = st.known - 1
    b = tokens.shape[0]

    def logp_of(h):
        logits, _ = dec.mtp_head(tp, h)
        return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), np.float64)

    def h_along(branch_tokens):  # [B, L] tokens from depth 1: the block's output at the last
        h, cache = s.h, s.cache
        for i in range(branch_tokens.shape[1]):
            at = base + i
            out, cache = dec.mtp_hidden(tp, h[:, None], jnp.asarray(branch_tokens[:, i])[:, None],
                                        reachable_positions(at[:, None], st.max_len), cache.replace(lengths=at))
            h = out[:, 0]
        return h

    for r in range(b):
        lp = logp_of(s.h)[r]
        top = np.argsort(-lp, kind="stable")[:k]
        cands = [(int(t), -1, float(lp[t])) for t in top]  # (token, parent candidate, cumulative)
        beam = list(range(k))

        def branch(c, cands=cands):
            out = []
            while c >= 0:
                out.append(cands[c][0])
                c = cands[c][1]
            return out[::-1]

        for _ in range(1, depth):
            kids = []
            for c in beam:
                h = h_along(np.array([branch(c)] * b, np.int32))
                lp = logp_of(h)[r]
                for t in np.argsort(-lp, kind="stable")[:k]:
                    kids.append((int(t), c, cands[c][2] + float(lp[t])))
            first = len(cands)
            cands += kids
            order = np.argsort([-x[2] for x in kids], kind="stable")[:k]
            beam = [first + int(i) for i in order]
        keep = sorted(np.argsort([-x[2] for x in cands], kind="stable")[:n_keep].tolist())
        node = {c: i + 1 for i, c in enumerate(keep)}
        np.testing.assert_array_equal(tokens[r], [cands[c][0] for c in keep], err_msg=f"row {r}")
        np.testing.assert_array_equal(parents[r], [-1] + [node.get(cands[c][1], 0) for c in keep],
                                      err_msg=f"row {r}")


@pytest.mark.parametrize("tree,depth,rule,cache", [
    ("dynamic:8,2", 4, "per_sequence", "dense"),
    ("dynamic:10,3", 3, "cohort", "paged"),
    ("dynamic:5,5", 2, "cohort", "dense"),
    ("dynamic:12,2", 6, "per_sequence", "paged"),
])
def test_greedy_dynamic_tree_equals_plain(tree, depth, rule, cache):
    prompts = _prompts(5, seed=depth + 20)
    got = generate(MODEL, prompts, max_new_tokens=20, drafter="mtp", tree=tree, depth=depth, kv_advance=rule,
                   cache=cache)
    assert got.tokens == _plain(prompts, 20)
    assert got.metrics["depth"] == depth


@pytest.mark.parametrize("tree,depth,rule", [("dynamic:4,2", 3, "per_sequence"), ("dynamic:6,3", 2, "cohort")])
def test_dynamic_tree_sampling_matches_the_target_distribution(tiny, tree, depth, rule):
    prompt = [1, 2, 0]
    exact = exact_continuations(tiny, prompt, 3, 1.0, 1.0)
    rows, calls = 2000, 5
    samples = []
    for c in range(calls):
        r = generate(tiny, [prompt] * rows, max_new_tokens=3, drafter="mtp", tree=tree, depth=depth, kv_advance=rule,
                     temperature=1.0, seed=list(range(c * rows, (c + 1) * rows)))
        samples += r.tokens
    assert r.metrics["accepted_drafts"] > 0
    assert chi2_pvalue(samples, exact) > 1e-3


def test_dynamic_tree_rows_are_batch_invariant():
    prompts = _prompts(5, seed=3)
    kw = dict(max_new_tokens=16, drafter="mtp", tree="dynamic:8,2", depth=4, temperature=1.0)
    batch = generate(MODEL, prompts, seed=[1, 2, 3, 4, 5], **kw)
    alone = generate(MODEL, [prompts[2]], seed=[3], **kw)
    assert alone.tokens[0] == batch.tokens[2]


DRAFT = None


def _draft():
    global DRAFT
    if DRAFT is None:
        from engine_models import noisy

        DRAFT = noisy(MODEL, 0.3)
    return DRAFT


@pytest.mark.parametrize("drafter,tree,depth,rule,cache", [
    ("ngram", "dynamic:8,3", 4, "per_sequence", "dense"),
    ("ngram", "dynamic:6,2", 3, "cohort", "paged"),
    ("draft_model", "dynamic:8,2", 4, "per_sequence", "paged"),
    ("draft_model", "dynamic:6,3", 3, "cohort", "dense"),
])
def test_greedy_trees_of_every_drafter_equal_plain(drafter, tree, depth, rule, cache):
    prompts = [(p[:2] * 8)[: len(p)] if i % 2 else p for i, p in enumerate(_prompts(6, seed=depth + 30))]
    got = generate(MODEL, prompts, max_new_tokens=20, drafter=drafter, draft_model=_draft(), tree=tree, depth=depth,
                   kv_advance=rule, cache=cache)
    assert got.tokens == _plain(prompts, 20)
    assert got.metrics["accepted_drafts"] > 0


def test_draft_model_trees_on_sliding_window_models_equal_plain():
    draft = sharp(SLIDING, seed=1)
    prompts = _prompts(4, seed=12)
    want = generate(SLIDING_MODEL, prompts, max_new_tokens=20, drafter=None).tokens
    got = generate(SLIDING_MODEL, prompts, max_new_tokens=20, drafter="draft_model", draft_model=draft,
                   tree="dynamic:6,2", depth=4)
    assert got.tokens == want


def test_after_draft_model_tree_steps_its_cache_holds_what_a_fresh_prefill_holds():
    """The draft model's own window is compacted as the target's: its live K/V equal a fresh
    prefill of the row's tokens (a rejected branch never reaches a later step)."""
    import specjax
    from specjax.engine import make_engine, prefill, request_capacity, step
    from specjax.tree import DynamicTree

    tree, depth, b, width = DynamicTree(6, 2), 3, 4, 16
    eng = make_engine(MODEL, drafter="draft_model", draft_model=_draft(), depth=depth,
                      kv_advance_rule=specjax.kv_advance("per_sequence"), cache="dense",
                      capacity=request_capacity(2 * width, 24, 16), tree=tree)
    params = {"target": MODEL.params, "draft": _draft().params}
    prompts = _prompts(b, seed=8)
    toks = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    st = prefill(eng, params, toks, plen, plen + 24, np.full(b, -1, np.int32), np.arange(b, dtype=np.uint32))
    for _ in range(3):
        st = step(eng, params, st)
    assert int(np.sum(np.asarray(st.accepted))) > 0
    seq, known = np.asarray(st.seq), np.asarray(st.known)
    toks = np.zeros((b, 2 * width), np.int32)
    for i in range(b):
        toks[i, : known[i] - 1] = seq[i, : known[i] - 1]
    fresh = prefill(eng, params, toks, known - 1, known + 7, np.full(b, -1, np.int32), np.arange(b, dtype=np.uint32))
    lengths = np.asarray(st.dstate.lengths)
    np.testing.assert_array_equal(lengths, known - 1)
    for layer in range(MODEL.config.n_layers):
        for got, want in ((st.dstate.global_kv.k[layer], fresh.dstate.global_kv.k[layer]),
                          (st.dstate.global_kv.v[layer], fresh.dstate.global_kv.v[layer])):
            for i in range(b):
                np.testing.assert_allclose(np.asarray(got)[i, :, : lengths[i]], np.asarray(want)[i, :, : lengths[i]],
                                           atol=1e-4, err_msg=f"layer {layer} row {i}")


def test_ngram_tree_is_a_trie_of_the_latest_matches():
    """Three earlier occurrences of the last two tokens (1, 2), followed by (3, 4, 5), (3, 4, 6)
    and (7, 8, 9): the trie shares (3, 4) and keeps the latest match first (7 nodes: all it
    holds; a wider tree fills up with candidates below the root)."""
    from specjax.engine import make_engine
    from specjax.engine.state import new_state
    from specjax.tree import DynamicTree

    seq = [1, 2, 7, 8, 9, 0, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4, 5, 0, 1, 2]  # matches at 12 (latest), 6, 0
    eng = make_engine(MODEL, drafter="ngram", draft_model=None, depth=3, kv_advance_rule="per_sequence",
                      cache="dense", ngram_n=2, capacity=32, tree=DynamicTree(7, 3))
    arr = jnp.zeros((1, 32), jnp.int32).at[0, : len(seq)].set(jnp.asarray(seq))
    n = jnp.asarray([len(seq)], jnp.int32)
    st = new_state(eng, seq=arr, known=n, cache=None, dstate=None, prompt_len=n, max_len=n + 8,
                   eos=jnp.full((1, 1), -1, jnp.int32), seeds=jnp.zeros((1,), jnp.uint32), sampling=None,
                   live=jnp.ones((1,), bool), done=jnp.zeros((1,), bool))
    tokens, parents, _ = eng.drafter.propose_tree(eng, {}, st)
    # match-major: 3 4 5 (latest), then 6 below the shared (3, 4), then 7 8 9
    assert np.asarray(tokens)[0].tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert np.asarray(parents)[0].tolist() == [-1, 0, 1, 2, 2, 0, 5, 6]


@pytest.mark.parametrize("drafter,tree,depth", [("draft_model", "dynamic:4,2", 3), ("ngram", "dynamic:4,2", 2)])
def test_tree_sampling_of_other_drafters_matches_the_target_distribution(tiny, drafter, tree, depth):
    from engine_models import noisy

    prompt = [1, 2, 1, 2, 0]
    exact = exact_continuations(tiny, prompt, 3, 1.0, 1.0)
    rows, calls = 2000, 5
    samples = []
    for c in range(calls):
        r = generate(tiny, [prompt] * rows, max_new_tokens=3, drafter=drafter, draft_model=noisy(tiny, 1.0, seed=9),
                     tree=tree, depth=depth, temperature=1.0, seed=list(range(c * rows, (c + 1) * rows)))
        samples += r.tokens
    assert r.metrics["accepted_drafts"] > 0
    assert chi2_pvalue(samples, exact) > 1e-3


def test_presets_are_for_the_mtp_drafter():
    with pytest.raises(ValueError, match=r"tree=\[2, 1\] is a preset; drafter 'ngram' drafts dynamic trees only"):
        generate(MODEL, [[1, 2]], max_new_tokens=4, drafter="ngram", tree=(2, 1))


def test_stream_with_a_tree_yields_generates_tokens():
    from specjax.streaming import stream

    prompts = _prompts(3, seed=14)
    got = [[] for _ in prompts]
    for chunk in stream(MODEL, prompts, max_new_tokens=16, drafter="mtp", tree="dynamic:6,2", depth=3):
        for i, t in enumerate(chunk.new_tokens):
            got[i] += t
    assert got == _plain(prompts, 16)
