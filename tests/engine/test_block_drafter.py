"""The block drafter (``drafter="block"``, ``specjax.model.block``): its pass against a NumPy
reference written from the method (DFlash: non-causal block over projected target context),
the cached pass against the uncached training forward, losslessness and per-row invariance
in the engine, and its refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.cache import DenseKVCache
from specjax.model import ModelConfig
from specjax.model.block import block_draft_logits, block_logits, train_block_hidden, write_context
from specjax.model.llama import hidden_states, init_model, unfuse_params

from engine_models import chi2_pvalue, exact_continuations, sharp

CFG = ModelConfig(vocab_size=48, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=96,
                  mtp_depth=0, block_size=4, block_layers=2, block_taps=(0, 2), block_mask_id=47)


def _model(cfg=CFG, seed=1):
    m = init_model(cfg, seed=seed)
    # larger weights than init's 0.02 so that attention patterns and positions matter
    # and norm weights away from 1 (a norm applied twice then differs from once)
    keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
    scale = lambda x: x * 6.0 if x.ndim == 2 else x * jax.random.uniform(next(keys), x.shape, x.dtype, 0.5, 1.5)  # noqa: E731
    return dataclasses.replace(m, params=dict(m.params, block=jax.tree.map(scale, m.params["block"])))


# ----------------------------------------------------------------------------- NumPy reference


def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _np_rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv[None]  # [t, hd/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def np_block_logits(params, cfg, taps, tokens, anchor):
    """One row's block at ``anchor`` from the method's description: context entries
    ``hidden_norm(fc(taps))`` at positions ``< anchor`` enter each layer as keys (k_proj,
    RoPE; no input norm) and values; the block ``[tokens[anchor], mask...]`` runs every layer
    with full (non-causal) attention over [context; block]; logits = lm_head(norm(block rows 1..))."""
    p = unfuse_params(jax.device_get(params), cfg)
    b = {k: np.asarray(v, np.float64) if not isinstance(v, list) else v for k, v in p["block"].items()}
    eps, hd, k = cfg.norm_eps, cfg.head_dim, cfg.block_size
    ctx = _np_rms(np.asarray(taps, np.float64)[:anchor] @ b["fc"], b["hidden_norm"], eps)
    emb = np.asarray(p["embed"], np.float64)
    x = emb[np.array([tokens[anchor]] + [cfg.block_mask_id] * (k - 1))]
    pos_c, pos_b = np.arange(anchor), anchor + np.arange(k)
    g = cfg.n_heads // cfg.n_kv_heads
    for lp in b["layers"]:
        w = {n: np.asarray(a, np.float64) for n, a in lp.items()}
        kc = _np_rope((ctx @ w["wk"]).reshape(anchor, -1, hd), pos_c, cfg.rope_theta)
        vc = (ctx @ w["wv"]).reshape(anchor, -1, hd)
        h = _np_rms(x, w["attn_norm"], eps)
        q = _np_rope((h @ w["wq"]).reshape(k, -1, hd), pos_b, cfg.rope_theta)
        kb = _np_rope((h @ w["wk"]).reshape(k, -1, hd), pos_b, cfg.rope_theta)
        vb = (h @ w["wv"]).reshape(k, -1, hd)
        keys, vals = np.concatenate([kc, kb]), np.concatenate([vc, vb])  # [anchor + k, Hkv, hd]
        out = np.zeros((k, cfg.n_heads, hd))
        for hq in range(cfg.n_heads):
            s = q[:, hq] @ keys[:, hq // g].T / np.sqrt(hd)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hq] = (s / s.sum(-1, keepdims=True)) @ vals[:, hq // g]
        x = x + out.reshape(k, -1) @ w["wo"]
        h = _np_rms(x, w["mlp_norm"], eps)
        gate = h @ w["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
    return _np_rms(x[1:], b["norm"], eps) @ emb.T


def test_the_block_pass_matches_a_numpy_reference():
    """Three blocks of one sequence in one training forward, each against the reference alone."""
    m = _model()
    tokens = jax.random.randint(jax.random.key(3), (1, 24), 0, CFG.vocab_size)
    _, hidden = hidden_states(m, tokens, taps=CFG.block_taps)
    taps = hidden[..., CFG.d_model:]
    anchors = [1, 7, 20]
    x = train_block_hidden(m.params, CFG, taps, tokens, jnp.array([anchors], jnp.int32))
    for i, anchor in enumerate(anchors):
        got = np.asarray(block_logits(m.params, CFG, x[0, i, 1:]))
        want = np_block_logits(m.params, CFG, np.asarray(taps[0]), np.asarray(tokens[0]), anchor)
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3, err_msg=f"anchor {anchor}")


def test_the_target_taps_are_the_layer_outputs():
    """``forward_hidden(..., taps=)``'s extra columns are the tapped layers' outputs, in both layer
    loops: tap ``n_layers - 1`` is the last hidden state itself."""
    m = _model()
    tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, CFG.vocab_size)
    _, plain = hidden_states(m, tokens)
    _, tapped = hidden_states(m, tokens, taps=(2, 0))
    np.testing.assert_array_equal(tapped[..., : CFG.d_model], plain)
    np.testing.assert_array_equal(tapped[..., CFG.d_model:2 * CFG.d_model], plain)
    _, first = hidden_states(dataclasses.replace(m, config=dataclasses.replace(
        CFG, n_layers=1, block_taps=(0,))), tokens)  # one layer: its output is layer 0's
    np.testing.assert_allclose(tapped[..., 2 * CFG.d_model:], first, atol=1e-6)
    scan = specjax.model.with_layer_loop(m, "scan")
    _, tapped_scan = hidden_states(scan, tokens, taps=(2, 0))
    np.testing.assert_allclose(tapped_scan, tapped, atol=1e-5)


def test_the_cached_pass_equals_the_uncached_blocks():
    """Per-row context lengths: each row's cached pass (context written through the cache,
    then one block over it) gives the training forward's logits at that row's anchor."""
    m = _model()
    b, t = 3, 30
    tokens = jax.random.randint(jax.random.key(5), (b, t), 0, CFG.vocab_size)
    anchors = jnp.array([4, 17, 25], jnp.int32)
    _, hidden = hidden_states(m, tokens, taps=CFG.block_taps)
    want = block_logits(m.params, CFG, train_block_hidden(m.params, CFG, hidden[..., CFG.d_model:], tokens,
                                                          anchors[:, None])[:, 0, 1:])
    cache = DenseKVCache.create(CFG.block_layers, b, 48, CFG.n_kv_heads, CFG.head_dim)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = write_context(m.params, CFG, hidden, pos, cache, anchors).advance(anchors)
    first = jnp.take_along_axis(tokens, anchors[:, None], axis=1)[:, 0]
    got, _ = block_draft_logits(m.params, CFG, first, anchors[:, None] + jnp.arange(CFG.block_size), cache)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- in the engine


PROMPTS = [[5, 9, 11, 3, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [30, 31, 32]]


@pytest.mark.parametrize("rule", ["per_sequence", "cohort"])
@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_greedy_block_drafting_is_plain_decoding(rule, cache):
    m = _model()
    plain = specjax.generate(m, PROMPTS, max_new_tokens=24, drafter=None).tokens
    got = specjax.generate(m, PROMPTS, max_new_tokens=24, drafter="block", depth=3, kv_advance=rule, cache=cache)
    assert got.tokens == plain
    assert got.metrics["steps"] > 0


def test_a_trained_block_drafter_is_accepted():
    """The bundled block drafter drafts the bundled target's own continuations: on Python code
    it accepts far more than nothing (a broken context or block would not). With no depth
    given it verifies the whole block (block_size - 1 drafts)."""
    bundle = specjax.load_model()
    prompts = bundle.encode_prompts(["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n"])
    plain = specjax.generate(bundle.model, prompts, max_new_tokens=40, drafter=None).tokens
    got = specjax.generate(bundle.model, prompts, max_new_tokens=40, drafter="block")
    assert got.tokens == plain
    assert got.metrics["depth"] == bundle.model.decoder.block_size - 1 == 7
    assert got.metrics["tok_per_step"] > 2.0, got.metrics["tok_per_step"]


def _run_steps(model, prompts, steps, **kw):
    """The engine after prefill and ``steps`` steps: ``(engine, params, state)``."""
    from specjax.engine import generate_loop
    from specjax.generation import setup
    from specjax.generation_config import GenerationConfig

    eng, params, args = setup(model, prompts, GenerationConfig(drafter="block", max_new_tokens=60, **kw))
    st = jax.jit(generate_loop, static_argnums=0)(eng, params, *args, None, jnp.int32(steps))
    return eng, params, st


def _oracle(model, st, row):
    """Row ``row``'s known tokens, its target taps (one uncached forward) and its length."""
    n = int(st.known[row])
    tokens = st.seq[row : row + 1, :n]
    return tokens, hidden_states(model, tokens, taps=model.config.block_taps)[1], n


@pytest.mark.parametrize("rule", ["per_sequence", "cohort"])
def test_the_context_cache_holds_every_verified_position(rule):
    """After some steps every row's context cache holds, before its last known token, the
    entries one uncached target forward over its tokens gives: also under the cohort rule,
    whose caches advance by the batch's minimum while the context keeps what the row verified."""
    bundle = specjax.load_model()
    model, cfg = bundle.model, bundle.model.config
    prompts = bundle.encode_prompts(["def main():\n    args = ", "for i in range(10):\n    ", "import json\n"])
    eng, params, st = _run_steps(model, prompts, 6, depth=7, kv_advance=rule)
    cache = st.dstate.cache
    for row in range(len(prompts)):
        tokens, hidden, n = _oracle(model, st, row)
        ref = DenseKVCache.create(cfg.block_layers, 1, n, cfg.n_kv_heads, cfg.head_dim)
        ref = write_context(model.params, cfg, hidden, jnp.arange(n)[None], ref, jnp.array([n - 1]))
        for layer in range(cfg.block_layers):
            for got, want in ((cache.k[layer], ref.k[layer]), (cache.v[layer], ref.v[layer])):
                np.testing.assert_allclose(got[row, :, : n - 1], want[0, :, : n - 1], atol=2e-3, rtol=2e-3,
                                           err_msg=f"row {row} layer {layer}")


@pytest.mark.parametrize("steps", [0, 5])
def test_the_engines_draft_distributions_are_the_uncached_drafters(steps):
    """The draft distributions the engine proposes (sampling at temperature 1; after prefill,
    and after some steps) are those of one uncached drafter forward over each row's tokens,
    anchored at its last known token."""
    bundle = specjax.load_model()
    model, cfg = bundle.model, bundle.model.config
    prompts = bundle.encode_prompts(["class Stack:\n    def push(self", "while True:\n", "x = [i * i for i in"])
    eng, params, st = _run_steps(model, prompts, steps, depth=7, kv_advance="cohort", temperature=1.0, seed=3)
    _, probs, _ = jax.jit(eng.drafter.propose, static_argnums=0)(eng, params, st)
    for row in range(len(prompts)):
        tokens, hidden, n = _oracle(model, st, row)
        x = train_block_hidden(model.params, cfg, hidden[..., cfg.d_model:], tokens, jnp.array([[n - 1]]))
        want = jax.nn.softmax(block_logits(model.params, cfg, x[0, 0, 1:]), axis=-1)
        np.testing.assert_allclose(probs[row], want, atol=2e-4, err_msg=f"row {row}")


def test_sampled_rows_alone_equal_rows_in_the_batch():
    m = _model()
    kw = dict(max_new_tokens=20, drafter="block", depth=3, temperature=0.8, top_k=20, seed=[11, 12, 13])
    batch = specjax.generate(m, PROMPTS, **kw).tokens
    for i, p in enumerate(PROMPTS):
        alone = specjax.generate(m, [p], **dict(kw, seed=[kw["seed"][i]])).tokens[0]
        assert alone == batch[i], i


@pytest.mark.parametrize("chunk", [None, 3])
def test_batch_jobs_refill_slots_with_block_drafting(chunk):
    """Slot refill, and prompts taken in chunks beside running rows (the drafter's context of
    a chunk written from the chunk's own tapped forward)."""
    m = _model()
    prompts = [[i % 40 + 1, 3, 5, (7 * i) % 40, 9, 2, i % 7 + 1][: 4 + i % 4] for i in range(7)]
    plain = specjax.generate(m, prompts, max_new_tokens=12, drafter=None).tokens
    got = {c.id: c.tokens for c in specjax.batch_generate(m, [{"prompt": p, "max_new_tokens": 12} for p in prompts],
                                                          slots=3, drafter="block", depth=3, cache="paged",
                                                          prefill_chunk=chunk)}
    assert [got[i] for i in range(len(prompts))] == plain


# ----------------------------------------------------------------------------- trees over the block


@pytest.mark.parametrize(("tree", "rule", "cache"), [
    ("2x2x1", "per_sequence", "dense"),
    ("dynamic:6,2", "cohort", "paged"),
    ("dynamic:4,3", "per_sequence", "paged"),
])
def test_greedy_block_trees_are_plain_decoding(tree, rule, cache):
    m = _model()
    plain = specjax.generate(m, PROMPTS, max_new_tokens=24, drafter=None).tokens
    got = specjax.generate(m, PROMPTS, max_new_tokens=24, drafter="block", depth=3, tree=tree, kv_advance=rule,
                           cache=cache)
    assert got.tokens == plain


def _np_beam_tree(logp, nodes, k):
    """EAGLE-2's expansion over one row's per-position log-probabilities ``logp [depth, V]``
    (a block drafter's: a child's distribution is its position's, whatever its branch): each
    depth's ``k`` best candidates by cumulative log-probability grow ``k`` children each; the
    ``nodes`` best candidates are kept, in candidate order. Returns (tokens, parents)."""
    top = lambda x, n: list(np.argsort(-x, kind="stable")[:n])  # noqa: E731  (ties: the lower index)
    kids = top(logp[0], k)
    cands = [(logp[0][t], t, -1) for t in kids]  # (cumulative, token, parent candidate)
    beam = list(range(k))
    for lvl in range(1, logp.shape[0]):
        first, kids = len(cands), top(logp[lvl], k)
        cands += [(np.float32(cands[b][0] + logp[lvl][t]), t, b) for b in beam for t in kids]
        beam = [first + i for i in top(np.array([c[0] for c in cands[first:]]), k)]
    keep = sorted(top(np.array([c[0] for c in cands]), nodes))
    return [cands[i][1] for i in keep], [-1] + [keep.index(cands[i][2]) + 1 if cands[i][2] >= 0 else 0 for i in keep]


@pytest.mark.parametrize("tree", ["2x2x1", "3x1", "dynamic:7,3", "dynamic:5,2"])
def test_block_trees_take_each_positions_top_candidates(tree):
    """The tree of one pass: a preset node at depth j has its position's top ``tree[j]``
    tokens as children whatever its branch; a dynamic tree is EAGLE-2's best-first expansion
    over the positions' distributions (a NumPy reference)."""
    depth = 2 if tree == "3x1" else 3
    eng, params, st = _run_steps(_model(), PROMPTS, 2, depth=depth, tree=tree)
    logits, _ = jax.jit(eng.drafter._pass, static_argnums=0)(eng, params, st)
    tokens, parents, _ = jax.jit(eng.drafter.propose_tree, static_argnums=0)(eng, params, st)
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    for row in range(len(PROMPTS)):
        if tree.startswith("dynamic"):
            n, k = (int(x) for x in tree[len("dynamic:"):].split(","))
            want_tok, want_par = _np_beam_tree(logp[row, :depth], n, k)
        else:
            want_tok, want_par, level = [], [-1], [0]
            for j, kids in enumerate(int(x) for x in tree.split("x")):
                top = list(np.argsort(-logp[row, j], kind="stable")[:kids])
                nxt = []
                for parent in level:
                    for t in top:
                        want_tok.append(t)
                        want_par.append(parent)
                        nxt.append(len(want_par) - 1)
                level = nxt
        assert list(np.asarray(tokens[row])) == want_tok, row
        assert list(np.asarray(parents[row])) == want_par, row


def test_a_tree_over_the_trained_block_accepts_more_than_its_chain():
    bundle = specjax.load_model()
    prompts = bundle.encode_prompts(["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n"])
    plain = specjax.generate(bundle.model, prompts, max_new_tokens=32, drafter=None).tokens
    chain = specjax.generate(bundle.model, prompts, max_new_tokens=32, drafter="block", depth=4)
    tree = specjax.generate(bundle.model, prompts, max_new_tokens=32, drafter="block", depth=4, tree="dynamic:12,3")
    assert chain.tokens == tree.tokens == plain
    assert tree.metrics["tok_per_step"] > chain.metrics["tok_per_step"], (tree.metrics, chain.metrics)


# ----------------------------------------------------------------------------- lossless sampling

TINY_BLOCK = ModelConfig(vocab_size=5, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16,
                         tie_embeddings=False, mtp_depth=0, block_size=4, block_layers=1, block_taps=(0, 1),
                         block_mask_id=4)


@pytest.fixture(scope="module")
def tiny_block():
    return sharp(TINY_BLOCK, seed=3, s_emb=2.0, s_head=6.0)


@pytest.mark.parametrize(("tree", "rule", "temperature", "top_k", "top_p"), [
    (None, "per_sequence", 1.0, None, None),
    (None, "cohort", 0.7, 3, None),
    ("2x2x1", "per_sequence", 1.0, None, 0.9),
    ("dynamic:5,2", "cohort", 1.3, 4, 0.95),
])
def test_block_sampling_matches_the_target_distribution(tiny_block, tree, rule, temperature, top_k, top_p):
    """Chi-square over 6,000 3-token continuations vs the exact enumerated distribution under
    the same temperature, top-k and top-p (alpha = 1e-3, fixed seeds: deterministic): chains
    (rejection sampling against the block's draft distributions) and trees."""
    prompt = [1, 2, 0]
    exact = exact_continuations(tiny_block, prompt, 3, temperature, top_p or 1.0, top_k or 0)
    rows, samples = 2000, []
    for c in range(3):
        r = specjax.generate(tiny_block, [prompt] * rows, max_new_tokens=3, drafter="block", depth=3, tree=tree,
                             kv_advance=rule, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=list(range(c * rows, (c + 1) * rows)))
        samples += r.tokens
    assert r.metrics["accepted_drafts"] > 0  # drafts were accepted, not only bonus tokens
    assert chi2_pvalue(samples, exact) > 1e-3


@pytest.mark.parametrize(("kw", "says"), [
    (dict(depth=4), "depth=4 is invalid with drafter='block'"),
    (dict(tree="2x2x1x1"), "depth=4 is invalid with drafter='block'"),
    (dict(depth="auto"), "depth='auto' is not offered with drafter='block'"),
])
def test_block_drafting_refuses_what_it_cannot_do(kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        specjax.generate(_model(), PROMPTS, max_new_tokens=4, drafter="block", **kw)


def test_a_model_without_a_block_drafter_is_refused():
    plain = init_model(dataclasses.replace(CFG, block_size=0, block_layers=0, block_taps=()))
    with pytest.raises(ValueError, match="no block drafter"):
        specjax.generate(plain, PROMPTS, max_new_tokens=4, drafter="block", depth=2)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("block_size", 1, "block_size=1 is invalid"),
    ("block_taps", (0, 3), "block_taps=(0, 3) is invalid"),
    ("block_mask_id", 48, "block_mask_id=48 is invalid"),
    ("block_layers", 0, "block_layers=0 is invalid"),
])
def test_block_config_errors_name_the_field(field, value, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(CFG, **{field: value})
