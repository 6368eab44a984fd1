"""A Llama-family decoder with an optional DeepSeek-V3-style MTP module and an optional block
drafter (``specjax.model.block``), in plain JAX.

Read top to bottom: params -> the forward over a per-row KV cache -> the plain full-prefix
forward -> MTP -> the engine's view. One block's pieces (RMSNorm, q/k/v and RoPE, attention
output and MLP, the head) are ``specjax.model.layers``.

Params are a plain pytree (dicts of arrays); ``Model`` pairs them with a static
``ModelConfig``. Shapes: tokens/positions ``[B, t]``, hidden ``[B, t, d_model]``,
q ``[B, t, n_heads, head_dim]``, k/v ``[B, t, n_kv_heads, head_dim]``.

``fuse_params``/``unfuse_params`` convert every block to and from the separate tensors that
bundles and Hugging Face checkpoints store.

Attention goes through the caches (``cache.attend(..., impl=attention_impl)``): the
XLA live-range path or the Pallas kernels; the uncached forward uses the same core
(``specjax.attention``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass, static_field
from specjax.attention import TreeMask
from specjax.cache import DenseKVCache, PagedKVCache
from specjax.cache.base import is_stacked
from specjax.cache.compressed import compressed_attention
from specjax.cache.model_cache import ModelCache
from specjax.model import block
from specjax.model.config import ModelConfig
from specjax.model.kv_cache import init_cache
from specjax.model.layers import (
    block_finish,
    block_params,
    block_qkv,
    cache_attention,
    causal_attention,
    embed,
    head,
    rms_norm,
)
from specjax.model.layout import (
    LAYER_LOOPS,
    fuse_params,
    layer_loop,
    layer_params,
    unfuse_params,
    with_layer_loop,
)
from specjax.model.mtp import (
    init_mtp_params,
    mtp_attention_input,
    mtp_forward,
    mtp_hidden,
    mtp_input,
    mtp_logits,
    mtp_source,
)
from specjax.sharding import per_shard

__all__ = [
    "LAYER_LOOPS", "LlamaDecoder", "Model", "ModelCache", "embed", "forward", "forward_hidden", "forward_mixed",
    "fuse_params", "head", "init_cache", "init_model", "init_mtp_params", "layer_loop", "layer_params", "logits",
    "mtp_attention_input", "mtp_forward", "mtp_hidden", "mtp_input", "mtp_logits", "mtp_source", "rms_norm",
    "unfuse_params", "with_draft_vocab", "with_layer_loop",
]


# ----------------------------------------------------------------------------- params


@pytree_dataclass
class Model:
    """``params``: ``embed``, ``final_norm`` (``lm_head``), ``layers`` and optionally ``mtp``.

    ``layers`` comes in two layouts, which pick the layer loop (``layer_loop``): a list of
    per-layer dicts (``"unrolled"``: a Python loop, every layer compiled; what loaders give)
    or one dict of ``[L, ...]`` stacks (``"scan"``: one ``lax.scan``, compile time flat in
    depth). ``with_layer_loop`` converts."""

    params: dict
    config: ModelConfig = static_field()

    def __repr__(self) -> str:
        """One line (the params are summed up, never printed: a model holds millions of numbers)."""
        c, leaves = self.config, jax.tree.leaves(self.params)
        count = sum(int(np.prod(x.shape)) for x in leaves)
        dtypes = "/".join(sorted({str(x.dtype) for x in leaves}))
        mtp = f", MTP depth {c.mtp_depth}" if c.mtp_depth else ""
        return (f"Model({c.n_layers} layers, d_model {c.d_model}, {c.n_heads}/{c.n_kv_heads} heads, vocab "
                f"{c.vocab_size}, context {c.max_seq_len}{mtp}; {count / 1e6:.2f}M params {dtypes}, "
                f"{layer_loop(self.params)})")

    @property
    def decoder(self) -> LlamaDecoder:
        """The engine's view of this model (``specjax.protocols``): static, hashable."""
        return LlamaDecoder(self.config, layer_loop(self.params), jnp.dtype(self.params["embed"].dtype))


def init_model(config: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Model:
    """Random-initialised ``Model`` (normal(0, 0.02) weights, unit norms)."""
    key = jax.random.key(seed)
    k_emb, k_head, k_layers, k_mtp = jax.random.split(key, 4)
    params: dict = {
        "embed": (jax.random.normal(k_emb, (config.vocab_size, config.d_model)) * 0.02).astype(dtype),
        "layers": [block_params(k, config, dtype) for k in jax.random.split(k_layers, config.n_layers)],
        "final_norm": jnp.full((config.d_model,), 1.0 - config.norm_offset, dtype),
    }
    if not config.tie_embeddings:
        params["lm_head"] = (jax.random.normal(k_head, (config.d_model, config.vocab_size)) * 0.02).astype(dtype)
    if config.mtp_depth > 0:
        params["mtp"] = init_mtp_params(k_mtp, config, dtype)
    if config.block_size:
        params["block"] = block.init_block_params(jax.random.fold_in(key, 1), config, dtype)
    return Model(params, config)


def with_draft_vocab(model: Model, ids) -> Model:
    """``model`` whose MTP module drafts over the target tokens ``ids [N]`` (distinct, in range):
    ``mtp.draft_ids`` and a ``draft_head`` of the target head's columns at ``ids`` (a start a
    ``train-mtp --draft-vocab`` run trains further). The model must have an MTP module."""
    cfg = model.config
    if "mtp" not in model.params:
        raise ValueError("the model has no MTP module (attach_mtp / load_mtp first)")
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size == 0 or ids.size >= cfg.vocab_size or len(np.unique(ids)) != ids.size or ids.min() < 0 \
            or ids.max() >= cfg.vocab_size:
        raise ValueError(f"draft vocabulary of {ids.size} ids is invalid: distinct ids in [0, {cfg.vocab_size}), "
                         f"fewer than the vocabulary")
    p = model.params
    w = p["embed"].T if cfg.tie_embeddings else p["lm_head"]  # [d, V]
    mtp = {k: v for k, v in p["mtp"].items() if k not in ("draft_ids", "draft_head")}
    mtp.update(draft_ids=jnp.asarray(ids, jnp.int32), draft_head=jnp.asarray(w)[:, jnp.asarray(ids)])
    return Model({**p, "mtp": mtp}, dataclasses.replace(cfg, mtp_draft_vocab=int(ids.size)))


# ----------------------------------------------------------------------------- forward




def _layer_period(kinds: list[str]) -> int:
    """The smallest ``P`` with every layer of the same kind (global, local, compressed) as layer
    ``i % P``: the scan's body runs one period of ``P`` layers (1 for a uniform stack, Gemma 3's
    6, ``global_every`` for interleaved models)."""
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def _run_layers(config: ModelConfig, x: jax.Array, carry, layer_fn, loop: str, taps: tuple[int, ...] = ()):
    """Run every layer: ``layer_fn(x, carry, kind_layer, layer, kind_index) -> (x, carry)``.

    ``kind_layer`` is a static layer index of the same kind (it picks the kind and the RoPE);
    ``layer`` (the params' index) and ``kind_index`` (the layer's index among its kind's cache
    layers) are traced inside the scan. With ``loop="scan"`` whole periods run as one
    ``lax.scan`` (compile time does not grow with depth); the remainder, models with fewer
    than two periods and ``loop="unrolled"`` run a Python loop with static indices.
    ``taps`` (``layer_fn`` from ``_tapping``): the returned ``x`` is the last layer's output and
    then each tapped layer's, on the last axis."""
    if taps:
        x, (carry, kept) = _run_layers(config, x, (carry, tuple(jnp.zeros_like(x) for _ in taps)), layer_fn, loop)
        return jnp.concatenate([x, *kept], axis=-1), carry
    kinds = [config.layer_kind(i) for i in range(config.n_layers)]
    period = _layer_period(kinds)
    per = {k: kinds[:period].count(k) for k in set(kinds)}  # layers of each kind in one period
    offset = [kinds[:j].count(kinds[j]) for j in range(period)]  # index among its kind within the period
    n_scan = config.n_layers // period if loop == "scan" and config.n_layers >= 2 * period else 0

    def body(state, p):
        x, carry = state
        for j in range(period):
            x, carry = layer_fn(x, carry, j, p * period + j, p * per[kinds[j]] + offset[j])
        return (x, carry), None

    if n_scan:
        (x, carry), _ = jax.lax.scan(body, (x, carry), jnp.arange(n_scan, dtype=jnp.int32))
    for i in range(n_scan * period, config.n_layers):
        x, carry = layer_fn(x, carry, i, i, kinds[:i].count(kinds[i]))
    return x, carry


def forward_hidden(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: ModelCache,
    *,
    attention_impl: str = "xla",
    tree: TreeMask | None = None,
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, ModelCache]:
    """Run ``tokens [B, t]`` at RoPE ``positions [B, t]``, writing their K/V at each row's
    own ``cache.lengths`` (the lengths do not move: commit with ``cache.apply_plan``).
    ``tree``: the ``t`` tokens are the nodes of a token tree (``specjax.tree``): each attends
    to the committed prefix and its own branch (global and sliding-window layers).

    Query ``j`` of row ``b`` attends cache slots up to ``lengths[b] + j`` (and the window
    on local layers); everything else is masked per row. ``attention_impl``: ``"xla"`` or
    ``"pallas"`` (already resolved). Returns the last block's hidden state ``[B, t, d]``
    (before the final norm: what ``head`` and MTP consume) and the written cache.
    Stacked params (``with_layer_loop(model, "scan")``) run as a ``lax.scan`` carrying the
    caches, which must then be stacked too (``init_cache(..., stacked=True)``) and are written
    in place; listed params run a Python loop over per-layer cache buffers.
    ``taps``: the outputs of these layers come back too, after the last block's hidden state on
    the last axis: ``[B, t, d * (1 + len(taps))]`` (what a block drafter reads: ``with_taps``).
    """
    return forward_mixed(params, config, [(tokens, positions, cache, tree)], attention_impl=attention_impl,
                         taps=taps)[0]


def forward_mixed(
    params: dict,
    config: ModelConfig,
    groups: list[tuple[jax.Array, jax.Array, ModelCache, TreeMask | None]],
    *,
    attention_impl: str = "xla",
    taps: tuple[int, ...] = (),
) -> list[tuple[jax.Array, ModelCache]]:
    """``forward_hidden`` of several groups of rows ``(tokens [B_g, t_g], positions [B_g, t_g],
    cache, tree)`` of different widths in one forward (a mixed batch: a step's decode windows
    and a prefill chunk): each layer's matmuls run once over every group's tokens, so the
    weights are read once, and attention runs per group over its own cache.

    The groups' paged global caches are views of one pool (their rows' pages are disjoint).
    Each layer writes them in group order, each group over the pool as the group before left
    it, so a later group's write wins where two overlap (a pending row's slots, which a decode
    step's window also writes, take its prefill chunk); then every group attends over the
    final pool (reads after the last write: XLA updates the pool in place, where a read
    between two writes would make it copy the layer's pool). A group's rows read only their
    own pages, so they see what they would alone. Every group's cache comes back on the final
    pool. Returns ``[(hidden [B_g, t_g, d], cache)]`` per group (``taps``: as ``forward_hidden``'s)."""
    loop = layer_loop(params)
    for _, _, cache, _ in groups:
        if any(is_stacked(c.k) != (loop == "scan") for c in cache.parts):
            raise ValueError(f"the params' layers are laid out for layer_loop={loop!r} but the cache is "
                             f"{'not ' if loop == 'scan' else ''}stacked: init_cache(..., stacked={loop == 'scan'})")
    shapes = [tokens.shape for tokens, *_ in groups]
    positions = _join([pos for _, pos, _, _ in groups])

    def layer_fn(x, caches, kind_layer, layer, idx):
        p = layer_params(params, layer)
        q, k, v = (_split(a, shapes) for a in block_qkv(p, x, positions, config, kind_layer))
        out, attn = [], []
        for g in range(len(groups)):  # every group's write first: a pool's reads all come after its last write
            glob, loc, mem = caches[g]
            if g and isinstance(glob, PagedKVCache) and isinstance(out[-1][0], PagedKVCache):
                glob = glob.on_pool_of(out[-1][0])  # the pool as the group before left it
            glob, loc, mem, a = _layer_write(config, (glob, loc, mem), q[g], k[g], v[g], kind_layer, idx,
                                             groups[g][3])
            out.append((glob, loc, mem))
            attn.append(a)
        last = out[-1][0]
        if isinstance(last, PagedKVCache):  # every group on the final pool
            out = [(g.on_pool_of(last) if isinstance(g, PagedKVCache) else g, loc, mem)
                   for g, loc, mem in out]
        attn = [_layer_attend(config, out[g], q[g], kind_layer, idx, attention_impl, groups[g][3]) if a is None else a
                for g, a in enumerate(attn)]
        return block_finish(p, x, _join(attn), config), tuple(out)

    caches = tuple((cache.global_kv, cache.local_kv, cache.memory_kv) for _, _, cache, _ in groups)
    x = _join([embed(params, config, tokens) for tokens, *_ in groups])
    x, caches = _run_layers(config, x, caches, _tapping(layer_fn, taps), loop, taps)
    return [(h, ModelCache(*c)) for h, c in zip(_split(x, shapes), caches, strict=True)]


def _tapping(layer_fn, taps: tuple[int, ...]):
    """``layer_fn`` that also keeps the outputs of layers ``taps`` (``_run_layers`` carries them
    as ``(carry, kept)``; inside a scan the layer index is traced: a select per tap)."""
    if not taps:
        return layer_fn

    def fn(x, carry, kind_layer, layer, idx):
        inner, kept = carry
        x, inner = layer_fn(x, inner, kind_layer, layer, idx)
        if isinstance(layer, int):
            kept = tuple(x if layer == t else k for t, k in zip(taps, kept, strict=True))
        else:
            kept = tuple(jnp.where(layer == t, x, k) for t, k in zip(taps, kept, strict=True))
        return x, (inner, kept)

    return fn


def _layer_write(config: ModelConfig, caches: tuple, q, k, v, kind_layer: int, idx,
                 tree: TreeMask | None = None) -> tuple:
    """One group's K/V into the layer's cache (global, sliding-window or compressed):
    ``(glob, loc, mem, attn)``, ``attn`` already computed where the write and the attention are
    one operation (compressed layers, a prefill wider than the ring), else ``None``."""
    glob, loc, mem = caches
    attn = None
    if config.is_compressed(kind_layer):  # XLA path only (no Pallas kernel for this kind yet)
        mem, attn = mem.write_attend(idx, q, k, v, tree=tree)
    elif config.is_local(kind_layer) and k.shape[1] > loc.slack:  # a prefill wider than the ring: XLA
        loc, attn = loc.write_attend(idx, q, k, v)
    elif config.is_local(kind_layer):
        loc = loc.write(idx, k, v)
    else:
        glob = glob.write(idx, k, v)
    return glob, loc, mem, attn


def _layer_attend(config: ModelConfig, caches: tuple, q, kind_layer: int, idx, attention_impl: str,
                  tree: TreeMask | None) -> jax.Array:
    """One group's queries over the layer's written cache (global or sliding-window)."""
    glob, loc, _ = caches
    return per_shard(cache_attention(attention_impl), loc if config.is_local(kind_layer) else glob, q, idx, tree)


def _join(parts: list[jax.Array]) -> jax.Array:
    """Groups' ``[B_g, t_g, ...]`` as one row ``[1, sum B_g t_g, ...]`` (one group: as it is)."""
    if len(parts) == 1:
        return parts[0]
    return jnp.concatenate([a.reshape(1, -1, *a.shape[2:]) for a in parts], axis=1)


def _split(a: jax.Array, shapes: list[tuple[int, int]]) -> list[jax.Array]:
    """``_join``'s inverse: ``a [1, sum B_g t_g, ...]`` back into ``[B_g, t_g, ...]`` per group."""
    if len(shapes) == 1:
        return [a]
    cuts = np.cumsum([b * t for b, t in shapes])[:-1].tolist()
    return [part.reshape(b, t, *a.shape[2:]) for part, (b, t) in zip(jnp.split(a, cuts, axis=1), shapes, strict=True)]


def forward(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: ModelCache,
    *,
    attention_impl: str = "xla",
) -> tuple[jax.Array, jax.Array, ModelCache]:
    """``forward_hidden`` plus float32 logits ``[B, t, V]`` at every position:
    ``(logits, hidden, cache)``."""
    x, cache = forward_hidden(params, config, tokens, positions, cache, attention_impl=attention_impl)
    return head(params, config, x), x, cache


def hidden_states(model: Model, tokens: jax.Array, taps: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """Plain full-prefix forward without a cache: ``tokens [B, T]`` -> float32 logits
    ``[B, T, V]`` and the pre-norm hidden ``[B, T, d]`` (what MTP consumes; ``taps``: then the
    outputs of those layers, ``[B, T, d * (1 + len(taps))]``, as ``forward_hidden``'s)."""
    cfg, params = model.config, model.params
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def layer_fn(x, carry, kind_layer, layer, _):
        p = layer_params(params, layer)
        q, k, v = block_qkv(p, x, positions, cfg, kind_layer)
        if cfg.is_compressed(kind_layer):
            attn = compressed_attention(q, k, v, window=cfg.compress_window, block=cfg.compress_block)
        else:
            attn = causal_attention(q, k, v, cfg.sliding_window if cfg.is_local(kind_layer) else None)
        return block_finish(p, x, attn, cfg), carry

    x, _ = _run_layers(cfg, embed(params, cfg, tokens), (), _tapping(layer_fn, taps), layer_loop(params), taps)
    return head(params, cfg, x[..., : cfg.d_model]), x


def logits(model: Model, tokens: jax.Array) -> jax.Array:
    """Plain full-prefix forward without a cache: ``tokens [B, T] -> float32 [B, T, V]``."""
    return hidden_states(model, tokens)[0]


# ----------------------------------------------------------------------------- the model protocol


@dataclasses.dataclass(frozen=True)
class LlamaDecoder:
    """This model as the engine sees it (``specjax.protocols.Decoder``): the config, the
    params' layer layout (``"scan"`` needs stacked caches) and the dtype; every function is one
    of this module's, bound to them."""

    config: ModelConfig
    layer_loop: str = "unrolled"
    dtype: Any = jnp.float32
    # layers whose outputs the forward returns after the last one's (``with_taps``: the block drafter's input)
    taps: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def mtp_depth(self) -> int:
        return self.config.mtp_depth

    @property
    def hidden_size(self) -> int:
        """The width of ``forward_hidden``'s hidden: ``d_model``, times ``1 + len(taps)``."""
        return self.config.d_model * (1 + len(self.taps))

    def init_cache(self, batch: int, capacity: int, *, kind: str, slack: int, page_size: int,
                   num_pages: int | None) -> ModelCache:
        return init_cache(self.config, batch, capacity, kind=kind, slack=slack, page_size=page_size,
                          num_pages=num_pages, dtype=self.dtype, stacked=self.layer_loop == "scan")

    def forward_hidden(self, params, tokens, positions, cache, *, attention_impl="xla", tree=None):
        return forward_hidden(params, self.config, tokens, positions, cache, attention_impl=attention_impl, tree=tree,
                              taps=self.taps)

    def forward_mixed(self, params, groups, *, attention_impl="xla"):
        """Groups of rows of different widths in one forward (``forward_mixed``)."""
        return forward_mixed(params, self.config, groups, attention_impl=attention_impl, taps=self.taps)

    def head(self, params, hidden):
        return head(params, self.config, hidden[..., : self.config.d_model])

    # the block drafter (``specjax.protocols.BlockHead``)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def with_taps(self, taps: tuple[int, ...] | None = None) -> LlamaDecoder:
        """This decoder with its forward returning the outputs of layers ``taps`` too (default:
        the block drafter's; an EAGLE-3 head's are ``mtp_taps``)."""
        return dataclasses.replace(self, taps=self.config.block_taps if taps is None else tuple(taps))

    @property
    def mtp_taps(self) -> tuple[int, ...]:
        """The layers an EAGLE-3 MTP module reads (the engine runs the target ``with_taps`` them)."""
        return self.config.mtp_taps

    @property
    def mtp_width(self) -> int:
        """The width of the MTP module's own hidden (what a chain feeds back)."""
        return self.config.d_model

    def init_block_cache(self, batch: int, capacity: int) -> DenseKVCache:
        """The block drafter's per-row context cache (one layer per drafter layer)."""
        c, bc = self.config, self.config.block_config
        return DenseKVCache.create(c.block_layers, batch, capacity, bc.n_kv_heads, bc.head_dim, self.dtype)

    def block_context(self, params, hidden, positions, cache, count):
        """``block.write_context``: the context K/V of a tapped forward's ``hidden``."""
        return block.write_context(params, self.config, hidden, positions, cache, count)

    def block_draft(self, params, first, positions, cache, *, attention_impl="xla"):
        """``block.block_draft_logits``: one drafter pass, ``(logits [B, k - 1, V], cache)``."""
        return block.block_draft_logits(params, self.config, first, positions, cache, attention_impl=attention_impl)

    def mtp_head(self, params, hidden):
        """The MTP module's draft logits ``[..., N]`` and the int32 ``[N]`` target ids they cover,
        or the target's own logits ``[..., V]`` and ``None`` (no draft vocabulary)."""
        ids = params["mtp"]["draft_ids"] if self.config.mtp_draft_vocab else None
        return mtp_logits(params, self.config, hidden), ids

    def init_mtp_cache(self, batch: int, capacity: int) -> DenseKVCache:
        """The MTP block's own per-row cache (one layer)."""
        mc = self.config.mtp_config
        return DenseKVCache.create(1, batch, capacity, mc.n_kv_heads, mc.head_dim, self.dtype)

    def mtp_hidden(self, params, hidden, next_tokens, positions, cache, *, attention_impl="xla", tree=None):
        return mtp_hidden(params, self.config, hidden, next_tokens, positions, cache, attention_impl=attention_impl,
                          tree=tree)

    def mtp_hidden_at(self, params, hidden, next_tokens, positions, cache, at, *, attention_impl="xla"):
        """``mtp_hidden``'s output at slot ``at [B]`` of each row, ``[B, d]``: attention and MLP
        for that slot only (the cache gets every position's K/V). ``hidden`` is the target's (a
        commit's or a prefill's), read as the module reads it (``mtp_source``)."""
        hidden = mtp_source(params, self.config, hidden)
        return mtp_hidden(params, self.config, hidden, next_tokens, positions, cache, at=at,
                          attention_impl=attention_impl)
