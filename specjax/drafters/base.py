"""The engine's drafter interface (``EngineDrafter``) and what every drafter shares.

An engine drafter proposes ``depth`` draft tokens per row and commits per-row accepted
counts. Everything runs traced inside the engine's jitted step (pure, static shapes); the
object is frozen and hashable (it is part of the static engine).

Required (``EngineDrafter``):

* ``empty(eng, batch, width) -> dstate``: an empty state for ``batch`` rows (prefills of
  up to ``width`` tokens); ``rows_view(eng, dstate, rows, width)`` an empty state for
  refilling ``rows [R]`` and ``put_rows(dstate, rows, sub)`` merges it back (slot refill);
  ``release(dstate, idle)`` returns the pages of ``idle [B]`` rows to a paged pool;
* ``prefill(eng, params, st, hidden, positions, live) -> dstate`` after the target prefill,
  filling the empty ``st.dstate`` (``live [B]``: rows that are real, not padding);
* ``propose(eng, params, st) -> (drafts [B, d], draft_probs [B, d, V] | None, dstate)``:
  ``draft_probs`` is the draft distribution (``None`` when drafts are deterministic: one-hot);
* ``commit(eng, params, st, dstate, hidden, old_lengths, u, a, advance) -> dstate`` after
  verification (``st.seq`` already holds the emitted tokens).

Capabilities: class-level flags, each naming the methods it brings (the engine asks the flag,
never probes for a method):

* ``trees``: ``propose_tree(eng, params, st) -> (tokens [B, N], parents [B, N + 1], dstate)``;
  ``tree_presets``: it also drafts preset trees (else only ``DynamicTree``);
* ``compacts``: ``compact_tree(dstate, src)``: its own caches hold the verify window and
  compact as the target's;
* ``reports_status``: ``status(dstate) -> int32 [B]`` (its caches' status bits);
* ``defers``: work a window-1 step (``depth="auto"``) may defer: ``backlog_size(eng) -> R``
  (0: nothing deferred), ``backlog(dstate) -> int32 []`` and ``settle(eng, params, st)``;
  ``engine.run_steps`` settles before a drafting window and when the backlog reaches ``R``;
* ``offers``: ``offer(eng, st) -> (count [B], first [B])``: rows that can draft fewer now
  (n-gram lookup without a match);
* ``stores_prefixes``: ``with_prefix_store`` / ``keep_prefix``: its own K/V of a batch job's
  cached prompt pages (the prefix cache).

Drafter caches mirror the target's per-row lengths and advance by the same plan. A user's
drafter follows the smaller public protocol (``specjax.protocols.Drafter``: it sees a
``DraftContext``, not the engine's state); ``PluggedDrafter`` adapts it to this one.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

from specjax.sampling import draft_token

__all__ = ["EngineDrafter", "Stateless", "gather_tokens", "pick", "stack_probs"]


class EngineDrafter(Protocol):
    """What the engine calls on a drafter (see the module docstring); drafters subclass it
    explicitly and set the capability flags they implement."""

    name: str
    trees: ClassVar[bool] = False
    tree_presets: ClassVar[bool] = True
    compacts: ClassVar[bool] = False
    reports_status: ClassVar[bool] = False
    defers: ClassVar[bool] = False
    offers: ClassVar[bool] = False
    stores_prefixes: ClassVar[bool] = False

    def empty(self, eng: Any, batch: int, width: int) -> Any: ...

    def rows_view(self, eng: Any, dstate: Any, rows: jax.Array, width: int) -> Any: ...

    def put_rows(self, dstate: Any, rows: jax.Array, sub: Any) -> Any: ...

    def release(self, dstate: Any, idle: jax.Array) -> Any: ...

    def prefill(self, eng: Any, params: Any, st: Any, hidden: jax.Array, positions: jax.Array,
                live: jax.Array) -> Any: ...

    def propose(self, eng: Any, params: Any, st: Any) -> tuple[jax.Array, jax.Array | None, Any]: ...

    def commit(self, eng: Any, params: Any, st: Any, dstate: Any, hidden: jax.Array, old_lengths: jax.Array,
               u: jax.Array, a: jax.Array, advance: jax.Array) -> Any: ...


def pick(logits: jax.Array, eng: Any, st: Any, positions: jax.Array):
    """Draft tokens from ``logits [B, V]`` for absolute ``positions [B]`` (``sampling.draft_token``)."""
    return draft_token(logits, eng.greedy, st.seeds, st.sampling, positions)



def stack_probs(probs_all: list, greedy: bool):
    return None if greedy else jnp.stack(probs_all, axis=1)


def gather_tokens(seq: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(seq, jnp.clip(idx, 0, seq.shape[1] - 1), axis=1)


class Stateless(EngineDrafter):
    """A drafter that keeps no state of its own: nothing to prefill, refill or release."""

    def empty(self, eng, batch, width):
        return None

    def rows_view(self, eng, dstate, rows, width):
        return None

    def put_rows(self, dstate, rows, sub):
        return None

    def release(self, dstate, idle):
        return dstate

    def prefill(self, eng, params, st, hidden, positions, live):
        return None

