"""Plain decoding as a drafter: no drafts (depth 0), on the same step."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.drafters.base import Stateless


@dataclasses.dataclass(frozen=True)
class NoDrafter(Stateless):
    """Plain decoding (depth 0): the baseline, on the same step."""

    name: str = "none"

    def propose(self, eng, params, st):
        b = st.seq.shape[0]
        return jnp.zeros((b, 0), jnp.int32), None, st.dstate

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        return dstate
