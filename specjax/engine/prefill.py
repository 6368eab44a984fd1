"""The prefill: prompts into empty caches and each row's first token (the state a decode loop
starts from)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine.config import EngineConfig
from specjax.engine.state import EngineState, new_state
from specjax.protocols import reachable_positions
from specjax.sampling import SAMPLE, RowSampling, position_keys, probs, sample

__all__ = ["Chunk", "chunk_commit", "chunk_window", "fresh_prefill", "pending_rows", "prefill", "prefill_chunk",
           "prefill_rows"]


def prefill_rows(eng: EngineConfig, params: dict, prompts: jax.Array, prompt_len: jax.Array, max_len, eos, seeds,
                 sampling: RowSampling, cache: Any, dstate: Any, live: jax.Array, c: int | None = None) -> EngineState:
    """Run ``prompts [B, P]`` into the empty ``cache`` and drafter state ``dstate`` and take
    each row's first token. ``live [B]``: real rows (padding rows of a refill own no pages).
    One ``prefill_chunk`` over ``pending_rows``, of the whole width, or ``c`` tokens where
    rows start past their prompt's head (cached prefix pages: every row's rest fits ``c``)."""
    st = pending_rows(eng, prompts, prompt_len, max_len, eos, seeds, sampling, cache, dstate, live)
    return prefill_chunk(eng, params, st, prompts.shape[1] if c is None else c)


def pending_rows(eng: EngineConfig, prompts: jax.Array, prompt_len: jax.Array, max_len, eos, seeds,
                 sampling: RowSampling, cache: Any, dstate: Any, live: jax.Array) -> EngineState:
    """Rows whose prompts ``prompts [B, P]`` are known but not yet in the empty ``cache`` and
    ``dstate``: every row done (nothing to decode) until ``prefill_chunk`` takes its last
    prompt token and its first new one."""
    b, p = prompts.shape
    seq = jnp.zeros((b, eng.capacity), jnp.int32).at[:, :p].set(prompts)
    return new_state(eng, seq=seq, known=prompt_len, cache=cache, dstate=dstate, prompt_len=prompt_len,
                     max_len=max_len, eos=eos, seeds=seeds, sampling=sampling, live=live,
                     done=jnp.ones((b,), bool))


def prefill_chunk(eng: EngineConfig, params: dict, st: EngineState, c: int) -> EngineState:
    """The next ``c`` prompt tokens of every row of ``st`` (``pending_rows``) into its caches
    and drafter state, from each row's own cache length (a row's prompt may end inside the
    chunk: only its own tokens count); a row whose prompt ends here takes its first token
    (its prompt's last hidden state through the head) and is done only if that stops it.
    A row whose prompt ended in an earlier chunk is left as it is (its chunk writes padding
    past its length, unread). ``c`` is static: one compile per (rows, width, ``c``).
    ``chunk_window`` and ``chunk_commit`` are its halves, either side of the target's forward
    (a batch job runs that forward beside a decode step's: ``specjax.engine.step``)."""
    chunk = chunk_window(eng, st, c)
    hidden, cache = eng.target.forward_hidden(params["target"], chunk.tokens, chunk.positions, chunk.cache,
                                              attention_impl=eng.attention_impl)
    return chunk_commit(eng, params, st, chunk, hidden, cache)


class Chunk(NamedTuple):
    """The target's input for the next chunk of pending rows' prompts (``chunk_window``)."""

    tokens: jax.Array  # int32 [R, c]: each row's next prompt tokens (padding past its prompt)
    positions: jax.Array  # int32 [R, c]
    cache: Any  # the rows' target caches: pages reserved for their real tokens, the write bounded to them
    count: jax.Array  # int32 [R]: each row's real tokens in the chunk (0: its prompt is in)


def chunk_window(eng: EngineConfig, st: EngineState, c: int) -> Chunk:
    """``prefill_chunk``'s first half: the next ``c`` tokens of each row from its own cache length."""
    start = st.cache.lengths
    count = jnp.clip(st.prompt_len - start, 0, c)
    at = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
    tokens = jnp.take_along_axis(st.seq, jnp.minimum(at, st.seq.shape[1] - 1), axis=1)
    return Chunk(tokens, reachable_positions(at, st.max_len), st.cache.reserve(count, st.live).bound_write(count),
                 count)


def chunk_commit(eng: EngineConfig, params: dict, st: EngineState, chunk: Chunk, hidden: jax.Array,
                 cache: Any) -> EngineState:
    """``prefill_chunk``'s second half: the target's ``hidden [R, c, d]`` and written ``cache``
    for ``chunk``: the rows' caches advance by their counts, a row whose prompt ends here takes
    its first token, and the drafter takes the chunk."""
    b = st.seq.shape[0]
    count = chunk.count
    cache = cache.advance(count)
    final = (count > 0) & (st.cache.lengths + count == st.prompt_len)
    h_last = jnp.take_along_axis(hidden, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    last = eng.target.head(params["target"], h_last)  # logits for the one position used
    if eng.greedy:
        first = jnp.argmax(last, axis=-1).astype(jnp.int32)
    else:
        first = sample(position_keys(st.seeds, st.prompt_len[:, None], SAMPLE)[:, 0], probs(last, st.sampling))
    rows = jnp.arange(b)
    seq = st.seq.at[rows, jnp.where(final, st.prompt_len, st.seq.shape[1])].set(first, mode="drop")
    stops = jnp.any(first[:, None] == st.eos, axis=1) | (st.prompt_len + 1 >= st.max_len) | ~st.live
    st = st.replace(seq=seq, known=jnp.where(final, st.prompt_len + 1, st.known), cache=cache,
                    done=jnp.where(final, stops, st.done))
    return st.replace(dstate=eng.drafter.prefill(eng, params, st, hidden, chunk.positions, st.live))


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
