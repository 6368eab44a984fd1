"""The two KV advance rules as pure, jit-compiled plan functions.

Per step a sequence ``i`` enters with ``u_i`` uncached tokens (``1 <= u_i <= w``,
``w = depth + 1``), proposes ``w - u_i`` drafts and has ``a_i`` of them accepted.

* per-sequence: ``committed_i = u_i + a_i``; the row advances by ``committed_i``;
  ``next_u_i = 1``.
* cohort: ``keep = min_i committed_i``; every row advances by ``keep``;
  ``next_u_i = committed_i - keep + 1`` (the surplus is re-fed next step).

Both rules run through ``_plan_core``; the *only* difference is the function that
turns ``committed`` into ``advance`` (identity vs. batch minimum).

Inputs are int32 ``[..., B]``: the rules reduce over the last axis only, so the
functions are vmappable over any leading axes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass
from specjax.advance import KvAdvance, parse_kv_advance
from specjax.errors import dtype_of

__all__ = [
    "CohortStepPlan",
    "PerSeqStepPlan",
    "accepted_from_prefix",
    "plan_cohort_step",
    "plan_per_sequence_step",
    "plan_step",
    "trace_count",
]


@pytree_dataclass
class PerSeqStepPlan:
    """Plan of one verify step under the per-sequence rule; every field int32 ``[..., B]``."""

    uncached: jax.Array  # u_i: tokens fed this step whose KV is not yet cached
    proposed: jax.Array  # w - u_i: draft slots this row had
    accepted: jax.Array  # a_i <= proposed_i
    committed: jax.Array  # u_i + a_i: tokens whose KV is now valid
    advance: jax.Array  # how far this row's cache length moves
    next_uncached: jax.Array  # u_i for the next step
    emitted: jax.Array  # a_i + 1 tokens returned to the user


@pytree_dataclass
class CohortStepPlan(PerSeqStepPlan):
    """Plan of one verify step under the cohort rule; ``keep`` is ``[..., 1]``."""

    keep: jax.Array  # min_i committed_i, shared by the whole batch


_TRACES = {"per_sequence": 0, "cohort": 0}


def trace_count(rule: str) -> int:
    """How many times the jitted plan function for ``rule`` has been traced."""
    return _TRACES[rule]


def _own_advance(committed: jax.Array) -> jax.Array:
    """Per-sequence: each row advances by what it committed. No batch reduction."""
    return committed


def _cohort_keep(committed: jax.Array) -> jax.Array:
    """Cohort: the batch minimum of ``committed``, ``[..., 1]``."""
    return jnp.min(committed, axis=-1, keepdims=True)


def _cohort_advance(committed: jax.Array) -> jax.Array:
    return jnp.broadcast_to(_cohort_keep(committed), committed.shape)


def _plan_core(
    u: jax.Array, a: jax.Array, window: int, advance_fn: Callable[[jax.Array], jax.Array]
) -> dict[str, jax.Array]:
    u = u.astype(jnp.int32)
    a = a.astype(jnp.int32)
    proposed = window - u
    committed = u + a
    advance = advance_fn(committed)  # the one line where the rules differ
    return dict(
        uncached=u,
        proposed=proposed,
        accepted=a,
        committed=committed,
        advance=advance,
        next_uncached=committed - advance + 1,
        emitted=a + 1,
    )


def _per_sequence_impl(u: jax.Array, a: jax.Array, window: int) -> PerSeqStepPlan:
    _TRACES["per_sequence"] += 1
    return PerSeqStepPlan(**_plan_core(u, a, window, _own_advance))


def _cohort_impl(u: jax.Array, a: jax.Array, window: int) -> CohortStepPlan:
    _TRACES["cohort"] += 1
    fields = _plan_core(u, a, window, _cohort_advance)
    return CohortStepPlan(**fields, keep=_cohort_keep(fields["committed"]))


_per_sequence_jit = jax.jit(_per_sequence_impl, static_argnames="window")
_cohort_jit = jax.jit(_cohort_impl, static_argnames="window")


def accepted_from_prefix(prefix_len: jax.Array, proposed: jax.Array) -> jax.Array:
    """Accepted drafts given the length of the matching prefix: the saturation cap.

    A row with ``proposed == 0`` (saturated, ``u == w``) accepts nothing, whatever
    its drafter would have matched.
    """
    return jnp.minimum(prefix_len, proposed)


def _is_concrete(x: object) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _bad_rows(mask: np.ndarray) -> list:
    rows = np.argwhere(mask)
    return [tuple(int(i) for i in r) if len(r) > 1 else int(r[0]) for r in rows[:16]]


def _validate(u: object, a: object, window: object) -> None:
    """Host-side checks at the public boundary; value checks only for concrete inputs."""
    if isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 1:
        raise ValueError(f"window must be an int >= 1 (depth + 1), got {window!r}")
    u_shape, a_shape = np.shape(u), np.shape(a)
    if len(u_shape) == 0:
        raise ValueError(f"u must have shape [..., B] with B >= 1, got a scalar {u!r}")
    if u_shape != a_shape:
        raise ValueError(f"u and a must have the same shape [..., B]; got u {u_shape}, a {a_shape}")
    for name, x in (("u", u), ("a", a)):
        dtype = dtype_of(x)
        if not np.issubdtype(dtype, np.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {dtype}")
    if not (_is_concrete(u) and _is_concrete(a)):
        return  # inside a trace: shapes are checked, values are the caller's contract
    un, an = np.asarray(u), np.asarray(a)
    bad = (un < 1) | (un > window)
    if bad.any():
        raise ValueError(
            f"u must lie in [1, window={window}]; bad rows {_bad_rows(bad)} "
            f"have u={un[bad][:16].tolist()}"
        )
    bad = (an < 0) | (an > window - un)
    if bad.any():
        raise ValueError(
            f"a must lie in [0, window - u]; bad rows {_bad_rows(bad)} have "
            f"a={an[bad][:16].tolist()} with window - u={(window - un)[bad][:16].tolist()}"
        )


def plan_per_sequence_step(u: jax.Array, a: jax.Array, window: int) -> PerSeqStepPlan:
    """Per-sequence plan. ``u, a``: int32 ``[..., B]``; ``window = depth + 1`` (static)."""
    _validate(u, a, window)
    return _per_sequence_jit(jnp.asarray(u), jnp.asarray(a), window=int(window))


def plan_cohort_step(u: jax.Array, a: jax.Array, window: int) -> CohortStepPlan:
    """Cohort plan. ``u, a``: int32 ``[..., B]``; ``keep`` is ``[..., 1]``."""
    _validate(u, a, window)
    return _cohort_jit(jnp.asarray(u), jnp.asarray(a), window=int(window))


def plan_step(u: jax.Array, a: jax.Array, window: int, rule: object) -> PerSeqStepPlan:
    """Dispatch on a ``KvAdvance`` (or its name) to the matching plan function."""
    r = parse_kv_advance(rule)
    if r is KvAdvance.COHORT:
        return plan_cohort_step(u, a, window)
    return plan_per_sequence_step(u, a, window)
