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
    second, ``sum_i E[accepted_i + 1] / cost(active, window)``, wins.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass, static_field

__all__ = ["POLICIES", "CostTable", "choose", "expected_tokens", "init_estimates", "update_estimates"]

POLICIES = ("fixed", "ema", "goodput")


@pytree_dataclass
class CostTable:
    """Seconds per target step: ``seconds [NB, NW]`` at ``batches [NB]`` active rows (ascending;
    linear in between, clamped outside) and each window of ``windows`` (ascending, static)."""

    batches: jax.Array  # float32 [NB]
    seconds: jax.Array  # float32 [NB, NW]
    windows: tuple[int, ...] = static_field()

    @classmethod
    def create(cls, windows, batches, seconds) -> CostTable:
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
        return cls(jnp.asarray(b), jnp.asarray(s), w)

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
        """A JSON file ``{"windows": [...], "batches": [...], "seconds": [[...], ...]}``."""
        try:
            raw = json.loads(Path(path).read_text())
            return cls.create(raw["windows"], raw["batches"], raw["seconds"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"cost table {path}: {e}") from None

    def at(self, active: jax.Array) -> jax.Array:
        """Seconds of one step at ``active`` rows, per window: ``[NW]``."""
        a = jnp.asarray(active, jnp.float32)
        return jax.vmap(lambda col: jnp.interp(a, self.batches, col), in_axes=1)(self.seconds)


def init_estimates(batch: int, depth: int, prior: float = 0.5) -> jax.Array:
    """Every row starts at ``prior`` at every draft position: ``float32 [B, depth]``."""
    return jnp.full((batch, depth), prior, jnp.float32)


def update_estimates(est: jax.Array, proposed: jax.Array, accepted: jax.Array, rate: float, prior: float = 0.5,
                     relax: float = 0.0) -> jax.Array:
    """EMA update from one step: row ``i`` proposed ``proposed[i]`` drafts and the target
    accepted its first ``accepted[i]``. Positions ``j < accepted`` were accepted, position
    ``accepted`` (if proposed) was rejected; later ones revealed nothing and drift back to
    ``prior`` by ``relax`` (so a row that stopped drafting tries again some steps later)."""
    j = jnp.arange(est.shape[1], dtype=jnp.int32)[None]
    seen = j < jnp.minimum(accepted + 1, proposed)[:, None]
    hit = (j < accepted[:, None]).astype(jnp.float32)
    return jnp.where(seen, (1.0 - rate) * est + rate * hit, est + relax * (prior - est))


def reach(est: jax.Array) -> jax.Array:
    """``[B, D]``: the estimated chance that draft ``j`` is accepted (all before it were)."""
    return jnp.cumprod(est, axis=1)


def expected_tokens(est: jax.Array, drafts: jax.Array) -> jax.Array:
    """``E[accepted + 1]`` per row when it proposes ``drafts [B]``: ``1 + sum_{j < drafts} reach_j``."""
    j = jnp.arange(est.shape[1], dtype=jnp.int32)[None]
    return 1.0 + jnp.sum(jnp.where(j < drafts[:, None], reach(est), 0.0), axis=1)


def _leading(ok: jax.Array) -> jax.Array:
    """Leading ``True`` count per row of ``ok [B, D]``."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def choose(
    est: jax.Array,
    live: jax.Array,
    table: CostTable,
    policy: str,
    *,
    min_window: jax.Array | int = 1,
    threshold: float = 0.5,
    min_gain: float = 0.05,
) -> tuple[jax.Array, jax.Array]:
    """``(window index into table.windows, drafts [B])`` for one step.

    ``est [B, D]`` (``D >= max(windows) - 1``), ``live [B]`` (rows that step), ``min_window``:
    the narrowest window the step can take (a cohort-ruled batch re-feeds up to ``u`` tokens).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    windows = jnp.asarray(table.windows, jnp.int32)  # [NW]
    feasible = windows >= min_window
    widest = len(table.windows) - 1
    if policy == "fixed":
        idx = jnp.int32(widest)
        return idx, jnp.broadcast_to(windows[idx] - 1, live.shape).astype(jnp.int32)
    if policy == "ema":
        want = jnp.minimum(_leading(est >= threshold), table.windows[-1] - 1)  # [B]
        need = jnp.max(jnp.where(live, want, 0)) + 1
        idx = jnp.argmax(feasible & (windows >= need)).astype(jnp.int32)  # smallest window holding every row
        return idx, jnp.minimum(want, windows[idx] - 1).astype(jnp.int32)
    # goodput: per window, drafts while the next position is reached with chance >= min_gain
    base = _leading(reach(est) >= min_gain)  # [B]
    drafts = jnp.minimum(base[None], windows[:, None] - 1)  # [NW, B]
    tokens = jax.vmap(lambda k: jnp.sum(jnp.where(live, expected_tokens(est, k), 0.0)))(drafts)  # [NW]
    rate = jnp.where(feasible, tokens / table.at(jnp.maximum(jnp.sum(live), 1)), -jnp.inf)
    idx = jnp.argmax(rate).astype(jnp.int32)
    return idx, drafts[idx].astype(jnp.int32)
