"""The two plug-in surfaces of the engine: a model (``Decoder``) and a drafter (``Drafter``).

The model protocol: what the engine needs from a target or a draft model. A model handed
to ``generate`` (``stream``, ``batch_generate``, ``make_engine``) is any object with two
attributes:

* ``params``: a pytree of arrays (traced: data, never a static argument);
* ``decoder``: a frozen, hashable object (it is part of the static engine, so two equal
  decoders share every compile) that implements ``Decoder`` below.

specjax's own Llama (``specjax.model.Model``, whose ``decoder`` is a ``LlamaDecoder``)
implements it like any other model; ``specjax.nnx_adapter.nnx_model`` wraps a Flax NNX
module. The engine calls nothing else: it imports no model module.

Shapes: ``tokens``/``positions [B, t]`` (int32; ``positions`` are absolute, per row),
``hidden [B, t, H]`` (what ``head`` and an MTP module consume), logits float32 ``[..., V]``.

Positions a model sees: never past what the request can reach. A forward is wider than a
row's real tokens (a prefill padded to its width bucket, a verify window or draft chain
running past the row's token budget); those extra slots get the row's last reachable position
(``reachable_positions``: at most ``prompt + max_new_tokens - 1 <= max_seq_len - 1``), so a
model with a position table of exactly ``max_seq_len`` rows is never indexed past it. Their
outputs are never used, and attention never lets a real token see them (and the attention
paths drop whatever values a masked slot holds, NaN included).

The cache ``init_cache`` returns is the model's whole per-row KV state with the interface of
``specjax.cache.ModelCache`` (``lengths [B]``, ``status [B]``, ``reserve``, ``bound_write``,
``advance``, ``with_lengths``, ``release``, ``rows_view``, ``put_rows``): build it from
specjax's caches (``specjax.cache.kv_cache``), which already give every row its own offset,
its own mask and the two advance rules. ``forward_hidden`` writes the window's K/V at each
row's ``cache.lengths`` (the lengths do not move; the engine advances them by plan).

The drafter protocol: ``generate(..., drafter=MyDrafter())`` takes, besides the built-in
names, any frozen (hashable) object with a ``name`` and ``propose(ctx, state)``; see ``Drafter``.
It sees each step only a ``DraftContext`` (the rows' tokens, not the engine's state).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass, static_field
from specjax.sampling import RowSampling, draft_token

__all__ = ["BlockHead", "Decoder", "DecoderModel", "DraftContext", "Drafter", "MixedForward", "MtpHead", "MtpOneSlot",
           "MtpTapped", "check_drafter", "check_model", "reachable_positions"]


def reachable_positions(positions: jax.Array, max_len: jax.Array) -> jax.Array:
    """``positions [B, t]`` clipped per row to ``[0, max_len[b] - 1]`` (``max_len [B]``: the
    row's prompt + token budget; an idle slot's 0 gives 0): what a model is handed."""
    return jnp.clip(positions, 0, jnp.maximum(max_len - 1, 0)[:, None]).astype(jnp.int32)


@runtime_checkable
class Decoder(Protocol):
    """The static half of a model: facts and pure functions of ``(params, ...)``."""

    vocab_size: int  # logits width (a draft model must match its target's)
    max_seq_len: int  # the longest sequence (prompt + new tokens) it accepts: a validation bound
    dtype: Any  # its activations' and caches' dtype
    mtp_depth: int  # MTP modules it carries (0: none; drafter="mtp" needs >= 1)
    hidden_size: int  # width of ``hidden`` (an MTP drafter keeps one row of it)

    def init_cache(self, batch: int, capacity: int, *, kind: str, slack: int, page_size: int,
                   num_pages: int | None) -> Any:
        """Empty caches for ``batch`` rows of ``capacity`` slots; ``kind``: ``"dense"`` or
        ``"paged"`` (``page_size``, pool of ``num_pages``, ``None``: every row's full
        capacity); ``slack``: how far a write reaches past the committed length (rings)."""

    def forward_hidden(self, params: Any, tokens: jax.Array, positions: jax.Array, cache: Any, *,
                       attention_impl: str) -> tuple[jax.Array, Any]:
        """Run ``tokens [B, t]`` at ``positions [B, t]`` over ``cache``, writing their K/V at
        each row's ``cache.lengths``: ``(hidden [B, t, H], cache)``. ``attention_impl``:
        ``"xla"`` or ``"pallas"`` (resolved; a model may serve both from its caches)."""

    def head(self, params: Any, hidden: jax.Array) -> jax.Array:
        """``hidden [..., H]`` -> float32 logits ``[..., V]`` (applied only where used)."""


@runtime_checkable
class MixedForward(Protocol):
    """Optional: groups of rows of different widths in one forward (a verify window with a
    prefill chunk riding along); without it the engine runs them one after the other."""

    def forward_mixed(self, params: Any, groups: list, *, attention_impl: str) -> tuple: ...


@runtime_checkable
class MtpHead(Protocol):
    """Optional: the MTP module's own head, ``(logits [..., N], ids int32 [N] | None)`` (a draft
    vocabulary's logits and the target ids they cover; ``None``: the target's vocabulary);
    without it the MTP drafter reads the target's ``head``."""

    def mtp_head(self, params: Any, hidden: jax.Array) -> tuple[jax.Array, jax.Array | None]: ...


@runtime_checkable
class MtpOneSlot(Protocol):
    """Optional: ``mtp_hidden``'s output at one slot ``at [B]`` per row (K/V written for every
    slot): the MTP drafter then runs attention and MLP for the slot it reads only."""

    def mtp_hidden_at(self, params: Any, hidden: jax.Array, next_tokens: jax.Array, positions: jax.Array,
                      cache: Any, at: jax.Array, *, attention_impl: str) -> tuple[jax.Array, Any]: ...


@runtime_checkable
class MtpTapped(Protocol):
    """Optional: an MTP module that reads tapped target layers (an EAGLE-3 head): ``mtp_taps``
    (the engine runs the target ``with_taps(mtp_taps)``; empty: none) and ``mtp_width`` (the
    width of the module's own hidden, which a chain feeds back)."""

    mtp_taps: tuple[int, ...]
    mtp_width: int

    def with_taps(self, taps: tuple[int, ...] | None = None) -> Any: ...


@runtime_checkable
class BlockHead(Protocol):
    """Optional: a block drafter the model carries (``drafter="block"``; ``specjax.model.block``).
    ``block_size`` (``k``; 0: none); ``with_taps()``: the decoder whose forward also returns the
    tapped layers' hidden states (``hidden_size`` wide); ``init_block_cache(batch, capacity)``:
    the per-row context cache; ``block_context(params, hidden, positions, cache, count)``: the
    context K/V of a tapped ``hidden [B, t, hidden_size]``, each row's first ``count [B]`` written
    at its cache length; ``block_draft(params, first [B], positions [B, k], cache)``: one pass,
    ``(logits [B, k - 1, V], cache)`` over the context before ``cache.lengths``."""

    block_size: int

    def with_taps(self) -> Any: ...

    def init_block_cache(self, batch: int, capacity: int) -> Any: ...

    def block_context(self, params: Any, hidden: jax.Array, positions: jax.Array, cache: Any,
                      count: jax.Array) -> Any: ...

    def block_draft(self, params: Any, first: jax.Array, positions: jax.Array, cache: Any, *,
                    attention_impl: str) -> tuple[jax.Array, Any]: ...


class DecoderModel(Protocol):
    params: Any
    decoder: Decoder


def lacking(obj: object, names: tuple[str, ...]) -> list[str]:
    """The ``names`` a user's object (a model, a decoder, a drafter) does not have: the one place
    an object is probed, to name what is missing before anything compiles."""
    return [n for n in names if not hasattr(obj, n)]


_NEEDS = ("vocab_size", "max_seq_len", "dtype", "mtp_depth", "hidden_size", "init_cache", "forward_hidden", "head")


def check_model(arg: str, model: object) -> Decoder:
    """``model``'s decoder, or ``ValueError`` naming ``arg`` and what is missing (before any compile)."""
    dec = getattr(model, "decoder", None)
    if lacking(model, ("params",)) or dec is None:
        raise ValueError(f"{arg}={type(model).__name__} is invalid: a model needs .params (a pytree) and .decoder "
                         "(specjax.protocols.Decoder): a specjax Model, specjax.nnx_model(...) or your own")
    missing = lacking(dec, _NEEDS)
    if missing:
        raise ValueError(f"{arg}.decoder={type(dec).__name__} is invalid: it lacks {', '.join(missing)} "
                         "(specjax.protocols.Decoder)")
    try:
        hash(dec)
    except TypeError as e:
        raise ValueError(f"{arg}.decoder={type(dec).__name__} is invalid: it must be hashable (a frozen "
                         f"dataclass; it is a static argument of every compile): {e}") from None
    if dec.mtp_depth and lacking(dec, ("mtp_hidden", "init_mtp_cache")):
        raise ValueError(f"{arg}.decoder={type(dec).__name__} is invalid: mtp_depth={dec.mtp_depth} needs "
                         "mtp_hidden and init_mtp_cache")
    return dec


@pytree_dataclass
class DraftContext:
    """What a drafter sees at a step (read-only; the engine's state stays private).

    ``tokens[b, :known[b]]`` is row ``b``'s prompt and generated text (later slots hold no
    meaning); the drafts continue it, as token ``known[b]`` onward. ``live [B]``: the slot
    holds a request (drafts of idle slots are ignored). ``depth``: drafts to propose per row
    (static; under ``depth="auto"`` a step may ask for fewer, and a depth-0 step asks none).
    """

    tokens: jax.Array  # int32 [B, C]
    known: jax.Array  # int32 [B]
    live: jax.Array  # bool [B]
    seeds: jax.Array  # uint32 [B]: each row's seed (``pick`` draws from it)
    sampling: RowSampling  # per-row temperature / top_k / top_p [B]
    depth: int = static_field()
    greedy: bool = static_field()  # every row greedy: return argmax drafts and probs None

    def last(self, n: int) -> jax.Array:
        """Each row's last ``n`` known tokens ``int32 [B, n]`` (clamped at the row's start)."""
        idx = jnp.clip(self.known[:, None] - n + jnp.arange(n)[None], 0, self.tokens.shape[1] - 1)
        return jnp.take_along_axis(self.tokens, idx, axis=1)

    def pick(self, logits: jax.Array, at: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """A draft per row from ``logits [B, V]`` at absolute position ``at [B]``:
        ``(tokens [B], probs [B, V] | None)`` (``sampling.draft_token``)."""
        return draft_token(logits, self.greedy, self.seeds, self.sampling, at)


class Drafter(Protocol):
    """A drafter of your own. Only ``name`` and ``propose`` are required.

    * ``propose(ctx, state) -> (drafts, probs, state)``: ``drafts int32 [B, ctx.depth]`` continue
      each row; ``probs float32 [B, ctx.depth, V]`` is the distribution each draft was drawn from
      (``None``: deterministic drafts, one-hot; always ``None`` under ``ctx.greedy``). Verification
      keeps sampling lossless whatever you propose, as long as ``probs`` are honest.
    * ``init(batch) -> state`` (optional): a pytree of per-row arrays ``[batch, ...]`` (slot
      refill replaces a row's entries with a fresh ``init(1)``'s); without it the state is ``None``.
    * ``commit(ctx, state, accepted) -> state`` (optional): after verification; ``accepted [B]``
      drafts of each row were kept and ``ctx`` already holds the emitted tokens.

    Everything runs traced inside the engine's jitted step: pure ``jax.numpy``, static shapes.
    The object must be hashable (a frozen dataclass): it is part of the static engine.
    """

    name: str

    def propose(self, ctx: DraftContext, state: Any) -> tuple[jax.Array, jax.Array | None, Any]: ...


def check_drafter(arg: str, drafter: object) -> None:
    """A user drafter has ``name``, ``propose`` and a hash, or ``ValueError`` naming ``arg``."""
    missing = lacking(drafter, ("name", "propose"))
    if missing:
        raise ValueError(f"{arg}={type(drafter).__name__} is invalid: a drafter is a name ('mtp', 'draft_model', "
                         f"'ngram'), None, or an object with {' and '.join(missing)} (specjax.protocols.Drafter)")
    try:
        hash(drafter)
    except TypeError as e:
        raise ValueError(f"{arg}={type(drafter).__name__} is invalid: it must be hashable (a frozen dataclass; "
                         f"it is a static argument of every compile): {e}") from None
