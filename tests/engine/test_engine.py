"""The engine: token identity with plain decoding, batch invariance, the cohort control,
compile counts, lossless sampling, and input validation."""

import dataclasses
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.auto.policy import DepthPolicy
from specjax.drafters import DraftModelDrafter, MtpDrafter
from specjax.engine.loop import TRACES
from specjax.generation import generate
from specjax.model import logits

from engine_models import GLOBAL, SLIDING, TINY, chi2_pvalue, exact_continuations, noisy, sharp

MODELS = {"global": sharp(GLOBAL), "sliding": sharp(SLIDING, seed=1)}
DRAFTS = {name: noisy(m, 0.3) for name, m in MODELS.items()}
_PLAIN: dict = {}


def _prompts(batch, seed, vocab=31, lo=1, hi=8):
    rng = np.random.default_rng(seed)
    # a few repetitive prompts so the n-gram drafter has something to find
    out = []
    for i in range(batch):
        n = int(rng.integers(lo, hi + 1))
        p = rng.integers(0, vocab, n).tolist()
        if i % 3 == 0 and n >= 4:
            p = (p[:2] * n)[:n]
        out.append(p)
    return out


def _plain(model_name, prompts, cache, max_new):
    key = (model_name, str(prompts), cache, max_new)
    if key not in _PLAIN:
        _PLAIN[key] = generate(MODELS[model_name], prompts, max_new_tokens=max_new, drafter=None, cache=cache)
    return _PLAIN[key]


def _assert_identical(model, prompts, got, want) -> int:
    """Token identity, except at a proven numerical tie (top-2 gap < 1e-6); returns ties."""
    ties = 0
    for p, g, w in zip(prompts, got, want, strict=True):
        if g == w:
            continue
        i = next(i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b)
        lg = np.asarray(logits(model, np.array([p + w[:i]])))[0, -1]
        top = np.sort(lg)[-2:]
        assert top[1] - top[0] < 1e-6, f"mismatch at new token {i}: got {g}, want {w}"
        ties += 1
    return ties


# (model, drafter, rule, cache, depth, batch)
CASES = [
    ("global", "ngram", "per_sequence", "dense", 3, 7),
    ("global", "ngram", "cohort", "paged", 2, 7),
    ("global", "draft_model", "per_sequence", "paged", 4, 7),
    ("global", "draft_model", "cohort", "dense", 3, 7),
    ("global", "mtp", "per_sequence", "dense", 1, 7),
    ("global", "mtp", "cohort", "paged", 5, 7),
    ("sliding", "ngram", "per_sequence", "paged", 5, 7),
    ("sliding", "draft_model", "per_sequence", "dense", 2, 7),
    ("sliding", "draft_model", "cohort", "paged", 3, 7),
    ("sliding", "mtp", "cohort", "dense", 3, 7),
    ("global", "draft_model", "per_sequence", "dense", 3, 64),
]


@pytest.mark.parametrize("model_name,drafter,rule,cache,depth,batch", CASES)
def test_greedy_speculative_equals_plain(model_name, drafter, rule, cache, depth, batch):
    prompts = _prompts(batch, seed=batch + depth)
    want = _plain(model_name, prompts, cache, 24).tokens
    got = generate(MODELS[model_name], prompts, max_new_tokens=24, drafter=drafter, draft_model=DRAFTS[model_name],
                   depth=depth, kv_advance=rule, cache=cache)
    ties = _assert_identical(MODELS[model_name], prompts, got.tokens, want)
    assert ties <= 1, f"{ties} ties"
    assert all(len(t) == 24 for t in got.tokens)
    m = got.metrics
    assert m["drafter"] == drafter and m["depth"] == depth and m["kv_advance"] == rule
    assert m["tok_per_step"] >= 1.0
    if drafter == "draft_model":
        assert m["mean_accepted_drafts"] > 0.2  # the accept path really ran


@settings(max_examples=8)
@given(seed=st.integers(0, 10_000), rule=st.sampled_from(["per_sequence", "cohort"]),
       drafter=st.sampled_from(["ngram", "draft_model"]))
def test_greedy_identity_random_prompts(seed, rule, drafter):
    prompts = _prompts(5, seed)
    want = _plain("global", prompts, "dense", 16).tokens
    got = generate(MODELS["global"], prompts, max_new_tokens=16, drafter=drafter, draft_model=DRAFTS["global"],
                   depth=3, kv_advance=rule)
    assert _assert_identical(MODELS["global"], prompts, got.tokens, want) <= 1


def test_eos_stops_each_row_on_its_own():
    prompts = _prompts(6, 11)
    plain = _plain("global", prompts, "dense", 24).tokens
    eos = plain[0][5]  # a token the first row emits
    got = generate(MODELS["global"], prompts, max_new_tokens=24, drafter="draft_model",
                   draft_model=DRAFTS["global"], depth=3, eos_id=eos)
    for g, w in zip(got.tokens, plain, strict=True):
        cut = w.index(eos) + 1 if eos in w else len(w)
        assert g == w[:cut]


def test_per_sequence_rows_are_batch_invariant():
    prompts = _prompts(4, 3)
    kw = dict(max_new_tokens=20, drafter="draft_model", draft_model=DRAFTS["global"], depth=3,
              kv_advance="per_sequence")
    batch = generate(MODELS["global"], prompts, **kw)
    for i, p in enumerate(prompts):
        alone = generate(MODELS["global"], [p], **kw)
        assert alone.tokens[0] == batch.tokens[i]
        assert alone.metrics["row_accepted_trace"][0] == batch.metrics["row_accepted_trace"][i]


def test_cohort_same_tokens_fewer_tokens_per_step():
    prompts = _prompts(8, 21)
    kw = dict(max_new_tokens=24, drafter="draft_model", draft_model=DRAFTS["global"], depth=3)
    ps = generate(MODELS["global"], prompts, kv_advance="per_sequence", **kw)
    co = generate(MODELS["global"], prompts, kv_advance="cohort", **kw)
    assert co.tokens == ps.tokens
    assert co.metrics["tok_per_step"] < ps.metrics["tok_per_step"]  # control: the min costs tokens


def test_finished_rows_do_not_hold_back_the_cohort():
    """A row done after prefill must not set the cohort minimum for the rows still running."""
    kw = dict(max_new_tokens=20, drafter="draft_model", draft_model=DRAFTS["global"], depth=3, kv_advance="cohort")
    a = _prompts(1, 30)[0]
    a_tokens = _plain("global", [a], "dense", 20).tokens[0]
    cands = _prompts(12, 31)
    firsts = _plain("global", cands, "dense", 20).tokens
    b, eos = next((p, t[0]) for p, t in zip(cands, firsts, strict=True) if t[0] not in a_tokens)
    alone = generate(MODELS["global"], [a], eos_id=eos, **kw)
    pair = generate(MODELS["global"], [a, b], eos_id=eos, **kw)
    assert pair.tokens == [a_tokens, [eos]]
    assert pair.metrics["row_accepted_trace"][0] == alone.metrics["row_accepted_trace"][0]
    assert pair.metrics["row_steps"][1] == 0


def test_one_compile_per_static_config():
    kw = dict(drafter="ngram", depth=2, kv_advance="per_sequence", cache="paged")
    first = generate(MODELS["global"], _prompts(3, 1, hi=8), max_new_tokens=10, **kw)
    again = generate(MODELS["global"], _prompts(3, 2, hi=8), max_new_tokens=17, seed=[4, 5, 6], eos_id=3, **kw)
    assert first.metrics["compiles"] == 1
    assert again.metrics["compiles"] == 0  # new prompts, budget, seeds, EOS: data, not a recompile
    other = generate(MODELS["global"], _prompts(3, 2, hi=8), max_new_tokens=10, **(kw | {"depth": 3}))
    assert other.metrics["compiles"] == 1
    # compile and run are timed apart: a cached loop reports no compile time
    assert first.metrics["seconds_compile"] > 0 and again.metrics["seconds_compile"] == 0.0
    n_new = sum(len(t) for t in again.tokens)
    assert again.metrics["tok_per_s"] == pytest.approx(n_new / again.metrics["seconds_run"])
    # sampling settings are data too: a new temperature, top-k or top-p is no recompile
    hot = generate(MODELS["global"], _prompts(3, 2, hi=8), max_new_tokens=10, temperature=0.7, **kw)
    warm = generate(MODELS["global"], _prompts(3, 2, hi=8), max_new_tokens=10, temperature=1.3, top_k=4, top_p=0.9,
                    **kw)
    assert hot.metrics["compiles"] == 1 and warm.metrics["compiles"] == 0


def test_every_engine_cache_carries_row_lengths_and_a_flax_decode_cache_does_not():
    """The per-sequence rule needs a length per row in every cache the engine touches: target
    (dense or paged global layers, rolling local ones), draft model and MTP. A Flax decode
    cache keeps one ``cache_index`` for the batch and is refused, naming it."""
    import flax.linen as nn
    import jax

    from specjax.advance import KvAdvance
    from specjax.cache import cache_supports_per_sequence_advance
    from specjax.engine import make_engine, prefill

    for cache in ("dense", "paged"):
        for drafter in ("mtp", "draft_model"):
            model = MODELS["sliding"]
            eng = make_engine(model, drafter=drafter, draft_model=DRAFTS["sliding"], depth=2,
                              kv_advance_rule=KvAdvance.PER_SEQUENCE, cache=cache, capacity=128)
            params = {"target": model.params, "draft": DRAFTS["sliding"].params}
            st = prefill(eng, params, np.ones((3, 8), np.int32), np.array([2, 5, 8], np.int32),
                         np.array([20] * 3, np.int32), np.full(3, -1, np.int32), np.zeros(3, np.uint32))
            for part in (st.cache, st.dstate if drafter == "draft_model" else st.dstate.cache):
                assert cache_supports_per_sequence_advance(part) is None, (cache, drafter)
            assert st.cache.local_kv is not None and st.cache.global_kv is not None
    attn = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, decode=True)
    x = np.zeros((3, 5, 8), np.float32)
    flax_cache = attn.init(jax.random.key(0), x, x)["cache"]
    msg = cache_supports_per_sequence_advance({"layer0": flax_cache})
    assert msg is not None and "cache['layer0']" in msg and "'cache_index' has shape ()" in msg, msg


# ------------------------------------------------------------------ lossless sampling


@pytest.fixture(scope="module")
def tiny():
    target = sharp(TINY, seed=3, s_emb=2.0, s_head=6.0)
    return target, noisy(target, 1.0, seed=9)


# depth="auto" with the EMA rule and a high prior: rows rejected early draft fewer than their
# neighbours inside one window (per-row draft counts: fill off), others keep the widest
AUTO = DepthPolicy((1, 2, 3), rule="ema", prior=0.7, threshold=0.6, rate=0.25, fill=False)


@pytest.mark.parametrize("drafter,temperature,top_p,depth", [
    (None, 1.0, None, 2), ("draft_model", 1.0, None, 2), ("draft_model", 1.0, 0.9, 2), ("ngram", 1.0, 0.9, 2),
    ("draft_model", 1.0, 0.9, AUTO),
])
def test_speculative_sampling_matches_the_target_distribution(tiny, drafter, temperature, top_p, depth):
    """Chi-square over 20,000 3-token continuations vs the exact enumerated distribution
    (alpha = 1e-3, fixed seeds: deterministic)."""
    target, draft = tiny
    prompt = [1, 2, 0]
    exact = exact_continuations(target, prompt, 3, temperature, top_p or 1.0)
    rows, calls = 2000, 10
    samples = []
    for c in range(calls):
        r = generate(target, [prompt] * rows, max_new_tokens=3, drafter=drafter, draft_model=draft, depth=depth,
                     temperature=temperature, top_p=top_p, seed=list(range(c * rows, (c + 1) * rows)))
        samples += r.tokens
        if depth is AUTO:  # the policy did vary the draft counts
            assert 0 < r.metrics["proposed_drafts"] < 2 * r.metrics["total_row_steps"]
    assert chi2_pvalue(samples, exact) > 1e-3


def test_sampling_rows_are_batch_invariant_and_seeded(tiny):
    target, draft = tiny
    kw = dict(max_new_tokens=6, drafter="draft_model", draft_model=draft, depth=2, temperature=1.0)
    batch = generate(target, [[1, 2], [1, 2], [3]], seed=[7, 8, 9], **kw)
    alone = generate(target, [[1, 2]], seed=[8], **kw)
    assert alone.tokens[0] == batch.tokens[1]
    many = generate(target, [[1, 2]] * 16, seed=list(range(16)), **kw)
    assert len({tuple(t) for t in many.tokens}) > 4  # different seeds, different samples


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=[]), r"prompts=\[\] is invalid: must be a non-empty list"),
        (dict(prompts=[[1], []]), r"prompts\[1\]=\[\] is invalid: a prompt must hold at least one token"),
        (dict(prompts=[[1, 31]]), r"prompts\[0\]\[1\]=31 is invalid: token ids must lie in \[0, 31\)"),
        (dict(max_new_tokens=60), r"prompt length 5 \(prompts\[0\]\) \+ max_new_tokens must be <= the model's "
                                  r"max_seq_len=64: at most 59 new tokens fit"),
        (dict(prompts=[[1], [2] * 64]), r"prompts\[1\]='64 tokens' is invalid: the model's context is max_seq_len=64 "
                                        r"tokens: a prompt may hold at most 63"),
        (dict(prompts=[1, 2, 3]), r"prompts=\[1, 2, 3\] is invalid: is one flat list of ints: pass a list of prompts"),
        (dict(prompts=[[1], 5]), r"prompts\[1\]=5 is invalid: must be a list of int token ids"),
        (dict(temperature=float("nan")), r"temperature=nan is invalid: must be a finite float >= 0"),
        (dict(depth=0), r"depth=0 is invalid: must be an int in \[1, 8\]"),
        (dict(depth=9), r"depth=9 is invalid"),
        (dict(drafter="eagle"), r"drafter='eagle' is invalid: must be one of \['auto', 'mtp', 'draft_model',"),
        (dict(cache="ring"), r"cache='ring' is invalid: must be 'dense' or 'paged'"),
        (dict(kv_advance="min"), r"kv_advance='min' is invalid: must be 'per_sequence', 'cohort' or None"),
        (dict(drafter="draft_model", draft_model=sharp(TINY)), r"draft_model='vocab_size 4' is invalid"),
        (dict(drafter="draft_model"), r"draft_model=None is invalid: drafter='draft_model' needs a draft model"),
        (dict(top_p=0.0), r"top_p=0.0 is invalid: must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 is invalid"),
        (dict(temperature=-1.0), r"temperature=-1.0 is invalid: must be a finite float >= 0"),
        (dict(seed=[1, 2]), r"seed=\[1, 2\] is invalid: must be an int in \[0, 2\*\*32\) or one per prompt"),
    ],
)
def test_bad_input_is_rejected_before_compile(kwargs, match):
    before = TRACES["generate"]
    args = dict(prompts=[[1, 2, 3, 4, 5]], max_new_tokens=4, drafter="ngram") | kwargs
    prompts = args.pop("prompts")
    with pytest.raises(ValueError, match=match):
        generate(MODELS["global"], prompts, **args)
    assert TRACES["generate"] == before


def _prefilled(drafter, rule, prompts, budget=30, model=None, **kw):
    """An engine for the global model (or ``model``) and its state after prefill (the public step API)."""
    import jax.numpy as jnp

    from specjax.advance import KvAdvance
    from specjax.engine import make_engine, prefill

    model = MODELS["global"] if model is None else model
    eng = make_engine(model, drafter=drafter, draft_model=None, depth=3, kv_advance_rule=KvAdvance(rule),
                      cache="dense", **kw)
    params = {"target": model.params}
    toks = np.zeros((len(prompts), 8), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    st = prefill(eng, params, jnp.asarray(toks), jnp.asarray(plen), jnp.asarray(plen + budget),
                 jnp.full((len(prompts),), -1), jnp.arange(len(prompts), dtype=jnp.uint32))
    return eng, params, st


def test_public_step_is_one_compile_across_steps():
    from specjax.engine import step

    eng, params, st = _prefilled("ngram", "cohort", [[1, 2, 3, 1, 2, 3], [5, 6]], ngram_n=2)
    before = step._cache_size()
    for _ in range(5):
        st = step(eng, params, st)
    assert step._cache_size() == before + 1
    assert int(st.i) == 5 and (np.asarray(st.known) > np.array([7, 3])).all()


@pytest.mark.parametrize("rule", ["per_sequence", "cohort"])
def test_mtp_first_draft_matches_uncached_mtp(rule):
    """The MTP drafter's per-row cache stays exact: after every step its first draft equals
    the MTP head run without a cache over the row's whole known sequence."""
    import jax.numpy as jnp

    from specjax.engine import step
    from specjax.model import hidden_states, mtp_forward

    model = MODELS["global"]
    prompts = _prompts(3, 41, hi=8)
    eng, params, st = _prefilled("mtp", rule, prompts)
    for _ in range(4):
        seq, known = np.asarray(st.seq), np.asarray(st.known)
        for b in range(3):
            s = seq[b, : known[b]][None]
            _, h = hidden_states(model, s)
            k = known[b]
            lg, g, _ = mtp_forward(model.params, model.config, h[:, : k - 1], s[:, 1:k],
                                   jnp.arange(k - 1, dtype=jnp.int32)[None])
            np.testing.assert_allclose(np.asarray(st.dstate.h[b]), np.asarray(g)[0, -1], atol=1e-4)
            assert int(np.argmax(np.asarray(lg)[0, -1])) == int(st.dstate.first[b])
        st = step(eng, params, st)
    assert int(np.asarray(st.cache.lengths).min()) > min(len(p) for p in prompts)


@dataclasses.dataclass(frozen=True)
class _ProtocolOnlyMtp:
    """A decoder with the protocol's ``mtp_hidden`` but no ``mtp_hidden_at`` (a model of one's own)."""

    inner: object

    def __getattr__(self, name):
        if name == "mtp_hidden_at":
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclasses.dataclass(frozen=True)
class _ShortBlockCache(MtpDrafter):
    """The MTP block's cache sized to the prompt only: its first commit cannot be written."""

    def empty(self, eng, batch, width, capacity=None):
        return super().empty(eng, batch, width, capacity=width if capacity is None else capacity)


@dataclasses.dataclass(frozen=True)
class _ShortDraftCache(DraftModelDrafter):
    """The draft model's cache sized to the prompt only: its first proposal cannot be written."""

    def empty(self, eng, batch, width):
        return eng.draft.init_cache(batch, width, kind="dense", slack=0, page_size=16, num_pages=None)


@pytest.mark.parametrize("drafter,short",
                         [(MtpDrafter(), _ShortBlockCache()), (DraftModelDrafter(), _ShortDraftCache())])
def test_a_write_the_drafters_own_cache_refused_is_an_error_not_silent(drafter, short):
    """The drafter's cache (the MTP block's, a draft model's) flags a refused write as the
    target's does; ``generate`` raises naming the rows instead of returning tokens drafted from
    a stale cache."""
    prompts = _prompts(2, 44, hi=8)
    kw = dict(max_new_tokens=6, draft_model=DRAFTS["global"], depth=2)
    ok = generate(MODELS["global"], prompts, drafter=drafter, **kw)
    assert [len(t) for t in ok.tokens] == [6, 6]
    with pytest.raises(RuntimeError, match=r"refused a write or advance.*rows \{0: \['capacity exceeded'\]"):
        generate(MODELS["global"], prompts, drafter=short, **kw)


def test_mtp_drafter_on_a_model_without_the_one_slot_block_drafts_the_same():
    """Without ``mtp_hidden_at`` the drafter runs the block at every slot and keeps one: the
    block's state (hidden, first draft, cache) and the tokens equal the one-slot block's."""
    from specjax.engine import step

    model = MODELS["global"]
    own = types.SimpleNamespace(params=model.params, decoder=_ProtocolOnlyMtp(model.decoder))
    prompts = _prompts(3, 43, hi=8)
    (e1, p1, s1), (e2, p2, s2) = (_prefilled("mtp", "per_sequence", prompts, model=m) for m in (model, own))
    assert hasattr(e1.target, "mtp_hidden_at") and not hasattr(e2.target, "mtp_hidden_at")
    for _ in range(4):
        s1, s2 = step(e1, p1, s1), step(e2, p2, s2)
        np.testing.assert_array_equal(s1.seq, s2.seq)
        np.testing.assert_array_equal(s1.dstate.first, s2.dstate.first)
        np.testing.assert_allclose(np.asarray(s1.dstate.h), np.asarray(s2.dstate.h), atol=1e-5)
        np.testing.assert_array_equal(s1.dstate.cache.lengths, s2.dstate.cache.lengths)
