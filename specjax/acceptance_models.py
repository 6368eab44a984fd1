"""What the simulator draws (``specjax.sim``): models of how many of a row's drafts the target
accepts, each step, from that row's own random stream. ``Bernoulli`` and ``PositionDecay``
(independent draws per position), ``BetaRows`` (each row its own rate), ``Trace`` (a run's
accepted counts replayed), ``Matches`` (n-gram rows that offer drafts only on a match) and
``TreeAcceptance`` (a token tree's acceptance per level and rank). ``Acceptance``: any of them."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass, static_field

__all__ = ["Acceptance", "Bernoulli", "BetaRows", "Matches", "PositionDecay", "Trace", "TreeAcceptance", "iid_prefix"]


def iid_prefix(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Accepted-prefix length for per-position acceptance ``probs [depth]``."""
    hits = jax.random.uniform(key, probs.shape) < probs
    return jnp.sum(jnp.cumprod(hits.astype(jnp.int32)))


@pytree_dataclass
class Bernoulli:
    """Every draft position accepted independently with probability ``p``."""

    p: float

    def probs(self, key: jax.Array, depth: int) -> jax.Array:
        return jnp.full((depth,), self.p, jnp.float32)

    def check(self, depth: int) -> None:
        _check_prob("p", self.p)


@pytree_dataclass
class PositionDecay:
    """Draft position ``k`` (0-based) accepted with ``p * decay**k``."""

    p: float
    decay: float

    def probs(self, key: jax.Array, depth: int) -> jax.Array:
        return self.p * self.decay ** jnp.arange(depth, dtype=jnp.float32)

    def check(self, depth: int) -> None:
        _check_prob("p", self.p)
        if not 0.0 <= float(self.decay) or float(self.p) * max(1.0, self.decay ** (depth - 1)) > 1:
            raise ValueError(
                f"decay must be >= 0 with p * decay**k <= 1 for k < depth={depth}, "
                f"got decay={self.decay!r}"
            )


@pytree_dataclass
class BetaRows:
    """Heterogeneous rows: row ``i`` has its own ``p_i ~ Beta(alpha, beta)`` (times ``decay**k``)."""

    alpha: float
    beta: float
    decay: float = 1.0

    def probs(self, row_key: jax.Array, depth: int) -> jax.Array:
        p = jax.random.beta(row_key, self.alpha, self.beta)
        return p * self.decay ** jnp.arange(depth, dtype=jnp.float32)

    def check(self, depth: int) -> None:
        for name, v in (("alpha", self.alpha), ("beta", self.beta)):
            if not float(v) > 0:
                raise ValueError(f"Beta {name} must be > 0, got {v!r}")
        if not 0.0 <= float(self.decay) <= 1.0:
            raise ValueError(f"decay must lie in [0, 1] with Beta rows, got {self.decay!r}")


@pytree_dataclass
class Trace:
    """Recorded accepted-prefix lengths ``[steps, rows]`` (int): row ``r`` at step ``t``
    would accept ``prefix[t, r]`` drafts if it proposed at least that many. A prefix longer
    than the simulated depth accepts every draft proposed: a run recorded at depth 3 replays
    at any window (``simulate_fixed``, ``compare_policies``)."""

    prefix: jax.Array

    @classmethod
    def from_rows(cls, row_traces: list[list[int]], steps: int | None = None) -> Trace:
        """A trace from per-row recorded counts (``GenerationResult.metrics["row_accepted_trace"]``:
        each row's accepted drafts per step). ``steps=None``: cut to the steps every row ran;
        an int: each row's own counts repeated, in order, to ``steps`` (a run's rows recorded over
        128 tokens replay for as many steps as a policy needs, each keeping its own rate)."""
        if not row_traces or not all(len(t) for t in row_traces):
            raise ValueError("row_traces must hold at least one step for every row")
        if steps is None:
            steps = min(len(t) for t in row_traces)
        elif isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps={steps!r} is invalid: must be None or an int >= 1")
        return cls(np.array([np.resize(np.asarray(t, np.int32), steps) for t in row_traces], np.int32).T)

    def check(self, depth: int) -> None:
        arr = np.asarray(self.prefix)
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"Trace.prefix must be an int array [steps, rows], got {arr.dtype}{arr.shape}")
        if (arr < 0).any():
            raise ValueError("Trace.prefix values must be >= 0 (accepted drafts)")


@pytree_dataclass
class Matches:
    """An n-gram drafter's rows: a row offers drafts only at the steps where its context repeats
    (a match), and none at the others. Each row's matches are a two-state chain over steps, matched
    a long-run share ``rate`` of them, in runs of ``burst`` steps on average (1: steps independent;
    a repeated span matches for many steps in a row); where a row matches, ``accept`` says how its
    drafts fare. ``concentration`` > 0 gives each row its own share, ``Beta(rate * c, (1 - rate) * c)``
    (a workload of repetitive and plain prompts); 0: every row's share is ``rate``. A row's chance
    of starting a run is capped at 1, so a share beyond ``burst / (1 + burst)`` is not reached.

    Simplified from the engine's ``NgramDrafter``: a match offers every draft (the engine's offers
    the known tokens after it, up to the depth), and a row without one drafts nothing at a fixed
    depth too (the engine's fills its window with its last token, rarely accepted)."""

    accept: Bernoulli | PositionDecay | BetaRows
    rate: float
    burst: float = 1.0
    concentration: float = 0.0

    def check(self, depth: int) -> None:
        if not isinstance(self.accept, Bernoulli | PositionDecay | BetaRows):
            raise ValueError(f"Matches.accept must be a Bernoulli, PositionDecay or BetaRows, got {self.accept!r}")
        self.accept.check(depth)
        _check_prob("Matches.rate", self.rate)
        if not float(self.burst) >= 1.0:
            raise ValueError(f"Matches.burst must be >= 1 (mean steps a match lasts), got {self.burst!r}")
        if not float(self.concentration) >= 0.0:
            raise ValueError(f"Matches.concentration must be >= 0 (0: every row the same share), "
                             f"got {self.concentration!r}")
        rate, burst = float(self.rate), float(self.burst)
        if not self.concentration and rate < 1 and rate / (1 - rate) > burst:
            raise ValueError(f"Matches.rate={self.rate!r} needs burst >= rate / (1 - rate) = {rate / (1 - rate):.3g} "
                             f"(runs of matches that long on average), got burst={self.burst!r}")

    def chain(self, row_key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This row's (long-run share, chance a match lasts to the next step, chance one starts)."""
        rate, c, burst = (jnp.asarray(x, jnp.float32) for x in (self.rate, self.concentration, self.burst))
        drawn = jax.random.beta(row_key, jnp.maximum(rate * c, 1e-6), jnp.maximum((1 - rate) * c, 1e-6))
        q = jnp.where(c > 0, drawn, rate)
        stay = jnp.where(q < 1, 1 - 1 / burst, 1.0)  # a row that always matches never leaves its run
        start = jnp.where(q < 1, jnp.minimum(q / jnp.maximum(1 - q, 1e-9) / burst, 1.0), 1.0)
        return q, stay, start


@pytree_dataclass
class TreeAcceptance:
    """A token tree's rows (acceptance per branch): at draft level ``j`` the walk tries its
    node's children in rank order (window order: the drafter's best first), and rank ``r`` is
    accepted with ``rates[j, r]`` given that ranks ``< r`` were rejected, as a tree run measures
    it (``learn``: ``metrics["acceptance_per_branch"]``). A level is passed when any of its
    ``children[j]`` ranks is; levels are independent, so a step's accepted prefix is a chain's
    with ``p_j = 1 - prod_{r < children[j]} (1 - rates[j, r])`` per position, and the plan
    functions commit it as they commit a chain's. ``children``: a preset's children per node at
    each level (``(2, 2, 1)``; static); ``(1,) * D`` is the chain of first children, the chain
    its drafter would draft. Simplified from the engine: a row the cohort rule makes re-feed
    ``u`` tokens keeps its tree's leading ``depth + 1 - u`` levels here, where the engine keeps
    its first ``N + 1 - u`` nodes."""

    rates: jax.Array  # float32 [D, K]
    children: tuple[int, ...] = static_field()

    def probs(self, key: jax.Array, depth: int) -> jax.Array:
        r = jnp.asarray(self.rates, jnp.float32)
        tried = jnp.arange(r.shape[1])[None] < jnp.asarray(self.children)[:, None]
        return 1.0 - jnp.prod(jnp.where(tried, 1.0 - r, 1.0), axis=1)[:depth]

    def check(self, depth: int) -> None:
        r, c = np.asarray(self.rates), self.children
        if not c or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in c):
            raise ValueError(f"TreeAcceptance.children must be ints >= 1 (children per node at each level), "
                             f"got {c!r}")
        if len(c) != depth:
            raise ValueError(f"TreeAcceptance.children={list(c)} has {len(c)} levels but depth={depth}: "
                             "they must agree")
        if r.ndim != 2 or r.shape[0] != depth or r.shape[1] < max(c):
            raise ValueError(f"TreeAcceptance.rates must have shape [levels={depth}, ranks >= {max(c)}] (the most "
                             f"children a node has), got {r.shape}")
        if not ((r >= 0) & (r <= 1)).all():
            raise ValueError("TreeAcceptance.rates must lie in [0, 1]")

    @classmethod
    def learn(cls, metrics: dict, children: Sequence[int]) -> TreeAcceptance:
        """The rates a tree run measured (``GenerationResult.metrics`` of ``generate(tree=...)``,
        or the ``"metrics"`` of ``specjax generate --json``: ``branch_tested_count``,
        ``branch_accepted_count``), to simulate the tree ``children`` (any preset within the
        run's levels and ranks: a tree other than the run's, or the chain ``(1,) * D``). A
        (level, rank) the run never tested takes the same rank's rate at the nearest level
        above that tested it, else 0 (never accepted: nothing says it would be)."""
        m = metrics.get("metrics", metrics)
        if "branch_tested_count" not in m or "branch_accepted_count" not in m:
            raise ValueError("these metrics hold no acceptance per branch: learn from a tree run's "
                             "(generate(..., tree=...); `specjax generate --tree ... --json`)")
        tested = np.asarray(m["branch_tested_count"], np.float64)
        took = np.asarray(m["branch_accepted_count"], np.float64)
        if tested.ndim != 2 or tested.shape != took.shape:
            raise ValueError(f"branch_tested_count and branch_accepted_count must be [levels, ranks] alike, "
                             f"got {tested.shape} and {took.shape}")
        c = tuple(int(k) for k in children)
        if len(c) > tested.shape[0] or (c and max(c) > tested.shape[1]):
            raise ValueError(f"tree={list(c)} needs {len(c)} levels and {max(c, default=0)} ranks; the run measured "
                             f"{tested.shape[0]} levels and {tested.shape[1]} ranks")
        rates = np.where(tested > 0, took / np.maximum(tested, 1), np.nan)
        for j in range(1, rates.shape[0]):  # untested: the level above's rate at that rank
            rates[j] = np.where(np.isnan(rates[j]), rates[j - 1], rates[j])
        rates = np.nan_to_num(rates, nan=0.0)[: len(c), : max(c)]
        return cls(rates.astype(np.float32), c)


def _check_prob(name: str, p: object) -> None:
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {p!r}")


Acceptance = Bernoulli | PositionDecay | BetaRows | Trace | Matches | TreeAcceptance
