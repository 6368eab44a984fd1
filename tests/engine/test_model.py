"""The model's cached, per-row forward against its plain full-prefix forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.cache import DenseKVCache
from specjax.model import (
    ModelConfig,
    forward,
    hidden_states,
    init_cache,
    init_model,
    logits,
    mtp_forward,
    mtp_hidden,
    with_layer_loop,
)

W = 4  # verify window
PROMPTS = np.array([5, 9, 2], np.int32)
B, T_PROMPT, STEPS = 3, 9, 6
SEQ = T_PROMPT + W * STEPS + W

CONFIGS = {
    "global": ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64),
    "local": ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=64, max_seq_len=64,
                         sliding_window=5, tie_embeddings=False),
    "interleaved": ModelConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=2, n_kv_heads=2, d_ff=48,
                               max_seq_len=64, sliding_window=4, global_every=2, qkv_bias=True),
    # local, global, local, global, local: under the layer scan two periods scan, the fifth unrolls
    "deep": ModelConfig(vocab_size=61, d_model=32, n_layers=5, n_heads=2, n_kv_heads=1, d_ff=48, max_seq_len=64,
                        sliding_window=4, global_every=2, qkv_bias=True),
}

_forward = jax.jit(forward, static_argnums=1)


def _bias(model):
    """Non-zero q/k/v biases so the bias path is exercised."""
    if not model.config.qkv_bias:
        return model
    params = jax.tree.map(lambda x: x, model.params)
    for i, p in enumerate(params["layers"]):
        p["bqkv"] = jax.random.normal(jax.random.key(i), p["bqkv"].shape) * 0.1
    return model.replace(params=params)


def _verify_steps(model, seq, full, cache, rng):
    """Verify-like steps: every row feeds W tokens of ``seq`` at its own length (logits must
    match the full prefix ``full``) and commits its own random count; no status bit set."""
    for _ in range(STEPS):
        idx = np.asarray(cache.lengths)[:, None] + np.arange(W)[None]
        out, _, cache = _forward(model.params, model.config, np.take_along_axis(seq, idx, 1), idx.astype(np.int32),
                                 cache.reserve(W))
        for b in range(B):
            np.testing.assert_allclose(np.asarray(out)[b], full[b, idx[b]], atol=1e-5)
        cache = cache.advance(rng.integers(1, W + 1, B).astype(np.int32))
    assert (np.asarray(cache.status) == 0).all()
    return cache


@pytest.mark.parametrize("name,kind,loop", [("global", "dense", "unrolled"), ("global", "paged", "unrolled"),
                                            ("local", "dense", "unrolled"), ("interleaved", "paged", "unrolled"),
                                            ("global", "dense", "scan"), ("global", "paged", "scan"),
                                            ("deep", "dense", "scan"), ("deep", "paged", "scan")])
def test_cached_ragged_forward_matches_full_prefix(name, kind, loop):
    """The cached forward (under ``loop``: stacked params and caches for the scan) against the
    full prefix of the listed params (the unrolled loop)."""
    cfg = CONFIGS[name]
    model = _bias(init_model(cfg, seed=1))
    rng = np.random.default_rng(0)
    seq = rng.integers(0, cfg.vocab_size, (B, SEQ)).astype(np.int32)
    full = np.asarray(logits(model, seq))
    model = with_layer_loop(model, loop)
    cache = init_cache(cfg, B, SEQ, kind=kind, slack=T_PROMPT + 1, page_size=4, stacked=loop == "scan")
    # prefill: prompts of different lengths in one call, right-padded
    tok = np.where(np.arange(T_PROMPT)[None] < PROMPTS[:, None], seq[:, :T_PROMPT], 0)
    pos = np.broadcast_to(np.arange(T_PROMPT, dtype=np.int32), (B, T_PROMPT))
    out, _, cache = _forward(model.params, cfg, tok, pos, cache.reserve(T_PROMPT))
    for b in range(B):
        np.testing.assert_allclose(np.asarray(out)[b, : PROMPTS[b]], full[b, : PROMPTS[b]], atol=1e-5)
    cache = _verify_steps(model, seq, full, cache.advance(PROMPTS), rng)
    assert len(set(np.asarray(cache.lengths).tolist())) > 1  # rows really are ragged


def test_sliding_window_changes_the_output():
    """Control: the local model really uses its window (else the test above proves little)."""
    cfg = CONFIGS["local"]
    model = init_model(cfg, seed=1)
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 20)).astype(np.int32)
    wide = init_model(ModelConfig(**(cfg.to_dict() | {"sliding_window": None})), seed=1)
    a, b = np.asarray(logits(model, seq)), np.asarray(logits(wide.replace(params=model.params), seq))
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-5)
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-4


def test_mtp_cached_matches_uncached():
    cfg = CONFIGS["global"]
    model = init_model(cfg, seed=2)
    seq = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, 12)).astype(np.int32)
    _, hid = hidden_states(model, seq)
    pos = np.broadcast_to(np.arange(11, dtype=np.int32), (B, 11))
    ref, _, _ = mtp_forward(model.params, cfg, hid[:, :11], seq[:, 1:], pos)
    assert ref.shape == (B, 11, cfg.vocab_size)
    cache = DenseKVCache.create(1, B, 16, cfg.n_kv_heads, cfg.head_dim)
    got = []
    for s in range(0, 11, 4):
        e = min(s + 4, 11)
        out, _, cache = mtp_forward(model.params, cfg, hid[:, s:e], seq[:, s + 1 : e + 1], pos[:, s:e], cache)
        cache = cache.advance(e - s)
        got.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(got, axis=1), np.asarray(ref), atol=1e-5)


_MTP_CFG = CONFIGS["global"]
_MTP_MODEL = init_model(_MTP_CFG, seed=2)


@jax.jit
def _mtp_both(hid, nxt, pos, cache, at):
    """(every slot's output, its cache) and (slot ``at`` only, its cache) over the same inputs."""
    p = _MTP_MODEL.params
    return mtp_hidden(p, _MTP_CFG, hid, nxt, pos, cache), mtp_hidden(p, _MTP_CFG, hid, nxt, pos, cache, at=at)


@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 6), data=st.data())
def test_mtp_block_at_one_slot_equals_that_slot_of_the_full_block(t, data):
    """``mtp_hidden(at=)`` (what a commit or settle reads: one slot per row) equals that slot of
    the block run at every slot and writes the same K/V up to it, over ragged per-row lengths;
    the slots after it (padding, rejected drafts) keep what the cache held."""
    cfg, b, cap = _MTP_CFG, 4, 16
    lengths = np.asarray(data.draw(st.lists(st.integers(0, cap - t), min_size=b, max_size=b)), np.int32)
    at = np.asarray(data.draw(st.lists(st.integers(0, t - 1), min_size=b, max_size=b)), np.int32)
    rng = np.random.default_rng(t)
    cache = DenseKVCache.create(1, b, cap, cfg.n_kv_heads, cfg.head_dim)  # earlier positions: random K/V
    noise = lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype)  # noqa: E731
    cache = cache.replace(k=jax.tree.map(noise, cache.k), v=jax.tree.map(noise, cache.v), lengths=jnp.asarray(lengths))
    hid = rng.normal(size=(b, t, cfg.d_model)).astype(np.float32)
    nxt = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    pos = lengths[:, None] + np.arange(t, dtype=np.int32)[None]
    (full, c_full), (one, c_one) = _mtp_both(hid, nxt, pos, cache, at)
    assert one.shape == (b, cfg.d_model)
    np.testing.assert_allclose(np.asarray(one), np.asarray(full)[np.arange(b), at], atol=1e-5)
    np.testing.assert_array_equal(c_one.lengths, lengths)  # written, not advanced
    upto = (np.arange(cap)[None] <= (lengths + at)[:, None])[:, None, :, None]  # [B, 1, cap, 1]: written
    before = jax.tree.leaves((cache.k, cache.v))
    for x, y, z in zip(jax.tree.leaves((c_one.k, c_one.v)), jax.tree.leaves((c_full.k, c_full.v)), before, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.where(upto, np.asarray(y), np.asarray(z)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_heads=3), r"n_heads=3 must be a multiple of n_kv_heads=2"),
        (dict(d_model=30, head_dim=None), r"d_model=30 must be a multiple of n_heads=4"),  # head_dim derived
        (dict(vocab_size=0), r"vocab_size must be an int >= 1, got 0"),
        (dict(sliding_window=0), r"sliding_window must be >= 1"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**(CONFIGS["global"].to_dict() | kwargs))


def test_head_dim_is_one_concrete_field():
    derived = ModelConfig(**(CONFIGS["global"].to_dict() | {"head_dim": None}))
    assert derived.head_dim == derived.d_model // derived.n_heads
    assert ModelConfig(**derived.to_dict()) == derived  # a saved config round-trips
    wide = ModelConfig(**(CONFIGS["global"].to_dict() | {"d_model": 30, "head_dim": 8}))  # HF-style explicit size
    assert wide.head_dim == 8


def test_init_cache_rejects_unknown_kind():
    with pytest.raises(ValueError, match=r"cache kind must be 'dense' or 'paged', got 'ring'"):
        init_cache(CONFIGS["global"], 2, 16, kind="ring")
    c = init_cache(CONFIGS["interleaved"], 2, 16)
    assert len(c.global_kv.k) == 1 and len(c.local_kv.k) == 2
    assert jnp.all(c.lengths == 0)


@pytest.mark.parametrize("name", ["local", "interleaved"])
def test_a_bounded_prefill_wider_than_the_ring(name):
    """The ring holds window + slack slots, fewer than the prompt: the prefill attends through
    ``write_attend`` and keeps each row's own last real positions (right padding is never
    written), then verify-like steps match the full prefix."""
    cfg = CONFIGS[name]
    model = _bias(init_model(cfg, seed=3))
    rng = np.random.default_rng(2)
    width, prompts = 20, np.array([20, 13, 3], np.int32)
    seq = rng.integers(0, cfg.vocab_size, (B, width + W * STEPS + W)).astype(np.int32)
    full = np.asarray(logits(model, seq))
    cache = init_cache(cfg, B, seq.shape[1], kind="paged" if cfg.global_layers else "dense", slack=W, page_size=4)
    assert cache.local_kv.size < width
    tok = np.where(np.arange(width)[None] < prompts[:, None], seq[:, :width], 0)
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), (B, width))
    out, _, cache = _forward(model.params, cfg, tok, pos, cache.reserve(width).bound_write(prompts))
    for b in range(B):
        np.testing.assert_allclose(np.asarray(out)[b, : prompts[b]], full[b, : prompts[b]], atol=1e-5)
    _verify_steps(model, seq, full, cache.advance(prompts), rng)


def _per_layer_loop(model, tokens):
    """Oracle for the layer scan: a Python loop over layers with static indices."""
    from specjax.model.layers import block_finish, block_qkv, causal_attention, embed, head
    from specjax.model.layout import layer_params

    cfg, params = model.config, model.params
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = embed(params, cfg, tokens)
    for i in range(cfg.n_layers):
        p = layer_params(params, i)
        q, k, v = block_qkv(p, x, pos, cfg, i)
        x = block_finish(p, x, causal_attention(q, k, v, cfg.sliding_window if cfg.is_local(i) else None), cfg)
    return head(params, cfg, x)


def _depth(name, n_layers):
    return ModelConfig(**{**CONFIGS[name].to_dict(), "n_layers": n_layers})


@pytest.mark.parametrize("name", ["global", "deep"])
def test_layer_scan_matches_a_per_layer_loop(name):
    """Every layer in the scan reads its own params and RoPE: the uncached forward of the
    stacked params equals a loop over layers with static indices (the cached forward is held
    to the uncached one above), and the layouts convert back and forth exactly."""
    model = _bias(init_model(_depth(name, 7), seed=4))
    tokens = np.random.default_rng(5).integers(0, 61, (2, 12)).astype(np.int32)
    want = np.asarray(_per_layer_loop(model, tokens))
    scan = with_layer_loop(model, "scan")
    assert isinstance(scan.params["layers"], dict) and scan.params["layers"]["wqkv"].shape[0] == 7
    np.testing.assert_allclose(np.asarray(logits(scan, tokens)), want, atol=1e-5)
    back = with_layer_loop(scan, "unrolled")
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _scans(jaxpr) -> list[int]:
    """Lengths of the top-level ``scan``s of a jaxpr."""
    return [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]


@pytest.mark.parametrize("name,period", [("global", 1), ("deep", 2)])
def test_the_scan_program_does_not_grow_with_depth(name, period):
    """Stacked params run the layers as one ``lax.scan`` over periods of layers: 4x the depth,
    the same program; listed params trace every layer (the program grows)."""
    sizes: dict = {"scan": [], "unrolled": []}
    for n_layers in (2 * period + 1, 8 * period + 1):
        cfg = _depth(name, n_layers)
        tokens = jnp.zeros((2, 8), jnp.int32)
        for loop, scans in (("scan", [n_layers // period]), ("unrolled", [])):
            model = with_layer_loop(init_model(cfg), loop)
            assert _scans(jax.make_jaxpr(logits)(model, tokens).jaxpr) == scans
            step = jax.make_jaxpr(lambda p, t, c, cfg=cfg: forward(p, cfg, t, jnp.zeros((2, 1), jnp.int32), c))
            cache = init_cache(cfg, 2, 16, stacked=loop == "scan")
            assert _scans(step(model.params, tokens[:, :1], cache).jaxpr) == scans
            sizes[loop].append(len(jax.jit(logits).lower(model, tokens).as_text()))
    assert sizes["scan"][1] < 1.1 * sizes["scan"][0], sizes
    assert sizes["unrolled"][1] > 2 * sizes["unrolled"][0], sizes  # what the scan saves


def test_layouts_must_match():
    model = with_layer_loop(init_model(CONFIGS["global"]), "scan")
    tok = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"laid out for layer_loop='scan' but the cache is not stacked"):
        forward(model.params, model.config, tok, tok, init_cache(model.config, 1, 8))
    with pytest.raises(ValueError, match=r"layer_loop='loop' is invalid: must be one of \['unrolled', 'scan'\]"):
        with_layer_loop(model, "loop")
