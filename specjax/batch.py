"""Continuous batching: a fixed set of slots, refilled from a request stream as rows finish.

The per-sequence rule is what makes this possible inside ``jit``: every row already has its
own cache lengths, pages, drafter state and sampling settings, so a finished row's slot can
take a new prompt without touching its neighbours. The loop, per round:

1. **admit** (jitted, one compile per (slots, rows, prompt bucket); rows: the requests
   admitted, rounded up to a power of two): up to ``refill_rows`` queued requests of one
   prompt bucket are prefilled into empty per-row views of the live caches
   (a paged view shares the pool) and scattered into free slots: lengths, lead pad, pages,
   MTP hidden state, seeds and sampling settings all per row. Pages of idle slots return to
   the pool first.
2. **decode** (jitted, one compile per slots): ``step`` in a ``while_loop`` until enough rows
   finished to refill (or ``sync_every`` steps, or every row is done). No host sync inside.
3. **harvest** (one device read): finished rows become ``Completion``s, yielded in
   completion order; their slots are free. The host clock at these boundaries gives each
   request its latency (queue wait, time to first token, inter-token; ``specjax.latency``).

Per-request sampling settings are data (``RowSampling``), never compile-time constants.
A request's seed is its own (explicit) or derived from (``seed``, request id): never from
its slot, so a seeded request gives the same tokens alone, in any batch, in any slot.

Paged pools are sized by ``pages`` (default: every slot's full capacity). A request is
admitted only when its worst-case page need fits beside the worst cases of the running
rows; otherwise it waits for a row to finish (no request fails for lack of pages).

On a mesh the slots split into one group per data shard, each with its own paged pool
(``pages / data`` pages: ``PagedKVCache.split_pool``). An admit fills up to
``ceil(refill_rows / data)`` slots of every group (group-major, so each shard prefills and
allocates only for its own slots); a request goes to the group with the most free slots
among those whose pool fits its worst case.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import latency
from specjax.advance import kv_advance as resolve_kv_advance
from specjax.auto import AutoDepth, auto_state
from specjax.auto.cost import SLICES, check_cost, cost_key, cost_table, placeholder_cost, slice_timer, warm_steps
from specjax.cache import PagedKVCache
from specjax.compile_cache import default_on
from specjax.drafters import default_drafter
from specjax.engine import (
    PAGE_SIZE,
    EngineConfig,
    EngineState,
    check_status,
    chunk_commit,
    chunk_window,
    make_engine,
    new_state,
    pending_rows,
    prefill_chunk,
    prefill_rows,
    prompt_bucket,
    request_capacity,
    row_status,
    run_steps,
    step_and_chunk,
)
from specjax.generation import check_mesh, mesh_context
from specjax.generation_config import GenerationConfig, check_sampling, is_int, shown, takes_settings
from specjax.prefix_cache import PrefixCache, page_keys
from specjax.protocols import DecoderModel, check_model
from specjax.sampling import RowSampling, derive_seed
from specjax.sharding import constrain, data_shards, shard_model, shardings, state_specs
from specjax.tree import tree_reach
from specjax.validate import EOS_WIDTH, check_drafter_models, check_eos, eos_table, fail, resolve_depth

__all__ = ["Completion", "Request", "batch_generate"]

# Chunked prefill runs each chunk in a decode step's forward (``_chunk_step``); False: each
# chunk is its own call before the step (``_chunk``), the baseline
# ``benchmarks/batch_latency.py`` compares against.
MIXED_STEP = True

_TRACES = {"admit": 0, "decode": 0, "begin": 0, "chunk": 0, "chunk_step": 0, "finish": 0}
_ROW_FIELDS = ("seq", "known", "u", "prompt_len", "max_len", "eos", "seeds", "live", "done", "steps", "emitted",
               "accepted", "proposed", "acc_pos", "prop_pos", "seen_pos", "trace", "est", "branch_tested",
               "branch_accepted")


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. ``None`` fields take the job's defaults."""

    prompt: Sequence[int]
    id: Any = None  # default: the request's index in the stream
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # default: derived from (the job's seed, id)
    eos_id: int | list[int] | None = None  # a list: the row stops on any


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its new tokens (EOS included when hit), why it stopped
    (``"eos"`` | ``"length"``) and its own metrics (``num_tokens``, ``steps``,
    ``tok_per_step``, ``accepted_drafts``, ``mean_accepted_length``, ``accepted_trace``;
    ``prompt_tokens`` and ``cached_tokens``, those the prefix cache served; ``pages_in_use``,
    the paged pool's pages held by rows in the round it finished (``None``: dense); and
    its latency in seconds: ``queue_s``, ``ttft_s``, ``tpot_s``, ``e2e_s``, and ``itl_s``
    per decode step; ``specjax.latency``)."""

    id: Any
    tokens: list[int]
    finish_reason: str
    metrics: dict


@dataclasses.dataclass(frozen=True)
class _Row:
    """A validated request, resolved against the job's defaults (host side)."""

    id: Any
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    eos: tuple[int, ...]  # stop ids (empty: none)
    pages: int  # worst-case pages this request can hold (paged caches)
    key_ahead: int = 0  # tokens past a page its key covers (an MTP block's entry reads the next token)

    @property
    def bucket(self) -> int:
        """Its prompt's padded width (``prompt_bucket``): an admit holds one bucket."""
        return prompt_bucket([self.prompt])

    @functools.cached_property
    def keys(self) -> list[bytes]:
        """Its prompt's full pages' chain keys (``specjax.prefix_cache``)."""
        return page_keys(self.prompt, PAGE_SIZE, self.key_ahead)


# ----------------------------------------------------------------------------- jitted pieces


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
def _admit(eng: EngineConfig, c: int | None, params: dict, st: EngineState, idle: jax.Array, rows: jax.Array,
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
    cached pages each row starts on, ``_admit``)."""
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
def _begin(eng: EngineConfig, st: EngineState, rows: jax.Array, prompts: jax.Array, prompt_len, max_len, eos, seeds,
           sampling: RowSampling, shared: tuple | None = None) -> tuple[EngineState, EngineState]:
    """A chunked admit's rows, pending (``pending_rows``): their prompts known, nothing cached.
    Dense views are their own buffers; a paged pool keeps one owner, the live state, which
    holds the rows' (emptied) pool entries from here on (``_give``). There the rows are done
    (no step advances them) but live: a step still writes its window past their length, so
    it reserves the pages for it (rolled back after), and no write is refused and flagged;
    the next chunk writes over those slots before anything reads them. ``shared``: the cached
    prefix pages each row starts on (``_admit``; its chunks start past them). Returns ``(st, sub)``."""
    _TRACES["begin"] += 1
    sub = pending_rows(eng, *_views(eng, st, rows, prompts, prompt_len, max_len, eos, seeds, sampling, shared))
    if _pooled(st.cache) or _pooled(st.dstate):
        st = st.replace(live=st.live.at[rows].set(True, mode="drop"), done=st.done.at[rows].set(True, mode="drop"))
    st, sub = _give(st, sub, rows)
    return constrain(st, eng.mesh), constrain(sub, eng.mesh)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2, 3))
def _chunk(eng: EngineConfig, params: dict, st: EngineState, sub: EngineState, rows: jax.Array,
           c: int) -> tuple[EngineState, EngineState]:
    """The next ``c`` prompt tokens of pending rows ``sub`` in slots ``rows`` (``prefill_chunk``),
    their paged entries and the pool lent by the live state ``st`` for the call (``_lend``)."""
    _TRACES["chunk"] += 1
    st, sub = _give(st, prefill_chunk(eng, params, _lend(st, sub, rows), c), rows)
    return constrain(st, eng.mesh), constrain(sub, eng.mesh)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2, 3))
def _chunk_step(eng: EngineConfig, params: dict, st: EngineState, sub: EngineState, rows: jax.Array,
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
def _finish(eng: EngineConfig, st: EngineState, idle: jax.Array, rows: jax.Array, sub: EngineState,
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


def _pools(st: EngineState) -> list[PagedKVCache]:
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
def _decode(eng: EngineConfig, params: dict, st: EngineState, target_done: jax.Array, stop_i: jax.Array) -> EngineState:
    """Steps until ``target_done`` rows are done, every row is done, or ``st.i == stop_i``."""
    _TRACES["decode"] += 1
    return run_steps(eng, params, st, lambda s: jnp.any(~s.done) & (jnp.sum(s.done) < target_done) & (s.i < stop_i))


def _empty_state(eng: EngineConfig, slots: int, width: int, eos_width: int = EOS_WIDTH) -> EngineState:
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


# ----------------------------------------------------------------------------- validation


def _as_request(r: Any, index: int) -> Request:
    if isinstance(r, Request):
        return r if r.id is not None else dataclasses.replace(r, id=index)
    if isinstance(r, dict):
        unknown = set(r) - {f.name for f in dataclasses.fields(Request)}
        if unknown:
            fail(f"requests[{index}]", sorted(unknown)[0], f"unknown field; allowed: "
                  f"{[f.name for f in dataclasses.fields(Request)]}")
        if "prompt" not in r:
            fail(f"requests[{index}]", r, "has no 'prompt'")
        return Request(**{**r, "id": r.get("id", index)})
    if isinstance(r, list | tuple | np.ndarray):
        return Request(prompt=r, id=index)
    fail(f"requests[{index}]", r, "must be a Request, a dict with 'prompt', or a list of token ids")
    raise AssertionError  # unreachable


@dataclasses.dataclass(frozen=True)
class _Job:
    """The job's static settings and defaults, checked once."""

    model: DecoderModel
    max_new_tokens: int
    max_prompt_len: int
    depth: int  # slots past a row's length a step writes, less one: its drafts (a tree's nodes and beams)
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    eos_id: int | list[int] | None
    pages: int | None
    bounded: bool  # a stream: max_new_tokens bounds each request (it sized the caches)
    eos_width: int | None  # stop ids per row a stream's requests must fit (None: listed, the list sizes it)
    groups: int = 1  # pool groups (the mesh's data axis): a request must fit one group's pool
    key_ahead: int = 0  # its rows' prefix keys cover this many tokens past each page (``_Row``)

    def row(self, r: Request, index: int, where: str | None = None) -> _Row:
        """Validate one request against the model and the job; errors name the request
        (``where``, default ``requests[index] (id ...)``) and the field."""
        cfg = self.model.decoder
        at = f"requests[{index}] (id {r.id!r})." if where is None else f"{where}: "  # a field's prefix in errors
        where = where or f"requests[{index}] (id {r.id!r})"
        prompt = r.prompt
        if not isinstance(prompt, list | tuple | np.ndarray) or len(prompt) == 0:
            fail(f"{at}prompt", prompt, "must be a non-empty list of int token ids")
        arr = np.asarray(prompt)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            fail(f"{at}prompt", prompt, "must be a flat list of int token ids")
        bad = np.nonzero((arr < 0) | (arr >= cfg.vocab_size))[0]
        if len(bad):
            fail(f"{at}prompt[{int(bad[0])}]", int(arr[bad[0]]), f"token ids must lie in [0, {cfg.vocab_size})")
        n_new = self.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
        if self.bounded and (not is_int(n_new) or not 1 <= n_new <= self.max_new_tokens):
            fail(f"{at}max_new_tokens", n_new, f"must be an int in [1, {self.max_new_tokens}] (for a stream "
                  "of requests the job's max_new_tokens bounds every request)")
        if not is_int(n_new) or n_new < 1:
            fail(f"{at}max_new_tokens", n_new, "must be an int >= 1")
        if self.bounded and len(arr) > self.max_prompt_len:
            fail(f"{at}prompt", f"{len(arr)} tokens", f"at most max_prompt_len={self.max_prompt_len} tokens")
        if n_new >= cfg.max_seq_len:
            fail(f"{at}max_new_tokens", n_new, f"must be < the model's max_seq_len={cfg.max_seq_len} "
                 "(the prompt needs a token)")
        if len(arr) + n_new > cfg.max_seq_len:
            fail(f"{at}prompt", f"{len(arr)} tokens", f"prompt + max_new_tokens ({n_new}) must be <= the "
                  f"model's max_seq_len={cfg.max_seq_len}: at most {cfg.max_seq_len - n_new} prompt tokens fit")
        temp = self.temperature if r.temperature is None else r.temperature
        top_k = self.top_k if r.top_k is None else r.top_k
        top_p = self.top_p if r.top_p is None else r.top_p
        check_sampling(f"{at}", temp, top_k, top_p)
        if r.seed is not None and (not is_int(r.seed) or not 0 <= r.seed < 2**32):
            fail(f"{at}seed", r.seed, "must be an int in [0, 2**32)")
        eos = check_eos(f"{at}eos_id", shown(self.eos_id) if r.eos_id is None else r.eos_id, cfg.vocab_size)
        if self.eos_width is not None and len(eos) > self.eos_width:
            fail(f"{at}eos_id", list(eos), f"at most {self.eos_width} stop ids in a streamed job (the job's "
                  "widest list, at least EOS_WIDTH, sizes every row's stops)")
        w = self.depth + 1
        pages = -(-(len(arr) + n_new + 2 * w - 1) // PAGE_SIZE)  # (a prefill reserves only its prompt)
        if self.pages is not None and pages > self.pages // self.groups:
            g = self.groups
            held = f"pool holds pages={self.pages}" if g == 1 else \
                f"pool of each of the mesh's {g} data shards holds pages/{g}={self.pages // g}"
            fail(f"{where}", f"{len(arr)} + {n_new} tokens", f"needs {pages} pages of {PAGE_SIZE} tokens but the "
                 f"{held}")
        seed = derive_seed(self.seed, r.id) if r.seed is None else int(r.seed)
        return _Row(r.id, [int(t) for t in arr], int(n_new), float(temp), top_k, top_p, seed, eos, pages,
                    self.key_ahead)


# ----------------------------------------------------------------------------- the job


@takes_settings
def batch_generate(
    model: DecoderModel,
    requests: Iterable[Any],
    config: GenerationConfig | None = None,
    *,
    draft_model: DecoderModel | None = None,
    mesh: Any = None,
    slots: int = 32,
    max_prompt_len: int | None = None,
    pages: int | None = None,
    refill_rows: int | None = None,
    sync_every: int = 64,
    prefill_chunk: int | None = None,
    prefix_cache: bool | None = None,
    stop: Callable[[], bool] | None = None,
    where: Sequence[str] | None = None,
    **settings: Any,
) -> Iterator[Completion]:
    """Generate for every request of ``requests`` through ``slots`` rows, refilling a row as
    soon as it finishes; yields a ``Completion`` per request, in completion order.

    ``requests``: any iterable (a generator too) of ``Request``s, dicts with ``prompt`` (token
    ids) and optional ``id``, ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
    ``seed``, ``eos_id``, or plain token-id lists. ``id`` defaults to the stream index; ids
    must be unique. ``config`` (``GenerationConfig``) and the keyword settings over it (as in
    ``generate``; ``max_new_tokens`` and ``seed`` one int each) are the defaults of requests
    that omit them; for a stream, ``max_new_tokens`` also bounds every request's own.

    A list is validated whole before anything compiles, and sizes the caches; a generator is
    validated request by request, and caches are sized by ``max_prompt_len`` (default: the
    model's context minus ``max_new_tokens``). ``pages``: the paged pool's size (``cache=
    "paged"``; default every slot's full capacity): requests wait for pages, never fail.
    ``refill_rows``: rows prefilled per admit (default ``slots // 4``); decoding runs until
    that many rows are free (fewer when the stream runs dry) or ``sync_every`` steps.
    ``prefill_chunk``: prompts longer than this are prefilled ``prefill_chunk`` tokens per
    decode step (each chunk in the step's own forward: ``step_and_chunk``): a long prompt
    stalls the running rows for one chunk at a time, not its whole prefill; its row joins the
    decode loop when its last chunk has taken its first token (dense and paged caches,
    sliding-window and compressed layers, ``depth="auto"``, a mesh and the prefix cache too). ``prefix_cache`` (``cache=
    "paged"``, the default cache of a batch job whose model's layers are all global; on
    wherever it applies): a request whose prompt begins with full pages
    already in the pool starts on them (reference-counted, never written by it) and computes
    only the rest; unreferenced cached pages are evicted least recently used when the pool
    needs them (``specjax.prefix_cache``; a model whose layers are all global, any drafter; each
    completion's ``cached_tokens`` says what it reused). ``stop``: checked between
    rounds; when it returns True the job ends early (requests still running are dropped,
    nothing partial is yielded). ``where``: how validation errors
    name each listed request (default ``requests[i] (id ...)``; the CLI names file lines).
    ``depth="auto"`` (with ``max_depth``, ``cost``): as in ``generate``; without a table the
    first rounds time a few real decode steps at each window (then kept on disk).
    ``mesh`` (``specjax.make_mesh``; one process): slots split over ``"data"`` (``slots`` must
    divide by it), the model over ``"model"``, as in ``generate``. A paged pool is one pool per
    data shard (``pages`` must divide by ``data``; a request must fit ``pages / data``).
    Compiles: one decode loop per (slots, ...) and one admit per prompt bucket; sampling
    settings, seeds and lengths are data.
    """
    default_on()  # the persistent compilation cache, before the first compile
    cfg = GenerationConfig.of(config, **settings)
    max_new_tokens, seed = cfg.max_new_tokens, cfg.seed
    # the default cache: paged, where rows can share cached prompt prefixes (else dense, below)
    cache = cfg.cache or ("dense" if prefix_cache is False and pages is None else "paged")
    for name, val, lo in (("slots", slots, 1), ("max_new_tokens", max_new_tokens, 1), ("sync_every", sync_every, 1)):
        if not is_int(val) or val < lo:
            fail(name, val, f"must be an int >= {lo}")
    if not is_int(seed):
        fail("seed", seed, "must be one int in [0, 2**32) (each request's seed is derived from it and its id)")
    drafter = default_drafter(cfg.drafter, model, draft_model)
    check_drafter_models(drafter, model, draft_model)
    d, policy = resolve_depth(cfg.depth, cfg.max_depth, drafter, tree=cfg.tree)
    reach = tree_reach(cfg.tree, d)
    check_cost(cfg.cost, policy)
    if pages is not None and (cache != "paged" or not is_int(pages) or pages < 1):
        fail("pages", pages, "is the paged pool's size: an int >= 1, with cache='paged'")
    if refill_rows is not None and (not is_int(refill_rows) or not 1 <= refill_rows <= slots):
        fail("refill_rows", refill_rows, f"must be an int in [1, slots={slots}]")
    if prefill_chunk is not None:
        if not is_int(prefill_chunk) or prefill_chunk < 1:
            fail("prefill_chunk", prefill_chunk, "must be an int >= 1 (prompt tokens per chunk), or None")
    check_mesh(mesh, slots, "slots", slots)
    groups = data_shards(mesh)
    if pages is not None and pages % groups:
        fail("pages", pages, f"must divide by the mesh's data axis ({groups}): each data shard holds its own pool "
             "of pages / data")
    if mesh is not None:
        if jax.process_count() > 1:
            fail("mesh", mesh, "batch_generate runs in one process (each host its own job); generate takes many")
        model = shard_model(model, mesh)
        draft_model = None if draft_model is None else shard_model(draft_model, mesh, replicate=True)
    model_cfg = check_model("model", model)
    listed = isinstance(requests, Sequence) and not isinstance(requests, str | bytes)
    if not listed and max_new_tokens >= model_cfg.max_seq_len:  # it sizes a stream's caches
        fail("max_new_tokens", max_new_tokens, f"must be < the model's max_seq_len={model_cfg.max_seq_len}")
    rule = resolve_kv_advance(cfg.kv_advance)
    bound = max_prompt_len if max_prompt_len is not None else max(1, model_cfg.max_seq_len - max_new_tokens)
    if not is_int(bound) or bound < 1:
        fail("max_prompt_len", bound, "must be an int >= 1")
    job = _Job(model, max_new_tokens, bound if not listed else model_cfg.max_seq_len - 1, reach, float(cfg.temperature),
               cfg.top_k, cfg.top_p, seed, cfg.eos_id, pages, bounded=not listed,
               eos_width=None if listed else max(EOS_WIDTH, len(check_eos("eos_id", cfg.eos_id, model_cfg.vocab_size))),
               groups=groups, key_ahead=int(drafter == "mtp"))
    job.row(Request([0], max_new_tokens=1), -1, where="batch_generate")  # the defaults (temperature, ...)
    rows_iter: Iterator[_Row]
    if listed:  # everything checked before any compile; the list sizes the caches
        checked = list(_checked(job, requests, where))
        rows_iter = iter(checked)
        width = prompt_bucket([r.prompt for r in checked]) if checked else 8
        longest_new = max((r.max_new_tokens for r in checked), default=1)
        greedy = all(r.temperature == 0 for r in checked)
        eos_width = max([EOS_WIDTH] + [len(r.eos) for r in checked])
    else:
        rows_iter = _checked(job, requests)
        width = prompt_bucket([[0] * bound])
        longest_new = max_new_tokens
        greedy = False  # unknown requests: per-row sampling (a temperature-0 row stays exactly greedy)
        eos_width = job.eos_width
    cap_width = width if prefill_chunk is None else -(-width // prefill_chunk) * prefill_chunk  # whole chunks

    def engine(cache: str) -> EngineConfig:
        return make_engine(model, drafter=drafter, draft_model=draft_model, depth=d, kv_advance_rule=rule,
                           cache=cache, greedy=greedy, ngram_n=cfg.ngram_n,
                           capacity=request_capacity(cap_width, longest_new, reach),
                           attention_impl=cfg.attention_impl, num_pages=pages,
                           controller=None if policy is None else AutoDepth(policy), mesh=mesh, tree=cfg.tree)

    eng = engine(cache)
    if cfg.cache is None and pages is None and _prefix_refusal(eng) is not None:  # nothing to share: dense
        cache = "dense"
        eng = engine(cache)
    params = {"target": model.params}
    if eng.draft is not None:
        params["draft"] = draft_model.params
    refill = refill_rows or max(1, slots // 4)
    pool = pages if pages is not None else slots * -(-eng.capacity // PAGE_SIZE)
    prefixes = _prefixes(eng, prefix_cache, eng.pool_groups)
    return _run(eng, params, rows_iter, slots, width, refill, sync_every, pool if cache == "paged" else None,
                stop or (lambda: False), eos_width, cfg.cost, listed, prefill_chunk, prefixes)


def _prefix_refusal(eng: EngineConfig) -> str | None:
    """Why rows of this engine cannot start on cached prefix pages, or ``None`` if they can."""
    target = jax.eval_shape(lambda: eng.new_cache(eng.target, eng.pool_groups))
    if not getattr(target, "shares_prefixes", False):
        return "needs cache='paged' and a model whose layers are all global (a sliding-window or compressed " \
               "layer keeps no prefix pages)"
    if eng.drafter.name == "draft_model":
        if not getattr(jax.eval_shape(lambda: eng.new_cache(eng.draft, eng.pool_groups)), "shares_prefixes", False):
            return "needs a draft model whose layers are all global too"
    elif eng.drafter.name not in ("none", "ngram", "mtp"):
        return f"runs with drafters 'none', 'ngram', 'mtp' and 'draft_model' (the {eng.drafter.name!r} drafter " \
               "keeps caches of its own that cached pages do not hold)"
    return None


def _prefixes(eng: EngineConfig, prefix_cache: bool | None, groups: int) -> PrefixCache | None:
    """The job's prefix cache: on by default wherever it applies; ``True`` where it cannot
    apply is refused."""
    if prefix_cache not in (None, True, False):
        fail("prefix_cache", prefix_cache, "must be True, False or None (on wherever it applies)")
    if prefix_cache is False:
        return None
    why = _prefix_refusal(eng)
    if why is not None:
        if prefix_cache:
            fail("prefix_cache", True, why)
        return None
    return PrefixCache(PAGE_SIZE, groups, pools=2 if eng.drafter.name == "draft_model" else 1)



def _checked(job: _Job, requests: Iterable[Any], where: Sequence[str] | None = None) -> Iterator[_Row]:
    """Each request validated as it is read; ``where`` names listed requests in errors."""
    seen = set()
    for i, r in enumerate(requests):
        name = None if where is None else where[i]
        row = job.row(_as_request(r, i), i, name)
        if row.id in seen:
            fail(f"{name or f'requests[{i}]'}.id", row.id, "duplicate id: ids must be unique")
        seen.add(row.id)
        yield row


def _run(eng: EngineConfig, params: dict, rows_iter: Iterator[_Row], slots: int, width: int, refill: int,
         sync_every: int, pool: int | None, stop: Callable[[], bool], eos_width: int, cost: Any = None,
         listed: bool = False, chunk: int | None = None, prefixes: PrefixCache | None = None) -> Iterator[Completion]:
    """The host loop: admit, decode, harvest (one device read per round). The host clock at
    round boundaries times every request (``specjax.latency``): a listed job's requests
    arrive at its start, a stream's when it yields them. With ``chunk``, an admit of prompts
    wider than it is pending (``_Pending``): each round runs one decode step with the next
    chunk of the oldest pending admit in its forward (``_chunk_step``); its rows join when
    their prompts are in. With ``prefixes``
    (the prefix cache), each admit starts its rows on the cached pages of their prompts' heads
    and registers the full prompt pages it writes; at the end every page is back in the pool."""
    start = latency.now()
    st = _empty_state(eng, slots, width, eos_width)
    if prefixes is not None and eng.drafter.stores_prefixes:  # the MTP block's entries of cached pages
        st = st.replace(dstate=eng.drafter.with_prefix_store(eng, st.dstate, st.cache.global_kv.num_pages, PAGE_SIZE))
    table_ready = eng.controller is None
    held: list[_Row | None] = [None] * slots  # the request each slot serves
    timed: list[_Timed | None] = [None] * slots  # its host times
    shares: list[tuple[int, ...]] = [()] * slots  # the cached pages it started on
    arrived: dict[Any, float] = {}
    timeline, i_now = latency.Timeline(), 0  # i_now: global steps taken (read back each round)
    queue: collections.deque[_Row] = collections.deque()
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
            st = _finish(eng, st, jnp.asarray(idle), head.rows, head.sub, head.upto)
        jax.block_until_ready(st.done)
        t_first = latency.now()
        _name_pages(eng, st, prefixes, [(s, r) for s, r, _ in head.picked], head.started, slots)
        for s, _, arrival in head.picked:
            timed[s] = _Timed(arrival, head.t_admit, t_first, i_now, len(shares[s]) * PAGE_SIZE)
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
                prefixes.forget(jax.device_get([c.cached for c in _pools(st)]))
            batch, started = _pick(held, queue, refill, pool, eng.pool_groups, prefixes, shares)
            if not any(batch):
                break
            idle = np.array([held[s] is None for s in range(slots)])
            t_admit = latency.now()
            picked = [x for group in batch for x in group]
            rest = max(len(r.prompt) - len(started.get(s, ())) * PAGE_SIZE for s, r in picked)  # to compute
            shared = None if prefixes is None else \
                _share_inputs(batch, refill, slots, started, st.cache.global_kv.max_pages, prefixes.pools)
            for s, r in picked:  # the cached pages are held from the admit on (the target pool's ids)
                held[s], shares[s] = r, tuple(p[0] for p in started.get(s, ()))
            if chunk is not None and rest > chunk:
                args = _admit_inputs(batch, refill, slots, eos_width, chunk)
                with mesh_context(eng):
                    st, sub = _begin(eng, st, *args, shared)
                pending.append(_Pending(args[0], sub, -(-rest // chunk), [(s, r, arrived.pop(r.id)) for s, r in picked],
                                        t_admit, started, None if shared is None else shared[2]))
                continue
            inputs = _admit_inputs(batch, refill, slots, eos_width)
            c = prompt_bucket([[0] * rest])  # the uncached rests' width (the whole width without the cache)
            with mesh_context(eng):
                st = _admit(eng, None if c >= inputs[1].shape[1] else c, params, st, jnp.asarray(idle), *inputs,
                            shared)
            jax.block_until_ready(st.done)  # the admit's end: the rows' first token, the live rows' stall
            t_first = latency.now()
            _name_pages(eng, st, prefixes, picked, started, slots)
            for s, r in picked:
                timed[s] = _Timed(arrived.pop(r.id), t_admit, t_first, i_now, len(shares[s]) * PAGE_SIZE)
        if pending and not mixed:  # one chunk of the oldest pending admit, as its own call
            with mesh_context(eng):
                st, pending[0].sub = _chunk(eng, params, st, pending[0].sub, pending[0].rows, chunk)
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
                st, pending[0].sub = _chunk_step(eng, params, st, pending[0].sub, pending[0].rows, chunk)
            else:
                st = _decode(eng, params, st, jnp.int32(target), st.i + steps)
        done, i_next, free = (np.array(x) for x in jax.device_get((st.done, st.i, _free_pages(st))))
        timeline.add(i_now, int(i_next), t0, latency.now())
        i_now = int(i_next)
        if pending and mixed:
            st = chunk_done(st)
        done[list(waiting)] = False  # pending rows are not finished
        in_use = None if pool is None else pool - int(free.sum())
        yield from _harvest(eng, st, held, done, timed, timeline, in_use)
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
    picked: list[tuple[int, _Row, float]]
    t_admit: float
    started: dict  # {slot: the cached pages it starts on} (the prefix cache)
    upto: jax.Array | None  # its rows' full prompt pages, registered when they are in


@dataclasses.dataclass(frozen=True)
class _Timed:
    """A running request's host times: arrival, its admit's start and end, and the global
    step its first decode step runs at; and the prompt tokens the prefix cache served it."""

    arrival: float
    admit_start: float
    admit_end: float
    start_step: int
    cached_tokens: int = 0  # prompt tokens it started on from the prefix cache


def _pick(held: list[_Row | None], queue: collections.deque[_Row], refill: int, pool: int | None,
          groups: int, prefixes: PrefixCache | None = None,
          shares: Sequence[tuple[int, ...]] | None = None) -> tuple[list[list[tuple[int, _Row]]], dict]:
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
    picks: list[list[tuple[int, _Row]]] = [[] for _ in range(groups)]
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
    timed, box = slice_timer(st, lambda s, n: _decode(eng, params, s, never, s.i + n), len(eng.windows))
    table, _ = cost_table(eng, slots, cost, cost_key(eng, [[slots, width], ["batch"]]), timed,
                          warm=warm_steps(eng.capacity - width), **SLICES)
    return box[0].replace(auto=auto_state(eng, table, slots))


def _admit_inputs(batch: list[list[tuple[int, _Row]]], refill: int, slots: int, eos_width: int = EOS_WIDTH,
                  chunk: int | None = None):
    """Host arrays for one admit: ``batch``'s slot groups in order (group-major; ``_pick``), each
    padded to the same row count: the fullest group's, rounded up to a power of two, at most
    ``ceil(refill / groups)`` (a prefill's work follows the requests admitted; a few row counts
    per bucket compile). Padding rows point at slot ``slots``. ``chunk``: the prompt width
    rounds up to whole chunks (a chunk past a row's prompt writes padding inside it)."""
    laid = _layout(batch, refill, slots)
    width = prompt_bucket([r.prompt for s, r in laid if s < slots])
    if chunk is not None:
        width = -(-width // chunk) * chunk
    rows = np.array([s for s, _ in laid], np.int32)
    toks = np.zeros((len(laid), width), np.int32)
    for i, (_, r) in enumerate(laid):  # host-side batch assembly
        toks[i, : len(r.prompt)] = r.prompt
    req = [r for _, r in laid]
    plen = np.array([len(r.prompt) for r in req], np.int32)
    return (
        jnp.asarray(rows), jnp.asarray(toks), jnp.asarray(plen),
        jnp.asarray(plen + np.array([r.max_new_tokens for r in req], np.int32)),
        jnp.asarray(eos_table([r.eos for r in req], eos_width)),
        jnp.asarray(np.array([r.seed for r in req], np.uint32)),
        RowSampling.rows([r.temperature for r in req], [r.top_k for r in req], [r.top_p for r in req]),
    )


def _name_pages(eng: EngineConfig, st: EngineState, prefixes: PrefixCache | None, picked: list[tuple[int, _Row]],
                started: dict, slots: int) -> None:
    """The prefix cache: the full prompt pages the rows ``picked`` just wrote (past the cached
    ones they ``started`` on) name their prefixes; one read of the block tables."""
    if prefixes is None:
        return
    tables = np.stack(jax.device_get([c.block_table for c in _pools(st)]), axis=-1)
    for s, r in picked:
        m, g = len(started.get(s, ())), s // (slots // eng.pool_groups)
        prefixes.add(r.keys[m:], tables[s, m : len(r.keys)], g)
        prefixes.count(len(r.prompt), m)


@functools.partial(jax.jit, static_argnums=0)
def _drained(eng: EngineConfig, st: EngineState) -> list[tuple[jax.Array, jax.Array]]:
    """Each paged pool's ``(refs, num_free)`` once every slot has let its pages go."""
    return [(c.refs, c.num_free) for c in _pools(_release(eng, st, jnp.ones(st.done.shape, bool)))]


def _check_pool(eng: EngineConfig, st: EngineState) -> None:
    """At the end of a job on a paged pool: once every slot lets its pages go, no page may
    keep a reference and every page must be back on the free stack(s); a leak raises."""
    if not _pools(st):
        return
    with mesh_context(eng):
        counts = jax.device_get(_drained(eng, st))
    for refs, free in counts:
        if refs.any() or int(free.sum()) != refs.size:
            raise RuntimeError(f"page accounting leaked at the end of the job: {int(np.count_nonzero(refs))} pages "
                               f"still referenced, {int(free.sum())} of {refs.size} free")


def _layout(batch: list[list[tuple[int, _Row]]], refill: int, slots: int) -> list[tuple[int, _Row]]:
    """``batch``'s ``(slot, request)`` pairs in admit order: group-major, each group padded to
    the fullest group's count rounded up to a power of two, at most ``ceil(refill / groups)``
    (padding: slot ``slots``, a copy of a real request)."""
    fullest = max(len(g) for g in batch)
    rg = min(-(-refill // len(batch)), 1 << (fullest - 1).bit_length())
    real = next(x for g in batch for x in g)
    return [x for g in batch for x in g + [(slots, real[1])] * (rg - len(g))]


def _share_inputs(batch: list[list[tuple[int, _Row]]], refill: int, slots: int, started: dict, max_pages: int,
                  pools: int = 1) -> tuple:
    """``_admit``'s prefix arguments for ``batch`` (laid out as ``_admit_inputs``): ``(pages
    [pools, R, M], count [R], upto [R])``, the cached pages each row starts on in each pool,
    and its full prompt pages, registered once written."""
    laid = _layout(batch, refill, slots)
    pages = np.full((pools, len(laid), max_pages), -1, np.int32)
    count, upto = np.zeros(len(laid), np.int32), np.zeros(len(laid), np.int32)
    for i, (s, r) in enumerate(laid):
        if s == slots:
            continue
        got = started.get(s, ())
        if got:
            pages[:, i, : len(got)] = np.asarray(got).T
        count[i], upto[i] = len(got), len(r.keys)
    return jnp.asarray(pages), jnp.asarray(count), jnp.asarray(upto)


def _free_pages(st: EngineState) -> jax.Array:
    """The target pool's free pages (cached ones not held by a row included); 0 for a dense cache."""
    return st.cache.global_kv.num_free if _pooled(st.cache) else jnp.zeros((), jnp.int32)


def _harvest(eng: EngineConfig, st: EngineState, held: list[_Row | None], done: np.ndarray,
             timed: list[_Timed | None], timeline: latency.Timeline, in_use: int | None = None) -> Iterator[Completion]:
    """Completions of rows that finished since the last harvest (``done [B]``, read back);
    their slots become free. ``in_use``: the paged pool's pages held by rows at this round."""
    finished = [s for s in range(len(held)) if held[s] is not None and done[s]]
    if not finished:
        return
    host = jax.device_get((st.seq, st.prompt_len, st.known, st.steps, st.emitted, st.accepted, st.proposed, st.trace,
                           row_status(eng, st)))
    seq, plen, known, steps, emitted, accepted, proposed, trace, status = (np.asarray(x) for x in host)
    # only the finished slots are judged
    check_status(np.where(np.isin(np.arange(len(held)), finished), status, 0), "slots")
    out = []
    for s in finished:
        r, t = held[s], timed[s]
        held[s] = timed[s] = None
        toks = seq[s, plen[s] : known[s]].tolist()
        n_steps = int(steps[s])
        reason = "eos" if toks and toks[-1] in r.eos else "length"
        out.append(Completion(r.id, toks, reason, {
            "num_tokens": len(toks),
            "steps": n_steps,
            "tok_per_step": float(emitted[s] / n_steps) if n_steps else 0.0,
            "accepted_drafts": int(accepted[s]),
            "mean_accepted_length": float((accepted[s] + n_steps) / n_steps) if n_steps else 0.0,
            "accepted_trace": [int(x) for x in trace[s, :n_steps]],
            "drafter": eng.drafter.name, "depth": "auto" if eng.controller else eng.depth,
            "kv_advance": eng.kv_rule.value, "proposed_drafts": int(proposed[s]),
            "prompt_tokens": len(r.prompt), "cached_tokens": t.cached_tokens, "pages_in_use": in_use,
            **latency.request_latency(timeline, arrival=t.arrival, admit_start=t.admit_start, admit_end=t.admit_end,
                                      start_step=t.start_step, trace=trace[s, :n_steps], num_tokens=len(toks)),
        }))
    yield from out
