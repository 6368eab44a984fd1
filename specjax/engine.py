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

import collections
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass
from specjax.advance import KvAdvance
from specjax.advance import kv_advance as resolve_kv_advance
from specjax.cache import describe_status
from specjax.cache.base import resolve_attention_impl
from specjax.drafter import DraftModelDrafter, MtpDrafter, NgramDrafter, NoDrafter
from specjax.metrics import GenerationResult, metrics, tokens
from specjax.model.config import ModelConfig
from specjax.model.llama import Model, ModelCache, forward, forward_hidden, head, init_cache, layer_loop
from specjax.plan import plan_step
from specjax.sampling import SAMPLE, RowSampling, position_keys, probs, sample
from specjax.validate import MAX_DEPTH, eos_table, validate
from specjax.verify import greedy_verify, rejection_verify

__all__ = [
    "MAX_DEPTH", "EngineConfig", "EngineState", "GenerationResult", "generate", "make_engine", "prefill",
    "prompt_bucket", "request_capacity", "step",
]

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
    eos: jax.Array  # [B, E]: the row's stop ids (it stops on any), -1 padded
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
class EngineConfig:
    """The static configuration of a generation: everything a compile depends on (hashable;
    a static argument of every jitted function). The state that changes is ``EngineState``."""

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
    layer_loop: str = "unrolled"  # the target params' layout: "unrolled" | "scan" (stacked caches)
    draft_layer_loop: str = "unrolled"  # the draft model's

    @property
    def window(self) -> int:
        return self.depth + 1

    def new_cache(self, cfg: ModelConfig, batch: int, loop: str = "unrolled") -> ModelCache:
        """Empty caches for ``cfg`` run by layer loop ``loop`` (stacked for ``"scan"``). Rolling and
        compressed caches reach a window plus chained draft writes (``2w + 2``) past the committed
        length; the prefill, however wide, is bounded per row (``bound_write``), so it does not
        size their rings."""
        return init_cache(cfg, batch, self.capacity, kind=self.cache_kind, slack=2 * self.window + 2,
                          page_size=PAGE_SIZE, num_pages=self.num_pages, dtype=self.dtype, stacked=loop == "scan")


_TRACES = {"generate": 0}


def _prefill(eng: EngineConfig, params: dict, prompts: jax.Array, prompt_len: jax.Array, max_len, eos, seeds,
             sampling: RowSampling, cache: ModelCache, dstate: Any, live: jax.Array) -> EngineState:
    """Run ``prompts [B, P]`` into the empty ``cache`` and drafter state ``dstate`` and take
    each row's first token. ``live [B]``: real rows (padding rows of a refill own no pages)."""
    b, p = prompts.shape
    c = eng.capacity
    seq = jnp.zeros((b, c), jnp.int32).at[:, :p].set(prompts)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, cache = forward_hidden(params["target"], eng.config, prompts, positions,
                                   cache.reserve(p, live).bound_write(prompt_len), attention_impl=eng.attention_impl)
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
        done=jnp.any(first[:, None] == eos, axis=1) | (prompt_len + 1 >= max_len) | ~live,
        steps=zeros, emitted=zeros, accepted=zeros, proposed=zeros,
        acc_pos=jnp.zeros((b, d), jnp.int32), prop_pos=jnp.zeros((b, d), jnp.int32),
        trace=jnp.full((b, eng.max_steps), -1, jnp.int32),
        i=jnp.int32(0),
    )
    return st.replace(dstate=eng.drafter.prefill(eng, params, st, hidden, positions, live))


def _fresh_prefill(eng: EngineConfig, params: dict, prompts, prompt_len, max_len, eos, seeds, sampling) -> EngineState:
    """``_prefill`` into new caches of the engine's full capacity (one static batch)."""
    b, p = prompts.shape
    return _prefill(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling,
                    eng.new_cache(eng.config, b, eng.layer_loop),
                    eng.drafter.empty(eng, b, p), jnp.ones((b,), bool))


def _step(eng: EngineConfig, params: dict, st: EngineState) -> EngineState:
    """One speculative step for every row: draft, verify, commit. Pure: ``state -> state``."""
    w, d = eng.window, eng.depth
    b, c = st.seq.shape
    lengths, u, active = st.cache.lengths, st.u, ~st.done
    drafts, draft_probs, dstate = eng.drafter.propose(eng, params, st)

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
        a, nxt = rejection_verify(logits, drafts, draft_probs, u, lengths, st.seeds, st.sampling)

    # emit drafts[:a] + nxt at positions known .. known + a, cut at EOS / the token budget
    k = jnp.arange(d + 1, dtype=jnp.int32)[None]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tok = jnp.where(k < a[:, None], padded, nxt[:, None])
    valid = (k <= a[:, None]) & (k < (st.max_len - st.known)[:, None]) & active[:, None]
    is_eos = valid & jnp.any(new_tok[:, :, None] == st.eos[:, None, :], axis=2)
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
        accepted=st.accepted + jnp.minimum(a, n_new) * act,  # drafts emitted: none cut by EOS/budget
        proposed=st.proposed + proposed * act,
        acc_pos=st.acc_pos + ((kd < a[:, None]) & active[:, None]).astype(jnp.int32),
        prop_pos=st.prop_pos + ((kd < proposed[:, None]) & active[:, None]).astype(jnp.int32),
        trace=st.trace.at[jnp.arange(b), jnp.where(active, st.steps, eng.max_steps)].set(a, mode="drop"),
        i=st.i + 1,
    )


_prefill_jit = jax.jit(_fresh_prefill, static_argnums=0)


def prefill(eng: EngineConfig, params: dict, prompts, prompt_len, max_len, eos, seeds,
            sampling: RowSampling | None = None) -> EngineState:
    """Jitted prefill of ``prompts [B, P]`` (``prompt_len, max_len, seeds [B]``; ``eos [B]`` or
    ``[B, E]`` stop ids, -1 for none) into new caches of the engine's capacity. ``sampling``
    defaults to greedy rows."""
    eos = jnp.asarray(eos, jnp.int32)
    eos = eos[:, None] if eos.ndim == 1 else eos
    if sampling is None:
        b = np.shape(prompts)[0]
        sampling = RowSampling.rows([0.0] * b, [None] * b, [None] * b)
    return _prefill_jit(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling)


step = jax.jit(_step, static_argnums=0, donate_argnums=2)
step.__doc__ = """``step(engine, params, state) -> state``: one jitted speculative step (static ``engine``).
The input state is donated: its buffers (caches included) are updated in place, not copied."""


@functools.partial(jax.jit, static_argnums=0)
def _generate(eng: EngineConfig, params: dict, prompts, prompt_len, max_len, eos, seeds, sampling) -> EngineState:
    _TRACES["generate"] += 1
    st = _fresh_prefill(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling)
    return jax.lax.while_loop(
        lambda st: jnp.any(~st.done) & (st.i < eng.max_steps),
        lambda st: _step(eng, params, st),
        st,
    )


def prompt_bucket(prompts: list[list[int]]) -> int:
    """Padded prompt width of a batch: the longest prompt rounded up to a power of two (>= 8).
    Each bucket is its own compile (warm every bucket before timing)."""
    return max(8, 1 << (max(len(p) for p in prompts) - 1).bit_length())


def make_engine(model: Model, *, drafter, draft_model, depth, kv_advance_rule, cache, greedy: bool = True,
                ngram_n: int = 3, capacity: int | None = None, attention_impl: str = "xla",
                num_pages: int | None = None) -> EngineConfig:
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
    return EngineConfig(
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
        layer_loop=layer_loop(model.params),
        draft_layer_loop="unrolled" if draft_model is None else layer_loop(draft_model.params),
    )


def _setup(model, prompts, max_new_tokens, drafter, draft_model, depth, kv_advance, cache, temperature, top_k, top_p,
           seed, eos_id, ngram_n, attention_impl):
    """Validate (before any compile), build the static engine and the host-side batch."""
    seeds, news, stops = validate(model, prompts, max_new_tokens, drafter, draft_model, depth, cache, temperature,
                                  top_k, top_p, seed, eos_id)
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
    args = (
        jnp.asarray(toks), jnp.asarray(plen), jnp.asarray(plen + np.array(news, np.int32)),
        jnp.asarray(eos_table([stops] * b)), jnp.asarray(np.array(seeds, np.uint32)),
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
    eos_id: int | list[int] | None = None,
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
    ``eos_id``: one stop id or a list (a row stops at the first of any; Llama-3-Instruct's
    ``<|end_of_text|>`` and ``<|eot_id|>``).
    Caches hold ``request_capacity(prompt bucket, max(max_new_tokens), depth)`` slots per row,
    whatever the model's ``max_seq_len``. Compiles once per (batch, prompt-width bucket,
    capacity bucket, model, drafter, depth, cache kind, rule, greedy or sampled, attention);
    everything else is data. A cache that refused a write raises ``RuntimeError``.
    """
    eng, params, args = _setup(model, prompts, max_new_tokens, drafter, draft_model, depth, kv_advance, cache,
                               temperature, top_k, top_p, seed, eos_id, ngram_n, attention_impl)
    before = _TRACES["generate"]
    run, compile_s = _compiled(eng, params, args)
    t0 = time.perf_counter()
    st = jax.device_get(run(params, *args))
    run_s = time.perf_counter() - t0
    compiles = _TRACES["generate"] - before
    _check_status(st)
    result_metrics = metrics(st, eng, compiles)
    n_new = sum(int(k - p) for k, p in zip(st.known, st.prompt_len, strict=True))
    result_metrics.update(seconds_compile=compile_s, seconds_run=run_s, tok_per_s=n_new / run_s if run_s else 0.0)
    return GenerationResult(tokens(st), result_metrics)


_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_MAX = 32  # compiled generate loops kept (least recently used dropped)


def _compiled(eng: EngineConfig, params: dict, args: tuple):
    """The compiled generate loop for these static settings and shapes, and the seconds its
    compile took now (0.0 when it was cached): compile time and run time are measured apart."""
    leaves, tree = jax.tree.flatten((params, args))
    key = (eng, tree, tuple((x.shape, str(x.dtype), getattr(x, "weak_type", False)) for x in leaves))
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    fn = _generate.lower(eng, params, *args).compile()
    _COMPILED[key] = fn
    if len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return fn, time.perf_counter() - t0


def _check_status(st) -> None:
    """Surface any cache status bit (a refused write or advance) instead of returning tokens
    computed from a cache that fell behind."""
    bad = describe_status(st.cache.status)
    if bad:
        raise RuntimeError(f"KV cache refused a write or advance (engine bug or undersized cache): rows {bad}")


