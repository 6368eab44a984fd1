"""``StepController``: how a loop picks each step's verify window and each row's draft count.

A fixed depth needs none (``EngineConfig.controller is None``): one window, every row drafts
all the window holds. ``depth="auto"`` is one (``specjax.auto.AutoDepth``). The loop
(``engine.loop``) calls it; the step (``engine.step``) never sees it: it takes the per-row
draft counts the controller chose and returns the verdicts the controller learns from.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

__all__ = ["StepController", "Verdicts"]


class Verdicts(Protocol):
    """What one step revealed (``engine.step.StepVerdicts``)."""

    asked: jax.Array  # int32 [B]: drafts each row was asked for
    accepted: jax.Array  # int32 [B]: drafts the target accepted
    token: jax.Array  # int32 [B]: the target's own token after them
    chain_asked: jax.Array  # int32 [B]: a chain's verdicts (a tree step's main branch) ...
    chain_accepted: jax.Array  # int32 [B]: ... drafts asked and accepted


class StepController(Protocol):
    """Static (hashable: part of the compile key). Its data rides in ``EngineState.auto``
    (never recompiles); ``EngineState.est`` holds its per-row estimates.

    * ``windows``: ascending verify windows; the widest is ``eng.depth + 1``, or with
      ``eng.tree`` the tree's window (``eng.window``), after the chains up to ``eng.depth + 1``.
    * ``init(eng, st, data) -> st``: a fresh state (its rows just prefilled) under ``data``.
    * ``choose(eng, st) -> st``: the next step's window and drafts, kept in the state (the loop
      calls it once on entry and once after every step; its conditions only read ``chosen``).
    * ``chosen(st) -> int32 []``: the index in ``windows`` of the step chosen.
    * ``drafts(eng, st, w) -> (asked, offered)``: int32 ``[B]`` each, the drafts each row is asked
      for in window ``w`` and those it offers to verify (``offered <= asked``).
    * ``observe(eng, before, after, verdicts, w) -> st``: ``after`` (the state the step at window
      ``w`` made from ``before``) updated with what the controller learns from ``verdicts``.
    * ``metrics(eng, st) -> dict``: what a result reports about its choices (``st``: host arrays).
    """

    windows: tuple[int, ...]

    def init(self, eng: Any, st: Any, data: Any) -> Any: ...

    def choose(self, eng: Any, st: Any) -> Any: ...

    def chosen(self, st: Any) -> jax.Array: ...

    def drafts(self, eng: Any, st: Any, w: int) -> tuple[jax.Array, jax.Array]: ...

    def observe(self, eng: Any, before: Any, after: Any, verdicts: Verdicts, w: int) -> Any: ...

    def metrics(self, eng: Any, st: Any) -> dict: ...
