"""The jitted slot operations of continuous batching: admit (prefill into free slots), the
chunked admit's begin / chunk / chunk-with-a-step / finish, release, decode, and the paged
pool's lending between the live state and pending rows."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax.auto import auto_state
from specjax.auto.cost import placeholder_cost
from specjax.cache import PagedKVCache
from specjax.engine import (
    EngineConfig,
    EngineState,
    chunk_commit,
    chunk_window,
    new_state,
    pending_rows,
    prefill_chunk,
    prefill_rows,
    run_steps,
    step_and_chunk,
)
from specjax.generation import mesh_context
from specjax.sampling import RowSampling
from specjax.sharding import constrain, shardings, state_specs
from specjax.validate import EOS_WIDTH

_TRACES = {"admit": 0, "decode": 0, "begin": 0, "chunk": 0, "chunk_step": 0, "finish": 0}


_ROW_FIELDS = ("seq", "known", "u", "prompt_len", "max_len", "eos", "seeds", "live", "done", "steps", "emitted",
               "accepted", "proposed", "acc_pos", "prop_pos", "seen_pos", "trace", "est", "branch_tested",
               "branch_accepted")


def _put_rows(eng: EngineConfig, st: EngineState, rows: jax.Array, sub: EngineState) -> EngineState:
    """``st`` with rows ``rows [R]`` replaced by ``sub``'s (index ``slots``: padding, dropped)."""
    put = lambda big, small: big.at[rows].set(small, mode="drop")  # noqa: E731
    fields = {f: put(getattr(st, f), getattr(sub, f)) for f in _ROW_FIELDS}
    return st.replace(
        **fields,
        sampling=jax.tree.map(put, st.sampling, sub.sampling),
        cache=st.cache.put_rows(rows, sub.cache),
        dstate=eng.drafter.put_rows(st.dstate, rows, sub.dstate),
    )


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def admit(eng: EngineConfig, c: int | None, params: dict, st: EngineState, idle: jax.Array, rows: jax.Array,
          prompts: jax.Array, prompt_len, max_len, eos, seeds, sampling: RowSampling,
          shared: tuple | None = None) -> EngineState:
    """Release the pages of ``idle [B]`` slots, prefill ``prompts [R, P]`` and put them in
    slots ``rows [R]`` (``B`` for a padding row). Every other row is untouched.
    ``shared = (pages [pools, R, M], count [R], upto [R])`` (the prefix cache; pools: the
    target's, then a draft model's): row ``r`` starts on cached pages ``pages[:, r, :count[r]]``,
    computes only the rest of its prompt (``c`` tokens wide, static; ``None``: ``P``), and its
    first ``upto[r]`` pages are registered as cached."""
    _TRACES["admit"] += 1
    st = _release(eng, st, idle)
    sub = prefill_rows(eng, params, *_views(eng, st, rows, prompts, prompt_len, max_len, eos, seeds, sampling,
                                            shared), c=c)
    if shared is None:
        return _place(eng, st, rows, sub)
    return _keep_prefix(eng, _place(eng, st, rows, _register(sub, shared[2])), rows, shared[2])


def _release(eng: EngineConfig, st: EngineState, idle: jax.Array) -> EngineState:
    """The pages (and drafter pages) of ``idle [B]`` slots back to the pool; they hold nothing."""
    return st.replace(cache=st.cache.release(idle), dstate=eng.drafter.release(st.dstate, idle),
                      live=st.live & ~idle)


def _views(eng: EngineConfig, st: EngineState, rows: jax.Array, prompts: jax.Array, prompt_len, max_len, eos, seeds,
           sampling: RowSampling, shared: tuple | None = None) -> tuple:
    """``prefill_rows``' / ``pending_rows``' arguments after ``params``: empty per-row views of
    the live caches for ``rows [R]`` (``B``: padding) of ``prompts [R, P]`` (``shared``: the
    cached pages each row starts on, ``admit``)."""
    p = prompts.shape[1]
    if shared is None:
        return (prompts, prompt_len, max_len, eos, seeds, sampling, st.cache.rows_view(rows, p),
                eng.drafter.rows_view(eng, st.dstate, rows, p), rows < st.seq.shape[0])
    pages, count, _ = shared
    if pages.shape[0] > 1:  # a draft model's pool
        draft = st.dstate.rows_view(rows, p, (pages[1], count))
    elif getattr(st.dstate, "prefix", None) is not None:  # the MTP block's store of cached pages
        draft = eng.drafter.rows_view(eng, st.dstate, rows, p, (pages[0], count))
    else:
        draft = eng.drafter.rows_view(eng, st.dstate, rows, p)
    return (prompts, prompt_len, max_len, eos, seeds, sampling, st.cache.rows_view(rows, p, (pages[0], count)),
            draft, rows < st.seq.shape[0])


def _place(eng: EngineConfig, st: EngineState, rows: jax.Array, sub: EngineState) -> EngineState:
    """Prefilled rows ``sub`` into slots ``rows``; under a step controller they start at the
    table's prior (only the rows' fields are put)."""
    if eng.controller is not None:
        sub = eng.controller.init(eng, sub, st.auto)
    return constrain(_put_rows(eng, st, rows, sub), eng.mesh)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def begin_chunked(eng: EngineConfig, st: EngineState, rows: jax.Array, prompts: jax.Array, prompt_len, max_len, eos,
                  seeds, sampling: RowSampling, shared: tuple | None = None) -> tuple[EngineState, EngineState]:
    """A chunked admit's rows, pending (``pending_rows``): their prompts known, nothing cached.
    Dense views are their own buffers; a paged pool keeps one owner, the live state, which
    holds the rows' (emptied) pool entries from here on (``_give``). There the rows are done
    (no step advances them) but live: a step still writes its window past their length, so
    it reserves the pages for it (rolled back after), and no write is refused and flagged;
    the next chunk writes over those slots before anything reads them. ``shared``: the cached
    prefix pages each row starts on (``admit``; its chunks start past them). Returns ``(st, sub)``."""
    _TRACES["begin"] += 1
    sub = pending_rows(eng, *_views(eng, st, rows, prompts, prompt_len, max_len, eos, seeds, sampling, shared))
    if _pooled(st.cache) or _pooled(st.dstate):
        st = st.replace(live=st.live.at[rows].set(True, mode="drop"), done=st.done.at[rows].set(True, mode="drop"))
    st, sub = _give(st, sub, rows)
    return constrain(st, eng.mesh), constrain(sub, eng.mesh)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2, 3))
def chunk_alone(eng: EngineConfig, params: dict, st: EngineState, sub: EngineState, rows: jax.Array,
                c: int) -> tuple[EngineState, EngineState]:
    """The next ``c`` prompt tokens of pending rows ``sub`` in slots ``rows`` (``prefill_chunk``),
    their paged entries and the pool lent by the live state ``st`` for the call (``_lend``)."""
    _TRACES["chunk"] += 1
    st, sub = _give(st, prefill_chunk(eng, params, _lend(st, sub, rows), c), rows)
    return constrain(st, eng.mesh), constrain(sub, eng.mesh)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2, 3))
def chunk_step(eng: EngineConfig, params: dict, st: EngineState, sub: EngineState, rows: jax.Array,
               c: int) -> tuple[EngineState, EngineState]:
    """One decode step of the live rows with the next ``c`` prompt tokens of pending rows
    ``sub`` (slots ``rows``) in its verify forward (``step_and_chunk``: one forward, the
    weights read once; under a step controller, at the window it chose). The chunk's pages
    are reserved first and given back, so the step reserves its own from what is left; after
    the forward the rows borrow the pool again for the chunk's commit (``chunk_commit``:
    their first token, the drafter's prefill)."""
    _TRACES["chunk_step"] += 1
    lent = _lend(st, sub, rows)
    chunk = chunk_window(eng, lent, c)
    st, sub = _give(st, lent.replace(cache=chunk.cache), rows)
    st, (hidden, cache) = step_and_chunk(eng, params, st, chunk)
    sub = _lend(st, sub.replace(cache=cache), rows)  # the chunk's dense parts; the pool's rows as the step left them
    st, sub = _give(st, chunk_commit(eng, params, sub, chunk, hidden, sub.cache), rows)
    return constrain(st, eng.mesh), constrain(sub, eng.mesh)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def finish_chunked(eng: EngineConfig, st: EngineState, idle: jax.Array, rows: jax.Array, sub: EngineState,
                   upto: jax.Array | None = None) -> EngineState:
    """Fully prefilled pending rows ``sub`` into slots ``rows`` (``idle`` slots released first);
    ``upto [R]`` (the prefix cache): each row's full prompt pages, registered as cached."""
    _TRACES["finish"] += 1
    st = _release(eng, st, idle)
    sub = _lend(st, sub, rows)
    if upto is None:
        return _place(eng, st, rows, sub)
    return _keep_prefix(eng, _place(eng, st, rows, _register(sub, upto)), rows, upto)


def _register(sub: EngineState, upto: jax.Array) -> EngineState:
    """The prefix cache: each row's first ``upto [R]`` pages registered as cached, in every
    paged pool (the target's, a draft model's)."""
    return sub.replace(cache=sub.cache.register(upto),
                       dstate=sub.dstate.register(upto) if _pooled(sub.dstate) else sub.dstate)


def _keep_prefix(eng: EngineConfig, st: EngineState, rows: jax.Array, upto: jax.Array) -> EngineState:
    """The prefix cache, after rows ``rows [R]`` are placed: a drafter that keeps its own
    entries of cached pages (the MTP block, ``MtpDrafter.keep_prefix``) keeps the rows'
    first ``upto [R]`` pages' under the target's page ids."""
    if getattr(st.dstate, "prefix", None) is None:
        return st
    return st.replace(dstate=eng.drafter.keep_prefix(eng, st.dstate, rows, st.cache.global_kv.block_table, upto))


def _pooled(part: Any) -> bool:
    """Whether a cache part (the target's caches, a drafter's state) holds a paged pool."""
    return isinstance(getattr(part, "global_kv", None), PagedKVCache)


def paged_pools(st: EngineState) -> list[PagedKVCache]:
    """The paged pools of ``st``: the target's, then a draft model's (an MTP block's cache is dense)."""
    return [part.global_kv for part in (st.cache, st.dstate) if _pooled(part)]


def _lend(st: EngineState, sub: EngineState, rows: jax.Array) -> EngineState:
    """Pending rows ``sub`` (slots ``rows``) with their paged entries and the pool of the live
    state ``st`` (the target's, a draft model's): the pool has one owner between calls."""
    take = lambda part, mine: mine.replace(global_kv=part.global_kv.take_rows(rows)) if _pooled(part) else mine  # noqa: E731
    return sub.replace(cache=take(st.cache, sub.cache), dstate=take(st.dstate, sub.dstate))


def _give(st: EngineState, sub: EngineState, rows: jax.Array) -> tuple[EngineState, EngineState]:
    """``_lend``'s inverse: the rows' paged entries and the pool back into ``st``, ``sub``
    keeping its own (dense) parts only."""
    def back(part, mine):
        if not _pooled(mine):
            return part, mine
        return part.replace(global_kv=part.global_kv.put_rows(rows, mine.global_kv)), mine.replace(global_kv=None)

    cache, sub_cache = back(st.cache, sub.cache)
    dstate, sub_dstate = back(st.dstate, sub.dstate)
    return st.replace(cache=cache, dstate=dstate), sub.replace(cache=sub_cache, dstate=sub_dstate)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode(eng: EngineConfig, params: dict, st: EngineState, target_done: jax.Array, stop_i: jax.Array) -> EngineState:
    """Steps until ``target_done`` rows are done, every row is done, or ``st.i == stop_i``."""
    _TRACES["decode"] += 1
    return run_steps(eng, params, st, lambda s: jnp.any(~s.done) & (jnp.sum(s.done) < target_done) & (s.i < stop_i))


def empty_state(eng: EngineConfig, slots: int, width: int, eos_width: int = EOS_WIDTH) -> EngineState:
    """Every slot idle (done, owning nothing): the state before the first admit (each slot
    holds ``eos_width`` stop ids). Under a mesh it is made in place, on every device's shard."""
    if eng.mesh is None:
        return _empty(eng, slots, width, eos_width)
    make = functools.partial(_empty, eng, slots, width, eos_width)
    out = shardings(state_specs(jax.eval_shape(make), eng.mesh), eng.mesh)
    with mesh_context(eng):
        return jax.jit(make, out_shardings=out)()


def _empty(eng: EngineConfig, slots: int, width: int, eos_width: int) -> EngineState:
    zeros = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731  (distinct buffers: donatable)
    st = new_state(eng, seq=jnp.zeros((slots, eng.capacity), jnp.int32), known=zeros(),
                   cache=eng.new_cache(eng.target, slots), dstate=eng.drafter.empty(eng, slots, width),
                   prompt_len=zeros(), max_len=zeros(), eos=jnp.full((slots, eos_width), -1, jnp.int32),
                   seeds=jnp.zeros((slots,), jnp.uint32),
                   sampling=RowSampling(jnp.zeros((slots,), jnp.float32), zeros(), jnp.ones((slots,), jnp.float32)),
                   live=jnp.zeros((slots,), bool), done=jnp.ones((slots,), bool))
    if eng.controller is None:
        return st
    return eng.controller.init(eng, st, auto_state(eng, placeholder_cost(eng, slots), slots))


@functools.partial(jax.jit, static_argnums=0)
def drained_pools(eng: EngineConfig, st: EngineState) -> list[tuple[jax.Array, jax.Array]]:
    """Each paged pool's ``(refs, num_free)`` once every slot has let its pages go."""
    return [(c.refs, c.num_free) for c in paged_pools(_release(eng, st, jnp.ones(st.done.shape, bool)))]


def free_pages(st: EngineState) -> jax.Array:
    """The target pool's free pages (cached ones not held by a row included); 0 for a dense cache."""
    return st.cache.global_kv.num_free if _pooled(st.cache) else jnp.zeros((), jnp.int32)
