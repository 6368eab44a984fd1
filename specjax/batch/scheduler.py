"""The host scheduler of a batch job: each round admits queued requests into free slots (pages
permitting), decodes until enough rows finish (or one step with a prefill chunk in its
forward), and harvests. One device read per round."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import latency
from specjax.auto import auto_state
from specjax.auto.cost import SLICES, cost_key, cost_table, slice_timer, warm_steps
from specjax.batch.harvest import Timed, completions
from specjax.batch.prefix_store import name_pages, share_inputs
from specjax.batch.requests import Completion, Row, admit_inputs
from specjax.batch.slots import (
    admit,
    begin_chunked,
    chunk_alone,
    chunk_step,
    decode,
    drained_pools,
    empty_state,
    finish_chunked,
    free_pages,
    paged_pools,
)
from specjax.engine import (
    PAGE_SIZE,
    EngineConfig,
    EngineState,
    prompt_bucket,
)
from specjax.generation import mesh_context
from specjax.prefix_cache import PrefixCache

# Chunked prefill runs each chunk in a decode step's forward (``chunk_step``); False: each
# chunk is its own call before the step (``chunk_alone``), the baseline
# ``benchmarks/batch_latency.py`` compares against.
MIXED_STEP = True


def schedule(eng: EngineConfig, params: dict, rows_iter: Iterator[Row], slots: int, width: int, refill: int,
             sync_every: int, pool: int | None, stop: Callable[[], bool], eos_width: int, cost: Any = None,
             listed: bool = False, chunk: int | None = None,
             prefixes: PrefixCache | None = None) -> Iterator[Completion]:
    """The host loop: admit, decode, harvest (one device read per round). The host clock at
    round boundaries times every request (``specjax.latency``): a listed job's requests
    arrive at its start, a stream's when it yields them. With ``chunk``, an admit of prompts
    wider than it is pending (``_Pending``): each round runs one decode step with the next
    chunk of the oldest pending admit in its forward (``chunk_step``); its rows join when
    their prompts are in. With ``prefixes``
    (the prefix cache), each admit starts its rows on the cached pages of their prompts' heads
    and registers the full prompt pages it writes; at the end every page is back in the pool."""
    start = latency.now()
    st = empty_state(eng, slots, width, eos_width)
    if prefixes is not None and eng.drafter.stores_prefixes:  # the MTP block's entries of cached pages
        st = st.replace(dstate=eng.drafter.with_prefix_store(eng, st.dstate, st.cache.global_kv.num_pages, PAGE_SIZE))
    table_ready = eng.controller is None
    held: list[Row | None] = [None] * slots  # the request each slot serves
    timed: list[Timed | None] = [None] * slots  # its host times
    shares: list[tuple[int, ...]] = [()] * slots  # the cached pages it started on
    arrived: dict[Any, float] = {}
    timeline, i_now = latency.Timeline(), 0  # i_now: global steps taken (read back each round)
    queue: collections.deque[Row] = collections.deque()
    pending: collections.deque[_Pending] = collections.deque()  # chunked admits, oldest first
    exhausted = False
    mixed = chunk is not None and MIXED_STEP  # chunks ride in the step's forward

    def chunk_done(st: EngineState) -> EngineState:
        """After a chunk of the oldest pending admit: its rows join when their prompts are in."""
        head = pending[0]
        head.left -= 1
        if head.left:
            jax.block_until_ready(head.sub.done)  # its time is the running rows' stall
            return st
        pending.popleft()
        idle = np.array([held[s] is None for s in range(slots)])
        with mesh_context(eng):
            st = finish_chunked(eng, st, jnp.asarray(idle), head.rows, head.sub, head.upto)
        jax.block_until_ready(st.done)
        t_first = latency.now()
        name_pages(eng, st, prefixes, [(s, r) for s, r, _ in head.picked], head.started, slots)
        for s, _, arrival in head.picked:
            timed[s] = Timed(arrival, head.t_admit, t_first, i_now, len(shares[s]) * PAGE_SIZE)
        return st

    while not stop():
        while not exhausted and len(queue) < slots:  # look ahead: enough to fill every free slot
            nxt = next(rows_iter, None)
            if nxt is None:
                exhausted = True
            else:
                queue.append(nxt)
                arrived[nxt.id] = start if listed else latency.now()
        # admit, refill rows at a time, while free slots, requests and pages allow
        while queue:
            if prefixes is not None:  # pages evicted since the last look are forgotten
                prefixes.forget(jax.device_get([c.cached for c in paged_pools(st)]))
            batch, started = _pick(held, queue, refill, pool, eng.pool_groups, prefixes, shares)
            if not any(batch):
                break
            idle = np.array([held[s] is None for s in range(slots)])
            t_admit = latency.now()
            picked = [x for group in batch for x in group]
            rest = max(len(r.prompt) - len(started.get(s, ())) * PAGE_SIZE for s, r in picked)  # to compute
            shared = None if prefixes is None else \
                share_inputs(batch, refill, slots, started, st.cache.global_kv.max_pages, prefixes.pools)
            for s, r in picked:  # the cached pages are held from the admit on (the target pool's ids)
                held[s], shares[s] = r, tuple(p[0] for p in started.get(s, ()))
            if chunk is not None and rest > chunk:
                args = admit_inputs(batch, refill, slots, eos_width, chunk)
                with mesh_context(eng):
                    st, sub = begin_chunked(eng, st, *args, shared)
                pending.append(_Pending(args[0], sub, -(-rest // chunk), [(s, r, arrived.pop(r.id)) for s, r in picked],
                                        t_admit, started, None if shared is None else shared[2]))
                continue
            inputs = admit_inputs(batch, refill, slots, eos_width)
            c = prompt_bucket([[0] * rest])  # the uncached rests' width (the whole width without the cache)
            with mesh_context(eng):
                st = admit(eng, None if c >= inputs[1].shape[1] else c, params, st, jnp.asarray(idle), *inputs,
                            shared)
            jax.block_until_ready(st.done)  # the admit's end: the rows' first token, the live rows' stall
            t_first = latency.now()
            name_pages(eng, st, prefixes, picked, started, slots)
            for s, r in picked:
                timed[s] = Timed(arrived.pop(r.id), t_admit, t_first, i_now, len(shares[s]) * PAGE_SIZE)
        if pending and not mixed:  # one chunk of the oldest pending admit, as its own call
            with mesh_context(eng):
                st, pending[0].sub = chunk_alone(eng, params, st, pending[0].sub, pending[0].rows, chunk)
            st = chunk_done(st)
        waiting = {s for g in pending for s, _, _ in g.picked}  # held, not yet in the live state
        busy = sum(r is not None for r in held)
        if busy == 0:
            _check_pool(eng, st)
            return
        free_now = slots - busy
        more = bool(queue) or not exhausted
        target = min(slots, max(refill, free_now + 1)) if more else slots
        target += len(waiting)  # a pending slot counts as done in the loop: it is not stepping
        steps = 1 if pending else sync_every  # a chunk between every two steps while one is pending
        if not table_ready and busy > len(waiting):  # depth="auto": the table, timed on the first running rows
            t0 = latency.now()
            with mesh_context(eng):
                st = _set_cost(eng, params, st, slots, width, cost)
            i_next = int(st.i)
            timeline.add(i_now, i_next, t0, latency.now())
            i_now, table_ready = i_next, True
        t0 = latency.now()
        with mesh_context(eng):
            if pending and mixed:  # one step, the oldest pending admit's next chunk in its forward
                st, pending[0].sub = chunk_step(eng, params, st, pending[0].sub, pending[0].rows, chunk)
            else:
                st = decode(eng, params, st, jnp.int32(target), st.i + steps)
        done, i_next, free = (np.array(x) for x in jax.device_get((st.done, st.i, free_pages(st))))
        timeline.add(i_now, int(i_next), t0, latency.now())
        i_now = int(i_next)
        if pending and mixed:
            st = chunk_done(st)
        done[list(waiting)] = False  # pending rows are not finished
        in_use = None if pool is None else pool - int(free.sum())
        yield from completions(eng, st, held, done, timed, timeline, in_use)
        shares = [x if held[s] is not None else () for s, x in enumerate(shares)]
        timeline.drop_before(min((t.start_step for t in timed if t is not None), default=i_now))


@dataclasses.dataclass
class _Pending:
    """A chunked admit in progress: its slots ``rows [R]`` (``B``: padding), its rows' state
    ``sub`` (``pending_rows``), the chunks ``left``, each ``(slot, request, arrival)``, and
    what the prefix cache gave and takes."""

    rows: jax.Array
    sub: EngineState
    left: int
    picked: list[tuple[int, Row, float]]
    t_admit: float
    started: dict  # {slot: the cached pages it starts on} (the prefix cache)
    upto: jax.Array | None  # its rows' full prompt pages, registered when they are in


def _pick(held: list[Row | None], queue: collections.deque[Row], refill: int, pool: int | None,
          groups: int, prefixes: PrefixCache | None = None,
          shares: Sequence[tuple[int, ...]] | None = None) -> tuple[list[list[tuple[int, Row]]], dict]:
    """One admit's ``(slot, request)`` pairs per slot group (one group per data shard, each with
    its own paged pool of ``pool / groups`` pages), taken from the head of ``queue``: at most
    ``ceil(refill / groups)`` per group, all of the first one's prompt bucket (a short prompt
    is never padded to a long one's width: the next admit of the round takes it). The head
    goes to the group with the most free slots left among those whose pool fits its worst
    case beside the running rows'; when none can take it, it waits (FIFO: later requests do
    not jump it). Also ``{slot: cached pages it starts on}``.

    With ``prefixes`` (the prefix cache) a request starts on the cached pages of its prompt's
    head: its worst case leaves them out, and they count once in the pool however many rows
    share them (``shares``: each running slot's). An admit never holds two requests that would
    write the same new prefix page: the later one waits for the next admit and reuses it."""
    per, rg = len(held) // groups, -(-refill // groups)
    share = None if pool is None else pool // groups
    shares = shares or [()] * len(held)
    free = [[s for s in range(g * per, (g + 1) * per) if held[s] is None] for g in range(groups)]
    used = [{p for s in range(g * per, (g + 1) * per) for p in shares[s]} for g in range(groups)]  # shared pages held
    committed = [sum(r.pages - len(shares[s]) for s, r in enumerate(held[g * per : (g + 1) * per], g * per)
                     if r is not None) + len(used[g]) for g in range(groups)]
    fresh: list[set[bytes]] = [set() for _ in range(groups)]  # prefix pages this admit writes
    picks: list[list[tuple[int, Row]]] = [[] for _ in range(groups)]
    started: dict[int, tuple[int, ...]] = {}
    queue_bucket = queue[0].bucket if queue else 0
    while queue and queue[0].bucket == queue_bucket:
        head = queue[0]
        match = [tuple(prefixes.match(head.keys, len(head.prompt), g)) if prefixes is not None else ()
                 for g in range(groups)]  # per page: its id in each pool (the target's first)
        cost = [head.pages - len(match[g]) + len({p[0] for p in match[g]} - used[g]) for g in range(groups)]
        room = [g for g in range(groups) if len(picks[g]) < min(rg, len(free[g]))
                and (share is None or committed[g] + cost[g] <= share)]
        if not room:
            break
        g = max(room, key=lambda g: (len(free[g]) - len(picks[g]), -g))
        new = set(head.keys[len(match[g]):]) if prefixes is not None else set()
        if new & fresh[g]:
            break
        slot = free[g][len(picks[g])]
        picks[g].append((slot, queue.popleft()))
        committed[g] += cost[g]
        used[g] |= {p[0] for p in match[g]}
        fresh[g] |= new
        started[slot] = match[g]
    return picks, started


def _set_cost(eng: EngineConfig, params: dict, st: EngineState, slots: int, width: int, cost: Any) -> EngineState:
    """``depth="auto"``'s table (given, cached, or timed on a few real decode steps at each
    forced window: the tokens they emit are kept, a forced window is still exact)."""
    never = jnp.int32(slots + 1)  # no done-count target: only the step count stops it
    timed, box = slice_timer(st, lambda s, n: decode(eng, params, s, never, s.i + n), len(eng.windows))
    table, _ = cost_table(eng, slots, cost, cost_key(eng, [[slots, width], ["batch"]]), timed,
                          warm=warm_steps(eng.capacity - width), **SLICES)
    return box[0].replace(auto=auto_state(eng, table, slots))


def _check_pool(eng: EngineConfig, st: EngineState) -> None:
    """At the end of a job on a paged pool: once every slot lets its pages go, no page may
    keep a reference and every page must be back on the free stack(s); a leak raises."""
    if not paged_pools(st):
        return
    with mesh_context(eng):
        counts = jax.device_get(drained_pools(eng, st))
    for refs, free in counts:
        if refs.any() or int(free.sum()) != refs.size:
            raise RuntimeError(f"page accounting leaked at the end of the job: {int(np.count_nonzero(refs))} pages "
                               f"still referenced, {int(free.sum())} of {refs.size} free")
