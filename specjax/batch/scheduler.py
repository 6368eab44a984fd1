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
    job = _Scheduler(eng, params, rows_iter, slots, width, refill, pool, eos_width, listed, chunk, prefixes)
    while not stop():
        job.read_ahead()
        job.admit_queued()
        if job.pending and not job.mixed:  # one chunk of the oldest pending admit, as its own call
            with mesh_context(eng):
                job.st, job.pending[0].sub = chunk_alone(eng, params, job.st, job.pending[0].sub,
                                                         job.pending[0].rows, chunk)
            job.chunk_done()
        waiting = {s for g in job.pending for s, _, _ in g.picked}  # held, not yet in the live state
        busy = sum(r is not None for r in job.held)
        if busy == 0:
            _check_pool(eng, job.st)
            return
        if not job.table_ready and busy > len(waiting):  # depth="auto": the table, timed on the first running rows
            job.time_table(cost)
        yield from job.decode_round(waiting, busy, sync_every)


class _Scheduler:
    """A batch job's host state between rounds: the live state ``st``, per slot the request it
    serves (``held``), its host times (``timed``) and the cached pages it started on
    (``shares``); the requests read ahead (``queue``) and the chunked admits in progress
    (``pending``, oldest first)."""

    def __init__(self, eng: EngineConfig, params: dict, rows_iter: Iterator[Row], slots: int, width: int,
                 refill: int, pool: int | None, eos_width: int, listed: bool, chunk: int | None,
                 prefixes: PrefixCache | None):
        self.eng, self.params, self.rows_iter, self.slots, self.width = eng, params, rows_iter, slots, width
        self.refill, self.pool, self.eos_width, self.listed, self.chunk = refill, pool, eos_width, listed, chunk
        self.prefixes = prefixes
        self.start = latency.now()
        st = empty_state(eng, slots, width, eos_width)
        if prefixes is not None and eng.drafter.stores_prefixes:  # the MTP block's entries of cached pages
            st = st.replace(dstate=eng.drafter.with_prefix_store(eng, st.dstate, st.cache.global_kv.num_pages,
                                                                  PAGE_SIZE))
        self.st = st
        self.table_ready = eng.controller is None
        self.held: list[Row | None] = [None] * slots
        self.timed: list[Timed | None] = [None] * slots
        self.shares: list[tuple[int, ...]] = [()] * slots
        self.arrived: dict[Any, float] = {}
        self.timeline, self.i_now = latency.Timeline(), 0  # i_now: global steps taken (read back each round)
        self.queue: collections.deque[Row] = collections.deque()
        self.pending: collections.deque[_Pending] = collections.deque()
        self.exhausted = False
        self.mixed = chunk is not None and MIXED_STEP  # chunks ride in the step's forward

    def idle(self) -> jax.Array:
        return jnp.asarray(np.array([self.held[s] is None for s in range(self.slots)]))

    def read_ahead(self) -> None:
        """Enough requests queued to fill every free slot, each timed from its arrival."""
        while not self.exhausted and len(self.queue) < self.slots:
            nxt = next(self.rows_iter, None)
            if nxt is None:
                self.exhausted = True
            else:
                self.queue.append(nxt)
                self.arrived[nxt.id] = self.start if self.listed else latency.now()

    def admit_queued(self) -> None:
        """Admits, ``refill`` rows at a time, while free slots, requests and pages allow."""
        eng, prefixes = self.eng, self.prefixes
        while self.queue:
            if prefixes is not None:  # pages evicted since the last look are forgotten
                prefixes.forget(jax.device_get([c.cached for c in paged_pools(self.st)]))
            batch, started = _pick(self.held, self.queue, self.refill, self.pool, eng.pool_groups, prefixes,
                                   self.shares)
            if not any(batch):
                return
            idle = self.idle()
            t_admit = latency.now()
            picked = [x for group in batch for x in group]
            rest = max(len(r.prompt) - len(started.get(s, ())) * PAGE_SIZE for s, r in picked)  # to compute
            shared = None if prefixes is None else \
                share_inputs(batch, self.refill, self.slots, started, self.st.cache.global_kv.max_pages,
                             prefixes.pools)
            for s, r in picked:  # the cached pages are held from the admit on (the target pool's ids)
                self.held[s], self.shares[s] = r, tuple(p[0] for p in started.get(s, ()))
            if self.chunk is not None and rest > self.chunk:
                self.begin_chunked(batch, picked, started, shared, rest, t_admit)
                continue
            inputs = admit_inputs(batch, self.refill, self.slots, self.eos_width)
            c = prompt_bucket([[0] * rest])  # the uncached rests' width (the whole width without the cache)
            with mesh_context(eng):
                self.st = admit(eng, None if c >= inputs[1].shape[1] else c, self.params, self.st, idle, *inputs,
                                shared)
            jax.block_until_ready(self.st.done)  # the admit's end: the rows' first token, the live rows' stall
            self.first_tokens(picked, started, [self.arrived.pop(r.id) for _, r in picked], t_admit)

    def first_tokens(self, picked, started: dict, arrivals: list[float], t_admit: float) -> None:
        """Rows whose first token is in: their prompt pages named in the prefix cache, their times kept."""
        t_first = latency.now()
        name_pages(self.eng, self.st, self.prefixes, picked, started, self.slots)
        for (s, _), arrival in zip(picked, arrivals, strict=True):
            self.timed[s] = Timed(arrival, t_admit, t_first, self.i_now, len(self.shares[s]) * PAGE_SIZE)

    def begin_chunked(self, batch, picked, started: dict, shared, rest: int, t_admit: float) -> None:
        """An admit whose prompts are prefilled ``chunk`` tokens per round: pending until they are in."""
        args = admit_inputs(batch, self.refill, self.slots, self.eos_width, self.chunk)
        with mesh_context(self.eng):
            self.st, sub = begin_chunked(self.eng, self.st, *args, shared)
        self.pending.append(_Pending(args[0], sub, -(-rest // self.chunk),
                                     [(s, r, self.arrived.pop(r.id)) for s, r in picked], t_admit, started,
                                     None if shared is None else shared[2]))

    def chunk_done(self) -> None:
        """After a chunk of the oldest pending admit: its rows join when their prompts are in."""
        head = self.pending[0]
        head.left -= 1
        if head.left:
            jax.block_until_ready(head.sub.done)  # its time is the running rows' stall
            return
        self.pending.popleft()
        with mesh_context(self.eng):
            self.st = finish_chunked(self.eng, self.st, self.idle(), head.rows, head.sub, head.upto)
        jax.block_until_ready(self.st.done)
        self.first_tokens([(s, r) for s, r, _ in head.picked], head.started, [a for _, _, a in head.picked],
                          head.t_admit)

    def time_table(self, cost: Any) -> None:
        """``depth="auto"``'s cost table, timed on the running rows (``_set_cost``)."""
        t0 = latency.now()
        with mesh_context(self.eng):
            self.st = _set_cost(self.eng, self.params, self.st, self.slots, self.width, cost)
        i_next = int(self.st.i)
        self.timeline.add(self.i_now, i_next, t0, latency.now())
        self.i_now, self.table_ready = i_next, True

    def decode_round(self, waiting: set[int], busy: int, sync_every: int) -> Iterator[Completion]:
        """Decode until enough rows finish (or one step with a pending admit's next chunk in its
        forward), read back once, and yield the finished rows' completions."""
        eng, pending = self.eng, self.pending
        more = bool(self.queue) or not self.exhausted
        target = min(self.slots, max(self.refill, self.slots - busy + 1)) if more else self.slots
        target += len(waiting)  # a pending slot counts as done in the loop: it is not stepping
        steps = 1 if pending else sync_every  # a chunk between every two steps while one is pending
        t0 = latency.now()
        with mesh_context(eng):
            if pending and self.mixed:  # one step, the oldest pending admit's next chunk in its forward
                self.st, pending[0].sub = chunk_step(eng, self.params, self.st, pending[0].sub, pending[0].rows,
                                                     self.chunk)
            else:
                self.st = decode(eng, self.params, self.st, jnp.int32(target), self.st.i + steps)
        done, i_next, free = (np.array(x) for x in jax.device_get((self.st.done, self.st.i, free_pages(self.st))))
        self.timeline.add(self.i_now, int(i_next), t0, latency.now())
        self.i_now = int(i_next)
        if pending and self.mixed:
            self.chunk_done()
        done[list(waiting)] = False  # pending rows are not finished
        in_use = None if self.pool is None else self.pool - int(free.sum())
        yield from completions(eng, self.st, self.held, done, self.timed, self.timeline, in_use)
        self.shares = [x if self.held[s] is not None else () for s, x in enumerate(self.shares)]
        self.timeline.drop_before(min((t.start_step for t in self.timed if t is not None), default=self.i_now))


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
