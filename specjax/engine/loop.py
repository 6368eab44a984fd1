"""The decode loop: steps in ``lax.while_loop`` until a condition fails, one jitted ``step``,
and the whole-generation loop (prefill, then steps until every row is done)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from specjax.engine.config import EngineConfig
from specjax.engine.prefill import Chunk, fresh_prefill
from specjax.engine.state import EngineState
from specjax.engine.step import step_window, step_with_chunk
from specjax.sharding import constrain

__all__ = ["TRACES", "decode_step", "generate_loop", "run_steps", "step", "step_and_chunk"]

TRACES = {"generate": 0}  # traces of ``generate_loop`` (compile-count tests)


def _fixed_step(eng: EngineConfig, params: dict, st: EngineState) -> EngineState:
    """A step at the one window, every row drafting all it holds."""
    return constrain(step_window(eng, params, st, eng.window)[0], eng.mesh)  # per-row arrays stay on their shard


def _controlled_step(eng: EngineConfig, params: dict, k: int):
    """The step at window ``eng.windows[k]`` with the controller's draft counts, what the
    controller learns from it, then its choice for the step after."""
    ctl, w = eng.controller, eng.windows[k]

    def body(st: EngineState) -> EngineState:
        out, verdicts = step_window(eng, params, st, w, ctl.drafts(eng, st, w))
        out = constrain(ctl.observe(eng, st, out, verdicts, w), eng.mesh)
        return ctl.choose(eng, out)
    return body


def run_steps(eng: EngineConfig, params: dict, st: EngineState, keep_going) -> EngineState:
    """Steps while ``keep_going(state)`` (a traced bool): ``lax.while_loop`` over the step.

    Under a step controller the window is dispatched by one inner ``while_loop`` per window
    (each runs while the controller keeps choosing it), not by ``lax.switch``: XLA copies every
    buffer a conditional's branches update in place (the caches, each step), while a loop
    updates its carry in place. Each outer trip runs at least one step.

    A drafter that defers work over window-1 steps (``settle`` / ``backlog``: the MTP block)
    settles it before a drafting window runs, and when its backlog reaches ``R``; those
    settles are loops of at most one trip, for the same in-place reason.

    The choice is made once per step, after it (``StepController.choose``; and once on entry: a
    batch job changes rows between calls), and kept in the state: the loops' conditions only
    read it."""
    ctl = eng.controller
    if ctl is None:
        return jax.lax.while_loop(keep_going, lambda s: _fixed_step(eng, params, s), st)

    def settle(s):
        return s.replace(dstate=eng.drafter.settle(eng, params, s))

    def trip(st):
        for k, w in enumerate(eng.windows):
            due, runs = _dispatch(eng, keep_going, k, w)
            if due is not None:
                st = jax.lax.while_loop(due, settle, st)
            st = jax.lax.while_loop(runs, _controlled_step(eng, params, k), st)
        return st
    return jax.lax.while_loop(keep_going, trip, ctl.choose(eng, st))


def _dispatch(eng: EngineConfig, keep_going, k: int, w: int):
    """Under a step controller: (when a settle is due before window ``k``'s loop, or None;
    while window ``k``'s loop runs), for ``run_steps`` and ``step_and_chunk``."""
    ctl, drafter = eng.controller, eng.drafter
    full = drafter.backlog_size(eng) if drafter.defers else 0  # R; 0: the drafter defers nothing

    def chosen(s):
        return keep_going(s) & (ctl.chosen(s) == k)
    if not full:
        return None, chosen
    if w == 1:  # plain steps pile up until the backlog is full
        return (lambda s: chosen(s) & (drafter.backlog(s.dstate) >= full),
                lambda s: chosen(s) & (drafter.backlog(s.dstate) < full))
    return lambda s: chosen(s) & (drafter.backlog(s.dstate) > 0), chosen  # a drafting step starts settled


def step_and_chunk(eng: EngineConfig, params: dict, st: EngineState, chunk: Chunk
                   ) -> tuple[EngineState, tuple[jax.Array, Any]]:
    """One step with a prefill ``chunk`` of pending rows in its forward (``step_with_chunk``):
    ``(st, (chunk hidden, chunk cache))``. Under a step controller the step runs at the window
    it chose, dispatched as in ``run_steps`` (one loop per window, each of at most one trip,
    settles before it); the chunk rides in whichever runs. Between the loops the chunk's
    paged view is carried without the pool's storage (one owner: the state's cache)."""
    ctl = eng.controller
    if ctl is None:
        st, _, out = step_with_chunk(eng, params, st, eng.window, chunk)
        return constrain(st, eng.mesh), out
    hidden = jnp.zeros((*chunk.tokens.shape, eng.target.hidden_size), eng.dtype)
    carry = (ctl.choose(eng, st), hidden, chunk.cache.without_pool(), jnp.bool_(False))

    def step_k(k: int, w: int):
        def body(c):
            st, _, cache, _ = c
            out, verdicts, (h, cache) = step_with_chunk(eng, params, st, w, chunk._replace(
                cache=cache.on_pool_of(st.cache)), ctl.drafts(eng, st, w))
            out = constrain(ctl.observe(eng, st, out, verdicts, w), eng.mesh)
            return ctl.choose(eng, out), h.astype(hidden.dtype), cache.without_pool(), jnp.bool_(True)
        return body

    def settle(c):
        return (c[0].replace(dstate=eng.drafter.settle(eng, params, c[0])), *c[1:])

    for k, w in enumerate(eng.windows):
        due, runs = _dispatch(eng, lambda s: True, k, w)
        if due is not None:
            carry = jax.lax.while_loop(lambda c, due=due: ~c[3] & due(c[0]), settle, carry)
        carry = jax.lax.while_loop(lambda c, runs=runs: ~c[3] & runs(c[0]), step_k(k, w), carry)
    st, hidden, cache, _ = carry
    return st, (hidden, cache.on_pool_of(st.cache))


def decode_step(eng: EngineConfig, params: dict, st: EngineState) -> EngineState:
    """One speculative step for every row: draft, verify, commit. Under a step controller the
    step first picks its window and each row's draft count (no host sync), then runs exactly
    that window's step (the dispatch of ``run_steps``, limited to one step)."""
    if eng.controller is None:
        return _fixed_step(eng, params, st)
    start = st.i
    return run_steps(eng, params, st, lambda s: s.i == start)


step = jax.jit(decode_step, static_argnums=0, donate_argnums=2)
step.__doc__ = """``step(engine, params, state) -> state``: one jitted speculative step (static ``engine``).
The input state is donated: its buffers (caches included) are updated in place, not copied."""


def generate_loop(eng: EngineConfig, params: dict, prompts, prompt_len, max_len, eos, seeds, sampling,
                  data, stop_i: jax.Array) -> EngineState:
    """Prefill, then steps until every row is done (or ``stop_i`` steps: cost measurement).
    ``data``: the step controller's (``StepController.init``), or None without one."""
    TRACES["generate"] += 1
    st = fresh_prefill(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling)
    st = constrain(st if data is None else eng.controller.init(eng, st, data), eng.mesh)
    return run_steps(eng, params, st, lambda st: jnp.any(~st.done) & (st.i < jnp.minimum(eng.max_steps, stop_i)))
