"""A user's drafter (``specjax.protocols.Drafter``) adapted to the engine's interface."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafters.base import EngineDrafter
from specjax.protocols import DraftContext


@dataclasses.dataclass(frozen=True)
class PluggedDrafter(EngineDrafter):
    """A user's drafter (``specjax.protocols.Drafter``) in the engine: it sees a ``DraftContext``,
    and its state (per-row arrays, or ``None``) follows slot refill row by row."""

    user: Any

    @property
    def name(self) -> str:
        return str(self.user.name)

    def _init(self, batch):
        init = getattr(self.user, "init", None)
        return None if init is None else init(batch)

    def empty(self, eng, batch, width):
        return self._init(batch)

    def rows_view(self, eng, dstate, rows, width):
        return self._init(rows.shape[0])

    def put_rows(self, dstate, rows, sub):
        return jax.tree.map(lambda big, small: big.at[rows].set(small.astype(big.dtype), mode="drop"), dstate, sub)

    def release(self, dstate, idle):
        return dstate

    def prefill(self, eng, params, st, hidden, positions, live):
        return st.dstate

    @staticmethod
    def context(eng, st) -> DraftContext:
        return DraftContext(st.seq, st.known, st.live, st.seeds, st.sampling, eng.depth, eng.greedy)

    def propose(self, eng, params, st):
        b = st.seq.shape[0]
        if eng.depth == 0:  # depth="auto" at window 1: no drafts asked
            return jnp.zeros((b, 0), jnp.int32), None, st.dstate
        drafts, draft_probs, state = self.user.propose(self.context(eng, st), st.dstate)
        if drafts.shape != (b, eng.depth):
            raise ValueError(f"drafter {self.name!r}: propose returned drafts of shape {drafts.shape}, "
                             f"expected (batch, depth) = {(b, eng.depth)}")
        if eng.greedy:
            draft_probs = None  # greedy verification compares tokens only
        return drafts.astype(jnp.int32), draft_probs, state

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        commit = getattr(self.user, "commit", None)
        return dstate if commit is None else commit(self.context(eng, st), dstate, a)
