"""The block drafter (DFlash style): a few decoder layers that draft a whole block in one pass.

A row's block is its last known token followed by ``k - 1`` mask tokens (``block_mask_id``), at
positions ``P .. P + k - 1`` (``P``: the last known token's; ``k = block_size``). The block's
rows attend to one another without a causal mask and to the row's context: one K/V entry per
earlier position ``< P``, projected from the target's hidden states after the layers
``block_taps``. Rows ``1 .. k - 1`` then go through the drafter's norm and the target's LM head:
``k - 1`` drafts from one pass, whatever ``k`` is.

Params (``params["block"]``, inside the target's, as the MTP module's): ``fc [n_taps * d, d]``,
``hidden_norm [d]``, ``layers`` (``block_layers`` blocks shaped like the target's), ``norm
[d]``. The embedding and the LM head are the target's. A context entry ``c = hiddennorm(taps
@ fc)`` enters every layer as a key and a value only (``k = knorm(c Wk)`` rotated at its
position, ``v = c Wv``; no input norm) and never runs as a query. This is the layout a DFlash
checkpoint's weights map onto (``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``;
``dflash_config``: ``target_layer_ids`` = ``block_taps``, ``mask_token_id``, ``block_size``).
The drafter's layers, norms and RoPE run with ``cfg.block_config`` (the model's config with
``block_overrides``: a DFlash drafter's own heads, widths and RoPE); the embedding and the LM
head with the model's.

Shapes: taps ``[B, t, n_taps * d]`` (``forward_hidden(..., taps=)`` after its first ``d``
columns); context ``[B, t, d]``; a block ``[B, k, d]``; the context cache one layer per
drafter layer, ``[B, Hkv, capacity, hd]`` (``DenseKVCache``), per-row lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.attention import TreeMask, attend_visible
from specjax.cache import DenseKVCache
from specjax.model.config import ModelConfig
from specjax.model.layers import block_finish, block_params, block_qkv, embed, norm, project_qkv

__all__ = ["block_draft_logits", "block_logits", "context", "init_block_params", "train_block_hidden",
           "write_context"]


def init_block_params(key: jax.Array, config: ModelConfig, dtype=jnp.float32) -> dict:
    """A random-initialised block drafter (``params["block"]``)."""
    k_fc, k_layers = jax.random.split(key)
    bc = config.block_config
    d, one = config.d_model, 1.0 - bc.norm_offset
    return {
        "fc": (jax.random.normal(k_fc, (len(config.block_taps) * d, d)) * 0.02).astype(dtype),
        "hidden_norm": jnp.full((d,), one, dtype),
        "layers": [block_params(k, bc, dtype) for k in jax.random.split(k_layers, config.block_layers)],
        "norm": jnp.full((d,), one, dtype),
    }


def context(params: dict, cfg: ModelConfig, taps: jax.Array) -> jax.Array:
    """Context entries ``[B, t, d]`` from the target's tapped hidden states ``[B, t, n_taps * d]``."""
    b = params["block"]
    return norm(taps @ b["fc"].astype(taps.dtype), b["hidden_norm"], cfg.block_config)


def _context_kv(p: dict, ctx: jax.Array, positions: jax.Array, cfg: ModelConfig):
    """A drafter layer's key and value ``[B, t, Hkv, hd]`` of context entries ``ctx`` (no input norm)."""
    _, k, v = project_qkv(p, ctx, positions, cfg.block_config, None)
    return k, v


def write_context(params: dict, cfg: ModelConfig, hidden: jax.Array, positions: jax.Array,
                  cache: DenseKVCache, count: jax.Array) -> DenseKVCache:
    """Each drafter layer's context K/V of the target's ``hidden [B, t, d * (1 + n_taps)]`` (a
    forward with ``taps``) at ``positions [B, t]``, the first ``count [B]`` of each row written at
    its ``cache.lengths`` (the lengths do not move: the caller advances them)."""
    ctx = context(params, cfg, hidden[..., cfg.d_model:])
    for i, p in enumerate(params["block"]["layers"]):
        k, v = _context_kv(p, ctx, positions, cfg)
        cache = cache.write(i, k, v, count)
    return cache


def block_logits(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The drafter's norm, then the target's LM head: ``x [..., d]`` -> float32 logits ``[..., V]``."""
    h = norm(x, params["block"]["norm"], cfg.block_config)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)


def block_tokens(first: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A block ``int32 [..., k]``: ``first [...]`` (the last known token) then ``k - 1`` mask tokens."""
    masks = jnp.full((*first.shape, cfg.block_size - 1), cfg.block_mask_id, jnp.int32)
    return jnp.concatenate([first[..., None].astype(jnp.int32), masks], axis=-1)


def block_draft_logits(params: dict, cfg: ModelConfig, first: jax.Array, positions: jax.Array,
                       cache: DenseKVCache, *, attention_impl: str = "xla") -> tuple[jax.Array, DenseKVCache]:
    """One drafter pass: the block of ``first [B]`` at ``positions [B, k]`` over the context
    ``cache`` (whose ``lengths`` are the context lengths: entries ``< lengths`` are read). The
    block's K/V is written at slots ``lengths .. lengths + k - 1`` (scratch: the lengths do not
    move) and each block row reads them all (a ``TreeMask`` whose nodes all see one another).
    Returns the drafts' float32 logits ``[B, k - 1, V]`` (row ``j`` drafts position
    ``positions[:, 0] + 1 + j``) and the written cache."""
    x = embed(params, cfg, block_tokens(first, cfg))
    b, k = x.shape[:2]
    mask = TreeMask(cache.lengths, jnp.ones((b, k, k), bool), positions, positions)
    bc = cfg.block_config
    for i, p in enumerate(params["block"]["layers"]):
        q, kk, v = block_qkv(p, x, positions, bc, None)
        cache = cache.write(i, kk, v)
        x = block_finish(p, x, cache.attend(q, i, impl=attention_impl, tree=mask), bc)
    return block_logits(params, cfg, x[:, 1:]), cache


def train_block_hidden(params: dict, cfg: ModelConfig, taps: jax.Array, tokens: jax.Array,
                       anchors: jax.Array) -> jax.Array:
    """The drafter without a cache, for training and as the cached pass's oracle: ``A`` blocks
    per sequence at once. ``taps [B, T, n_taps * d]`` (the target's, over ``tokens [B, T]``),
    ``anchors int32 [B, A]``: block ``a`` starts with ``tokens[anchor]`` at position ``anchor``
    and reads the context entries of positions ``< anchor`` and its own block. Returns the
    blocks' last hidden ``[B, A, k, d]`` (``block_logits`` of rows ``1 ..`` predict tokens
    ``anchor + 1 ..``)."""
    b, t = tokens.shape
    n, k = anchors.shape[1], cfg.block_size
    pos_ctx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    pos_blk = (anchors[:, :, None] + jnp.arange(k, dtype=jnp.int32)).reshape(b, n * k)
    first = jnp.take_along_axis(tokens, anchors, axis=1)
    x = embed(params, cfg, block_tokens(first, cfg)).reshape(b, n * k, -1)
    ctx = context(params, cfg, taps)
    block_of = jnp.repeat(jnp.arange(n), k)  # [A k]: each block row's block
    sees_ctx = pos_ctx[:, None, :] < jnp.repeat(anchors, k, axis=1)[:, :, None]  # [B, A k, T]
    sees_blk = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (b, n * k, n * k))
    ok = jnp.concatenate([sees_ctx, sees_blk], axis=2)
    head_major = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731
    bc = cfg.block_config
    for p in params["block"]["layers"]:
        kc, vc = _context_kv(p, ctx, pos_ctx, cfg)
        q, kb, vb = block_qkv(p, x, pos_blk, bc, None)
        kk = head_major(jnp.concatenate([kc, kb], axis=1))
        vv = head_major(jnp.concatenate([vc, vb], axis=1))
        x = block_finish(p, x, attend_visible(q, kk, vv, ok), bc)
    return x.reshape(b, n, k, -1)
