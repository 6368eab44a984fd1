"""Tokens-per-step simulator driven by the production plan functions.

One ``jax.jit`` + ``lax.scan`` per static (batch, depth, steps, rule, acceptance
kind). Each step draws, per row, the length of the draft prefix the target would
accept (from that row's own random stream keyed by ``(seed, row id, step)``), caps
it by the drafts the row actually proposed, and commits through
``plan_step``. There is no second implementation of the rules here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.acceptance_models import (
    Acceptance,
    Bernoulli,
    BetaRows,
    Matches,
    PositionDecay,
    Trace,
    TreeAcceptance,
    iid_prefix,
)
from specjax.advance import KvAdvance, parse_kv_advance
from specjax.auto.policy import POLICIES, CostTable, DepthPolicy, decide, init_estimates, learn, revealed
from specjax.plan import accepted_from_prefix, plan_step

__all__ = [
    "Bernoulli",
    "BetaRows",
    "Matches",
    "PolicyResult",
    "PositionDecay",
    "SimResult",
    "Trace",
    "TreeAcceptance",
    "compare_policies",
    "simulate",
    "simulate_alone",
    "simulate_fixed",
    "simulate_policy",
]


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What ``simulate`` measured. ``tok_per_step`` is the headline."""

    rule: str
    batch: int
    depth: int
    steps: int
    tok_per_step: float  # emitted tokens per row per step
    proposed: int  # drafts proposed, all rows and steps
    accepted: int  # drafts accepted, all rows and steps
    accept_rate: float  # accepted / proposed: reported, never the headline
    row_tok_per_step: np.ndarray  # [B]
    row_proposed: np.ndarray  # [B]
    row_accepted: np.ndarray  # [B]
    uncached: np.ndarray  # [steps, B]: u_i entering each step

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "batch": self.batch,
            "tok_per_step": self.tok_per_step,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "accept_rate": self.accept_rate,
        }


def _row_keys(seed: jax.Array, row_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    base = jax.random.key(seed)
    step_base = jax.random.fold_in(base, 0)
    row_base = jax.random.fold_in(base, 1)
    return (
        jax.vmap(lambda r: jax.random.fold_in(step_base, r))(row_ids),
        jax.vmap(lambda r: jax.random.fold_in(row_base, r))(row_ids),
    )


def _prefix_draws(acceptance: Any, seed: jax.Array, row_ids: jax.Array, depth: int):
    """``step -> prefix [B]``: each row's accepted-prefix length at ``step``, from the trace or
    from the row's own stream keyed by ``(seed, row id, step)``."""
    if isinstance(acceptance, Matches):
        acceptance = acceptance.accept  # where the row matches; ``_matches`` says where
    if isinstance(acceptance, Trace):
        return lambda step: acceptance.prefix[step, row_ids].astype(jnp.int32)
    stream_keys, row_keys = _row_keys(seed, row_ids)
    probs = jax.vmap(lambda k: acceptance.probs(k, depth))(row_keys)  # [B, depth]

    def draw(step):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(stream_keys)
        return jax.vmap(iid_prefix)(keys, probs)

    return draw


def _matches(acceptance: Any, seed: jax.Array, row_ids: jax.Array):
    """``(prev [B] bool, step) -> [B] bool``: which rows can offer drafts at ``step`` (``Matches``;
    every row at every step otherwise), from each row's own stream keyed by ``(seed, row id, step)``;
    ``prev`` is the step before's (ignored at step 0, where the chain starts at its long-run share)."""
    if not isinstance(acceptance, Matches):
        return lambda prev, step: jnp.ones(row_ids.shape, bool)
    base = jax.random.fold_in(jax.random.key(seed), 2)  # a stream of its own: the draws stay as without it
    keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(row_ids)
    q, stay, start = jax.vmap(lambda k: acceptance.chain(jax.random.fold_in(k, 0)))(keys)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)  # each row's per-step stream

    def matched(prev, step):
        x = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, step)))(step_keys)
        return x < jnp.where(step == 0, q, jnp.where(prev, stay, start))

    return matched


def _run(
    acceptance: Any, seed: jax.Array, row_ids: jax.Array, *, depth: int, steps: int, rule: KvAdvance
) -> dict[str, jax.Array]:
    """Scan ``steps`` plan steps over rows ``row_ids [B]``; returns per-step arrays."""
    window = depth + 1
    draw = _prefix_draws(acceptance, seed, row_ids, depth)
    matched = _matches(acceptance, seed, row_ids)

    def body(carry, step: jax.Array):
        u, m = carry
        m = matched(m, step)
        proposed = jnp.where(m, window - u, 0)  # a row without a match offers no draft
        plan = plan_step(u, accepted_from_prefix(draw(step), proposed), window, rule)
        out = {"emitted": plan.emitted, "proposed": proposed, "accepted": plan.accepted, "u": u}
        return (plan.next_uncached, m), out

    init = (jnp.ones(row_ids.shape, jnp.int32), jnp.ones(row_ids.shape, bool))
    _, outs = jax.lax.scan(body, init, jnp.arange(steps, dtype=jnp.int32))
    return outs


_run_jit = jax.jit(_run, static_argnames=("depth", "steps", "rule"))


@jax.jit(static_argnames=("depth", "steps"))  # type: ignore[misc]
def _run_alone_jit(acceptance: Any, seed: jax.Array, row_ids: jax.Array, *, depth: int, steps: int):
    # Each row as its own batch of one; at B=1 the rules coincide, use per-sequence.
    one = lambda r: _run(acceptance, seed, r[None], depth=depth, steps=steps, rule=KvAdvance.PER_SEQUENCE)  # noqa: E731
    out = jax.vmap(one)(row_ids)
    return jax.tree.map(lambda x: x[:, :, 0].T, out)  # [B, steps, 1] -> [steps, B]


def _coerce_acceptance(acceptance: object) -> Acceptance:
    if isinstance(acceptance, Acceptance):
        return acceptance
    if isinstance(acceptance, int | float) and not isinstance(acceptance, bool):
        return Bernoulli(float(acceptance))
    raise ValueError(
        "acceptance must be a float p or one of Bernoulli, PositionDecay, BetaRows, Trace, Matches, TreeAcceptance; "
        f"got {acceptance!r}"
    )


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _validate(batch: object, depth: object, steps: object, acceptance: object, seed: object):
    b = _check_int("batch", batch, 1)
    d = _check_int("depth", depth, 1)
    s = _check_int("steps", steps, 1)
    _check_int("seed", seed, 0)
    acc = _coerce_acceptance(acceptance)
    acc.check(d)
    if isinstance(acc, Trace):
        t, r = np.shape(acc.prefix)
        if t < s or r < b:
            raise ValueError(
                f"Trace.prefix has shape {(t, r)} but steps={s}, batch={b} need at least ({s}, {b})"
            )
    return b, d, s, acc


def _result(rule: str, depth: int, steps: int, outs: dict[str, jax.Array]) -> SimResult:
    o = jax.device_get(outs)
    emitted, proposed, accepted = (np.asarray(o[k], np.int64) for k in ("emitted", "proposed", "accepted"))
    tot_p, tot_a = int(proposed.sum()), int(accepted.sum())
    return SimResult(
        rule=rule,
        batch=emitted.shape[1],
        depth=depth,
        steps=steps,
        tok_per_step=float(emitted.mean()),
        proposed=tot_p,
        accepted=tot_a,
        accept_rate=tot_a / tot_p if tot_p else 0.0,
        row_tok_per_step=emitted.mean(axis=0),
        row_proposed=proposed.sum(axis=0),
        row_accepted=accepted.sum(axis=0),
        uncached=np.asarray(o["u"]),
    )


def simulate(
    batch: int,
    depth: int,
    steps: int,
    acceptance: Acceptance | float,
    rule: KvAdvance | str,
    seed: int = 0,
) -> SimResult:
    """Simulate ``steps`` verify steps of ``batch`` rows under ``rule``.

    Row ``i`` has row id ``i``; its draws depend only on ``(seed, i, step)``, so the
    same row behaves identically alone (``simulate_alone``) or in any batch.
    """
    b, d, s, acc = _validate(batch, depth, steps, acceptance, seed)
    r = parse_kv_advance(rule, what="rule")
    outs = _run_jit(acc, jnp.uint32(seed), jnp.arange(b, dtype=jnp.int32), depth=d, steps=s, rule=r)
    return _result(r.value, d, s, outs)


def simulate_alone(
    batch: int, depth: int, steps: int, acceptance: Acceptance | float, seed: int = 0
) -> SimResult:
    """The same rows as ``simulate(batch, ...)``, each run alone as a batch of one."""
    b, d, s, acc = _validate(batch, depth, steps, acceptance, seed)
    outs = _run_alone_jit(acc, jnp.uint32(seed), jnp.arange(b, dtype=jnp.int32), depth=d, steps=s)
    return _result("alone", d, s, outs)


# ----------------------------------------------------------------------------- depth policies


@dataclasses.dataclass(frozen=True)
class PolicyResult:
    """What ``simulate_policy`` measured: ``tok_per_s`` (emitted tokens per simulated second,
    from the cost table) is the headline."""

    policy: str
    batch: int
    steps: int
    tok_per_s: float
    tok_per_step: float  # emitted tokens per row per step
    seconds: float  # simulated time of all steps
    accept_rate: float
    windows: tuple[int, ...]  # the table's windows
    window_share: tuple[float, ...]  # fraction of steps run at each window
    mean_drafts: float  # drafts per row per step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _run_policy(acceptance: Any, seed: jax.Array, row_ids: jax.Array, table: CostTable, budget: jax.Array, *,
                policy: DepthPolicy, steps: int, rule: KvAdvance) -> dict[str, jax.Array]:
    """The plan steps of ``_run`` with the window and each row's drafts chosen per step as the
    engine chooses them (``policy.decide``, ``policy.learn``; ``specjax.auto.AutoDepth``).
    ``budget [B]``: tokens each row emits before it is done (a static batch); a step costs the
    whole batch while any row is left, and nothing after."""
    depth = max(max(table.windows) - 1, 1)
    draw = _prefix_draws(acceptance, seed, row_ids, depth)
    matched = _matches(acceptance, seed, row_ids)
    offers = isinstance(acceptance, Matches)  # the engine's ``offer``: rows say what they can draft before the choice
    windows = jnp.asarray(table.windows, jnp.int32)
    branches = [lambda u, a, w=w: plan_step(u, a, w, rule) for w in table.windows]
    cost = table.at(row_ids.shape[0])  # [NW]: every simulated row computes every step (static shapes)

    def body(carry, step):
        u, est, left, seen, m = carry
        live = left > 0
        m = matched(m, step)
        can = jnp.where(m, depth, 0)  # drafts each row can offer now
        idx, drafts = decide(policy, est, live, u, table, remaining=left, seen=seen, can=can if offers else None)
        room = windows[idx] - u  # left after the re-fed tokens
        drafts = room if policy.fill else jnp.minimum(drafts, room)  # what each row is asked for
        offered = jnp.minimum(drafts, can)
        prefix = draw(step)
        a = accepted_from_prefix(prefix, offered)
        plan = jax.lax.switch(idx, branches, u, a)
        # the verdicts, as ``AutoDepth.observe``'s: the drafts asked (one not offered counts as
        # rejected: long-run rates); at window 1 a row's first draft, judged for free (no match: rejected)
        told, told_a = drafts, a
        if offers:
            one = windows[idx] == 1
            told = jnp.where(one, 1, drafts)
            told_a = jnp.where(one, (m & (prefix >= 1)).astype(jnp.int32), a)
        est = learn(policy, est, told, told_a, policy.prior, seen)
        emitted = jnp.where(live, jnp.minimum(plan.emitted, left), 0)
        running = jnp.any(live)
        out = {"emitted": emitted, "drafts": jnp.where(live, offered, 0),
               "accepted": jnp.where(live, a, 0), "seconds": jnp.where(running, cost[idx], 0.0), "window": idx,
               "any": running}
        seen = seen + (revealed(told, told_a, depth) & live[:, None])
        return (plan.next_uncached, est, left - emitted, seen, m), out

    b = row_ids.shape[0]
    zeros = jnp.zeros((b, depth), jnp.int32)
    init = (jnp.ones((b,), jnp.int32), init_estimates(b, depth, policy.prior), budget, zeros, jnp.ones((b,), bool))
    _, outs = jax.lax.scan(body, init, jnp.arange(steps, dtype=jnp.int32))
    return outs


_run_policy_jit = jax.jit(_run_policy, static_argnames=("policy", "steps", "rule"))


def simulate_policy(
    batch: int,
    steps: int,
    acceptance: Acceptance | float,
    cost: CostTable,
    policy: str = "goodput",
    rule: KvAdvance | str = "per_sequence",
    seed: int = 0,
    *,
    rate: float = 0.1,
    threshold: float = 0.5,
    min_gain: float = 0.05,
    prior: float | Sequence[float] = 0.5,
    relax: float = 0.01,
    tokens: int | None = None,
    shrink: float = 0.5,
    spread: float = 0.0,
    explore: float = 0.0,
    prior_weight: float | None = None,
    pool: float = 0.0,
    relax_early: float = 0.0,
    fill: bool | float = False,
) -> PolicyResult:
    """Simulate ``steps`` steps of ``batch`` rows whose window (one of ``cost.windows``) and
    per-row draft counts ``policy`` picks each step (``specjax.auto.policy``), each step
    costing ``cost`` seconds at ``batch`` rows. The same row draws as ``simulate``.
    Estimates start at ``prior`` (one number, or one per draft position: a measured table's
    ``CostTable.acceptance``, as the engine takes it), move by ``rate`` on every revealed
    position and drift back to ``prior`` by ``relax`` on the others, by ``relax_early`` more
    while a position has had few verdicts (``update_estimates``; needs ``prior_weight``, the
    verdict counts).

    ``tokens``: a static batch (``generate``): every row emits ``tokens`` tokens and the run
    lasts until the slowest row is done (every step until then costs the whole batch;
    ``steps`` bounds it). Without it, rows never finish (a batch job refilling its slots).
    ``"makespan"`` needs ``tokens``; ``shrink``, ``spread`` and ``pool`` are its knobs (``choose``).
    ``explore``: the estimates' upper confidence bound (``auto.policy.optimistic``; the
    engine's ``DepthPolicy.explore``). ``prior_weight``: the prior counts as that many verdicts
    (``update_estimates``; the engine's ``DepthPolicy.prior_weight``); ``None``: a plain EMA.
    ``fill``: each row proposes every draft the chosen window holds (``DepthPolicy.fill``; the
    rows' counts still choose the window); off, only its own count. These defaults are the
    simulator's own; ``**DepthPolicy(windows).knobs()`` models the engine's."""
    prior = _check_policy(policy, tokens, cost, prior, prior_weight, relax_early, fill,
                          (("rate", rate, 0.0, 1.0), ("threshold", threshold, 0.0, 1.0),
                           ("min_gain", min_gain, 0.0, 1.0), ("relax", relax, 0.0, 1.0),
                           ("relax_early", relax_early, 0.0, 1.0), ("shrink", shrink, 0.0, 1.0),
                           ("spread", spread, 0.0, 1.0), ("explore", explore, 0.0, 1.0), ("pool", pool, 0.0, 1000.0)))
    b, _, s, acc = _validate(batch, max(max(cost.windows) - 1, 1), steps, acceptance, seed)
    r = parse_kv_advance(rule, what="rule")
    budget = jnp.full((b,), 2**30 if tokens is None else tokens, jnp.int32)
    knobs = DepthPolicy(cost.windows, policy, rate=float(rate), prior=prior, relax=float(relax),
                        relax_early=float(relax_early), min_gain=float(min_gain), threshold=float(threshold),
                        shrink=float(shrink), spread=float(spread), explore=float(explore), pool=float(pool),
                        prior_weight=None if prior_weight is None else float(prior_weight), fill=bool(fill))
    o = jax.device_get(_run_policy_jit(acc, jnp.uint32(seed), jnp.arange(b, dtype=jnp.int32), cost, budget,
                                       policy=knobs, steps=s, rule=r))
    emitted, drafts, accepted = (np.asarray(o[k], np.int64) for k in ("emitted", "drafts", "accepted"))
    ran = np.asarray(o["any"])  # the steps some row was left for
    if tokens is not None and emitted.sum() < b * tokens:
        raise ValueError(f"steps={s} is too few for every row to emit tokens={tokens}: raise steps")
    n = int(ran.sum())
    seconds = float(np.sum(o["seconds"], dtype=np.float64))
    share = np.bincount(np.asarray(o["window"])[ran], minlength=len(cost.windows)) / n
    return PolicyResult(policy=policy, batch=b, steps=n, tok_per_s=float(emitted.sum()) / seconds,
                        tok_per_step=float(emitted.sum()) / (n * b), seconds=seconds,
                        accept_rate=float(accepted.sum() / drafts.sum()) if drafts.sum() else 0.0,
                        windows=cost.windows, window_share=tuple(float(x) for x in share),
                        mean_drafts=float(drafts.sum()) / (n * b))


def _check_policy(policy: str, tokens, cost, prior, prior_weight, relax_early, fill, bounded: tuple):
    """``simulate_policy``'s settings, each failing by name; returns ``prior`` as one float or a
    tuple per draft position. ``bounded``: ``(name, value, low, high)`` of each ranged knob."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"tokens={tokens!r} is invalid: must be an int >= 1 or None")
    if policy == "makespan" and tokens is None:
        raise ValueError("policy 'makespan' needs tokens= (a static batch: rows that finish)")
    if not isinstance(cost, CostTable):
        raise ValueError(f"cost must be a CostTable, got {type(cost).__name__}")
    for name, v, lo, hi in bounded:
        if not lo <= float(v) <= hi:
            raise ValueError(f"{name} must lie in [{lo}, {hi}], got {v!r}")
    if fill not in (True, False):  # 0.0 / 1.0 pass: ``DepthPolicy.knobs`` gives floats
        raise ValueError(f"fill must be True or False, got {fill!r}")
    depth = max(max(cost.windows) - 1, 1)
    priors = np.atleast_1d(np.asarray(prior, np.float64))
    if priors.ndim != 1 or len(priors) not in (1, depth) or not ((priors >= 0) & (priors <= 1)).all():
        raise ValueError(f"prior must be a number in [0, 1] or {depth} of them (one per draft position), got {prior!r}")
    if prior_weight is not None and not float(prior_weight) >= 0:
        raise ValueError(f"prior_weight must be >= 0 or None, got {prior_weight!r}")
    if relax_early and prior_weight is None:
        raise ValueError(f"relax_early={relax_early!r} needs prior_weight (it fades with the verdict counts "
                         "that prior_weight turns on): pass prior_weight=0 or more")
    return float(priors[0]) if np.ndim(prior) == 0 else tuple(float(x) for x in priors)


def simulate_fixed(batch: int, steps: int, acceptance: Acceptance | float, cost: CostTable, seed: int = 0,
                   **kwargs: Any) -> list[PolicyResult]:
    """``simulate_policy`` at each window of ``cost`` alone (window 1: plain decoding), same rows."""
    kwargs.pop("prior", None)  # the fixed rule reads no estimate (and a prior per position fits only the widest)
    return [simulate_policy(batch, steps, acceptance, CostTable(cost.batches, cost.seconds[:, i : i + 1], (w,)),
                            "fixed", seed=seed, **kwargs) for i, w in enumerate(cost.windows)]


def compare_policies(batch: int, steps: int, acceptance: Acceptance | float, cost: CostTable, seed: int = 0,
                     **kwargs: Any) -> list[dict[str, Any]]:
    """Every fixed window of ``cost`` (window 1: plain decoding) and the ``"ema"`` and
    ``"goodput"`` policies over all of them (and ``"makespan"`` for a static batch: ``tokens=``),
    same rows and costs: one dict per row with ``tok_per_s`` and its ratios to plain and to the
    best fixed window."""
    fixed = simulate_fixed(batch, steps, acceptance, cost, seed, **kwargs)
    rows = [{**res.to_dict(), "policy": "plain" if w == 1 else f"depth {w - 1}"}
            for w, res in zip(cost.windows, fixed, strict=True)]
    for policy in ("ema", "goodput") + (("makespan",) if kwargs.get("tokens") else ()):
        rows.append(simulate_policy(batch, steps, acceptance, cost, policy, seed=seed, **kwargs).to_dict())
    plain = next((r["tok_per_s"] for r in rows if r["policy"] == "plain"), None)
    best = max(r["tok_per_s"] for r in rows[: len(cost.windows)])
    for r in rows:
        r["vs_plain"] = r["tok_per_s"] / plain if plain else None
        r["vs_best_fixed"] = r["tok_per_s"] / best
    return rows
