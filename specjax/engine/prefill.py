"""The prefill: prompts into empty caches and each row's first token (the state a decode loop
starts from)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine.config import EngineConfig
from specjax.engine.state import EngineState, new_state
from specjax.protocols import reachable_positions
from specjax.sampling import SAMPLE, RowSampling, position_keys, probs, sample

__all__ = ["fresh_prefill", "prefill", "prefill_rows"]


def prefill_rows(eng: EngineConfig, params: dict, prompts: jax.Array, prompt_len: jax.Array, max_len, eos, seeds,
                 sampling: RowSampling, cache: Any, dstate: Any, live: jax.Array) -> EngineState:
    """Run ``prompts [B, P]`` into the empty ``cache`` and drafter state ``dstate`` and take
    each row's first token. ``live [B]``: real rows (padding rows of a refill own no pages)."""
    b, p = prompts.shape
    c = eng.capacity
    seq = jnp.zeros((b, c), jnp.int32).at[:, :p].set(prompts)
    positions = reachable_positions(jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p)), max_len)
    hidden, cache = eng.target.forward_hidden(params["target"], prompts, positions,
                                              cache.reserve(p, live).bound_write(prompt_len),
                                              attention_impl=eng.attention_impl)
    cache = cache.advance(prompt_len)
    h_last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
    last = eng.target.head(params["target"], h_last)  # logits for the one position used
    if eng.greedy:
        first = jnp.argmax(last, axis=-1).astype(jnp.int32)
    else:
        first = sample(position_keys(seeds, prompt_len[:, None], SAMPLE)[:, 0], probs(last, sampling))
    seq = seq.at[jnp.arange(b), prompt_len].set(first)
    st = new_state(eng, seq=seq, known=prompt_len + 1, cache=cache, dstate=dstate, prompt_len=prompt_len,
                   max_len=max_len, eos=eos, seeds=seeds, sampling=sampling, live=live,
                   done=jnp.any(first[:, None] == eos, axis=1) | (prompt_len + 1 >= max_len) | ~live)
    return st.replace(dstate=eng.drafter.prefill(eng, params, st, hidden, positions, live))


def fresh_prefill(eng: EngineConfig, params: dict, prompts, prompt_len, max_len, eos, seeds,
                  sampling: RowSampling) -> EngineState:
    """``prefill_rows`` into new caches of the engine's full capacity (one static batch)."""
    b, p = prompts.shape
    return prefill_rows(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling,
                        eng.new_cache(eng.target, b), eng.drafter.empty(eng, b, p), jnp.ones((b,), bool))


_prefill_jit = jax.jit(fresh_prefill, static_argnums=0)


def prefill(eng: EngineConfig, params: dict, prompts, prompt_len, max_len, eos, seeds,
            sampling: RowSampling | None = None) -> EngineState:
    """Jitted prefill of ``prompts [B, P]`` (``prompt_len, max_len, seeds [B]``; ``eos [B]`` or
    ``[B, E]`` stop ids, -1 for none) into new caches of the engine's capacity. ``sampling``
    defaults to greedy rows."""
    eos = jnp.asarray(eos, jnp.int32)
    eos = eos[:, None] if eos.ndim == 1 else eos
    if sampling is None:
        b = np.shape(prompts)[0]
        sampling = RowSampling.rows([0.0] * b, [None] * b, [None] * b)
    return _prefill_jit(eng, params, prompts, prompt_len, max_len, eos, seeds, sampling)
