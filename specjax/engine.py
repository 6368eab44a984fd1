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
import contextlib
import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass
from specjax.advance import KvAdvance
from specjax.advance import kv_advance as resolve_kv_advance
from specjax.cache import describe_status
from specjax.cache.base import CAPACITY_BLOCK, resolve_attention_impl
from specjax.depth_policy import (
    AutoState,
    CostTable,
    DepthPolicy,
    choose,
    init_estimates,
    load_cached_cost,
    optimistic,
    revealed,
    store_cached_cost,
    update_estimates,
)
from specjax.drafter import default_drafter, drafter_kind, resolve_drafter
from specjax.metrics import GenerationResult, metrics, tokens
from specjax.plan import plan_step
from specjax.protocols import Decoder, DecoderModel, Drafter, check_model, reachable_positions
from specjax.sampling import SAMPLE, RowSampling, derive_seed, position_keys, probs, sample
from specjax.sharding import (
    DATA,
    agree_max,
    constrain,
    data_shards,
    local_rows,
    put_rows,
    shard_model,
    shardings,
    state_specs,
)
from specjax.validate import MAX_DEPTH, eos_table, fail, resolve_depth, validate
from specjax.verify import greedy_verify, rejection_verify

__all__ = [
    "MAX_DEPTH", "EngineConfig", "EngineState", "GenerationResult", "generate", "make_engine", "prefill",
    "prompt_bucket", "request_capacity", "step",
]

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
    cache: Any  # the target's caches (``Decoder.init_cache``: a ``ModelCache``); cache.lengths = known - u
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
    seen_pos: jax.Array  # [B, depth]: verdicts at draft position k (accepted, or the first rejected)
    trace: jax.Array  # [B, max_steps]: accepted drafts at the row's own step k (-1 past its steps)
    est: jax.Array  # float32 [B, depth]: per-row acceptance estimates (updated under depth="auto")
    i: jax.Array  # int32 []: steps taken
    auto: AutoState | None = None  # depth="auto": the cost table, a forced window, window counts


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The static configuration of a generation: everything a compile depends on (hashable;
    a static argument of every jitted function). The state that changes is ``EngineState``."""

    target: Decoder  # the target model's static half (``specjax.protocols``); its params are ``params["target"]``
    drafter: Any
    depth: int
    kv_rule: KvAdvance
    cache_kind: str
    greedy: bool  # every row greedy: argmax, no distributions (else per-row ``RowSampling``)
    capacity: int  # cache slots per row (request-sized: ``request_capacity``)
    max_steps: int  # trace length (a step emits >= 1 token per active row, so capacity bounds it)
    draft: Decoder | None = None  # a draft model's (drafter "draft_model"); its params are ``params["draft"]``
    attention_impl: str = "xla"  # resolved: "xla" | "pallas"
    num_pages: int | None = None  # paged pool size (None: every row's full capacity)
    policy: DepthPolicy | None = None  # depth="auto": the windows the step picks from (depth = widest - 1)
    mesh: Any = None  # a ("data", "model") jax.sharding.Mesh (specjax.sharding), or None: one device
    pool_groups: int = 1  # paged pools: one per data shard (the mesh's data axis; ``PagedKVCache.split_pool``)

    @property
    def window(self) -> int:
        """The widest verify window (every step's, without a depth policy)."""
        return self.depth + 1

    @property
    def windows(self) -> tuple[int, ...]:
        return (self.window,) if self.policy is None else self.policy.windows

    @property
    def dtype(self) -> Any:
        return self.target.dtype

    def new_cache(self, dec: Decoder, batch: int) -> Any:
        """Empty caches of ``dec`` (the target or the draft model) for ``batch`` rows. Rolling and
        compressed caches reach a window plus chained draft writes (``2w + 2``) past the committed
        length; the prefill, however wide, is bounded per row (``bound_write``), so it does not
        size their rings. A paged pool is split into ``pool_groups`` pools (one per data shard)
        when the cache can be (``split_pool``)."""
        cache = dec.init_cache(batch, self.capacity, kind=self.cache_kind, slack=2 * self.window + 2,
                               page_size=PAGE_SIZE, num_pages=self.num_pages)
        if self.pool_groups > 1 and hasattr(cache, "split_pool"):
            cache = cache.split_pool(self.pool_groups)
        return cache


_TRACES = {"generate": 0}


def _prefill(eng: EngineConfig, params: dict, prompts: jax.Array, prompt_len: jax.Array, max_len, eos, seeds,
             sampling: RowSampling, cache: Any, dstate: Any, live: jax.Array) -> EngineState:
    """Run ``prompts [B, P]`` into the empty ``cache`` and drafter state ``dstate`` and take
    each row's first token. ``live [B]``: real rows (padding rows of a refill own no pages)."""
    b, p = prompts.shape
    c = eng.capacity
    seq = jnp.zeros((b, c), jnp.int32).at[:, :p].set(prompts)
    positions = reachable_positions(jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p)), max_len)
    hidden, cache = eng.target.forward_hidden(params["target"], prompts, positions,
                                              cache.reserve(p, live).bound_write(prompt_len),
                                              attention_impl=eng.attention_impl)
    cache = cache.advance(prompt_len)
    h_last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
    last = eng.target.head(params["target"], h_last)  # logits for the one position used
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
        seen_pos=jnp.zeros((b, d), jnp.int32), trace=jnp.full((b, eng.max_steps), -1, jnp.int32),
        est=init_estimates(b, d, eng.policy.prior if eng.policy else 0.5),
        i=jnp.int32(0),
    )
    return st.replace(dstate=eng.drafter.prefill(eng, params, st, hidden, positions, live))


def _fresh_prefill(eng: EngineConfig, params: dict, prompts, prompt_len, max_len, eos, seeds, sampling) -> EngineState:
    """``_prefill`` into new caches of the engine's full capacity (one static batch)."""
    b, p = prompts.shape
    return _prefill(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling,
                    eng.new_cache(eng.target, b),
                    eng.drafter.empty(eng, b, p), jnp.ones((b,), bool))


def _choice(eng: EngineConfig, st: EngineState) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Under a depth policy: the index of this step's window in ``eng.windows``, each row's
    draft count in it (``depth_policy.choose`` on the rows' estimates and the cost table), and
    each row's first draft where the drafter knows it now (``offer``), else -1."""
    pol = eng.policy
    active = ~st.done
    need = jnp.max(jnp.where(active, st.u, 1))  # the window must hold every row's re-fed tokens (cohort)
    upper = optimistic(st.est, st.seen_pos, pol.explore)  # an upper bound while the batch's verdicts are few
    idx, drafts = choose(st.est, active, st.auto.cost, pol.rule, min_window=need, threshold=pol.threshold,
                         min_gain=pol.min_gain, load=st.seq.shape[0],  # every slot computes: static shapes
                         remaining=st.max_len - st.known, shrink=pol.shrink, spread=pol.spread,
                         seen=st.seen_pos, pool=pol.pool, upper=upper)
    windows = jnp.asarray(pol.windows)
    narrowest = jnp.argmax(windows >= need).astype(jnp.int32)
    first = jnp.full(st.known.shape, -1, jnp.int32)
    if hasattr(eng.drafter, "offer"):  # rows that can offer fewer drafts now (n-gram: none without a match)
        can, first = eng.drafter.offer(eng, st)
        offered = jnp.minimum(drafts, can)
        holds = jnp.minimum(jnp.max(jnp.where(active, st.u + offered, 1)), windows[idx])
        idx = jnp.minimum(idx, jnp.argmax(windows >= holds)).astype(jnp.int32)  # the same drafts, a cheaper window
        # no verdict yet in the whole batch (a run's first step): look before drafting. A window-1
        # step judges every row's first draft for free (``first``), so it learns what a drafting
        # step would, at plain decoding's price; from the prior alone a batch of 32-64 n-gram rows
        # drafted the widest window once, where plain decoding was best (0.99x plain by steps)
        fresh = jnp.sum(jnp.where(active, st.seen_pos[:, 0], 0)) == 0
        idx = jnp.where(fresh, narrowest, idx).astype(jnp.int32)
    forced = st.auto.force >= 0  # cost measurement: this window, every row drafting (the widest before force_from)
    at = jnp.where(st.i < st.auto.force_from, len(pol.windows) - 1, st.auto.force)
    return jnp.where(forced, jnp.maximum(at, narrowest), idx), jnp.where(forced, eng.depth, drafts), first


def _pick(eng: EngineConfig, st: EngineState) -> EngineState:
    """``st`` with the next step's choice (``_choice``) kept in ``st.auto.pick`` / ``.drafts`` / ``.first``."""
    idx, drafts, first = _choice(eng, st)
    return st.replace(auto=st.auto.replace(pick=idx, drafts=drafts, first=first))


def _chosen_step(eng: EngineConfig, params: dict, k: int):
    """The step at window ``eng.windows[k]`` with each row's chosen draft count, counted; then
    the choice for the step after it."""
    def body(st: EngineState) -> EngineState:
        counted = st.auto.window_steps + (jnp.arange(len(eng.windows)) == k)  # elementwise: fuses
        st = st.replace(auto=st.auto.replace(window_steps=counted.astype(jnp.int32)))
        return _pick(eng, _step_window(eng, params, st, eng.policy.windows[k], st.auto.drafts))
    return body


def run_steps(eng: EngineConfig, params: dict, st: EngineState, keep_going) -> EngineState:
    """Steps while ``keep_going(state)`` (a traced bool): ``lax.while_loop`` over ``_step``.

    Under a depth policy the window is dispatched by one inner ``while_loop`` per window
    (each runs while the policy keeps choosing it), not by ``lax.switch``: XLA copies every
    buffer a conditional's branches update in place (the caches, each step), while a loop
    updates its carry in place. Each outer trip runs at least one step.

    A drafter that defers work over window-1 steps (``settle`` / ``backlog``: the MTP block)
    settles it before a drafting window runs, and when its backlog reaches ``R``; those
    settles are loops of at most one trip, for the same in-place reason.

    The choice is made once per step, after it (``_pick``; and once on entry: a batch job
    changes rows between calls), and kept in the state: the loops' conditions only read it."""
    if eng.policy is None:
        return jax.lax.while_loop(keep_going, lambda s: _step(eng, params, s), st)
    drafter = eng.drafter
    full = drafter.backlog_size(eng) if hasattr(drafter, "settle") else 0  # R; 0: the drafter defers nothing

    def settle(s):
        return s.replace(dstate=drafter.settle(eng, params, s))

    def dispatch(k: int, w: int):
        """(when a settle is due before window k's loop, or None; while window k's loop runs)"""
        def chosen(s):
            return keep_going(s) & (s.auto.pick == k)
        if not full:
            return None, chosen
        if w == 1:  # plain steps pile up until the backlog is full
            return (lambda s: chosen(s) & (drafter.backlog(s.dstate) >= full),
                    lambda s: chosen(s) & (drafter.backlog(s.dstate) < full))
        return lambda s: chosen(s) & (drafter.backlog(s.dstate) > 0), chosen  # a drafting step starts settled

    def trip(st):
        for k, w in enumerate(eng.windows):
            due, runs = dispatch(k, w)
            if due is not None:
                st = jax.lax.while_loop(due, settle, st)
            st = jax.lax.while_loop(runs, _chosen_step(eng, params, k), st)
        return st
    return jax.lax.while_loop(keep_going, trip, _pick(eng, st))


def _step(eng: EngineConfig, params: dict, st: EngineState) -> EngineState:
    """One speculative step for every row: draft, verify, commit. Pure: ``state -> state``.

    Under a depth policy the step first picks its window from ``eng.windows`` and each row's
    draft count in it (``_choice``; no host sync), then runs exactly that window's step (the
    dispatch of ``run_steps``, limited to one step)."""
    if eng.policy is None:
        return _step_window(eng, params, st, eng.window, None)
    start = st.i
    return run_steps(eng, params, st, lambda s: s.i == start)


def _step_window(eng: EngineConfig, params: dict, st: EngineState, w: int, limit: jax.Array | None) -> EngineState:
    """The step at verify window ``w`` (static, ``<= eng.window``); ``limit [B]``: the policy's
    draft count for each row (``None``: a fixed depth), which caps what the row proposes unless
    the policy fills the window (``DepthPolicy.fill``). State arrays keep the engine's ``depth``."""
    d, dmax = w - 1, eng.depth
    b, c = st.seq.shape
    lengths, u, active = st.cache.lengths, st.u, ~st.done
    at_w = eng if w == eng.window else dataclasses.replace(eng, depth=d, policy=None)
    drafts, draft_probs, dstate = eng.drafter.propose(at_w, params, st)
    drafts = drafts[:, :d]  # an MTP chain yields its first draft even at depth 0
    draft_probs = None if draft_probs is None else draft_probs[:, :d]
    # every slot of the window (a fixed depth; a policy's ``fill``) or the policy's own count
    proposed = w - u
    if limit is not None:
        proposed = jnp.clip(proposed if eng.policy.fill else jnp.minimum(proposed, limit), 0, None)
    # what the row was asked for (its estimates learn from it: a draft the row could not offer
    # counts as rejected, so they stay long-run rates) and what it offers to verify
    intended = proposed
    if limit is not None and w > 1 and hasattr(eng.drafter, "offer"):  # window 1 proposes none (u >= 1)
        proposed = jnp.minimum(proposed, eng.drafter.available(eng, st))

    # the window: u known tokens, then w - u drafts, at this row's own offset
    j = jnp.arange(w, dtype=jnp.int32)[None]
    pos = lengths[:, None] + j
    known_tok = jnp.take_along_axis(st.seq, jnp.clip(pos, 0, c - 1), axis=1)
    if d:
        draft_tok = jnp.take_along_axis(drafts, jnp.clip(j - u[:, None], 0, d - 1), axis=1)
        window = jnp.where(j < u[:, None], known_tok, draft_tok)
    else:
        window = known_tok
    hidden, cache = eng.target.forward_hidden(params["target"], window, reachable_positions(pos, st.max_len),
                                              st.cache.reserve(w, st.live),
                                              attention_impl=eng.attention_impl)
    logits = eng.target.head(params["target"], hidden)  # [B, w, V]

    if eng.greedy:
        a, nxt = greedy_verify(logits, drafts, u, proposed)
    else:
        a, nxt = rejection_verify(logits, drafts, draft_probs, u, lengths, st.seeds, st.sampling, proposed)

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
    dstate = eng.drafter.commit(at_w, params, st, dstate, hidden, lengths, u, jnp.where(active, a, 0), advance)

    act = active.astype(jnp.int32)
    kd = jnp.arange(dmax, dtype=jnp.int32)[None]
    est = st.est
    # the verdicts the estimates learn from: the drafts' own, or at window 1, where the drafter
    # knew a row's first draft (``_pick``: n-gram), whether the target's token is that draft. Free
    # (nothing more runs) and exact: greedy, ``nxt`` is the argmax; sampling, ``nxt ~ p`` and
    # ``P(nxt = x) = p(x)``, a one-hot draft's acceptance probability. A row without a match is
    # judged rejected, as its unoffered draft is in a drafting window: the estimates stay each
    # row's long-run rate, which the makespan rule prices as if every step drafted (a rate
    # conditioned on a match, as learned first, had batches of 8-64 drafting wide windows for the
    # half of their rows that held one). A row whose first drafts failed still recovers its
    # estimate without drafting at a loss.
    told, told_a = intended, a
    if limit is not None and w == 1 and hasattr(eng.drafter, "offer"):
        hit = (st.auto.first >= 0) & (st.auto.first == nxt)
        told, told_a = jnp.ones_like(a), hit.astype(jnp.int32)
    if eng.policy is not None:
        pol = eng.policy
        est = jnp.where(active[:, None], update_estimates(est, told, told_a, pol.rate, st.auto.prior, pol.relax,
                                                          st.seen_pos, pol.prior_weight, pol.relax_early), est)
    out = st.replace(
        dstate=dstate,
        steps=st.steps + act,
        emitted=st.emitted + n_new,
        accepted=st.accepted + jnp.minimum(a, n_new) * act,  # drafts emitted: none cut by EOS/budget
        proposed=st.proposed + proposed * act,
        acc_pos=st.acc_pos + ((kd < a[:, None]) & active[:, None]).astype(jnp.int32),
        prop_pos=st.prop_pos + ((kd < intended[:, None]) & active[:, None]).astype(jnp.int32),
        seen_pos=st.seen_pos + (revealed(told, told_a, dmax) & active[:, None]).astype(jnp.int32),
        trace=st.trace.at[jnp.arange(b), jnp.where(active, st.steps, eng.max_steps)].set(a, mode="drop"),
        est=est,
        i=st.i + 1,
    )
    return constrain(out, eng.mesh)  # under a mesh: every per-row array stays on its data shard


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


def _generate_loop(eng: EngineConfig, params: dict, prompts, prompt_len, max_len, eos, seeds, sampling,
              auto: AutoState | None, stop_i: jax.Array) -> EngineState:
    """Prefill, then steps until every row is done (or ``stop_i`` steps: cost measurement)."""
    _TRACES["generate"] += 1
    st = _fresh_prefill(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling)
    st = constrain(st if auto is None else with_auto(st, auto), eng.mesh)
    return run_steps(eng, params, st, lambda st: jnp.any(~st.done) & (st.i < jnp.minimum(eng.max_steps, stop_i)))


_generate = jax.jit(_generate_loop, static_argnums=0)


def _generate_on(eng: EngineConfig, params: dict, args: tuple):
    """``_generate`` for ``eng.mesh``: its final state placed by the sharding table (the loop's
    per-step constraints place the state inside; this pins what the caller receives)."""
    before = _TRACES["generate"]
    out = jax.eval_shape(functools.partial(_generate_loop, eng), params, *args)
    _TRACES["generate"] = before  # shapes only: not a compile of the loop
    return jax.jit(_generate_loop, static_argnums=0, out_shardings=shardings(state_specs(out, eng.mesh), eng.mesh))


def prompt_bucket(prompts: list[list[int]]) -> int:
    """Padded prompt width of a batch: the longest prompt rounded up to a power of two (>= 8).
    Each bucket is its own compile (warm every bucket before timing)."""
    return max(8, 1 << (max(len(p) for p in prompts) - 1).bit_length())


def make_engine(model: DecoderModel, *, drafter, draft_model, depth, kv_advance_rule, cache, greedy: bool = True,
                ngram_n: int = 3, capacity: int | None = None, attention_impl: str = "xla",
                num_pages: int | None = None, policy: DepthPolicy | None = None, mesh=None,
                pool_groups: int | None = None) -> EngineConfig:
    """The static engine. ``capacity`` (cache slots per row; ``request_capacity``) defaults to
    what the model's longest sequence would need; ``generate`` passes the request's.
    ``greedy``: every row decodes greedily (no distributions are built); otherwise each row
    samples under its own ``RowSampling`` (a temperature-0 row stays exactly greedy).
    ``policy`` (``depth="auto"``): the step picks its window from ``policy.windows`` and
    ``depth`` must be the widest minus one. ``mesh``: the ``("data", "model")`` mesh the
    model was sharded for (``specjax.sharding``; ``None``: one device). ``pool_groups``: paged
    pools per batch (default: the mesh's data axis, one pool per data shard; 1 without). ``model`` and
    ``draft_model`` follow the model protocol (``specjax.protocols``); ``drafter`` is a name,
    ``None`` or a drafter object (``specjax.protocols.Drafter``)."""
    kind = drafter_kind(drafter)
    d = 0 if kind is None else depth
    if kind is None:
        policy = None
    if policy is not None and policy.windows[-1] != d + 1:
        raise ValueError(f"policy windows {policy.windows} must end at depth + 1 = {d + 1}")
    target = check_model("model", model)
    if capacity is None:
        capacity = request_capacity(0, target.max_seq_len, d)
    return EngineConfig(
        target=target,
        drafter=resolve_drafter(drafter, ngram_n),
        depth=d,
        kv_rule=kv_advance_rule,
        cache_kind=cache,
        greedy=bool(greedy),
        capacity=capacity,
        max_steps=capacity,
        draft=None if draft_model is None or kind != "draft_model" else check_model("draft_model", draft_model),
        attention_impl=resolve_attention_impl(attention_impl),
        num_pages=num_pages,
        policy=policy,
        mesh=mesh,
        pool_groups=data_shards(mesh) if pool_groups is None else pool_groups,
    )


def _setup(model, prompts, max_new_tokens, drafter, draft_model, depth, kv_advance, cache, temperature, top_k, top_p,
           seed, eos_id, ngram_n, attention_impl, max_depth=3, cost=None, mesh=None):
    """Validate (before any compile), build the static engine and the host-side batch (placed
    on the mesh's data shards under ``mesh``; the model and draft model sharded for it)."""
    drafter = default_drafter(drafter, model, draft_model)
    depth, policy = resolve_depth(depth, max_depth, drafter, static_batch=True)
    check_cost(cost, policy)
    total = len(prompts) * jax.process_count()
    check_mesh(mesh, total, "prompts", f"{total} rows", ": pad the batch", policy is not None and cost is None)
    seeds, news, stops = validate(model, prompts, max_new_tokens, drafter, draft_model, cache, temperature, top_k,
                                  top_p, seed, eos_id)
    if mesh is not None:
        model = shard_model(model, mesh)
        draft_model = None if draft_model is None else shard_model(draft_model, mesh, replicate=True)
    rule = resolve_kv_advance(kv_advance)
    width, longest = prompt_bucket(prompts), max(news)
    if mesh is not None and jax.process_count() > 1:  # every process compiles the same program: agree on its shapes
        width, longest = agree_max([width, longest])
        if isinstance(seed, int):  # a base seed: rows numbered globally (process p holds rows p*b ...)
            seeds = [derive_seed(seed, jax.process_index() * len(prompts) + i) for i in range(len(prompts))]
    capacity = request_capacity(width, longest, depth)
    eng = make_engine(model, drafter=drafter, draft_model=draft_model, depth=depth, kv_advance_rule=rule,
                      cache=cache, greedy=temperature == 0, ngram_n=ngram_n, capacity=capacity,
                      attention_impl=attention_impl, policy=policy, mesh=mesh)
    b = len(prompts)
    toks = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):  # host-side batch assembly
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    params = {"target": model.params}
    if eng.draft is not None:
        params["draft"] = draft_model.params
    if getattr(eng.drafter, "data", None) is not None:  # a drafter's data (``specjax.controlled``): not static
        params["drafter"] = eng.drafter.data
    args = (toks, plen, plen + np.array(news, np.int32), eos_table([stops] * b), np.array(seeds, np.uint32),
            RowSampling.rows([temperature] * b, [top_k] * b, [top_p] * b, host=True))
    if mesh is None:
        return eng, params, jax.device_put(args)  # one batched transfer (a call per array: ~1 ms of host time)
    return eng, params, jax.tree.map(lambda x: _put(x, mesh), args)


def mesh_context(eng: EngineConfig):
    """Trace under the engine's mesh (``jax.set_mesh``: attention runs per shard, ``per_shard``)."""
    return contextlib.nullcontext() if eng.mesh is None else jax.set_mesh(eng.mesh)


def _put(x: np.ndarray, mesh) -> jax.Array:
    """A host array onto the device (one device), or this process's rows onto the mesh's data shards."""
    return jax.device_put(x) if mesh is None else put_rows(x, mesh)


def check_mesh(mesh, rows: int, arg: str, value: object, hint: str = "", policy_needs_table: bool = False) -> None:
    """``mesh``: ``None`` or a ``specjax.make_mesh`` mesh whose data axis divides ``rows`` (the
    batch over every process; the argument ``arg=value`` that sets it is named in the error)."""
    if mesh is None:
        return
    if not isinstance(mesh, jax.sharding.Mesh) or set(mesh.axis_names) != {DATA, "model"}:
        fail("mesh", mesh, "must be a jax.sharding.Mesh with axes ('data', 'model'): specjax.make_mesh(data=, model=)")
    if policy_needs_table and jax.process_count() > 1:
        fail("cost", None, "depth='auto' on many processes needs a given cost table (each process would measure "
             "its own): pass cost=")
    if rows % mesh.shape[DATA]:
        fail(arg, value, f"must divide by the mesh's data axis ({mesh.shape[DATA]}){hint}")


def generate(
    model: DecoderModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int | list[int],
    drafter: str | Drafter | None = "auto",
    draft_model: DecoderModel | None = None,
    depth: int | str = 3,
    kv_advance: str | KvAdvance | None = None,
    cache: str = "dense",
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | list[int] = 0,
    eos_id: int | list[int] | None = None,
    ngram_n: int = 3,
    attention_impl: str = "auto",
    max_depth: int = 3,
    cost: CostTable | str | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt (one int, or one per prompt) with
    speculative decoding. One static batch: it runs until its slowest row finishes (for a
    stream of requests refilling finished rows, see ``batch_generate``).

    ``drafter``: ``"auto"`` (``"mtp"`` if the model has an MTP module, else ``"draft_model"``
    if ``draft_model`` is given, else ``"ngram"``), one of those names, ``None`` (plain
    autoregressive decoding on the same step: the baseline) or a drafter object of your own
    (``specjax.protocols.Drafter``). ``model`` and
    ``draft_model`` follow the model protocol (``specjax.protocols``: specjax's ``Model``, a
    Flax NNX module through ``specjax.nnx_model``, or your own).
    ``kv_advance``: ``"per_sequence"`` | ``"cohort"`` | ``None`` (the latched rule).
    ``attention_impl``: ``"xla"`` | ``"pallas"`` | ``"auto"`` (Pallas on TPU, XLA on GPU and CPU).
    ``seed``: one int (each row's seed is derived from it and the row index, so rows
    differ) or one seed per prompt (used as given: a row with an explicit seed gives the
    same tokens alone or in any batch). ``temperature``, ``top_k`` and ``top_p`` are data.
    ``eos_id``: one stop id or a list (a row stops at the first of any; Llama-3-Instruct's
    ``<|end_of_text|>`` and ``<|eot_id|>``).
    ``depth="auto"``: each step picks its verify window from 1 .. ``max_depth + 1`` and each row
    its draft count, maximising expected tokens per second (``specjax.depth_policy``: per-row
    acceptance estimates on device, a step-cost table). ``cost``: that table (a ``CostTable``
    or a JSON file); by default it is measured at warm-up (a few timed steps per window) and
    kept on disk (``depth_policy.cost_cache_path()``). Greedy tokens never depend on the
    choices; sampled rows stay lossless, but their draws follow the batch's window choices.
    Caches hold ``request_capacity(prompt bucket, max(max_new_tokens), depth)`` slots per row,
    whatever the model's ``max_seq_len``. Compiles once per (batch, prompt-width bucket,
    capacity bucket, model, drafter, depth, cache kind, rule, greedy or sampled, attention);
    everything else is data. A cache that refused a write raises ``RuntimeError``.

    ``mesh`` (``specjax.make_mesh``): run on many devices: the batch split over ``"data"``, the
    model over ``"model"`` (``specjax.sharding``; the model is sharded for it unless
    ``shard_model`` already did). Only the new tokens, counters and cache status come back to
    the host. With many processes (``jax.distributed``) each passes its own prompts (the same
    count everywhere) and gets its own rows back.
    """
    eng, params, args = _setup(model, prompts, max_new_tokens, drafter, draft_model, depth, kv_advance, cache,
                               temperature, top_k, top_p, seed, eos_id, ngram_n, attention_impl, max_depth, cost,
                               mesh)
    before = _TRACES["generate"]
    b = len(prompts) * (1 if mesh is None else jax.process_count())
    table, cost_source, key, auto = None, None, None, None
    if eng.policy is not None:  # a given or cached table: no placeholder state, one transfer of the real one
        key = cost_key(eng, [np.shape(a) for a in args[:2]])
        table, cost_source = known_cost(eng, cost, key)
        auto = _put_auto(auto_state(eng, placeholder_cost(eng, b) if table is None else table, b), mesh)
    limit = _put(np.int32(eng.max_steps), mesh)
    run, compile_s = _compiled(eng, params, (*args, auto, limit))
    if auto is not None and table is None:
        # each window timed over the whole generation (every step to the end, the prefill-only
        # call subtracted): the context spans the real run's, and the timed part dwarfs the noise
        # of the subtraction (a 32-step window-1 slice at B=8 was under a third of its call)
        table, cost_source = measured_cost(eng, b, key,
                                           lambda k, w, n: _timed_generate(run, params, args, auto, k, w, n),
                                           steps=eng.max_steps)
        auto = _put_auto(auto_state(eng, table, b), mesh)
    t0 = time.perf_counter()
    st, status = fetch(eng, run(params, *args, auto, limit))
    run_s = time.perf_counter() - t0
    compiles = _TRACES["generate"] - before
    _check_status(status)
    result_metrics = metrics(st, eng, compiles)
    if cost_source is not None:
        result_metrics["cost_source"] = cost_source
    n_new = sum(int(k - p) for k, p in zip(st.known, st.prompt_len, strict=True))
    result_metrics.update(seconds_compile=compile_s, seconds_run=run_s, tok_per_s=n_new / run_s if run_s else 0.0)
    return GenerationResult(tokens(st), result_metrics)


# ----------------------------------------------------------------------------- depth="auto": the cost table


def check_cost(cost: object, policy: DepthPolicy | None) -> None:
    """``cost`` must be ``None``, a ``CostTable`` over the policy's windows, or a file path."""
    if cost is None:
        return
    if policy is None:
        fail("cost", cost, "is the step-cost table of depth='auto'; this depth is fixed")
    if isinstance(cost, CostTable):
        if cost.windows != policy.windows:
            fail("cost", f"windows {list(cost.windows)}", f"must be depth='auto''s windows {list(policy.windows)}")
    elif not isinstance(cost, str | os.PathLike):
        fail("cost", cost, "must be a CostTable, a JSON file path, or None (measured at warm-up)")


def auto_state(eng: EngineConfig, table: CostTable, batch: int) -> AutoState:
    """The depth policy's data for a ``batch``-slot engine: ``table`` read at ``batch`` (every
    slot computes, so that is the only load the step sees; one shape for any table: no
    recompile), its prior (the table's ``acceptance`` where given, else ``DepthPolicy.prior``),
    no window forced, no steps counted. Built on the host and placed in one
    transfer (a dozen small device ops and a read-back cost ~1 ms of host time a call)."""
    at = CostTable(np.asarray([batch], np.float32), table.row(batch)[None], table.windows)
    i32 = np.int32
    host = AutoState(at, i32(-1), i32(0), np.zeros((len(eng.windows),), i32), i32(0), np.zeros((batch,), i32),
                     np.full((batch,), -1, i32), table.prior(eng.policy.prior))
    return jax.device_put(host)


def with_auto(st: EngineState, auto: AutoState) -> EngineState:
    """A fresh state (every row just prefilled) under ``auto``: its rows' estimates start at the
    table's prior (``AutoState.prior``)."""
    return st.replace(auto=auto, est=jnp.broadcast_to(auto.prior, st.est.shape))


def placeholder_cost(eng: EngineConfig, batch: int) -> CostTable:
    """Every window costing the same: used while the real table is measured."""
    return CostTable.create(eng.windows, [batch], [[1.0] * len(eng.windows)])


def cost_key(eng: EngineConfig, shapes: list) -> dict:
    """What a step's cost depends on: the device, the static engine, the batch's ``shapes``
    (and how it is run: ``generate``'s loop, ``stream``'s steps or a batch job's)."""
    dev = jax.devices()[0]
    # 3: generate's tables timed over whole runs in interleaved rounds (measure_cost); 4: the MTP
    # block's cache the target's size (its drafting steps got cheaper: older tables overrate them);
    # 5: drafting windows flattened downward (monotone_costs: older tables priced them at the slowest)
    return {"v": 5,
            "backend": dev.platform, "device": dev.device_kind, "devices": jax.device_count(),
            "jax": jax.__version__, "engine": repr(eng), "shapes": [list(x) for x in shapes]}


def _timed_generate(run, params, args, auto: AutoState, force: int, warm: int, steps: int) -> tuple[float, int]:
    """Seconds of the compiled loop run to ``warm + steps`` steps, the last ``steps`` at window
    ``force`` (the ``warm`` before at the widest), and the steps it took past ``warm``."""
    t0 = time.perf_counter()
    st = run(params, *args, auto.replace(force=jnp.int32(force), force_from=jnp.int32(warm)),
             jnp.int32(warm + steps))
    i = int(st.i)  # blocks until the loop is done
    return time.perf_counter() - t0, max(i - warm, 0)


def measure_cost(eng: EngineConfig, batch: int, timed, *, warm: int = 0, steps: int = 32, rounds: int = 3,
                 max_rounds: int = 16, budget_s: float = 4.0, baseline: bool = True) -> CostTable | None:
    """Seconds per step at each window. ``timed(window index, warm, steps) -> (seconds, steps
    taken)`` runs the engine's own compiled steps: ``warm`` at the widest window (so the timed
    steps see a grown context: a wide window's attention cost grows with it), then ``steps``
    at the window. The windows (and, with ``baseline``, the same call stopped after the warm
    steps: a loop's prefill, warm-up and dispatch, subtracted) are timed in interleaved rounds,
    the order rotating from round to round, so a slow spell of a shared machine falls on
    different windows in different rounds rather than on every repeat of one; each keeps its
    fastest. ``rounds`` rounds, more (up to ``max_rounds``) while the measurement has taken
    under ``budget_s`` (cheap steps get more samples). A wider window never costs less than a
    narrower one (``monotone_costs``). With no step past the warm-up (rows finished) it
    retries without one; ``None`` when no step ran."""
    calls = ([-1] if baseline else []) + list(range(len(eng.windows)))
    best = dict.fromkeys(calls, np.inf)
    taken = dict.fromkeys(calls, 0)
    t0, r = time.perf_counter(), 0
    while r < rounds or (r < max_rounds and time.perf_counter() - t0 < budget_s):
        for c in calls[r % len(calls):] + calls[:r % len(calls)]:
            s, n = timed(max(c, 0), warm, 0 if c < 0 else steps)
            best[c], taken[c] = min(best[c], s), max(taken[c], n)
        if r == 0 and min(taken[k] for k in calls if k >= 0) == 0:
            return measure_cost(eng, batch, timed, steps=steps, rounds=rounds, max_rounds=max_rounds,
                                budget_s=budget_s, baseline=baseline) if warm else None
        r += 1
    base = best[-1] if baseline else 0.0
    secs = [max(best[k] - base, 1e-6) / taken[k] for k in range(len(eng.windows))]
    return CostTable.create(eng.windows, [batch], [monotone_costs(secs).tolist()])


def monotone_costs(secs) -> np.ndarray:
    """Measured seconds per step at ascending windows, made non-decreasing. A shared machine
    only ever slows a run, so the fastest of a few is high by noise, never low: where a wider
    drafting window measured cheaper than a narrower one, the narrower one's figure is the
    inflated one and takes the wider's (flattened downward). Before, the wider took the
    narrower's: one slow window priced every wider one at its figure (n-gram at B=1: windows
    2-4 all at 2.08x window 1 where whole runs gave depth 1 the speed of plain decoding). The
    narrowest window (plain decoding) keeps its own figure and the others never go under it:
    pricing drafting as free is the costly mistake at large batch."""
    s = np.asarray(secs, np.float64)
    return np.maximum(np.concatenate([s[:1], np.minimum.accumulate(s[:0:-1])[::-1]]), s[0])


def warm_steps(max_new_tokens: int) -> int:
    """Widest-window steps before the timed ones, so they see some context (a few: the cost
    measured after 16 steps and after 40 differed by under 6% on the bundled model)."""
    return min(max_new_tokens // 16, 8)


# how stream and batch jobs time a window: slices of one state that keeps advancing, 2 runs a window
SLICES = {"steps": 24, "rounds": 2, "max_rounds": 2, "baseline": False}


def known_cost(eng: EngineConfig, cost, key: dict) -> tuple[CostTable | None, str | None]:
    """``cost_table`` without measuring: a given table (``"given"``), one cached on disk under
    ``key`` (``"cached"``), or ``(None, None)``."""
    if isinstance(cost, CostTable):
        return cost, "given"
    if cost is not None:
        table = CostTable.load(cost)
        check_cost(table, eng.policy)
        return table, "given"
    table = load_cached_cost(key)
    return (table, "cached") if table is not None else (None, None)


def cost_table(eng: EngineConfig, batch: int, cost, key: dict, timed, **measure) -> tuple[CostTable, str]:
    """The table ``depth="auto"`` decides by, and where it came from: ``"given"`` (a
    ``CostTable`` or file), ``"cached"`` (measured earlier, on disk) or ``"measured"`` now
    (``measure_cost`` with the ``measure`` settings)."""
    table, source = known_cost(eng, cost, key)
    return (table, source) if table is not None else measured_cost(eng, batch, key, timed, **measure)


def measured_cost(eng: EngineConfig, batch: int, key: dict, timed, **measure) -> tuple[CostTable, str]:
    """``cost_table``'s last resort: measured now (``"measured"``) and kept on disk under ``key``,
    or, with no step to time, the placeholder (``"none"``)."""
    table = measure_cost(eng, batch, timed, **measure)
    if table is None:
        return placeholder_cost(eng, batch), "none"
    store_cached_cost(key, table)
    return table, "measured"


_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_MAX = 32  # compiled generate loops kept (least recently used dropped)


def _compiled(eng: EngineConfig, params: dict, args: tuple):
    """The compiled generate loop for these static settings and shapes, and the seconds its
    compile took now (0.0 when it was cached): compile time and run time are measured apart."""
    leaves, tree = jax.tree.flatten((params, args))
    key = (eng, tree, tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves))
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    with mesh_context(eng):
        run = _generate if eng.mesh is None else _generate_on(eng, params, args)
        fn = run.lower(eng, params, *args).compile()
    _COMPILED[key] = fn
    if len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return fn, time.perf_counter() - t0


def row_status(eng: EngineConfig, st: EngineState) -> jax.Array:
    """int32 ``[B]``: each row's status bits, the target's caches' and those of the drafter's
    own (``drafter.status``: the MTP block's, a draft model's; a drafter that keeps no cache has none)."""
    if not hasattr(eng.drafter, "status"):
        return st.cache.status
    return st.cache.status | eng.drafter.status(st.dstate)


def fetch(eng: EngineConfig, st: EngineState) -> tuple[EngineState, np.ndarray]:
    """What comes back to the host from a finished state: every array but the caches and the
    drafter state (this process's rows of them), and the rows' status ``[B]`` (``row_status``)."""
    small = st.replace(cache=None, dstate=None)
    if eng.mesh is None:  # one device: one batched read-back (a read per array was ~30 syncs a call)
        return jax.tree.map(np.asarray, jax.device_get((small, row_status(eng, st))))
    return jax.tree.map(local_rows, small), local_rows(row_status(eng, st))


def _put_auto(auto: AutoState, mesh) -> AutoState:
    """``depth="auto"``'s data, replicated on every device of ``mesh`` (explicitly placed;
    without one it stays where ``auto_state`` put it)."""
    if mesh is None:
        return auto
    return jax.device_put(auto, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _check_status(status) -> None:
    """Surface any cache status bit (a refused write or advance) instead of returning tokens
    computed from a cache that fell behind."""
    bad = describe_status(status)
    if bad:
        raise RuntimeError(f"KV cache refused a write or advance (engine bug or undersized cache): rows {bad}")


