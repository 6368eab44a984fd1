"""A decode step taken apart for timing (``specjax.scale``'s breakdown): the decode loop, the
target's own ``w``-token forward, the LM head, and each of a step's parts (draft, verify,
commit, the drafter's commit) in a compiled loop of its own.

Every function here runs the engine's own step functions: nothing is re-implemented, so a part's
time is the time of the code the step runs.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["PARTS", "breakdown", "copy_tree", "decode", "forward", "forward_loop", "head", "part", "part_inputs",
           "part_timers", "time_on_copy"]


def decode_loop(eng, params, st):
    from specjax.engine import run_steps

    return run_steps(eng, params, st, lambda s: jnp.any(~s.done) & (s.i < eng.max_steps))


decode = jax.jit(decode_loop, static_argnums=0, donate_argnums=2)


def forward_loop(dec, impl: str, w: int, n: int, params, cache, tok):
    """``n`` forwards of a ``w``-token window per row (every layer, the LM head over all ``w``
    positions, argmax), each writing its K/V and advancing one slot; the argmax feeds the next."""
    b = tok.shape[0]
    live = jnp.ones((b,), bool)

    def body(_, carry):
        cache, tok = carry
        pos = cache.lengths[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
        hidden, cache = dec.forward_hidden(params, jnp.broadcast_to(tok[:, None], (b, w)), pos,
                                           cache.reserve(w, live), attention_impl=impl)
        nxt = jnp.argmax(dec.head(params, hidden), axis=-1).astype(jnp.int32)  # [B, w]
        return cache.advance(jnp.ones((b,), jnp.int32)), nxt[:, -1]
    return jax.lax.fori_loop(0, n, body, (cache, tok))


forward = jax.jit(forward_loop, static_argnums=(0, 1, 2, 3), donate_argnums=5)


def head_loop(dec, n: int, params, x):
    def body(_, x):
        return x + (1e-6 * jnp.max(dec.head(params, x), axis=-1, keepdims=True)).astype(x.dtype)
    return jax.lax.fori_loop(0, n, body, x)


head = jax.jit(head_loop, static_argnums=(0, 1))


# A step's parts, each from the step's own functions, each timed in a loop of its own as
# ``forward(w)`` is (a single call costs about 5% more on XLA:CPU). Each part maps its inputs to
# ``(next inputs, live outputs)``: a buffer it writes (a cache) becomes the next iteration's input,
# so it is written in place as in the decode loop, and what else it returns stays live (not dead
# code). An optimization barrier at the top of each iteration keeps XLA from hoisting the part out
# of the loop (its inputs do not change from one iteration to the next).
def _draft_part(eng, params, st):
    """What a step drafts: the drafter's chain or tree."""
    if eng.tree is not None:
        tokens, parents, dstate = eng.drafter.propose_tree(eng, params, st)
        return st.replace(dstate=dstate), (tokens, parents)
    proposals, probs_, dstate = eng.drafter.propose(eng.at_window(eng.window), params, st)
    return st.replace(dstate=dstate), (proposals, probs_)


def _verify_part(eng, params, st):
    """A step up to its commit: draft, the target's window forward, its LM head, acceptance (a
    tree's walk and compaction)."""
    from specjax.engine.step import verify

    v = verify(eng, params, st, eng.window)[0]
    return st.replace(cache=v.cache, dstate=v.dstate), v._replace(cache=None, dstate=None)


def _commit_part(eng, params, inputs):
    """A step's commit: emit, the plan's advance, the drafter's commit, the counters."""
    from specjax.engine.step import commit

    st, v = inputs
    new, verdicts = commit(eng, params, st, eng.window, v)
    # the caches it advanced and wrote go back to ``v`` (each buffer carried once: no copy)
    return (new.replace(cache=st.cache, dstate=st.dstate), v._replace(cache=new.cache, dstate=new.dstate)), verdicts


def _drafter_commit_part(eng, params, inputs):
    """The drafter's own commit (an MTP module's block pass over the window and its head)."""
    from specjax.engine.step import commit_drafter

    st, v, new, advance = inputs
    dstate = commit_drafter(eng, params, st, eng.window, v, new, advance)
    return (st, v._replace(dstate=dstate), new, advance), ()


_PART_FNS = {"draft": _draft_part, "verify": _verify_part, "commit": _commit_part,
             "drafter_commit": _drafter_commit_part}


def part_loop(eng, name: str, n: int, params, inputs):
    part = _PART_FNS[name]

    def body(_, carry):
        inputs, _ = jax.lax.optimization_barrier(carry)
        return part(eng, params, inputs)
    return jax.lax.fori_loop(1, n, body, part(eng, params, inputs))  # n runs


part = jax.jit(part_loop, static_argnums=(0, 1, 2), donate_argnums=4)


@functools.partial(jax.jit, static_argnums=0)
def part_inputs(eng, st, verified):
    """The commit parts' inputs from the verify part's outcome on ``st`` (``verified``: its
    ``(next inputs, live outputs)``): ``(v, emitted state, advance)``."""
    from specjax.engine.step import emit

    nxt, v = verified
    v = v._replace(cache=nxt.cache, dstate=nxt.dstate)
    new, _, advance = emit(eng, st, eng.window, v)
    return v, new, advance


def part_timers(eng, params, st, n: int) -> dict[str, tuple[Callable, Any]]:
    """``name -> (fn, arg)``: ``fn(arg)`` runs the step's part ``n`` times on ``st`` (compiled here)."""
    timers = {name: functools.partial(part, eng, name, n, params) for name in _PART_FNS}
    with warnings.catch_warnings():  # a donated input a part does not write (a counter) is not an error
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        # the verify part's compile run gives the commit parts their inputs (its n runs verify the
        # same window again: the commit's cost is what is timed)
        v, new, advance = part_inputs(eng, st, timers["verify"](copy_tree(st)))
        # one target cache per row in memory (a cache per part ran this machine's 23 GB out at B=4 at
        # Qwen3-0.6B's shape): the commit parts move caches' lengths and never read their K/V, so
        # they time the same on the state's own cache
        v = v._replace(cache=st.cache)
        new = new.replace(cache=st.cache)
        args = {"draft": st, "verify": st, "commit": (st, v), "drafter_commit": (st, v, new, advance)}
        for name in ("draft", "commit", "drafter_commit"):  # compile
            jax.block_until_ready(timers[name](copy_tree(args[name])))
    return {name: (fn, args[name]) for name, fn in timers.items()}


# the breakdown's columns, in a step's order: each is a part's time less the parts inside it
PARTS = ("draft", "forward", "verify", "drafter_commit", "commit", "loop")


def breakdown(step_ms: float, forward_ms: float, part_ms: dict[str, float]) -> dict[str, float]:
    """Where a step's ``step_ms`` goes, from its parts each timed in a loop (``part_ms``: ``draft``,
    ``verify``, ``commit``, ``drafter_commit``) and the target's own forward over the window:
    ``draft``; ``forward`` (the target's window forward: layers, K/V write, LM head); ``verify``
    (the rest of a step up to its commit: the window's assembly, acceptance, a tree's walk and
    compaction); ``drafter_commit``; ``commit`` (emit, plan, counters); ``loop`` (the decode
    loop's own work, less what fusing the parts in one step saves: may be negative). They sum
    to ``step_ms``."""
    return {"draft": part_ms["draft"], "forward": forward_ms,
            "verify": part_ms["verify"] - part_ms["draft"] - forward_ms,
            "drafter_commit": part_ms["drafter_commit"], "commit": part_ms["commit"] - part_ms["drafter_commit"],
            "loop": step_ms - part_ms["verify"] - part_ms["commit"]}


def copy_tree(tree):
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, tree)


def time_on_copy(fn: Callable[[Any], Any], arg) -> float:
    """Seconds of ``fn`` on a fresh copy of ``arg`` (which it may donate), the copy made first."""
    arg = jax.block_until_ready(copy_tree(arg))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arg))
    return time.perf_counter() - t0
