"""``AutoDepth``: ``depth="auto"`` as the engine's step controller (``engine.controller``).

Each step picks its verify window from ``policy.windows`` and each row's draft count in it
(``policy.decide`` on the rows' acceptance estimates and the step-cost table), and after it
the estimates learn from the step's verdicts (``policy.learn``). With a token tree
(``EngineConfig.tree``) the widest window is the tree's: a tree step's main branch teaches the
chain estimates, and its yield over that branch the tree's ``lift`` (``policy.learn_lift``).
The data (the cost table, the choice, window counts, the prior, the lift) rides in
``EngineState.auto`` as an ``AutoState``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.auto.policy import AutoState, CostTable, DepthPolicy, decide, learn, learn_lift, revealed
from specjax.engine.config import EngineConfig
from specjax.engine.state import EngineState
from specjax.engine.step import StepVerdicts

__all__ = ["AutoDepth", "auto_state"]


@dataclasses.dataclass(frozen=True)
class AutoDepth:
    """The step controller of ``depth="auto"`` (static: hashable, part of the compile key)."""

    policy: DepthPolicy

    @property
    def windows(self) -> tuple[int, ...]:
        return self.policy.windows

    def init(self, eng: EngineConfig, st: EngineState, data: AutoState) -> EngineState:
        """A fresh state (every row just prefilled) under ``data``: its rows' estimates start at
        the table's prior (``AutoState.prior``)."""
        return st.replace(auto=data, est=jnp.broadcast_to(data.prior, st.est.shape))

    def choose(self, eng: EngineConfig, st: EngineState) -> EngineState:
        """``st`` with the next step's window, each row's draft count in it, and each row's first
        draft where the drafter knows it now (``offer``; else -1), kept in ``st.auto``."""
        active = ~st.done
        can, first = None, jnp.full(st.known.shape, -1, jnp.int32)
        if eng.drafter.offers:  # rows that can offer fewer drafts now (n-gram: none without a match)
            can, first = eng.drafter.offer(eng, st)
        idx, drafts = decide(self.policy, st.est, active, st.u, st.auto.cost, remaining=st.max_len - st.known,
                             seen=st.seen_pos, can=can, lift=st.auto.lift)
        # cost measurement: this window, every row drafting (the widest before force_from)
        windows = jnp.asarray(self.windows)
        narrowest = jnp.argmax(windows >= jnp.max(jnp.where(active, st.u, 1))).astype(jnp.int32)
        forced = st.auto.force >= 0
        at = jnp.where(st.i < st.auto.force_from, len(self.windows) - 1, st.auto.force)
        idx = jnp.where(forced, jnp.maximum(at, narrowest), idx)
        drafts = jnp.where(forced, eng.depth, drafts)
        return st.replace(auto=st.auto.replace(pick=idx, drafts=drafts, first=first))

    def chosen(self, st: EngineState) -> jax.Array:
        return st.auto.pick

    def drafts(self, eng: EngineConfig, st: EngineState, w: int) -> tuple[jax.Array, jax.Array]:
        """(asked, offered) in window ``w``: each row's chosen count, or every slot of the window
        (``DepthPolicy.fill``); what it can offer of them (``available``)."""
        room = w - st.u
        asked = jnp.clip(room if self.policy.fill else jnp.minimum(room, st.auto.drafts), 0, None)
        if w > 1 and eng.drafter.offers:  # window 1 proposes none (u >= 1)
            return asked, jnp.minimum(asked, eng.drafter.available(eng, st))
        return asked, asked

    def observe(self, eng: EngineConfig, before: EngineState, after: EngineState, verdicts: StepVerdicts,
                w: int) -> EngineState:
        """The step's window counted, and each active row's estimates moved by its verdicts: the
        drafts it was asked for (one it could not offer counts as rejected, so the estimates stay
        long-run rates), or at window 1, where the drafter knew the row's first draft (``offer``:
        n-gram), whether the target's token is that draft. Free (nothing more runs) and exact:
        greedy, the token is the argmax; sampling, ``token ~ p`` and ``P(token = x) = p(x)``, a
        one-hot draft's acceptance probability. A row without a match is judged rejected, as its
        unoffered draft is in a drafting window: the estimates stay each row's long-run rate,
        which the makespan rule prices as if every step drafted (a rate conditioned on a match,
        as learned first, had batches of 8-64 drafting wide windows for the half of their rows
        that held one). A row whose first drafts failed still recovers its estimate without
        drafting at a loss."""
        active = ~before.done
        told, told_a = verdicts.chain_asked, verdicts.chain_accepted  # a tree step: its main branch
        seen = after.seen_pos
        if w == 1 and eng.drafter.offers:
            hit = (before.auto.first >= 0) & (before.auto.first == verdicts.token)
            told, told_a = jnp.ones_like(told_a), hit.astype(jnp.int32)
            seen = seen + (revealed(told, told_a, eng.depth) & active[:, None]).astype(jnp.int32)
        est = jnp.where(active[:, None], learn(self.policy, before.est, told, told_a, before.auto.prior,
                                               before.seen_pos), before.est)
        counted = after.auto.window_steps + (jnp.asarray(self.windows) == w)  # elementwise: fuses
        auto = after.auto.replace(window_steps=counted.astype(jnp.int32))
        if self.policy.tree and w == self.windows[-1]:
            lift, lift_seen = learn_lift(self.policy, before.auto.lift, before.auto.lift_seen, active,
                                         verdicts.accepted, verdicts.chain_accepted)
            auto = auto.replace(lift=lift, lift_seen=lift_seen)
        return after.replace(est=est, seen_pos=seen, auto=auto)

    def metrics(self, eng: EngineConfig, st: EngineState) -> dict:
        """What a result reports about the choices (host arrays in ``st``)."""
        ws = np.asarray(st.auto.window_steps)
        return dict(depth="auto", max_depth=eng.depth, windows=list(self.windows),
                    window_share=[float(x) for x in ws / max(int(ws.sum()), 1)], depth_rule=self.policy.rule,
                    # what the policy decided by: seconds of one step per window at this batch
                    cost_seconds=[float(x) for x in np.asarray(st.auto.cost.seconds)[0]],
                    # where each row's estimates started (the table's acceptance, or the policy's prior)
                    acceptance_prior=[float(x) for x in np.asarray(st.auto.prior)],
                    # a tree's yield over its main branch, as learned (the prior where no tree step ran)
                    **({"tree_lift": float(st.auto.lift)} if self.policy.tree else {}))


def auto_state(eng: EngineConfig, table: CostTable, batch: int) -> AutoState:
    """``depth="auto"``'s data for a ``batch``-slot engine: ``table`` read at ``batch`` (every
    slot computes, so that is the only load the step sees; one shape for any table: no
    recompile), its prior (the table's ``acceptance`` where given, else ``DepthPolicy.prior``),
    no window forced, no steps counted. Built on the host and placed in one
    transfer (a dozen small device ops and a read-back cost ~1 ms of host time a call)."""
    at = CostTable(np.asarray([batch], np.float32), table.row(batch)[None], table.windows)
    i32 = np.int32
    policy = eng.controller.policy
    host = AutoState(at, i32(-1), i32(0), np.zeros((len(eng.windows),), i32), i32(0), np.zeros((batch,), i32),
                     np.full((batch,), -1, i32), table.prior(policy.prior, eng.depth), np.float32(policy.lift), i32(0))
    return jax.device_put(host)
