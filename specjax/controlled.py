"""Drafts at a controlled acceptance, at the real drafter's cost (for benchmarks at real shapes).

Random weights accept nothing, so a speed figure at a real model's shape needs acceptance
from elsewhere. ``Controlled(inner)`` runs the real drafter (its MTP chain, draft model or
n-gram lookup: every op it costs stays in the step) and then replaces each proposal with the
target's own greedy continuation (``oracle``), corrupted per draft position to follow a given
profile:

* ``rates [d]``: draft ``k`` is right with probability ``rates[k]`` (given the drafts before
  it were: the conditional acceptance per position), drawn per row from its seed, the draft's
  absolute position and ``k`` (a row's draws never depend on its batch);
* ``trace [B, S]``: at the row's own step ``s`` exactly its first ``trace[b, s]`` drafts are
  right (a replayed run's accepted counts; ``-1``: draw by ``rates``).

Token trees (``propose_tree``): the real drafter's tree (its shape and cost) with each node's
token replaced. ``branch [d, K]`` is the acceptance per branch: at level ``j`` the right token
is the parent's child of rank ``r`` with probability ``branch[j, r]`` given ranks ``< r`` were
not (``specjax.sim.TreeAcceptance``'s rates; the draws of rank 0 are the chain's, so a tree and
a chain at the same profile share their luck). The nodes on the right path carry the oracle's
tokens, every other node a wrong one. ``trace`` is for chains only.

A wrong draft is the right one shifted by ``1 + (real draft mod (V - 1))``: never the right
token, and a data dependence on the real drafter's output, so XLA cannot drop the drafter's
work as dead code. Verification is greedy (the oracle is the greedy continuation); tokens
stay exactly the target's, so the run measures the engine's cost at that acceptance, not
any drafter's quality.

The oracle and profile are data (``ControlData``, passed to the step in ``params["drafter"]``):
a new oracle or profile of the same shapes never recompiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass
from specjax.drafters import gather_tokens
from specjax.tree import depths, earlier_siblings, sibling_rank

__all__ = ["ControlData", "Controlled", "control_data", "expected_tokens_per_step", "oracle_rows"]

_RANK_SALT = 1 << 12  # a rank-r node's draw key: its level + r * salt (rank 0: the chain's key, its level)


@pytree_dataclass
class ControlData:
    """What a ``Controlled`` drafter reads inside the step (data: never part of a compile)."""

    oracle: jax.Array  # int32 [B, C]: each row's prompt and the target's greedy continuation
    rates: jax.Array  # float32 [d]: P(draft k right | drafts < k right)
    trace: jax.Array  # int32 [B, S]: drafts right at the row's own step s; -1: draw by ``rates``
    branch: jax.Array  # float32 [d, K]: trees: P(child of rank r right | ranks < r not) at level j


def _uniform(seeds: jax.Array, positions: jax.Array, k: jax.Array) -> jax.Array:
    """float32 in [0, 1) per (row seed ``[B]``, absolute position ``[B, d]``, draft index ``[1, d]``):
    an integer hash (murmur3's finalizer), cheap beside the step and batch-independent."""
    x = (seeds[:, None].astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
         ^ positions.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)
         ^ (k.astype(jnp.uint32) + jnp.uint32(1)) * jnp.uint32(0xC2B2AE3D))
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = (x ^ (x >> shift)) * jnp.uint32(mult)
    x = x ^ (x >> 16)
    return (x >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


@dataclasses.dataclass(frozen=True)
class Controlled:
    """An engine drafter: ``inner``'s work, the oracle's tokens at the profile's acceptance.

    Compares and hashes as ``inner`` (its static half); ``data`` rides along for ``generate``,
    which passes it to the step as ``params["drafter"]``. Everything but ``propose`` is
    ``inner``'s (its state, prefill, commit, caches)."""

    inner: Any
    data: ControlData | None = dataclasses.field(default=None, compare=False, repr=False)
    wraps_drafter: ClassVar[bool] = True  # the engine resolves and sizes it by ``inner`` (specjax.drafters)

    @property
    def name(self) -> str:
        return f"{self.inner.name}@controlled"

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy / pickle probe dunders before the fields exist
            raise AttributeError(attr)
        return getattr(self.__dict__["inner"], attr)

    def empty(self, eng, batch, width):
        return self.inner.empty(eng, batch, width)

    def prefill(self, eng, params, st, hidden, positions, live):
        return self.inner.prefill(eng, params, st, hidden, positions, live)

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        return self.inner.commit(eng, params, st, dstate, hidden, old_lengths, u, a, advance)

    def propose_tree(self, eng, params, st):
        """``inner``'s tree (``[B, T]`` tokens, ``[B, T + 1]`` parents: its shape and its cost),
        its tokens replaced: the right path drawn level by level from ``branch`` (module doc)."""
        self._greedy_only(eng)
        tokens, parents, dstate = self.inner.propose_tree(eng, params, st)
        data: ControlData = params["drafter"]
        level = depths(parents)[:, 1:] - 1  # [B, T]: 0 for the root's children
        kid = parents[:, 1:]
        before = earlier_siblings(kid)  # [B, T, T]: the siblings ranked above it
        rank = sibling_rank(kid)
        pos = st.known[:, None] + level  # the absolute position each node is for
        right = gather_tokens(data.oracle, pos)
        d, k = data.branch.shape
        rate = data.branch[jnp.minimum(level, d - 1), jnp.minimum(rank, k - 1)]
        rate = jnp.where((level < d) & (rank < k), rate, 0.0)
        ok = _uniform(st.seeds, pos, level + _RANK_SALT * rank) < rate  # rank 0: the chain's draw at this level
        # the first of its siblings drawn right carries the right token (a node below a wrong one is never
        # reached by the walk, so its own draw decides nothing)
        chosen = ok & ~jnp.any(before & ok[:, None, :], axis=2)
        return jnp.where(chosen, right, self._wrong(eng, right, tokens)).astype(jnp.int32), parents, dstate

    def _greedy_only(self, eng) -> None:
        if not eng.greedy:
            raise ValueError("a Controlled drafter verifies greedily (its oracle is the greedy continuation): "
                             "temperature must be 0")

    @staticmethod
    def _wrong(eng, right: jax.Array, drafts: jax.Array) -> jax.Array:
        """Never ``right``, and a function of the real drafts (XLA keeps the drafter's work)."""
        v = eng.target.vocab_size
        return (right + 1 + jnp.abs(drafts) % max(v - 1, 1)) % v

    def propose(self, eng, params, st):
        self._greedy_only(eng)
        drafts, _, dstate = self.inner.propose(eng, params, st)
        d = drafts.shape[1]
        if d == 0:
            return drafts, None, dstate
        data: ControlData = params["drafter"]
        k = jnp.arange(d, dtype=jnp.int32)[None]
        pos = st.known[:, None] + k  # the absolute position each draft is for
        right = gather_tokens(data.oracle, pos)
        rates = jnp.pad(data.rates, (0, max(d - data.rates.shape[0], 0)))[:d]
        ok = _uniform(st.seeds, pos, k) < rates[None]
        s = st.steps[:, None]  # [B, 1]: the row's own step; past its trace, -1 (the rates)
        planned = jnp.where(s < data.trace.shape[1], gather_tokens(data.trace, s), -1)
        ok = jnp.where(planned >= 0, k < planned, ok)
        return jnp.where(ok, right, self._wrong(eng, right, drafts)).astype(jnp.int32), None, dstate


def oracle_rows(prompts: list[list[int]], continuations: list[list[int]], width: int) -> np.ndarray:
    """int32 ``[B, width]``: each row's prompt then its greedy continuation (zeros after)."""
    out = np.zeros((len(prompts), width), np.int32)
    for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        row = (list(p) + list(c))[:width]
        out[i, : len(row)] = row
    return out


def control_data(oracle: np.ndarray, rates, trace: np.ndarray | None = None, branch=None) -> ControlData:
    """``ControlData`` from host arrays; ``rates`` one per draft position (each in [0, 1]); ``trace``
    ``[B, S]`` replayed counts (``None``: draw every step by ``rates``); ``branch [d, K]`` a tree's
    acceptance per branch (``None``: ``rates`` for each level's first child, none for the rest)."""
    rates = np.asarray(rates, np.float32).reshape(-1)
    if rates.size == 0 or np.any(~np.isfinite(rates)) or np.any((rates < 0) | (rates > 1)):
        raise ValueError(f"rates={rates.tolist()} is invalid: one acceptance per draft position, each in [0, 1]")
    branch = rates[:, None] if branch is None else np.asarray(branch, np.float32)
    if branch.ndim != 2 or branch.size == 0 or np.any(~np.isfinite(branch)) or np.any((branch < 0) | (branch > 1)):
        raise ValueError(f"branch={branch.tolist()} is invalid: [levels, ranks] acceptances, each in [0, 1]")
    b = oracle.shape[0]
    if trace is None:
        trace = np.full((b, 1), -1, np.int32)
    trace = np.asarray(trace, np.int32)
    if trace.ndim != 2 or trace.shape[0] != b:
        raise ValueError(f"trace of shape {trace.shape} is invalid: must be [rows={b}, steps]")
    return ControlData(jnp.asarray(oracle, jnp.int32), jnp.asarray(rates), jnp.asarray(trace), jnp.asarray(branch))


def expected_tokens_per_step(rates, depth: int) -> float:
    """Tokens a step emits at ``depth`` drafts with conditional acceptance ``rates`` (iid draws):
    ``1 + sum_k prod_{j <= k} rates[j]``."""
    r = list(np.asarray(rates, np.float64).reshape(-1)) + [0.0] * depth
    total, run = 1.0, 1.0
    for k in range(depth):
        run *= r[k]
        total += run
    return total
