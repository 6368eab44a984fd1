"""Load-adaptive depth: per-row acceptance estimates, a step-cost table, and the rules that
pick each step's verify window (from a small static set) and each row's draft count in it.

All pure and traceable: the simulator runs them inside its scan (``specjax.sim.simulate_policy``).

* ``estimates [B, D]``: row ``i``'s running estimate of ``P(draft j accepted | drafts < j
  accepted)``, updated on device after every step from what the row proposed and accepted
  (``update_estimates``: an exponential moving average over the positions whose verdict the
  step revealed).
* ``CostTable``: seconds of one target step at ``batches`` active rows and each window of
  ``windows`` (measured, or a roofline model: ``CostTable.roofline``).
* Policies (``choose``):
  - ``"fixed"``: the widest window, every row drafts to fill it;
  - ``"ema"``: a row drafts the leading positions whose estimate reaches ``threshold``; the
    window is the smallest in the set that holds the longest row;
  - ``"goodput"``: for every window, each row drafts while its chance of reaching the next
    position is at least ``min_gain``; the window maximising expected emitted tokens per
    second, ``sum_i E[accepted_i + 1] / cost(active, window)``, wins. The right objective
    when a finished row's slot takes new work (``batch_generate``).
  - ``"makespan"``: the same draft counts; the window minimising the estimated time to
    finish the batch, ``max_i remaining_i / E[accepted_i + 1] * cost(window)``, wins. The
    right objective for a static batch (``generate``, ``stream``): every step costs the
    whole batch until its slowest row is done, so tokens fast rows gain early buy nothing.
* A token tree (``DepthPolicy.tree``): the widest window verifies a tree. Its rows' yield is
  ``lift`` times the widest chain's, ``lift`` learned from the tree's steps (``learn_lift``):
  so a step verifies the tree where its extra tokens pay for its wider window, a chain where
  they do not (a large batch, whose verify compute is not free), and each is priced by the
  same table: the tree's node budget is a per-step choice, data, never a recompile.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass, static_field
from specjax.auto.estimates import (
    EARLY_VERDICTS,
    expected_max_normal,
    expected_tokens,
    init_estimates,
    max_normal_table,
    optimistic,
    pooled_acceptance,
    reach,
    revealed,
    running_product,
    update_estimates,
    yield_variance,
)

__all__ = [
    "EARLY_VERDICTS", "POLICIES", "RELAX_EARLY", "AutoState", "CostTable", "DepthPolicy", "choose", "decide",
    "expected_max_normal", "expected_tokens", "init_estimates", "learn", "learn_lift", "max_normal_table",
    "optimistic",
    "pooled_acceptance", "revealed", "update_estimates", "yield_variance",
]

POLICIES = ("fixed", "ema", "goodput", "makespan")
# ``DepthPolicy.auto``'s ``relax_early`` for drafters that offer every draft asked. A window-1 step
# reveals nothing, so a row whose first drafts fail keeps its low estimate (the lock-in: at B=1,
# MTP, one bench prompt decoded 127 of 128 tokens plainly where depth 3 accepts 32 of its 34 first
# drafts); the drift sends it back to drafting within some tens of steps.
RELAX_EARLY = 0.02
# DepthPolicy's fields that tune its rule (``DepthPolicy.knobs``; ``simulate_policy``'s keywords)
KNOBS = ("rate", "prior", "relax", "relax_early", "min_gain", "threshold", "shrink", "spread", "explore", "pool",
         "prior_weight", "fill")


@pytree_dataclass
class CostTable:
    """Seconds per target step: ``seconds [NB, NW]`` at ``batches [NB]`` active rows (ascending;
    linear in between, clamped outside) and each window of ``windows`` (ascending, static)."""

    batches: jax.Array  # float32 [NB] (host arrays from ``create``; device arrays inside a state)
    seconds: jax.Array  # float32 [NB, NW]
    windows: tuple[int, ...] = static_field()
    # a prior per draft position (``max(windows) - 1`` of them): the conditional acceptance a
    # run saw (``pooled_acceptance`` of its ``metrics["accepted_per_position_count"]`` and
    # ``["verdicts_per_position_count"]``). The rows' estimates start from it and drift back to
    # it (``engine.auto_state``) in place of ``DepthPolicy.prior``. Given, never measured: as a
    # default it was a trade between prompt sets (README, "Two changes, one adopted")
    acceptance: tuple[float, ...] | None = static_field(default=None)

    @classmethod
    def create(cls, windows, batches, seconds, acceptance=None) -> CostTable:
        """Validated table (``ValueError`` naming the field)."""
        w = tuple(int(x) for x in windows)
        b = np.asarray(batches, np.float32)
        s = np.asarray(seconds, np.float32)
        if not w or any(x < 1 for x in w) or list(w) != sorted(set(w)):
            raise ValueError(f"windows must be distinct ascending ints >= 1, got {list(windows)}")
        if b.ndim != 1 or not len(b) or (np.diff(b) <= 0).any() or (b < 1).any():
            raise ValueError(f"batches must be ascending numbers >= 1, got {b.tolist()}")
        if s.shape != (len(b), len(w)) or not (s > 0).all():
            raise ValueError(f"seconds must be positive with shape [batches={len(b)}, windows={len(w)}], "
                             f"got shape {s.shape}")
        if acceptance is not None:
            a = np.asarray(acceptance, np.float64)
            if a.shape != (max(w) - 1,) or not ((a >= 0) & (a <= 1)).all():
                raise ValueError(f"acceptance must be {max(w) - 1} numbers in [0, 1] (one per draft position of "
                                 f"the widest window), got {list(acceptance)}")
            acceptance = tuple(float(x) for x in a)
        return cls(b, s, w, acceptance)  # host arrays: placed with the state they join (``engine.auto_state``)

    @classmethod
    def roofline(cls, floor: float, per_token: float, windows=(1, 2, 4), max_batch: int = 256) -> CostTable:
        """``seconds = max(floor, per_token * active * window)``: a memory-bound step (reading
        the weights) until the tokens it computes make it compute-bound."""
        if not floor > 0 or not per_token >= 0:
            raise ValueError(f"roofline needs floor > 0 and per_token >= 0, got {floor}, {per_token}")
        b = np.arange(1, max_batch + 1, dtype=np.float32)
        w = np.asarray(windows, np.float32)
        return cls.create(windows, b, np.maximum(floor, per_token * b[:, None] * w[None]))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """A JSON file ``{"windows": [...], "batches": [...], "seconds": [[...], ...]}`` and,
        optionally, ``"acceptance": [...]`` (one per draft position)."""
        try:
            raw = json.loads(Path(path).read_text())
            return cls.create(raw["windows"], raw["batches"], raw["seconds"], raw.get("acceptance"))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:  # named with its file
            raise ValueError(f"cost table {path}: {e}") from None

    def __repr__(self) -> str:  # one line, for error messages
        try:
            return f"CostTable(windows={self.windows}, batches={np.asarray(self.batches).tolist()})"
        except Exception:  # traced inside jit
            return f"CostTable(windows={self.windows})"

    def prior(self, default: float, depth: int | None = None) -> np.ndarray:
        """``float32 [depth]``: the estimates' prior per draft position, ``acceptance`` where
        given, else ``default`` at every position. ``depth``: the engine's (default
        ``max(windows) - 1``; a tree's window is wider than its depth)."""
        d = max(self.windows) - 1 if depth is None else depth
        return np.asarray(self.acceptance[:d] if self.acceptance is not None else [default] * d, np.float32)

    def row(self, active: int) -> np.ndarray:
        """``at`` on the host for a known load: ``float32 [NW]`` (no device work)."""
        b, s = np.asarray(self.batches, np.float32), np.asarray(self.seconds, np.float32)
        return np.asarray([np.interp(float(active), b, s[:, k]) for k in range(s.shape[1])], np.float32)

    def at(self, active: jax.Array) -> jax.Array:
        """Seconds of one step at ``active`` rows, per window: ``[NW]``."""
        if self.seconds.shape[0] == 1:  # one batch (the engine's, ``auto_state``): no interpolation ops per step
            return self.seconds[0]
        a = jnp.asarray(active, jnp.float32)
        return jax.vmap(lambda col: jnp.interp(a, self.batches, col), in_axes=1)(self.seconds)


@dataclasses.dataclass(frozen=True)
class DepthPolicy:
    """The static side of ``depth="auto"`` (hashable: part of the engine's compile key).

    ``windows``: the compiled verify windows the step picks from (``engine.run_steps``); the engine's
    ``depth`` is ``max(windows) - 1``. ``rule``: a ``choose`` policy. The rest are ``choose``'s
    and ``update_estimates``' knobs."""

    windows: tuple[int, ...]
    rule: str = "goodput"
    # rate 0.1: one unlucky run of rejections does not stop a row (from the prior, a row stops
    # after about 34 straight rejections; at 0.25 it took 9, and a row accepting 40% of its
    # drafts at B=1 spent long stretches not drafting: 0.79x the best fixed depth in the simulator)
    rate: float = 0.1
    prior: float | tuple[float, ...] = 0.7  # optimistic: a row must draft to learn that drafting does not pay
    # the drift of unrevealed positions back to ``prior`` a step: slow, so a row that stopped
    # drafting tries one draft again about every 10 steps
    relax: float = 0.0003
    # the extra drift of a position with few verdicts (``update_estimates``). 0 by default: a
    # low n-gram estimate mostly means no match (an unoffered draft counts as rejected), which a
    # drift would forget and a window-1 step cannot recheck. ``auto`` sets ``RELAX_EARLY`` for
    # drafters that offer every draft asked.
    relax_early: float = 0.0
    min_gain: float = 0.02
    threshold: float = 0.5
    shrink: float = 0.5  # makespan: each row's estimate pulled half way to the batch mean (noise)
    # makespan: weight of the slowest row's expected lateness (choose(spread=)); ``auto``: 1 for n-gram
    spread: float = 0.0
    # the estimates' upper confidence bound in standard errors of the batch's verdicts
    # (``optimistic``): a batch that has seen few verdicts keeps drafting until they are firm
    explore: float = 0.5
    # makespan: the batch mean counts as this many verdicts in each row's estimate (``choose``)
    pool: float = 0.0
    # the prior counts as this many verdicts (``update_estimates``): a row's first verdicts move its
    # estimate as a running mean would, so a batch stops drafting within a few steps where it does not pay
    prior_weight: float | None = 1.0  # None: a plain EMA (the simulator's default)
    # every row verifies all the drafts the chosen window holds (what it can offer: n-gram), not
    # only its own count. The rows' counts still choose the window (and narrow it to what is
    # offered); but a window computes every slot of every row, so a draft left out is a slot
    # computed for nothing, while verifying it can only add tokens (greedy: the same tokens, a
    # longer accepted prefix; sampling: still lossless). False: each row proposes its own count,
    # as in an engine that packs each row's tokens, where a draft left out saves its slot.
    # Simulator (n-gram rows, 48 cases): never worse, 0.957x -> 0.994x of the best fixed at B=8
    # with slots refilled; the bench's prompts priced by its tables: see the README
    fill: bool = True
    # the widest window verifies a token tree (``EngineConfig.tree``), the others chains
    tree: bool = False
    # the prior of a tree's yield over the widest chain's (``learn_lift``): the bundled MTP head's
    # dynamic trees yield 1.33-1.35x its chains of the same depth (docs/bench_trees.json)
    lift: float = 1.25

    @classmethod
    def auto(cls, max_depth: int, rule: str = "goodput", always_offers: bool = False,
             tree_window: int | None = None) -> DepthPolicy:
        """Every window from plain decoding (1) to ``max_depth + 1``, and a token tree's
        (``tree_window``, wider) last where given. ``always_offers``: the
        drafter offers every draft the policy asks for (MTP, a draft model, a user's drafter;
        not n-gram, whose rows without a match offer none), so a low estimate is a low
        acceptance rate, and one resting on few verdicts drifts back to the prior faster
        (``relax_early = RELAX_EARLY``).

        A drafter that does not (n-gram) gets ``spread = 1``: whether a row's context repeats
        splits its rows into truly different rates that come in bursts, so a static batch's
        slowest row lands well behind its expected steps (``choose``). Priced by steps x each
        run's cost table (a since-retired experiment script: bench prompts, B = 8-64,
        where no fixed n-gram depth beats plain): 0.90-0.96x plain with 0, 0.98-0.99x with 1.
        MTP's alike rows lost up to 19% with it (their noisy per-row estimates already make the
        slowest one pessimistic), so they keep 0."""
        tree = () if tree_window is None else (int(tree_window),)
        return cls(tuple(range(1, max_depth + 2)) + tree, rule, relax_early=RELAX_EARLY if always_offers else 0.0,
                   spread=0.0 if always_offers else 1.0, tree=bool(tree))

    @property
    def max_depth(self) -> int:
        """The widest chain's drafts: the engine's ``depth``."""
        return (self.windows[:-1] if self.tree else self.windows)[-1] - 1

    def knobs(self) -> dict[str, float]:
        """``choose``'s and ``update_estimates``' knobs as ``specjax.sim.simulate_policy`` takes
        them: the simulator modelling this policy (``specjax simulate --policy auto``)."""
        return {name: float(getattr(self, name)) for name in KNOBS}

    def check(self, max_depth: int) -> None:
        """``ValueError`` naming the bad field."""
        w = self.windows
        if self.tree not in (True, False):
            raise ValueError(f"DepthPolicy.tree={self.tree!r} is invalid: must be True or False")
        chains = w[:-1] if self.tree and isinstance(w, tuple) else w
        if not isinstance(w, tuple) or not chains or any(not isinstance(x, int) for x in w) \
                or list(w) != sorted(set(w)) or w[0] < 1 or chains[-1] < 2 or chains[-1] > max_depth + 1:
            tree = ", then a token tree's wider window" if self.tree else ""
            raise ValueError(f"DepthPolicy.windows={w!r} is invalid: distinct ascending ints >= 1, the widest chain "
                             f"in [2, {max_depth + 1}]{tree}")
        if isinstance(self.lift, bool) or not isinstance(self.lift, int | float) or not 1.0 <= self.lift <= 4.0:
            raise ValueError(f"DepthPolicy.lift={self.lift!r} is invalid: must lie in [1, 4]")
        if self.rule not in POLICIES:
            raise ValueError(f"DepthPolicy.rule={self.rule!r} is invalid: must be one of {list(POLICIES)}")
        for name in ("rate", "prior", "relax", "relax_early", "min_gain", "threshold", "shrink", "spread", "explore"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
                raise ValueError(f"DepthPolicy.{name}={v!r} is invalid: must lie in [0, 1]")
        if self.fill not in (True, False):  # 0.0 / 1.0 pass: ``knobs`` gives every knob as a float
            raise ValueError(f"DepthPolicy.fill={self.fill!r} is invalid: must be True or False")
        for name in ("prior_weight", "pool"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1000.0:
                raise ValueError(f"DepthPolicy.{name}={v!r} is invalid: must lie in [0, 1000]")


@pytree_dataclass
class AutoState:
    """The data side of ``depth="auto"``, carried in the engine state (never recompiles)."""

    cost: CostTable  # seconds per step at the engine's batch, per window
    force: jax.Array  # int32 []: -1 lets the policy choose; k >= 0 forces window k (cost measurement) ...
    force_from: jax.Array  # int32 []: ... from this step on; earlier steps run the widest window
    window_steps: jax.Array  # int32 [NW]: steps taken at each window
    # the next step's choice, made once after each step (``engine.run_steps``): the loops' conditions
    # only read it (each evaluation of the rule is some 25 small kernels per step on CPU)
    pick: jax.Array  # int32 []: index of the next step's window
    drafts: jax.Array  # int32 [B]: each row's draft count in it
    # int32 [B]: each row's first draft for the next step where the drafter knows it before the
    # target runs (n-gram), else -1: a window-1 step then reveals that draft's verdict for free
    first: jax.Array
    # float32 [D]: each draft position's prior (``CostTable.prior``): new rows' estimates start
    # here and unrevealed positions drift back to it. Data: another table's prior never recompiles
    prior: jax.Array
    # a token tree's yield over the widest chain's (``DepthPolicy.tree``; unused without): float32
    # [], learned from the tree's steps (``learn_lift``), and the tree steps it rests on (int32 [])
    lift: jax.Array
    lift_seen: jax.Array


def _leading(ok: jax.Array) -> jax.Array:
    """Leading ``True`` count per row of ``ok [B, D]``."""
    return jnp.sum(running_product(ok.astype(jnp.int32)), axis=1)


def choose(
    est: jax.Array,
    live: jax.Array,
    table: CostTable,
    policy: str,
    *,
    min_window: jax.Array | int = 1,
    threshold: float = 0.5,
    min_gain: float = 0.05,
    load: jax.Array | int | None = None,
    remaining: jax.Array | None = None,
    shrink: float = 0.5,
    spread: float = 0.0,
    seen: jax.Array | None = None,
    pool: float = 0.0,
    upper: jax.Array | None = None,
    lift: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(window index into table.windows, drafts [B])`` for one step.

    ``est [B, D]`` (``D >= max(windows) - 1``), ``live [B]`` (rows that step), ``min_window``:
    the narrowest window the step can take (a cohort-ruled batch re-feeds up to ``u`` tokens),
    ``load``: the rows the step computes, which set its cost (default: the live rows; a
    static-shape engine computes every slot), ``remaining [B]``: tokens each row may still
    emit (``"makespan"`` needs it), ``shrink``: how far ``"makespan"`` pulls each row's
    estimate towards the live rows' mean (0: its own; 1: the mean), ``spread``: how much of
    the slowest row's expected lateness ``"makespan"`` adds (0: the makespan of expected steps;
    1: about the expected makespan, see below), ``seen [B, D]``: the verdicts each row's
    estimates rest on; with ``pool`` > 0 a row's own share is further weighted by
    ``seen / (seen + pool)`` (``pool``: how many verdicts the batch mean counts as),
    ``upper [B, D]``: the estimates the windows are judged on (``optimistic``; default ``est``),
    ``lift`` (float32 []): the widest window is a token tree, whose rows yield ``lift`` times
    what they would in the widest chain (mean and standard deviation alike; ``"ema"`` never
    picks it, ``"fixed"`` always).
    Each row's draft count follows ``est`` alone, so a row whose drafts keep failing still stops.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    if policy == "makespan" and remaining is None:
        raise ValueError("policy 'makespan' needs remaining= (tokens each row may still emit)")
    windows = jnp.asarray(table.windows, jnp.int32)  # [NW]
    feasible = windows >= min_window
    widest = len(table.windows) - 1
    if policy == "fixed":
        idx = jnp.int32(widest)
        return idx, jnp.broadcast_to(windows[idx] - 1, live.shape).astype(jnp.int32)
    if policy == "ema":
        return _choose_ema(est, live, table, feasible, threshold, lift is not None)
    # goodput: per window, drafts while the next position is reached with chance >= min_gain
    base = _leading(reach(est) >= min_gain)  # [B]
    est = est if upper is None else upper  # what the windows are judged on
    drafts = jnp.minimum(base[None], windows[:, None] - 1)  # [NW, B]
    load = jnp.sum(live) if load is None else load
    cost = table.at(jnp.maximum(load, 1))  # [NW]
    # each window's yield over a row's own: 1 for a chain, ``lift`` for a tree (at its chain's drafts)
    gain = jnp.ones((len(table.windows),), jnp.float32)
    if lift is not None:
        gain = gain.at[-1].set(lift)
    tokens = gain * jax.vmap(lambda k: jnp.sum(jnp.where(live, expected_tokens(est, k), 0.0)))(drafts)  # [NW]
    if policy == "makespan":  # the batch ends with its slowest row: steps it needs at this window x cost
        steps = _makespan_steps(est, live, remaining, drafts, gain, shrink, spread, seen, pool)  # [NW]
        rate = jnp.where(feasible, -steps * cost, -jnp.inf)
        # windows the rule prices alike (the slowest row gains nothing from drafting, and the step
        # costs the same: a flat stretch of the table) go to the one emitting the most tokens. Its
        # rows then finish sooner, and a row that is slowest now (an n-gram row in a gap between
        # matches) may not be later. Simulator, n-gram rows, a static batch of 8 where drafting is
        # free: 0.947x-0.986x -> 0.991x-0.997x of the best fixed window (before, the narrowest won)
        rate = jnp.where(rate >= jnp.max(rate) * (1.0 + 1e-6), tokens / cost, -jnp.inf)
    else:
        rate = jnp.where(feasible, tokens / cost, -jnp.inf)
    idx = jnp.argmax(rate).astype(jnp.int32)
    return idx, drafts[idx].astype(jnp.int32)


def _choose_ema(est, live, table: CostTable, feasible, threshold: float, tree: bool) -> tuple[jax.Array, jax.Array]:
    """``"ema"``: each row drafts the leading positions whose estimate reaches ``threshold``; the
    smallest window holding the longest row (never the tree's)."""
    windows = jnp.asarray(table.windows, jnp.int32)
    chains = table.windows[:-1] if tree else table.windows
    want = jnp.minimum(_leading(est >= threshold), chains[-1] - 1)  # [B]
    need = jnp.max(jnp.where(live, want, 0)) + 1
    idx = jnp.argmax(feasible & (windows >= need)).astype(jnp.int32)  # smallest window holding every row
    return idx, jnp.minimum(want, windows[idx] - 1).astype(jnp.int32)


def _makespan_steps(est, live, remaining, drafts, gain, shrink: float, spread: float, seen, pool: float) -> jax.Array:
    """``"makespan"``: per window, the steps the batch's slowest row needs to finish ``[NW]``
    (``drafts [NW, B]`` each window's draft counts, ``gain [NW]`` its yield over a chain's)."""
    left = jnp.maximum(remaining, 0).astype(jnp.float32)
    # each row's estimate pulled ``shrink`` of the way to the live rows' mean: the max over many
    # rows' noisy EMAs would otherwise follow the most pessimistic one (with 32 alike rows it
    # held a batch at window 1 that every fixed depth beat; simulator: 0.89x the best fixed)
    mean = jnp.sum(jnp.where(live[:, None], est, 0.0), axis=0) / jnp.maximum(jnp.sum(live), 1)
    own = 1.0 - shrink
    if pool and seen is not None:  # static: 0 adds no kernels
        # a row's own estimate counts as its verdicts do: its first verdicts (0.7 -> 0.35
        # after one rejection) held a B=8 MTP batch at window 1 on 2 of 8 prompt groups where
        # depth 2 ran 1.14x plain; pool 8 drafted on both. Off by default: in the simulator
        # (a grid of rows that truly differ) it hid the slowest rows: 0.975 vs 0.985
        n = seen.astype(jnp.float32)
        own = own * n / (n + pool)
    pooled = own * est + (1.0 - own) * mean[None]
    # spread 1: the expected makespan, not the makespan of expected steps. A row needs about
    # left / mu steps with sd sqrt(left var / mu^3) (a renewal count), and the slowest of n
    # such rows lands about E[max of n normals] sds late; plain decoding has no spread.
    # Simulator: 0.5-2.7 points nearer the best fixed depth at B = 8-64. Engine bench (MTP,
    # B=32): 5-7% slower, as the max over noisy per-row EMAs is already pessimistic; so 0 by default,
    # and 1 for n-gram, whose rows differ truly (``DepthPolicy.auto``)
    z = 0.0
    if spread:  # static: 0 adds no kernels
        z = spread * jnp.asarray(max_normal_table(live.shape[0]))[jnp.sum(live)]

    def finish(k, g):
        mu = g * expected_tokens(pooled, k)
        if not spread:
            return jnp.max(jnp.where(live, left / mu, 0.0))
        sd = jnp.sqrt(left * g * g * yield_variance(pooled, k) / mu**3)
        return jnp.max(jnp.where(live, left / mu + z * sd, 0.0))
    return jax.vmap(finish)(drafts, gain)  # [NW]


def decide(policy: DepthPolicy, est: jax.Array, live: jax.Array, u: jax.Array, table: CostTable, *,
           remaining: jax.Array, seen: jax.Array, can: jax.Array | None = None,
           lift: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One step's choice, as the engine makes it (``specjax.auto.AutoDepth``) and the simulator
    replays it: ``(window index into table.windows, drafts [B])`` by ``choose`` under
    ``policy``'s rule and knobs, every slot computing (``load = B``: static shapes), the
    window holding every live row's ``u [B]`` re-fed tokens (a cohort-ruled batch). ``can [B]``
    (a drafter that says before drafting what each row can offer: n-gram): the narrowest window
    that holds the drafts offered, and, before the batch's first verdict, the narrowest of all
    (a window-1 step judges every row's first draft for free, so it learns what a drafting step
    would, at plain decoding's price; from the prior alone a batch of 32-64 n-gram rows drafted
    the widest window once, where plain decoding was best: 0.99x plain by steps). ``lift``: the
    widest window is a token tree (``choose``); a tree keeps its window while any live row
    offers a draft (its extra candidates are what a chain's window cannot hold)."""
    need = jnp.max(jnp.where(live, u, 1))
    upper = optimistic(est, seen, policy.explore)  # an upper bound while the batch's verdicts are few
    idx, drafts = choose(est, live, table, policy.rule, min_window=need, threshold=policy.threshold,
                         min_gain=policy.min_gain, load=live.shape[0], remaining=remaining, shrink=policy.shrink,
                         spread=policy.spread, seen=seen, pool=policy.pool, upper=upper,
                         lift=lift if policy.tree else None)
    if can is None:
        return idx, drafts
    windows = jnp.asarray(table.windows, jnp.int32)
    holds = jnp.minimum(jnp.max(jnp.where(live, u + jnp.minimum(drafts, can), 1)), windows[idx])
    if policy.tree:  # the tree's window holds more than its offered chain: kept while any draft is offered
        tree = idx == len(table.windows) - 1
        holds = jnp.where(tree & (holds > need), windows[idx], holds)
    idx = jnp.minimum(idx, jnp.argmax(windows >= holds)).astype(jnp.int32)  # the same drafts, a cheaper window
    fresh = jnp.sum(jnp.where(live, seen[:, 0], 0)) == 0
    return jnp.where(fresh, jnp.argmax(windows >= need), idx).astype(jnp.int32), drafts


def learn_lift(policy: DepthPolicy, lift: jax.Array, seen: jax.Array, live: jax.Array, accepted: jax.Array,
               chain_accepted: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(lift, seen)`` after one tree step: the step's yield over its main branch's (the chain's
    verdicts it revealed: ``first_child_verdicts``), ``sum (accepted + 1) / sum (chain_accepted
    + 1)`` over the ``live [B]`` rows, pooled over the batch (one number: rows differ in how
    often their drafts hit, less in what a sibling adds). The prior counts as one step: a
    running mean until ``policy.rate`` takes over (as ``update_estimates``). Never below 1: a
    tree holds its main branch."""
    n = jnp.sum(live)
    step = jnp.sum(jnp.where(live, accepted + 1, 0)) / jnp.maximum(jnp.sum(jnp.where(live, chain_accepted + 1, 0)), 1)
    r = jnp.maximum(policy.rate, 1.0 / (2.0 + seen.astype(jnp.float32)))
    new = jnp.maximum((1.0 - r) * lift + r * step.astype(jnp.float32), 1.0)
    return jnp.where(n > 0, new, lift), seen + (n > 0).astype(jnp.int32)


def learn(policy: DepthPolicy, est: jax.Array, asked: jax.Array, accepted: jax.Array, prior: float | jax.Array,
          seen: jax.Array) -> jax.Array:
    """``est [B, D]`` after one step's verdicts (``update_estimates`` under ``policy``'s knobs;
    ``prior_weight=None``: a plain EMA, the verdict counts ``seen`` unused)."""
    counted = policy.prior_weight is not None
    return update_estimates(est, asked, accepted, policy.rate, prior, policy.relax, seen if counted else None,
                            policy.prior_weight or 0.0, policy.relax_early)
