"""Bring your own model or drafter: a Flax NNX decoder written here (not specjax's Llama)
runs in the engine through ``specjax.nnx_model``, and a drafter of the test's own through
``drafter=`` (``specjax.protocols``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import KVLayout, nnx_model
from specjax.batch import batch_generate

nnx = pytest.importorskip("flax.nnx")

VOCAB, D, HQ, HKV, HD, LAYERS = 29, 32, 4, 2, 8, 2
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2], [1, 1, 2, 3, 5, 8, 13, 21, 3, 4, 1, 1, 2]]
NEW = 10


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary embedding of ``x [B, t, H, hd]`` at absolute ``positions [B, t]`` (half-split)."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    ang = positions[..., None, None].astype(jnp.float32) * freq
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x1 * jnp.sin(ang) + x2 * jnp.cos(ang)], -1)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
        self.wq, self.wk, self.wv, self.wo = lin(D, HQ * HD), lin(D, HKV * HD), lin(D, HKV * HD), lin(HQ * HD, D)
        self.up, self.down = lin(D, 2 * D), lin(2 * D, D)

    def __call__(self, x, positions, kv, i):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = rope(self.wq(h).reshape(b, t, HQ, HD), positions)
        k = rope(self.wk(h).reshape(b, t, HKV, HD), positions)
        a = kv(i, q, k, self.wv(h).reshape(b, t, HKV, HD))
        x = x + self.wo(a.reshape(b, t, HQ * HD))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyDecoder(nnx.Module):
    """A decoder in plain NNX: it knows nothing of caches; attention goes through ``kv``."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.out = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions, kv):
        x = self.embed(tokens) * 3.0
        for i, blk in enumerate(self.blocks):
            x = blk(x, positions, kv, i)
        return x

    def logits(self, hidden):
        return self.out(self.norm(hidden)) * 40.0  # sharp: greedy argmax gaps are not float ties


def oracle_kv(i, q, k, v, *, window=None, scale=None):
    """The uncached oracle of ``kv``: every query over the keys at or before it (within
    ``window``), scores scaled by ``scale`` (default ``HD ** -0.5``)."""
    t = q.shape[1]
    k, v = (jnp.repeat(x, HQ // HKV, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (HD**-0.5 if scale is None else scale)
    qi, ki = np.arange(t)[:, None], np.arange(t)[None]
    seen = (ki <= qi) & ((ki > qi - window) if window else True)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1), v)


def own_greedy(module: TinyDecoder, prompt: list[int], n: int) -> list[int]:
    """The module's own uncached greedy loop: the whole prefix re-run for every token."""
    seq = list(prompt)
    for _ in range(n):
        tok = jnp.asarray([seq], jnp.int32)
        hidden = module(tok, jnp.arange(len(seq))[None], oracle_kv)
        seq.append(int(jnp.argmax(module.logits(hidden)[0, -1])))
    return seq[len(prompt):]


def wrap(module):
    return nnx_model(module, layout=KVLayout(LAYERS, HKV, HD), vocab_size=VOCAB, max_seq_len=64)


@pytest.fixture(scope="module")
def target():
    return TinyDecoder(0)


@pytest.fixture(scope="module")
def draft(target):
    """The target with 5% noise on every weight: a draft that agrees often, not always."""
    graphdef, state = nnx.split(target)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [x + 0.05 * x.std() * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, noisy))


@pytest.fixture(scope="module")
def want(target):
    return [own_greedy(target, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("rule", ["per_sequence", "cohort"])
@pytest.mark.parametrize("drafter,cache", [("draft_model", "paged"), ("ngram", "dense")])
def test_nnx_decoder_speculates_its_own_greedy_tokens(target, draft, want, rule, drafter, cache):
    out = specjax.generate(wrap(target), PROMPTS, max_new_tokens=NEW, drafter=drafter,
                           draft_model=wrap(draft) if drafter == "draft_model" else None, depth=3, kv_advance=rule,
                           cache=cache)
    assert out.tokens == want
    if drafter == "draft_model":
        assert out.metrics["accepted_drafts"] > 0  # the drafts were used: tokens came from accepted windows


def test_the_default_drafter_follows_the_models(target, draft, want):
    """``drafter`` left out (``"auto"``): the CLI's rule everywhere. No MTP module and no draft
    model: n-gram; a draft model given: the draft model."""
    assert specjax.generate(wrap(target), PROMPTS, max_new_tokens=NEW, depth=3).metrics["drafter"] == "ngram"
    got = specjax.generate(wrap(target), PROMPTS, max_new_tokens=NEW, depth=3, draft_model=wrap(draft))
    assert got.metrics["drafter"] == "draft_model" and got.tokens == want
    done = list(batch_generate(wrap(target), [{"prompt": p} for p in PROMPTS], slots=2, max_new_tokens=NEW, depth=3))
    assert sorted((c.id, c.tokens) for c in done) == list(enumerate(want))


def test_wrapping_again_is_no_recompile(target, want):
    first = specjax.generate(wrap(target), PROMPTS, max_new_tokens=NEW, drafter="ngram", depth=2)
    again = specjax.generate(wrap(target), PROMPTS[::-1], max_new_tokens=NEW, drafter="ngram", depth=2)
    assert first.tokens == want and again.tokens == want[::-1]
    assert first.metrics["compiles"] == 1
    assert again.metrics["compiles"] == 0  # a re-split module: an equal graph definition, the same compile


# ----------------------------------------------------------------------------- a drafter of the test's own


@dataclasses.dataclass(frozen=True)
class BigramDrafter:
    """Per-row bigram table learned from each row's own emitted text (state: ``[B, V]`` next
    token after each token, -1 unseen); drafts chain through it from the last known token."""

    vocab: int = VOCAB
    name: str = "bigram"

    def init(self, batch: int):
        return {"next": jnp.full((batch, self.vocab), -1, jnp.int32)}

    def propose(self, ctx: specjax.DraftContext, state):
        tok = ctx.last(1)[:, 0]
        drafts = []
        for _ in range(ctx.depth):
            nxt = jnp.take_along_axis(state["next"], tok[:, None], axis=1)[:, 0]
            tok = jnp.where(nxt >= 0, nxt, tok)
            drafts.append(tok)
        return jnp.stack(drafts, axis=1), None, state

    def commit(self, ctx: specjax.DraftContext, state, accepted):
        w = ctx.depth + 2  # pairs among the last (accepted + 1) emitted tokens and the one before
        pairs = ctx.last(w)
        j = jnp.arange(1, w)[None]
        fresh = j >= w - 1 - accepted[:, None]
        rows = jnp.broadcast_to(jnp.arange(pairs.shape[0])[:, None], fresh.shape)
        prev = jnp.where(fresh, pairs[:, :-1], self.vocab)  # out of range: dropped
        return {"next": state["next"].at[rows, prev].set(pairs[:, 1:], mode="drop")}


@pytest.fixture(scope="module")
def bundle():
    return specjax.load_model()


@pytest.fixture(scope="module")
def llama(bundle):
    return bundle.model


@dataclasses.dataclass(frozen=True)
class RepeatLast:
    """What the bigram drafter does when its table never learns: repeat the last token."""

    name: str = "repeat"

    def propose(self, ctx: specjax.DraftContext, state):
        return jnp.repeat(ctx.last(1), ctx.depth, axis=1), None, state


CODE = ["def parse_args(", "import os\nimport sys\nimport ", "    for i in range(", "class Foo:\n    def "]


def test_a_drafter_of_your_own_is_lossless_and_used(bundle, llama):
    prompts = bundle.encode_prompts(CODE)
    bigram = BigramDrafter(vocab=llama.config.vocab_size)
    plain = specjax.generate(llama, prompts, max_new_tokens=32, drafter=None)
    mine = specjax.generate(llama, prompts, max_new_tokens=32, drafter=bigram, depth=3)
    assert mine.tokens == plain.tokens
    assert mine.metrics["drafter"] == "bigram"
    # its table learned from the rows' own text (commit ran): it beats its never-learning self
    repeat = specjax.generate(llama, prompts, max_new_tokens=32, drafter=RepeatLast(), depth=3)
    assert mine.metrics["accepted_drafts"] > repeat.metrics["accepted_drafts"] + 10


def test_a_drafters_state_follows_slot_refill(bundle, llama):
    prompts = bundle.encode_prompts(CODE)
    bigram = BigramDrafter(vocab=llama.config.vocab_size)
    alone = specjax.generate(llama, prompts, max_new_tokens=32, drafter=bigram, depth=3)
    done = list(batch_generate(llama, [{"prompt": p} for p in prompts], slots=2, max_new_tokens=32,
                               drafter=bigram, depth=3, refill_rows=1))
    done = sorted(done, key=lambda c: c.id)
    assert [c.tokens for c in done] == alone.tokens
    # a refilled slot starts from a fresh state: each row drafts (and accepts) exactly as it did alone
    assert [c.metrics["accepted_trace"] for c in done] == alone.metrics["row_accepted_trace"]


@dataclasses.dataclass
class Unhashable:  # eq without frozen: no hash
    name: str = "x"

    def propose(self, ctx, state):
        return ctx.last(1), None, state


def test_bad_plugins_get_clear_errors(llama, target):
    with pytest.raises(ValueError, match=r"drafter=object is invalid: .*propose"):
        specjax.generate(llama, [[1, 2]], max_new_tokens=2, drafter=object())
    with pytest.raises(ValueError, match=r"drafter=Unhashable is invalid: it must be hashable"):
        specjax.generate(llama, [[1, 2]], max_new_tokens=2, drafter=Unhashable())
    with pytest.raises(ValueError, match=r"model=dict is invalid: a model needs \.params"):
        specjax.generate({"params": 1}, [[1, 2]], max_new_tokens=2, drafter=None)
    with pytest.raises(ValueError, match=r"drafter='mtp' is invalid: the model has no MTP"):
        specjax.generate(wrap(target), [[1, 2]], max_new_tokens=2, drafter="mtp")
    with pytest.raises(ValueError, match=r"vocab_size=30 is invalid: the module's logits returns 29"):
        nnx_model(target, layout=KVLayout(LAYERS, HKV, HD), vocab_size=30, max_seq_len=64)
    with pytest.raises(ValueError, match=r"module is invalid: one token through it"):
        nnx_model(target, layout=KVLayout(LAYERS, HKV + 1, HD), vocab_size=VOCAB, max_seq_len=64)
    with pytest.raises(ValueError, match=r"model=NnxModel is invalid with mesh="):
        specjax.generate(wrap(target), [[1, 2]], max_new_tokens=2, drafter=None, mesh=specjax.make_mesh(data=1))


# ----------------------------------------------------------------------------- the model contract's edges

MAXLEN, WIN, SCALE = 96, 6, 0.2  # a position table of exactly MAXLEN rows; layer 0 a sliding window
PAD = 0  # never in a prompt, never generated: the module turns it into NaN (poisoned padding)
SEEN: list[tuple[int, int]] = []  # (min, max) of the positions of every forward the engine ran


class LearnedPositions(nnx.Module):
    """GPT-2 style: a learned position table of exactly ``MAXLEN`` rows (a position past it
    reads NaN), layer 0 attends in a window of ``WIN`` at scale ``SCALE``, and the token
    ``PAD`` embeds as NaN, so every padding slot the engine computes carries NaN K/V."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos = nnx.Param(0.5 * jax.random.normal(jax.random.key(seed + 1), (MAXLEN, D)))
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.out = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions, kv):
        jax.debug.callback(lambda lo, hi: SEEN.append((int(lo), int(hi))), jnp.min(positions), jnp.max(positions))
        x = self.embed(tokens) * 3.0 + jnp.take(self.pos[...], positions, axis=0, mode="fill", fill_value=jnp.nan)
        x = jnp.where((tokens == PAD)[..., None], jnp.nan, x)
        layer0 = lambda i, q, k, v: kv(i, q, k, v, window=WIN, scale=SCALE)  # noqa: E731
        for i, blk in enumerate(self.blocks):
            x = blk(x, positions, layer0 if i == 0 else kv, i)
        return x

    def logits(self, hidden):
        return (self.out(self.norm(hidden)) * 40.0).at[..., PAD].set(-1e9)


def learned_greedy(module, prompt, n):
    """The module's own uncached greedy loop over a fixed ``MAXLEN`` window (causal: the filler
    after the text, token 1, changes nothing before it; one compile for every step)."""
    graphdef, state = nnx.split(module)

    @jax.jit
    def last_logits(state, tokens, at):
        m = nnx.merge(graphdef, state)
        return m.logits(m(tokens, jnp.arange(MAXLEN)[None], oracle_kv))[0, at]

    seq = list(prompt)
    for _ in range(n):
        tokens = jnp.asarray([seq + [1] * (MAXLEN - len(seq))], jnp.int32)
        seq.append(int(jnp.argmax(last_logits(state, tokens, len(seq) - 1))))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def learned():
    module = LearnedPositions(3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (70, 3, 12)]  # a 128-wide prefill bucket
    edge = rng.integers(1, VOCAB, 60).tolist()  # 60 + 36 new: ends exactly at MAXLEN
    return module, prompts, edge, [learned_greedy(module, p, 20) for p in prompts], learned_greedy(module, edge, 36)


@pytest.mark.parametrize("drafter,cache", [(None, "dense"), ("ngram", "paged"), ("draft_model", "dense")])
def test_positions_stay_reachable_and_padding_nans_stay_masked(learned, drafter, cache):
    """A model with exactly ``max_seq_len`` learned positions, windowed attention at its own
    scale through ``kv``, and NaN K/V in every padding slot: every row decodes its own greedy
    tokens (prefill padded past ``max_seq_len``, verify windows and draft chains past the row's
    end, a request ending exactly at the limit)."""
    module, prompts, edge, want, want_edge = learned
    model = nnx_model(module, layout=KVLayout(LAYERS, HKV, HD), vocab_size=VOCAB, max_seq_len=MAXLEN)
    kw = dict(drafter=drafter, cache=cache, depth=3, draft_model=model if drafter == "draft_model" else None)
    SEEN.clear()
    assert specjax.generate(model, prompts, max_new_tokens=20, **kw).tokens == want
    assert specjax.generate(model, [edge], max_new_tokens=36, **kw).tokens == [want_edge]
    assert SEEN and min(lo for lo, _ in SEEN) >= 0 and max(hi for _, hi in SEEN) <= MAXLEN - 1
