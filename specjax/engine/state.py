"""``EngineState``: what changes from step to step (an immutable pytree of per-row arrays),
its one constructor (``new_state``), and what comes back to the host (``fetch``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass
from specjax.cache import describe_status
from specjax.engine.config import EngineConfig
from specjax.sampling import RowSampling
from specjax.sharding import local_rows

__all__ = ["EngineState", "check_status", "fetch", "new_state", "row_status"]


@pytree_dataclass
class EngineState:
    seq: jax.Array  # int32 [B, C]: prompt + generated tokens
    known: jax.Array  # [B]: tokens known (prompt + generated)
    u: jax.Array  # [B]: known tokens not yet in the cache (1..w)
    cache: Any  # the target's caches (``Decoder.init_cache``: a ``ModelCache``); cache.lengths = known - u
    dstate: Any  # drafter state (caches, MTP hidden, ...)
    prompt_len: jax.Array  # [B]
    max_len: jax.Array  # [B]: prompt_len + max_new_tokens
    eos: jax.Array  # [B, E]: the row's stop ids (it stops on any), -1 padded
    seeds: jax.Array  # uint32 [B]
    sampling: RowSampling  # per-row temperature / top_k / top_p [B] (data: never recompiles)
    live: jax.Array  # bool [B]: the slot holds a request, running or finished (idle slots own no pages)
    done: jax.Array  # bool [B]
    steps: jax.Array  # [B]: decode steps while active
    emitted: jax.Array  # [B]: tokens emitted by decode steps
    accepted: jax.Array  # [B]: drafts accepted
    proposed: jax.Array  # [B]: drafts proposed
    acc_pos: jax.Array  # [B, depth]: accepted at draft position k
    prop_pos: jax.Array  # [B, depth]: asked for at draft position k
    seen_pos: jax.Array  # [B, depth]: verdicts at draft position k (accepted, or the first rejected)
    trace: jax.Array  # [B, max_steps]: accepted drafts at the row's own step k (-1 past its steps)
    est: jax.Array  # float32 [B, depth]: a step controller's per-row estimates (0 without one)
    # a token tree's children tested / accepted at draft level j and sibling rank r (``branch_verdicts``;
    # K = the tree's most children, 0 without a tree)
    branch_tested: jax.Array  # int32 [B, depth, K]
    branch_accepted: jax.Array  # int32 [B, depth, K]
    i: jax.Array  # int32 []: steps taken
    auto: Any = None  # a step controller's data (depth="auto": ``specjax.auto.AutoState``), or None


def new_state(eng: EngineConfig, *, seq, known, cache, dstate, prompt_len, max_len, eos, seeds,
              sampling: RowSampling, live, done) -> EngineState:
    """A state whose rows have taken no decode step: every counter zero, one known token not
    yet cached per row (``u = 1``), no trace, no controller data. The prefill builds its rows
    with it, and a batch job its idle slots."""
    b, d = seq.shape[0], eng.depth
    zeros = lambda: jnp.zeros((b,), jnp.int32)  # noqa: E731  (distinct buffers: donatable)
    return EngineState(
        seq=seq, known=known, u=jnp.ones((b,), jnp.int32), cache=cache, dstate=dstate, prompt_len=prompt_len,
        max_len=max_len, eos=eos, seeds=seeds, sampling=sampling, live=live, done=done,
        steps=zeros(), emitted=zeros(), accepted=zeros(), proposed=zeros(),
        acc_pos=jnp.zeros((b, d), jnp.int32), prop_pos=jnp.zeros((b, d), jnp.int32),
        seen_pos=jnp.zeros((b, d), jnp.int32), trace=jnp.full((b, eng.max_steps), -1, jnp.int32),
        est=jnp.zeros((b, d), jnp.float32), branch_tested=jnp.zeros((b, d, eng.branches), jnp.int32),
        branch_accepted=jnp.zeros((b, d, eng.branches), jnp.int32), i=jnp.int32(0),
    )


def row_status(eng: EngineConfig, st: EngineState) -> jax.Array:
    """int32 ``[B]``: each row's status bits, the target's caches' and those of the drafter's
    own (``drafter.status``: the MTP block's, a draft model's; a drafter that keeps no cache has none)."""
    if not eng.drafter.reports_status:
        return st.cache.status
    return st.cache.status | eng.drafter.status(st.dstate)


def fetch(eng: EngineConfig, st: EngineState) -> tuple[EngineState, np.ndarray]:
    """What comes back to the host from a finished state: every array but the caches and the
    drafter state (this process's rows of them), and the rows' status ``[B]`` (``row_status``)."""
    small = st.replace(cache=None, dstate=None)
    if eng.mesh is None:  # one device: one batched read-back (a read per array was ~30 syncs a call)
        return jax.tree.map(np.asarray, jax.device_get((small, row_status(eng, st))))
    return jax.tree.map(local_rows, small), local_rows(row_status(eng, st))


def check_status(status, what: str = "rows") -> None:
    """Surface any cache status bit (a refused write or advance) instead of returning tokens
    computed from a cache that fell behind. ``status``: int32 ``[B]`` (``row_status``)."""
    bad = describe_status(status)
    if bad:
        raise RuntimeError(f"KV cache refused a write or advance (engine bug or undersized cache): {what} {bad}")
