"""The speculative decoding engine: one pure jitted step, looped in ``lax.while_loop``.

Per step and row (window ``w = depth + 1``): the row enters with ``u`` known tokens not
yet in its cache; the drafter proposes ``w - u`` drafts; the target runs once over the
``w``-token window at the row's own cache offset; verification accepts ``a`` drafts
and yields one more token; the production plan function (``plan_step``, under the
latched ``KvAdvance`` rule) says how far each row's caches advance and how many
tokens it re-feeds next step. Finished rows stay in the batch at static shape: they
present ``committed = w`` (so they never set the cohort minimum) and do not advance.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass
from specjax.advance import KvAdvance
from specjax.advance import kv_advance as resolve_kv_advance
from specjax.cache import cache_supports_per_sequence_advance, describe_status
from specjax.cache.base import resolve_attention_impl
from specjax.drafter import DRAFTERS, DraftModelDrafter, MtpDrafter, NgramDrafter, NoDrafter
from specjax.model.config import ModelConfig
from specjax.model.llama import Model, ModelCache, forward, forward_hidden, head, init_cache
from specjax.plan import plan_step
from specjax.sampling import SAMPLE, RowSampling, derive_seed, position_keys, probs, sample
from specjax.verify import greedy_verify, rejection_verify

__all__ = [
    "MAX_DEPTH", "Engine", "EngineState", "GenerationResult", "StreamChunk", "generate", "make_engine", "prefill",
    "prompt_bucket", "request_capacity", "step", "stream",
]

MAX_DEPTH = 8
CAPACITY_BLOCK = 128  # request-sized capacities are multiples of this (kernel key blocks divide them)
PAGE_SIZE = 16  # tokens per page of a paged cache


def request_capacity(prompt_width: int, max_new_tokens: int, depth: int, *, bucket: bool = True) -> int:
    """Cache slots per row for one request batch (``prompt_width`` = the padded prompt).

    The largest slot any write touches: a row's committed length reaches at most
    ``max_len - 1`` (``max_len = prompt + max_new_tokens``; a finished row stays there and
    keeps receiving masked writes), and past it a step writes the verify window ``w`` and a
    draft model reserves ``2w`` (its window plus ``d`` chained feeds). So
    ``prompt_width + max_new_tokens + 2w - 1`` slots, exactly (tested at the boundary).

    With ``bucket`` the result rounds up to a multiple of ``CAPACITY_BLOCK`` (eight buckets
    per octave above 1024 slots), so nearby requests share one compile and kernel blocks
    divide it. The model's ``max_seq_len`` is only a validation bound, never a size.
    """
    w = depth + 1
    need = max(prompt_width, 1) + max_new_tokens + 2 * w - 1
    if not bucket:
        return need
    step = CAPACITY_BLOCK if need <= 1024 else max(CAPACITY_BLOCK, (1 << (need - 1).bit_length()) // 8)
    return -(-need // step) * step


@pytree_dataclass
class EngineState:
    seq: jax.Array  # int32 [B, C]: prompt + generated tokens
    known: jax.Array  # [B]: tokens known (prompt + generated)
    u: jax.Array  # [B]: known tokens not yet in the cache (1..w)
    cache: ModelCache  # target caches; cache.lengths = known - u
    dstate: Any  # drafter state (caches, MTP hidden, ...)
    prompt_len: jax.Array  # [B]
    max_len: jax.Array  # [B]: prompt_len + max_new_tokens
    eos: jax.Array  # [B]: EOS id, -1 for none
    seeds: jax.Array  # uint32 [B]
    sampling: RowSampling  # per-row temperature / top_k / top_p [B] (data: never recompiles)
    live: jax.Array  # bool [B]: the slot holds a request, running or finished (idle slots own no pages)
    done: jax.Array  # bool [B]
    steps: jax.Array  # [B]: decode steps while active
    emitted: jax.Array  # [B]: tokens emitted by decode steps
    accepted: jax.Array  # [B]: drafts accepted
    proposed: jax.Array  # [B]: drafts proposed
    acc_pos: jax.Array  # [B, depth]: accepted at draft position k
    prop_pos: jax.Array  # [B, depth]: proposed at draft position k
    trace: jax.Array  # [B, max_steps]: accepted drafts at the row's own step k (-1 past its steps)
    i: jax.Array  # int32 []: steps taken


@dataclasses.dataclass(frozen=True)
class Engine:
    """Static configuration: everything a compile depends on."""

    config: ModelConfig
    drafter: Any
    depth: int
    kv_rule: KvAdvance
    cache_kind: str
    greedy: bool  # every row greedy: argmax, no distributions (else per-row ``RowSampling``)
    capacity: int  # cache slots per row (request-sized: ``request_capacity``)
    max_steps: int  # trace length (a step emits >= 1 token per active row, so capacity bounds it)
    draft_config: ModelConfig | None = None
    dtype: Any = jnp.float32
    attention_impl: str = "xla"  # resolved: "xla" | "pallas"
    num_pages: int | None = None  # paged pool size (None: every row's full capacity)

    @property
    def window(self) -> int:
        return self.depth + 1

    def new_cache(self, cfg: ModelConfig, batch: int, prefill: int) -> ModelCache:
        """Empty caches for ``cfg``. A rolling cache's slack covers the widest single write:
        the prefill (``prefill`` tokens) or a window plus chained draft writes (``2w``)."""
        slack = max(2 * self.window + 2, prefill)
        return init_cache(cfg, batch, self.capacity, kind=self.cache_kind, slack=slack, page_size=PAGE_SIZE,
                          num_pages=self.num_pages, dtype=self.dtype)


_TRACES = {"generate": 0}


def _prefill(eng: Engine, params: dict, prompts: jax.Array, prompt_len: jax.Array, max_len, eos, seeds,
             sampling: RowSampling, cache: ModelCache, dstate: Any, live: jax.Array) -> EngineState:
    """Run ``prompts [B, P]`` into the empty ``cache`` and drafter state ``dstate`` and take
    each row's first token. ``live [B]``: real rows (padding rows of a refill own no pages)."""
    b, p = prompts.shape
    c = eng.capacity
    seq = jnp.zeros((b, c), jnp.int32).at[:, :p].set(prompts)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, cache = forward_hidden(params["target"], eng.config, prompts, positions, cache.reserve(p, live),
                                   attention_impl=eng.attention_impl)
    cache = cache.advance(prompt_len)
    h_last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
    last = head(params["target"], eng.config, h_last)  # logits for the one position used
    if eng.greedy:
        first = jnp.argmax(last, axis=-1).astype(jnp.int32)
    else:
        first = sample(position_keys(seeds, prompt_len[:, None], SAMPLE)[:, 0], probs(last, sampling))
    seq = seq.at[jnp.arange(b), prompt_len].set(first)
    d = eng.depth
    zeros = jnp.zeros((b,), jnp.int32)
    st = EngineState(
        seq=seq, known=prompt_len + 1, u=jnp.ones((b,), jnp.int32), cache=cache, dstate=dstate,
        prompt_len=prompt_len, max_len=max_len, eos=eos, seeds=seeds, sampling=sampling, live=live,
        done=(first == eos) | (prompt_len + 1 >= max_len) | ~live,
        steps=zeros, emitted=zeros, accepted=zeros, proposed=zeros,
        acc_pos=jnp.zeros((b, d), jnp.int32), prop_pos=jnp.zeros((b, d), jnp.int32),
        trace=jnp.full((b, eng.max_steps), -1, jnp.int32),
        i=jnp.int32(0),
    )
    return st.replace(dstate=eng.drafter.prefill(eng, params, st, hidden, positions, live))


def _fresh_prefill(eng: Engine, params: dict, prompts, prompt_len, max_len, eos, seeds, sampling) -> EngineState:
    """``_prefill`` into new caches of the engine's full capacity (one static batch)."""
    b, p = prompts.shape
    return _prefill(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling, eng.new_cache(eng.config, b, p),
                    eng.drafter.empty(eng, b, p), jnp.ones((b,), bool))


def _step(eng: Engine, params: dict, st: EngineState) -> EngineState:
    """One speculative step for every row: draft, verify, commit. Pure: ``state -> state``."""
    w, d = eng.window, eng.depth
    b, c = st.seq.shape
    lengths, u, active = st.cache.lengths, st.u, ~st.done
    drafts, q, dstate = eng.drafter.propose(eng, params, st)

    # the window: u known tokens, then w - u drafts, at this row's own offset
    j = jnp.arange(w, dtype=jnp.int32)[None]
    pos = lengths[:, None] + j
    known_tok = jnp.take_along_axis(st.seq, jnp.clip(pos, 0, c - 1), axis=1)
    if d:
        draft_tok = jnp.take_along_axis(drafts, jnp.clip(j - u[:, None], 0, d - 1), axis=1)
        window = jnp.where(j < u[:, None], known_tok, draft_tok)
    else:
        window = known_tok
    logits, hidden, cache = forward(params["target"], eng.config, window, pos, st.cache.reserve(w, st.live),
                                    attention_impl=eng.attention_impl)

    if eng.greedy:
        a, nxt = greedy_verify(logits, drafts, u)
    else:
        a, nxt = rejection_verify(logits, drafts, q, u, lengths, st.seeds, st.sampling)

    # emit drafts[:a] + nxt at positions known .. known + a, cut at EOS / the token budget
    k = jnp.arange(d + 1, dtype=jnp.int32)[None]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tok = jnp.where(k < a[:, None], padded, nxt[:, None])
    valid = (k <= a[:, None]) & (k < (st.max_len - st.known)[:, None]) & active[:, None]
    is_eos = valid & (new_tok == st.eos[:, None])
    first_eos = jnp.min(jnp.where(is_eos, k, d + 1), axis=1)
    valid &= k <= first_eos[:, None]
    n_new = jnp.sum(valid, axis=1).astype(jnp.int32)
    dest = jnp.where(valid, st.known[:, None] + k, c)  # explicit out-of-range: dropped
    seq = st.seq.at[jnp.arange(b)[:, None], dest].set(new_tok, mode="drop")
    known = st.known + n_new
    done = st.done | (first_eos <= d) | (known >= st.max_len)

    # commit through the production plan function; finished rows neither set the min nor move
    plan = plan_step(u, jnp.where(active, a, w - u), w, eng.kv_rule)
    advance = jnp.where(active, plan.advance, 0)
    st = st.replace(seq=seq, known=known, u=jnp.where(active, plan.next_uncached, u), cache=cache.advance(advance),
                    done=done)
    dstate = eng.drafter.commit(eng, params, st, dstate, hidden, lengths, u, jnp.where(active, a, 0), advance)

    act = active.astype(jnp.int32)
    kd = jnp.arange(d, dtype=jnp.int32)[None]
    proposed = w - u
    return st.replace(
        dstate=dstate,
        steps=st.steps + act,
        emitted=st.emitted + n_new,
        accepted=st.accepted + a * act,
        proposed=st.proposed + proposed * act,
        acc_pos=st.acc_pos + ((kd < a[:, None]) & active[:, None]).astype(jnp.int32),
        prop_pos=st.prop_pos + ((kd < proposed[:, None]) & active[:, None]).astype(jnp.int32),
        trace=st.trace.at[jnp.arange(b), jnp.where(active, st.steps, eng.max_steps)].set(a, mode="drop"),
        i=st.i + 1,
    )


_prefill_jit = jax.jit(_fresh_prefill, static_argnums=0)


def prefill(eng: Engine, params: dict, prompts, prompt_len, max_len, eos, seeds,
            sampling: RowSampling | None = None) -> EngineState:
    """Jitted prefill of ``prompts [B, P]`` (``prompt_len, max_len, eos, seeds [B]``) into new
    caches of the engine's capacity. ``sampling`` defaults to greedy rows."""
    if sampling is None:
        b = np.shape(prompts)[0]
        sampling = RowSampling.rows([0.0] * b, [None] * b, [None] * b)
    return _prefill_jit(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling)


step = jax.jit(_step, static_argnums=0, donate_argnums=2)
step.__doc__ = """``step(engine, params, state) -> state``: one jitted speculative step (static ``engine``).
The input state is donated: its buffers (caches included) are updated in place, not copied."""


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _stream_step(eng: Engine, params: dict, st: EngineState):
    """``step`` plus the few values ``stream`` reads back: the (up to ``w``) tokens each row
    emitted, how many, and the loop state. Never the caches or the whole sequence."""
    before = st.known
    st = _step(eng, params, st)
    idx = before[:, None] + jnp.arange(eng.window, dtype=jnp.int32)[None]
    new = jnp.take_along_axis(st.seq, jnp.clip(idx, 0, st.seq.shape[1] - 1), axis=1)
    return st, (new, st.known - before, st.done, st.i)


@functools.partial(jax.jit, static_argnums=0)
def _generate(eng: Engine, params: dict, prompts, prompt_len, max_len, eos, seeds, sampling) -> EngineState:
    _TRACES["generate"] += 1
    st = _fresh_prefill(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling)
    return jax.lax.while_loop(
        lambda st: jnp.any(~st.done) & (st.i < eng.max_steps),
        lambda st: _step(eng, params, st),
        st,
    )


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What ``generate`` returns.

    ``tokens``: the new tokens of each prompt, in order (EOS included when hit).
    ``metrics`` (all over active decode steps; the first token comes from prefill):

    * ``emitted``: tokens the decode steps produced; ``total_row_steps``: steps summed over rows;
      ``steps``: steps of the longest row.
    * ``tok_per_step`` = ``emitted / total_row_steps`` (what a row gains per target forward;
      cut at EOS and the token budget) and ``row_tok_per_step`` per row.
    * ``mean_accepted_length`` = ``(accepted_drafts + total_row_steps) / total_row_steps``:
      accepted drafts plus the verifier's own token per step, before any EOS/budget cut, so
      it can exceed ``tok_per_step``.
    * ``acceptance_per_position``: accepted / proposed at draft position ``k``;
      ``row_accepted_trace``: accepted drafts per step per row.
    * ``compiles``: traces of the generate loop in this call (0 when the shapes were seen).
    """

    tokens: list[list[int]]
    metrics: dict


def prompt_bucket(prompts: list[list[int]]) -> int:
    """Padded prompt width of a batch: the longest prompt rounded up to a power of two (>= 8).
    Each bucket is its own compile (warm every bucket before timing)."""
    return max(8, 1 << (max(len(p) for p in prompts) - 1).bit_length())


def _fail(arg: str, value: object, allowed: str) -> None:
    raise ValueError(f"{arg}={value!r} is invalid: {allowed}")


def _validate(model, prompts, max_new_tokens, drafter, draft_model, depth, cache, temperature, top_k, top_p, seed,
              eos_id):
    cfg = model.config
    if not isinstance(prompts, list | tuple) or len(prompts) == 0:
        _fail("prompts", prompts, "must be a non-empty list of token-id lists")
    if all(isinstance(p, int | np.integer) for p in prompts):
        _fail("prompts", prompts, "is one flat list of ints: pass a list of prompts, e.g. [prompt]")
    for i, p in enumerate(prompts):
        if not isinstance(p, list | tuple | np.ndarray):
            _fail(f"prompts[{i}]", p, "must be a list of int token ids")
        if len(p) == 0:
            _fail(f"prompts[{i}]", p, "a prompt must hold at least one token")
        arr = np.asarray(p)
        if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1:
            _fail(f"prompts[{i}]", p, "must be a list of int token ids")
        bad = np.nonzero((arr < 0) | (arr >= cfg.vocab_size))[0]
        if len(bad):
            _fail(f"prompts[{i}][{int(bad[0])}]", int(arr[bad[0]]), f"token ids must lie in [0, {cfg.vocab_size})")
    per_row = isinstance(max_new_tokens, list | tuple)
    news = list(max_new_tokens) if per_row else [max_new_tokens] * len(prompts)
    if len(news) != len(prompts) or any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1
                                        for n in news):
        _fail("max_new_tokens", max_new_tokens, f"must be an int >= 1 or one per prompt ({len(prompts)})")
    lens = [len(p) for p in prompts]
    longest = max(lens)
    which = lens.index(longest)
    if longest >= cfg.max_seq_len:
        _fail(f"prompts[{which}]", f"{longest} tokens",
              f"the model's context is max_seq_len={cfg.max_seq_len} tokens: a prompt may hold at most "
              f"{cfg.max_seq_len - 1} (to leave room for one new token)")
    over = [i for i in range(len(prompts)) if lens[i] + news[i] > cfg.max_seq_len]
    if per_row and over:
        i = over[0]
        _fail(f"max_new_tokens[{i}]", news[i], f"prompt length {lens[i]} (prompts[{i}]) + max_new_tokens must be "
              f"<= the model's max_seq_len={cfg.max_seq_len}: at most {cfg.max_seq_len - lens[i]} new tokens fit")
    if over:
        _fail("max_new_tokens", max_new_tokens,
              f"prompt length {longest} (prompts[{which}]) + max_new_tokens must be <= the model's "
              f"max_seq_len={cfg.max_seq_len}: at most {cfg.max_seq_len - longest} new tokens fit")
    if drafter is not None and drafter not in DRAFTERS:
        _fail("drafter", drafter, f"must be one of {list(DRAFTERS)} or None")
    if drafter is not None and (isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH):
        _fail("depth", depth, f"must be an int in [1, {MAX_DEPTH}]")
    if drafter == "mtp" and cfg.mtp_depth < 1:
        _fail("drafter", drafter, "the model has no MTP module (mtp_depth=0)")
    if drafter == "draft_model":
        if not isinstance(draft_model, Model):
            _fail("draft_model", draft_model, "drafter='draft_model' needs a specjax Model")
        if draft_model.config.vocab_size != cfg.vocab_size:
            _fail("draft_model", f"vocab_size {draft_model.config.vocab_size}",
                  f"must equal the target's vocab_size {cfg.vocab_size}")
        if draft_model.config.max_seq_len < cfg.max_seq_len:
            _fail("draft_model", f"max_seq_len {draft_model.config.max_seq_len}",
                  f"must be >= the target's max_seq_len {cfg.max_seq_len}")
    if cache not in ("dense", "paged"):
        _fail("cache", cache, "must be 'dense' or 'paged'")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not math.isfinite(temperature) \
            or temperature < 0:
        _fail("temperature", temperature, "must be a finite float >= 0")
    if top_p is not None and not 0 < top_p <= 1:
        _fail("top_p", top_p, "must lie in (0, 1]")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        _fail("top_k", top_k, "must be an int >= 1 or None")
    seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompts) or any(not isinstance(s, int) or not 0 <= s < 2**32 for s in seeds):
        _fail("seed", seed, f"must be an int in [0, 2**32) or one per prompt ({len(prompts)})")
    if isinstance(seed, int):  # one base seed: each row's own stream, from (seed, row)
        seeds = [derive_seed(seed, i) for i in range(len(prompts))]
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        _fail("eos_id", eos_id, f"must lie in [0, {cfg.vocab_size}) or be None")
    return seeds, [int(n) for n in news]


def check_per_sequence_cache(cache: Any) -> None:
    """Refuse the per-sequence rule on a cache that cannot carry per-row lengths."""
    msg = cache_supports_per_sequence_advance(cache)
    if msg is not None:
        raise ValueError(f"kv_advance='per_sequence' is not supported by this cache: {msg}")


def make_engine(model: Model, *, drafter, draft_model, depth, kv_advance_rule, cache, greedy: bool = True,
                ngram_n: int = 3, capacity: int | None = None, attention_impl: str = "xla",
                num_pages: int | None = None) -> Engine:
    """The static engine. ``capacity`` (cache slots per row; ``request_capacity``) defaults to
    what the model's longest sequence would need; ``generate`` passes the request's.
    ``greedy``: every row decodes greedily (no distributions are built); otherwise each row
    samples under its own ``RowSampling`` (a temperature-0 row stays exactly greedy)."""
    d = 0 if drafter is None else depth
    dr = {None: NoDrafter(), "ngram": NgramDrafter(ngram_n), "draft_model": DraftModelDrafter(),
          "mtp": MtpDrafter()}[drafter]
    cfg = model.config
    if capacity is None:
        capacity = request_capacity(0, cfg.max_seq_len, d)
    return Engine(
        config=cfg,
        drafter=dr,
        depth=d,
        kv_rule=kv_advance_rule,
        cache_kind=cache,
        greedy=bool(greedy),
        capacity=capacity,
        max_steps=capacity,
        draft_config=None if draft_model is None or drafter != "draft_model" else draft_model.config,
        dtype=model.params["embed"].dtype,
        attention_impl=resolve_attention_impl(attention_impl),
        num_pages=num_pages,
    )


def _setup(model, prompts, max_new_tokens, drafter, draft_model, depth, kv_advance, cache, temperature, top_k, top_p,
           seed, eos_id, ngram_n, attention_impl):
    """Validate (before any compile), build the static engine and the host-side batch."""
    seeds, news = _validate(model, prompts, max_new_tokens, drafter, draft_model, depth, cache, temperature, top_k,
                            top_p, seed, eos_id)
    rule = resolve_kv_advance(kv_advance)
    width = prompt_bucket(prompts)
    capacity = request_capacity(width, max(news), 0 if drafter is None else depth)
    eng = make_engine(model, drafter=drafter, draft_model=draft_model, depth=depth, kv_advance_rule=rule,
                      cache=cache, greedy=temperature == 0, ngram_n=ngram_n, capacity=capacity,
                      attention_impl=attention_impl)
    b = len(prompts)
    toks = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):  # host-side batch assembly
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    params = {"target": model.params}
    if eng.draft_config is not None:
        params["draft"] = draft_model.params
    if rule is KvAdvance.PER_SEQUENCE:
        check_per_sequence_cache(jax.eval_shape(lambda: eng.new_cache(eng.config, b, width)))
    args = (
        jnp.asarray(toks), jnp.asarray(plen), jnp.asarray(plen + np.array(news, np.int32)),
        jnp.full((b,), -1 if eos_id is None else eos_id, jnp.int32), jnp.asarray(np.array(seeds, np.uint32)),
        RowSampling.rows([temperature] * b, [top_k] * b, [top_p] * b),
    )
    return eng, params, args


def generate(
    model: Model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int | list[int],
    drafter: str | None = "mtp",
    draft_model: Model | None = None,
    depth: int = 3,
    kv_advance: str | KvAdvance | None = None,
    cache: str = "dense",
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | list[int] = 0,
    eos_id: int | None = None,
    ngram_n: int = 3,
    attention_impl: str = "auto",
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt (one int, or one per prompt) with
    speculative decoding. One static batch: it runs until its slowest row finishes (for a
    stream of requests refilling finished rows, see ``batch_generate``).

    ``drafter=None`` is plain autoregressive decoding on the same step (the baseline).
    ``kv_advance``: ``"per_sequence"`` | ``"cohort"`` | ``None`` (the latched rule).
    ``attention_impl``: ``"xla"`` | ``"pallas"`` | ``"auto"`` (Pallas on TPU/GPU, XLA on CPU).
    ``seed``: one int (each row's seed is derived from it and the row index, so rows
    differ) or one seed per prompt (used as given: a row with an explicit seed gives the
    same tokens alone or in any batch). ``temperature``, ``top_k`` and ``top_p`` are data.
    Caches hold ``request_capacity(prompt bucket, max(max_new_tokens), depth)`` slots per row,
    whatever the model's ``max_seq_len``. Compiles once per (batch, prompt-width bucket,
    capacity bucket, model, drafter, depth, cache kind, rule, greedy or sampled, attention);
    everything else is data. A cache that refused a write raises ``RuntimeError``.
    """
    eng, params, args = _setup(model, prompts, max_new_tokens, drafter, draft_model, depth, kv_advance, cache,
                               temperature, top_k, top_p, seed, eos_id, ngram_n, attention_impl)
    before = _TRACES["generate"]
    st = jax.device_get(_generate(eng, params, *args))
    compiles = _TRACES["generate"] - before
    _check_status(st)
    return GenerationResult(_tokens(st), _metrics(st, eng, compiles))


def _check_status(st) -> None:
    """Surface any cache status bit (a refused write or advance) instead of returning tokens
    computed from a cache that fell behind."""
    bad = describe_status(st.cache.status)
    if bad:
        raise RuntimeError(f"KV cache refused a write or advance (engine bug or undersized cache): rows {bad}")


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    new_tokens: list[list[int]]  # per row: tokens emitted since the previous chunk
    result: GenerationResult | None  # set on the last chunk only


def stream(model: Model, prompts: list[list[int]], **kwargs: Any) -> Iterator[StreamChunk]:
    """``generate`` one step at a time, for interactive output: the same jitted ``prefill``
    and ``step`` (same tokens, same metrics), but the host reads the new tokens after
    every step (one device sync per step; ``generate`` has none). Same keyword arguments
    as ``generate``; the last chunk carries the ``GenerationResult``."""
    # generate's signature is the one source of names and defaults (a bad name is a TypeError)
    bound = inspect.signature(generate).bind(model, prompts, **kwargs)
    bound.apply_defaults()
    eng, params, args = _setup(**bound.arguments)
    st = prefill(eng, params, *args)
    # the first token comes from prefill; afterwards each step reads back only [B, w] tokens
    first, done, i = jax.device_get((st.seq[jnp.arange(st.seq.shape[0]), args[1]], st.done, st.i))
    new = [[int(t)] for t in first]
    while True:
        if bool(done.all()) or int(i) >= eng.max_steps:
            host = jax.device_get(st)
            _check_status(host)
            yield StreamChunk(new, GenerationResult(_tokens(host), _metrics(host, eng, 0)))
            return
        yield StreamChunk(new, None)
        st, small = _stream_step(eng, params, st)
        toks, n_new, done, i = jax.device_get(small)
        new = [toks[r, : n_new[r]].tolist() for r in range(toks.shape[0])]


stream.__signature__ = inspect.signature(generate).replace(  # help(stream) shows generate's keywords
    return_annotation=Iterator[StreamChunk])


def _tokens(st) -> list[list[int]]:
    seq, plen, known = np.asarray(st.seq), np.asarray(st.prompt_len), np.asarray(st.known)
    return [seq[i, plen[i] : known[i]].tolist() for i in range(seq.shape[0])]


def _metrics(st, eng: Engine, compiles: int) -> dict:
    steps = np.asarray(st.steps)
    emitted = np.asarray(st.emitted)
    acc = np.asarray(st.accepted)
    total_steps = int(steps.sum())
    prop_pos, acc_pos = np.asarray(st.prop_pos), np.asarray(st.acc_pos)
    pp = prop_pos.sum(axis=0)
    return {
        "tok_per_step": float(emitted.sum() / total_steps) if total_steps else 0.0,
        "row_tok_per_step": (emitted / np.maximum(steps, 1)).tolist(),
        "mean_accepted_length": float((acc.sum() + total_steps) / total_steps) if total_steps else 0.0,
        "mean_accepted_drafts": float(acc.sum() / total_steps) if total_steps else 0.0,
        "acceptance_per_position": [float(x) for x in acc_pos.sum(axis=0) / np.maximum(pp, 1)],
        "accepted_per_position_count": [int(x) for x in acc_pos.sum(axis=0)],
        "proposed_per_position_count": [int(x) for x in pp],
        "accepted_drafts": int(acc.sum()),
        "total_row_steps": total_steps,
        "emitted": int(emitted.sum()),
        "steps": int(steps.max()) if len(steps) else 0,
        "row_steps": steps.tolist(),
        "row_accepted_trace": [[int(x) for x in r if x >= 0] for r in np.asarray(st.trace)],
        "compiles": compiles,
        "drafter": eng.drafter.name,
        "depth": eng.depth,
        "kv_advance": eng.kv_rule.value,
        "cache": eng.cache_kind,
    }
