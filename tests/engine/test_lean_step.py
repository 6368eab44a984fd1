"""The lean decode step: attention inside the model on both paths, request-sized caches,
a donated step, status surfaced.

The Pallas path runs in interpret mode here (CPU); it must give the very tokens of the
XLA path for every cache kind (dense, paged, rolling), both rules and every drafter.
"""

import re

import numpy as np
import pytest

import specjax.engine as engine_mod
from specjax import generate, generation, stream
from specjax.advance import KvAdvance
from specjax.engine import make_engine, request_capacity
from specjax.engine.loop import TRACES
from specjax.model import ModelConfig, with_layer_loop

from engine_models import noisy, sharp

SMALL = ModelConfig(vocab_size=31, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
                    tie_embeddings=False)
# local, global, local, global: under the layer scan two periods run over the ring and the global cache
SMALL_SLIDING = ModelConfig(vocab_size=31, d_model=32, n_layers=4, n_heads=4, n_kv_heads=1, d_ff=64, max_seq_len=64,
                            tie_embeddings=False, sliding_window=5, global_every=2)
MODELS = {"global": sharp(SMALL, seed=3), "sliding": sharp(SMALL_SLIDING, seed=4)}
DRAFTS = {k: noisy(m, 0.3, seed=9) for k, m in MODELS.items()}


def _prompts(n, seed, lo=2, hi=9):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 31, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _run(kind, cache, drafter, rule, impl, prompts, max_new=10):
    """The Pallas path runs the target as the layer scan (the kernels read a traced layer of
    the stacked caches in place; a draft model stays unrolled); the XLA path unrolled."""
    model = with_layer_loop(MODELS[kind], "scan" if impl == "pallas" else "unrolled")
    return generate(model, prompts, max_new_tokens=max_new, drafter=drafter, depth=3, kv_advance=rule, cache=cache,
                    draft_model=DRAFTS[kind] if drafter == "draft_model" else None, attention_impl=impl, ngram_n=2)


# (model, global cache kind): dense, paged, and the rolling ring beside a dense global layer
KINDS = [("global", "dense"), ("global", "paged"), ("sliding", "dense")]


@pytest.mark.parametrize("drafter", ["mtp", "draft_model", "ngram"])
@pytest.mark.parametrize("kind,cache", KINDS)
def test_pallas_and_xla_attention_give_identical_tokens(kind, cache, drafter):
    """The whole engine with ``attention_impl="pallas"`` (every cache kind's kernel, interpret
    mode, inside the layer scan) is token-identical to the XLA path, under both rules."""
    prompts = _prompts(3, 17)
    for rule in ("per_sequence", "cohort"):
        xla = _run(kind, cache, drafter, rule, "xla", prompts)
        pal = _run(kind, cache, drafter, rule, "pallas", prompts)
        assert pal.tokens == xla.tokens, (rule, pal.tokens, xla.tokens)
        assert pal.metrics["row_accepted_trace"] == xla.metrics["row_accepted_trace"]


def test_plain_decoding_is_identical_on_both_paths():
    prompts = _prompts(2, 5)
    a = _run("sliding", "paged", None, "per_sequence", "xla", prompts, max_new=12)
    b = _run("sliding", "paged", None, "per_sequence", "pallas", prompts, max_new=12)
    assert a.tokens == b.tokens


def test_capacity_follows_the_request_not_the_declared_context():
    """The same weights declared at 8192 positions and at 64 build the same engine shapes
    (and decode the same tokens): the model's max_seq_len is only a validation bound."""
    import dataclasses

    small = MODELS["global"]
    big = small.replace(config=dataclasses.replace(small.config, max_seq_len=8192))
    prompts = _prompts(2, 7)
    a = generate(small, prompts, max_new_tokens=9, drafter="ngram", ngram_n=2)
    b = generate(big, prompts, max_new_tokens=9, drafter="ngram", ngram_n=2)
    assert a.tokens == b.tokens
    eng = make_engine(big, drafter="mtp", draft_model=None, depth=3, kv_advance_rule=KvAdvance.COHORT,
                      cache="dense", greedy=True,
                      capacity=request_capacity(8, 9, 3))
    st = engine_mod.prefill(eng, {"target": big.params}, np.ones((2, 8), np.int32), np.array([3, 8], np.int32),
                            np.array([12, 17], np.int32), np.full(2, -1, np.int32), np.zeros(2, np.uint32))
    assert st.cache.global_kv.k[0].shape == (2, big.config.n_kv_heads, 128, big.config.head_dim)
    assert st.seq.shape == (2, 128) and st.dstate.cache.capacity == 128


def test_request_capacity_buckets():
    assert request_capacity(8, 9, 3) == 128  # 8 + 9 + 7 = 24 -> one 128 bucket
    assert request_capacity(8, 9, 3, bucket=False) == 24
    assert request_capacity(200, 64, 0, bucket=False) == 265
    assert request_capacity(200, 64, 0) == 384
    assert request_capacity(4096, 64, 3) == 5120  # above 1024: eight buckets per octave (1024 apart here)
    for n in (1, 100, 1000, 5000, 70000):
        c = request_capacity(n, 1, 0)
        assert c >= n + 1 and c % 128 == 0 and c <= (n + 1) * 1.25 + 128


def test_nearby_requests_share_one_compile():
    """max_new_tokens 9 and 11 fall in one capacity bucket: no recompile."""
    prompts = _prompts(2, 3)
    generate(MODELS["global"], prompts, max_new_tokens=9, drafter="ngram", ngram_n=2)
    r = generate(MODELS["global"], prompts, max_new_tokens=11, drafter="ngram", ngram_n=2)
    assert r.metrics["compiles"] == 0


@pytest.mark.parametrize("cache", ["paged", "dense"])
def test_exact_capacity_suffices_at_the_boundary(cache, monkeypatch):
    """Unbucketed capacity (exactly ``request_capacity(..., bucket=False)`` slots) never makes
    a cache refuse a write: finished rows keep receiving masked writes at ``max_len - 1`` and a
    draft model reserves ``2w`` past it. Tokens equal the bucketed run's."""
    model, draft = MODELS["global"], DRAFTS["global"]
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [3], [4, 5], [9, 9, 9, 1, 2]]
    kw = dict(max_new_tokens=13, drafter="draft_model", draft_model=draft, depth=3, cache=cache)
    ref = generate(model, prompts, **kw)
    exact = engine_mod.request_capacity
    monkeypatch.setattr(engine_mod, "request_capacity", lambda *a, **k: exact(*a, bucket=False))
    out = generate(model, prompts, **kw)  # raises RuntimeError if any cache status bit is set
    assert out.tokens == ref.tokens


def test_capacity_is_exact_for_a_finished_row_under_a_draft_model():
    """The tight case of ``request_capacity``: a row finished at ``max_len - 1`` (here at
    prefill: one new token) whose paged draft-model cache still reserves ``2w`` every step
    while another row decodes. One slot fewer and its page budget is exceeded."""
    import jax.numpy as jnp

    from specjax.advance import KvAdvance
    from specjax.engine import prefill, step

    model, draft = MODELS["global"], DRAFTS["global"]
    width, depth = 9, 3  # 9 + 1 + 2 * 4 - 1 = 17 slots: one past a 16-slot page boundary
    cap = request_capacity(width, 1, depth, bucket=False)
    eng = make_engine(model, drafter="draft_model", draft_model=draft, depth=depth,
                      kv_advance_rule=KvAdvance.PER_SEQUENCE, cache="paged", greedy=True,
                      capacity=cap)
    params = {"target": model.params, "draft": draft.params}
    toks = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
    plen = jnp.asarray([9, 2], jnp.int32)
    st = prefill(eng, params, toks, plen, jnp.asarray([10, 7], jnp.int32), jnp.full((2,), -1), jnp.zeros(2, jnp.uint32))
    assert bool(st.done[0]) and not bool(st.done[1])
    for _ in range(3):
        st = step(eng, params, st)
    assert int(st.cache.status.max()) == 0 and int(st.dstate.status.max()) == 0


def test_a_refused_write_is_an_error_not_silence(monkeypatch):
    exact = generation.request_capacity
    monkeypatch.setattr(generation, "request_capacity", lambda *a, **k: exact(*a, bucket=False) - 10)
    with pytest.raises(RuntimeError, match=r"KV cache refused a write or advance.*capacity exceeded"):
        generate(MODELS["global"], [[1, 2, 3, 4, 5, 6, 7, 8]], max_new_tokens=6, drafter="ngram", ngram_n=2)


def test_stream_reads_back_only_new_tokens_and_matches_generate():
    prompts = _prompts(3, 11)
    kw = dict(max_new_tokens=10, drafter="mtp", depth=3)
    ref = generate(MODELS["global"], prompts, **kw)
    got = [[] for _ in prompts]
    for chunk in stream(MODELS["global"], prompts, **kw):
        for r, toks in enumerate(chunk.new_tokens):
            got[r] += toks
    assert got == ref.tokens and chunk.result.tokens == ref.tokens


def test_bad_attention_impl_is_rejected_before_compile():
    before = TRACES["generate"]
    with pytest.raises(ValueError, match=r"attention_impl='cuda' is invalid: must be one of \['xla', 'pallas', 'au"):
        generate(MODELS["global"], [[1, 2]], max_new_tokens=3, attention_impl="cuda")
    assert TRACES["generate"] == before


@pytest.mark.parametrize("backend,expected", [("tpu", "pallas"), ("gpu", "xla"), ("cuda", "xla"), ("cpu", "xla")])
def test_auto_attention_is_pallas_on_tpu_only(monkeypatch, backend, expected):
    """The kernels have not run on a GPU (JAX 0.11 on an H200 failed the old bodies:
    "Unimplemented primitive in Pallas Triton lowering: slice"), so "auto" takes XLA on GPU; an
    explicit choice is kept."""
    from specjax.cache import base

    monkeypatch.setattr(base.jax, "default_backend", lambda: backend)
    assert base.resolve_attention_impl("auto") == expected
    assert base.resolve_attention_impl("pallas") == "pallas" and base.resolve_attention_impl("xla") == "xla"


def test_step_donates_its_state():
    """``step`` updates the caches in place: the input state's buffers are consumed."""
    import jax.numpy as jnp

    from specjax.advance import KvAdvance
    from specjax.engine import prefill, step

    model = MODELS["global"]
    eng = make_engine(model, drafter="ngram", draft_model=None, depth=3, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="dense", ngram_n=2, capacity=128)
    st = prefill(eng, {"target": model.params}, jnp.ones((2, 8), jnp.int32), jnp.array([3, 5]), jnp.array([20, 20]),
                 jnp.full((2,), -1), jnp.zeros((2,), jnp.uint32))
    k0 = st.cache.global_kv.k[0]
    st2 = step(eng, {"target": model.params}, st)
    assert k0.is_deleted() and not st2.cache.global_kv.k[0].is_deleted()



def _copied_shapes(hlo: str) -> set[str]:
    """Result shapes (``f32[2,2,64,16]``) of every ``copy`` in a compiled module, loop bodies included."""
    return set(re.findall(r"= (\w+\[[\d,]*\])(?:\{[^}]*\})? copy\(", hlo))


@pytest.mark.parametrize("kind,cache", KINDS)
def test_the_layer_scan_writes_the_caches_in_place(kind, cache):
    """The layer scan carries every layer's cache stack and scatters into it: no step copies a
    whole stack (a copy would cost the cache's capacity on every step)."""
    import jax.numpy as jnp

    model = with_layer_loop(MODELS[kind], "scan")
    eng = make_engine(model, drafter="mtp", draft_model=None, depth=3, cache=cache, capacity=128,
                      kv_advance_rule=KvAdvance.PER_SEQUENCE)
    assert eng.target.layer_loop == "scan"
    params = {"target": model.params}
    st = engine_mod.prefill(eng, params, np.ones((2, 8), np.int32), np.array([3, 8], np.int32),
                            np.array([40, 40], np.int32), np.full(2, -1, np.int32), np.zeros(2, np.uint32))
    stacks = [x for part in st.cache.parts for x in (part.k, part.v)]
    assert all(x.ndim == 5 for x in stacks)
    shapes = {f"{jnp.dtype(x.dtype).name.replace('float', 'f')}[{','.join(map(str, x.shape))}]" for x in stacks}
    hlo = engine_mod.step.lower(eng, params, st).compile().as_text()
    assert " while(" in hlo
    assert not shapes & _copied_shapes(hlo), (shapes, _copied_shapes(hlo))


@pytest.mark.parametrize("kind,cache", KINDS)
@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_one_row_one_token_writes_the_caches_in_place(kind, cache, loop):
    """A batch of one decoding plain (one token a step) writes one cache entry per layer: XLA
    made that scatter a dynamic update slice and duplicated it into the attention reading the
    buffer, copying every layer's K and V each step (48 copies in the bundled model's step).
    ``set_rows`` keeps it a scatter: no cache-sized copy; the tokens are unchanged."""
    import jax.numpy as jnp

    model = with_layer_loop(MODELS[kind], loop)
    eng = make_engine(model, drafter=None, draft_model=None, depth=0, cache=cache, capacity=128,
                      kv_advance_rule=KvAdvance.PER_SEQUENCE)
    params = {"target": model.params}
    st = engine_mod.prefill(eng, params, np.ones((1, 8), np.int32), np.array([5], np.int32), np.array([40], np.int32),
                            np.full(1, -1, np.int32), np.zeros(1, np.uint32))
    bufs = [x for part in st.cache.parts for kv in (part.k, part.v) for x in (kv if isinstance(kv, tuple) else [kv])]
    shapes = {f"{jnp.dtype(x.dtype).name.replace('float', 'f')}[{','.join(map(str, x.shape))}]" for x in bufs}
    hlo = engine_mod.step.lower(eng, params, st).compile().as_text()
    assert not shapes & _copied_shapes(hlo), (shapes, _copied_shapes(hlo))
    prompt = [[3, 1, 4, 1, 5]]
    assert generate(model, prompt, max_new_tokens=12, drafter=None, cache=cache).tokens == \
        [generate(model, prompt * 2, max_new_tokens=12, drafter=None, cache=cache).tokens[0]]


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_scan_layout_gives_the_unrolled_tokens(cache):
    """Target and draft model both stacked (the layer scan, stacked caches): ``generate`` and a
    refilling ``batch_generate`` (rows_view/put_rows on the stacks) give the unrolled tokens."""
    from specjax import batch_generate

    prompts = _prompts(5, 23)
    model, draft = MODELS["sliding"], DRAFTS["sliding"]
    scan, draft_scan = with_layer_loop(model, "scan"), with_layer_loop(draft, "scan")
    kw = dict(max_new_tokens=9, drafter="draft_model", depth=3, cache=cache)
    want = generate(model, prompts, draft_model=draft, **kw)
    got = generate(scan, prompts, draft_model=draft_scan, **kw)
    assert got.tokens == want.tokens
    assert got.metrics["row_accepted_trace"] == want.metrics["row_accepted_trace"]
    done = {c.id: c.tokens for c in batch_generate(scan, prompts, slots=2, draft_model=draft_scan, **kw)}
    assert [done[i] for i in range(len(prompts))] == want.tokens


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_a_decode_step_never_sanitizes_the_whole_cache(cache):
    """Masked slots may hold NaN (``finite_values``), but zeroing them is a pass over every key
    slot of V, per layer, per step: it once made plain decoding at B=32 17% slower. The step
    multiplies ``p @ v`` as it is and takes the sanitized pass only under a ``lax.cond`` when
    that is not finite: no ``is-finite`` over a cache-shaped array outside a conditional's
    branch."""
    model = MODELS["global"]
    b, cap = 8, 256
    eng = make_engine(model, drafter=None, draft_model=None, depth=0, cache=cache, capacity=cap,
                      kv_advance_rule=KvAdvance.PER_SEQUENCE)
    params = {"target": model.params}
    st = engine_mod.prefill(eng, params, np.ones((b, 8), np.int32), np.full(b, 5, np.int32),
                            np.full(b, 200, np.int32), np.full(b, -1, np.int32), np.zeros(b, np.uint32))
    hlo = engine_mod.step.lower(eng, params, st).compile().as_text()
    checks = [ln for ln in hlo.splitlines() if " is-finite(" in ln]
    assert checks, "no finiteness check at all: the masked slots' NaN would reach the rows"
    per_slot = [ln for ln in checks if re.search(r"= pred\[[\d,]*,256,\d+\]", ln) and "/cond/" not in ln]
    assert not per_slot, per_slot[:3]
