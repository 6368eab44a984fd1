"""Compressed-memory layers and their cache: the cached forward against the uncached oracle over
random per-row commits, memory built from committed tokens only, both rules through the engine,
batch invariance, and the shared-time-base control."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax import batch_generate, kv_advance
from specjax.cache import CompressedKVCache, cache_supports_per_sequence_advance
from specjax.cache.compressed import compressed_attention
from specjax.generation import generate
from specjax.model import ModelConfig, init_cache, init_model, logits
from specjax.model.layers import block_finish, block_qkv, causal_attention
from specjax.model.llama import forward

from engine_models import noisy, sharp

# layer 0 compressed, 1 sliding-window, 2 global, 3 compressed: every cache kind side by side
CFG = ModelConfig(vocab_size=31, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=96,
                  tie_embeddings=False, sliding_window=5, global_every=3, compressed_layers=(0, 3),
                  compress_window=4, compress_block=3)
MODEL = sharp(CFG, seed=2)
DRAFT = noisy(MODEL, 0.3)
B, P, T, CAP, TMAX = 4, 8, 6, 96, 80  # rows, prefill width, write width, capacity, oracle width


def test_config_layer_kinds_and_errors():
    assert CFG.compressed_layers == (0, 3) and CFG.local_layers == (1,) and CFG.global_layers == (2,)
    assert ModelConfig(**(CFG.to_dict() | {"compressed_layers": [0, 3]})) == CFG  # JSON lists load as tuples
    with pytest.raises(ValueError, match="compress_block"):
        ModelConfig(**(CFG.to_dict() | {"compress_block": None}))
    with pytest.raises(ValueError, match="distinct layer indices"):
        ModelConfig(**(CFG.to_dict() | {"compressed_layers": (0, 4)}))
    with pytest.raises(ValueError, match="compressed_layers is empty"):
        ModelConfig(**(CFG.to_dict() | {"compressed_layers": ()}))


@dataclasses.dataclass(frozen=True)
class SharedClockMemory:
    """The control: the design that blocked the original engine. Per-row lengths, but one
    count of compressed blocks (one time base) for the whole batch."""

    k: jax.Array
    lengths: jax.Array  # [B]
    compressed: jax.Array  # [] : shared


def test_per_row_time_base_is_accepted_and_a_shared_one_refused():
    cache = init_cache(CFG, 3, 32)
    assert cache_supports_per_sequence_advance(cache) is None
    assert cache_supports_per_sequence_advance(cache.memory_kv) is None
    shared = SharedClockMemory(jnp.zeros((3, 4)), jnp.zeros((3,), jnp.int32), jnp.int32(0))
    msg = cache_supports_per_sequence_advance({"layer0": shared})
    assert msg is not None and "'compressed' is one value for the whole batch" in msg, msg
    nested = init_cache(CFG, 3, 32)
    nested = nested.replace(memory_kv=nested.memory_kv.replace(compressed=jnp.int32(0)))
    msg = cache_supports_per_sequence_advance(nested)
    assert msg is not None and "cache.memory_kv" in msg and "'compressed'" in msg, msg


def test_oracle_reads_each_token_once():
    """The oracle itself against a brute-force NumPy reading of the rule (one head)."""
    rng = np.random.default_rng(0)
    t, d, window, block = 11, 4, 3, 2
    q, k, v = (rng.normal(size=(1, t, 1, d)).astype(np.float32) for _ in range(3))
    got = np.asarray(compressed_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window=window, block=block))
    for r in range(t):
        cut = max(r - window + 1, 0) // block
        keys = [k[0, c * block:(c + 1) * block, 0].mean(0) for c in range(cut)] + [k[0, j, 0] for j in
                                                                                      range(cut * block, r + 1)]
        vals = [v[0, c * block:(c + 1) * block, 0].mean(0) for c in range(cut)] + [v[0, j, 0] for j in
                                                                                      range(cut * block, r + 1)]
        assert len(keys) == cut + (r + 1 - cut * block)  # every token once: pooled or raw
        s = np.array(keys) @ q[0, r, 0] / np.sqrt(d)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(got[0, r, 0], (p / p.sum()) @ np.array(vals), rtol=1e-5, atol=1e-6)


@jax.jit
def _memory_keys(model, tokens):
    """Per compressed layer, the oracle's post-RoPE keys/values ``[B, Hkv, T, D]`` of ``tokens
    [B, T]`` (causal: a row's first ``n`` keys do not depend on what follows them)."""
    cfg, params = model.config, model.params
    x = params["embed"][tokens]
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    out = []
    for layer, p in enumerate(params["layers"]):
        q, k, v = block_qkv(p, x, pos, cfg, layer)
        if cfg.is_compressed(layer):
            out.append((k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)))
            attn = compressed_attention(q, k, v, window=cfg.compress_window, block=cfg.compress_block)
        else:
            attn = causal_attention(q, k, v, cfg.sliding_window if cfg.is_local(layer) else None)
        x = block_finish(p, x, attn, cfg)
    return out


def _np_pool(x: np.ndarray, n: int, block: int) -> np.ndarray:
    """``[H, T, D]`` -> the means of its first ``n`` blocks ``[H, n, D]`` (NumPy)."""
    return x[:, : n * block].reshape(x.shape[0], n, block, x.shape[2]).mean(axis=2)


def assert_memory_from_committed(cache: CompressedKVCache, model, committed: list[list[int]]):
    """Each row's memory slots (and only as many as its committed length fills) equal the
    block means of the keys/values of its committed tokens alone: no draft in a summary."""
    block = model.config.compress_block
    counts = np.asarray(cache.compressed)
    rel = np.asarray(cache.lengths - cache.start)
    np.testing.assert_array_equal(counts, rel // block)
    tokens = np.zeros((len(committed), TMAX), np.int32)
    for b, toks in enumerate(committed):
        assert rel[b] == len(toks)
        tokens[b, : len(toks)] = toks
    keys = [(np.asarray(k), np.asarray(v)) for k, v in _memory_keys(model, jnp.asarray(tokens))]
    for b in range(len(committed)):
        n = counts[b]
        for layer, (k, v) in enumerate(keys):
            np.testing.assert_allclose(cache.mem_k[layer][b, :, :n], _np_pool(k[b], n, block), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(cache.mem_v[layer][b, :, :n], _np_pool(v[b], n, block), rtol=1e-5, atol=1e-5)


_fwd = jax.jit(lambda c, tk, ps: forward(MODEL.params, CFG, tk, ps, c))
_oracle = jax.jit(lambda tk: logits(MODEL, tk))
_advance = jax.jit(lambda c, n: c.advance(n))
_rollback = jax.jit(lambda c, n: c.rollback(n))


def _check_window(cache, window_tokens, committed, valid=None):
    """Forward ``window_tokens [B, t]`` at each row's length; compare with the oracle on
    committed + window (padded to ``TMAX``: causal, so the padding is never read). ``valid
    [B]``: tokens of the window that are real (a bounded prefill; the rest is padding)."""
    lengths = np.asarray(cache.lengths)
    t = window_tokens.shape[1]
    valid = [t] * len(committed) if valid is None else valid
    pos = jnp.asarray(lengths[:, None] + np.arange(t), jnp.int32)
    got, _, cache = _fwd(cache, jnp.asarray(window_tokens, jnp.int32), pos)
    full = np.zeros((len(committed), TMAX), np.int32)
    for b, toks in enumerate(committed):
        full[b, : len(toks) + t] = toks + list(window_tokens[b])
    want = np.asarray(_oracle(full))
    for b, toks in enumerate(committed):
        n = len(toks)
        np.testing.assert_allclose(got[b, : valid[b]], want[b, n: n + valid[b]], rtol=2e-4, atol=2e-4)
    return cache


def _run_commits(seed: int, steps: list[tuple[list[int], bool]], width: int = P):
    """Prefill ragged prompts (``width`` wide, bounded per row), then per step: write ``T`` tokens
    (drafts past what commits), commit ``a_b`` per row either directly or as
    commit-all-then-rollback; oracle every window."""
    rng = np.random.default_rng(seed)
    cache = init_cache(CFG, B, CAP, slack=max(width, T), reach=T)
    plen = rng.integers(1, width + 1, B)
    plen[0] = width  # one row fills the prefill: the others end inside it, padding after
    cache = cache.bound_write(jnp.asarray(plen, jnp.int32))
    prompts = rng.integers(0, CFG.vocab_size, (B, width))
    committed = [prompts[b, : plen[b]].tolist() for b in range(B)]
    cache = _check_window(cache, prompts, [[] for _ in range(B)], plen.tolist())
    cache = _advance(cache, jnp.asarray(plen, jnp.int32))
    crossings = []
    block = CFG.compress_block
    for commits, via_rollback in steps:
        win = rng.integers(0, CFG.vocab_size, (B, T))
        cache = _check_window(cache, win, committed)
        a = jnp.asarray(commits, jnp.int32)
        before = np.asarray(cache.lengths) // block
        if via_rollback:  # commit the whole window, then take back the rejected drafts
            cache = _rollback(_advance(cache, jnp.full((B,), T, jnp.int32)), cache.lengths + a)
        else:
            cache = _advance(cache, a)
        crossings += (np.asarray(cache.lengths) // block - before).tolist()
        for b in range(B):
            committed[b] += win[b, : commits[b]].tolist()
    assert not np.asarray(cache.status).any()
    return cache, committed, crossings


def test_commits_crossing_zero_one_and_two_blocks_in_one_step():
    steps = [([0, 1, 4, 6], False), ([6, 3, 0, 5], True), ([2, 6, 6, 1], False), ([5, 0, 3, 6], True)] * 2
    cache, committed, crossings = _run_commits(7, steps)
    assert {0, 1, 2} <= set(crossings)  # the case list covers what it claims
    assert_memory_from_committed(cache.memory_kv, MODEL, committed)


def test_a_prefill_wider_than_the_ring_keeps_each_rows_own_tail():
    steps = [([6, 0, 3, 5], False), ([1, 6, 6, 2], True), ([4, 4, 0, 6], False)]
    cache, committed, _ = _run_commits(11, steps, width=48)
    assert cache.memory_kv.size < 48  # the prefill really was wider than the ring
    assert_memory_from_committed(cache.memory_kv, MODEL, committed)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000),
       steps=st.lists(st.tuples(st.lists(st.integers(0, T), min_size=B, max_size=B), st.booleans()),
                      min_size=3, max_size=8))
def test_cached_forward_equals_oracle_over_random_commits(seed, steps):
    cache, committed, _ = _run_commits(seed, steps)
    assert_memory_from_committed(cache.memory_kv, MODEL, committed)


def test_capacity_is_flagged_not_clamped():
    cache = CompressedKVCache.create(1, 2, capacity=6, window=2, block=3, slack=4, kv_heads=1, head_dim=2)
    cache = cache.advance(jnp.array([4, 4], jnp.int32)).advance(jnp.array([4, 1], jnp.int32))
    assert np.asarray(cache.lengths).tolist() == [8, 5] and not np.asarray(cache.status).any()
    over = cache.advance(jnp.array([4, 1], jnp.int32))  # row 0 would need a third memory slot
    assert np.asarray(over.lengths).tolist() == [8, 6] and np.asarray(over.status).tolist() == [1, 0]
    bad = cache.rollback(jnp.array([2, 5], jnp.int32))  # row 0 rolls back past the slack
    assert np.asarray(bad.lengths).tolist() == [8, 5] and np.asarray(bad.status).tolist() == [4, 0]


# ------------------------------------------------------------------ the engine on compressed layers


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(0, CFG.vocab_size, int(rng.integers(1, 12))).tolist()
        out.append((p[:2] * 6)[: len(p)] if i % 3 == 0 and len(p) >= 4 else p)  # some repetitive: n-gram hits
    return out


PROMPTS = _prompts(6, 3)
NEW = 40  # long enough for many block boundaries per row


@pytest.fixture(scope="module")
def plain():
    return generate(MODEL, PROMPTS, max_new_tokens=NEW, drafter=None).tokens


def test_plain_decoding_equals_the_uncached_greedy_loop(plain):
    seqs = np.zeros((len(PROMPTS), TMAX), np.int32)
    lens = [len(p) for p in PROMPTS]
    for b, p in enumerate(PROMPTS):
        seqs[b, : len(p)] = p
    for i in range(NEW):
        nxt = np.argmax(np.asarray(_oracle(seqs)), axis=-1)
        for b in range(len(PROMPTS)):
            seqs[b, lens[b] + i] = nxt[b, lens[b] + i - 1]
    assert [seqs[b, lens[b]: lens[b] + NEW].tolist() for b in range(len(PROMPTS))] == plain


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "mtp"])
@pytest.mark.parametrize("rule", ["per_sequence", "cohort"])
@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_speculative_greedy_equals_plain(plain, drafter, rule, cache):
    got = generate(MODEL, PROMPTS, max_new_tokens=NEW, drafter=drafter, draft_model=DRAFT, depth=3, kv_advance=rule,
                   cache=cache)
    assert got.tokens == plain
    if drafter != "mtp":  # the random MTP head accepts nothing; the others must exercise acceptance
        assert got.metrics["mean_accepted_drafts"] > 0.3


def test_per_sequence_rows_alone_equal_rows_in_the_batch():
    kw = dict(max_new_tokens=NEW, drafter="draft_model", draft_model=DRAFT, depth=3, kv_advance="per_sequence")
    batch = generate(MODEL, PROMPTS[:4], **kw)
    for i, p in enumerate(PROMPTS[:4]):
        alone = generate(MODEL, [p], **kw)
        assert alone.tokens[0] == batch.tokens[i]
        assert alone.metrics["row_accepted_trace"][0] == batch.metrics["row_accepted_trace"][i]


def test_sampled_rows_alone_equal_rows_in_the_batch_and_stream_matches():
    from specjax import stream

    kw = dict(max_new_tokens=20, drafter="draft_model", draft_model=DRAFT, depth=3, temperature=0.8)
    batch = generate(MODEL, PROMPTS[:3], seed=[1, 2, 3], **kw)
    alone = generate(MODEL, PROMPTS[1:2], seed=[2], **kw)
    assert alone.tokens[0] == batch.tokens[1]
    streamed = [[] for _ in range(3)]
    for chunk in stream(MODEL, PROMPTS[:3], seed=[1, 2, 3], **kw):
        for row, toks in enumerate(chunk.new_tokens):
            streamed[row] += toks
    assert streamed == batch.tokens


@pytest.mark.parametrize("chunk", [None, 3])
def test_batch_jobs_refill_compressed_rows(plain, chunk):
    reqs = [{"id": i, "prompt": p, "max_new_tokens": NEW} for i, p in enumerate(PROMPTS)]
    out = {c.id: c.tokens for c in batch_generate(MODEL, reqs, slots=2, drafter="ngram", depth=3,
                                                  prefill_chunk=chunk)}
    assert [out[i] for i in range(len(PROMPTS))] == plain


def test_init_model_random_compressed_model_runs_at_every_block_size():
    """Window smaller than the verify window, block 1 (every token pooled), block > window."""
    for window, block in ((1, 1), (2, 5), (6, 2)):
        cfg = dataclasses.replace(CFG, compressed_layers=(0, 1, 2, 3), sliding_window=None, global_every=0,
                                  compress_window=window, compress_block=block)
        model = sharp(cfg, seed=window + block)
        want = generate(model, PROMPTS[:3], max_new_tokens=20, drafter=None).tokens
        got = generate(model, PROMPTS[:3], max_new_tokens=20, drafter="ngram", depth=4, kv_advance="cohort")
        assert got.tokens == want, (window, block)
    assert init_model(cfg).config.global_layers == ()


def test_export_to_transformers_is_refused_naming_the_layers(tmp_path):
    from specjax.hf import save_hf_checkpoint

    with pytest.raises(ValueError, match=r"compressed-memory layers \[0, 3\]"):
        save_hf_checkpoint(MODEL, tmp_path)


def test_a_bundle_round_trips_the_compressed_config(tmp_path):
    from specjax.checkpoint import load_model, save_bundle

    model = init_model(dataclasses.replace(CFG, vocab_size=259), seed=3)  # bundles hold byte-level models
    save_bundle(tmp_path / "b", model, dtype="float32")
    loaded = load_model(tmp_path / "b").model
    assert loaded.config == model.config and loaded.config.compressed_layers == (0, 3)
    got = generate(loaded, PROMPTS[:2], max_new_tokens=12, drafter=None).tokens
    assert got == generate(model, PROMPTS[:2], max_new_tokens=12, drafter=None).tokens


# ------------------------------------------------------------------ token trees on compressed layers

# a raw window wide enough for a 5-token tree (window 8 >= 5): memory read only from committed blocks
TREE_CFG = dataclasses.replace(CFG, compress_window=8)
TREE_MODEL = sharp(TREE_CFG, seed=5)
TREE_DRAFT = noisy(TREE_MODEL, 0.3)


@pytest.mark.parametrize("drafter,rule,cache", [("draft_model", "per_sequence", "paged"), ("ngram", "cohort", "dense"),
                                                ("mtp", "per_sequence", "dense")])
def test_trees_on_compressed_layers_equal_plain(drafter, rule, cache):
    kw = dict(max_new_tokens=NEW, cache=cache)
    want = generate(TREE_MODEL, PROMPTS, drafter=None, **kw).tokens
    got = generate(TREE_MODEL, PROMPTS, drafter=drafter, draft_model=TREE_DRAFT, depth=3, tree="dynamic:4,2",
                   kv_advance=rule, **kw)
    assert got.tokens == want
    if drafter != "mtp":
        assert got.metrics["mean_accepted_drafts"] > 0.3


@pytest.mark.parametrize("tree,rule", [(None, "cohort"), ("dynamic:4,2", "per_sequence"), ("dynamic:4,2", "cohort")])
def test_engine_memory_after_a_run_holds_committed_tokens_only(tree, rule):
    """After speculative steps every counted memory slot, the target's and the draft model's,
    is the block mean of committed tokens alone. With a tree: its step writes the nodes in
    window order and pools the blocks the window completes; after the accepted path is
    compacted and pooled again no rejected node and no tree order is left in memory."""
    from specjax.engine import make_engine, prefill, request_capacity, step
    from specjax.tree import DynamicTree

    target, draft = (MODEL, DRAFT) if tree is None else (TREE_MODEL, TREE_DRAFT)
    eng = make_engine(target, drafter="draft_model", draft_model=draft, depth=3,
                      tree=None if tree is None else DynamicTree(4, 2), kv_advance_rule=kv_advance(rule),
                      cache="dense", capacity=request_capacity(16, 60, 4 if tree else 3))
    params = {"target": target.params, "draft": draft.params}
    prompts = np.zeros((3, 16), np.int32)
    plen = np.array([3, 9, 14], np.int32)
    rng = np.random.default_rng(4)
    for b in range(3):
        prompts[b, : plen[b]] = rng.integers(0, CFG.vocab_size, plen[b])
    st_ = prefill(eng, params, prompts, plen, plen + 60, np.full(3, -1, np.int32), np.zeros(3, np.uint32))
    for _ in range(12):
        st_ = step(eng, params, st_)
    assert int(np.sum(np.asarray(st_.accepted))) > 6
    seq = np.asarray(st_.seq)
    for part, model in ((st_.cache, target), (st_.dstate, draft)):  # target and draft model: both committed-only
        lengths = np.asarray(part.lengths)
        assert_memory_from_committed(part.memory_kv, model, [seq[b, : lengths[b]].tolist() for b in range(3)])


def test_a_tree_wider_than_the_raw_window_is_refused_before_compile():
    with pytest.raises(ValueError, match=r"tree=dynamic:6,2 verifies 7 tokens.*compress_window=4"):
        generate(MODEL, PROMPTS[:1], max_new_tokens=4, drafter="mtp", depth=3, tree="dynamic:6,2")
