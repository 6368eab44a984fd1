"""The training losses: next-token cross-entropy for the target and draft model, the MTP
module's chained loss (each pass seeing the MTP cache as drafting does:
``mtp_chain_logits``), and the block drafter's loss per block position (``block_loss``).
``make_loss(stage, ...)`` picks a stage's; each is ``(trainable, frozen, windows) -> (loss,
metrics)``, jit-friendly."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax.attention import attend_visible
from specjax.model import Model, ModelConfig, logits
from specjax.model.block import block_logits, train_block_hidden
from specjax.model.layers import block_finish, project_qkv
from specjax.model.llama import hidden_states, mtp_attention_input, mtp_logits, mtp_source

__all__ = ["ANCHOR_STRIDE", "FROZEN_IDS", "anchors_for", "block_loss", "cross_entropy", "draft_labels", "make_loss",
           "merge_params", "mtp_chain_logits", "split_params"]

FROZEN_IDS = "mtp_draft_ids"  # where split_params keeps a draft vocabulary's ids among the frozen params


def cross_entropy(logits: jax.Array, labels: jax.Array, bytes_only: bool, valid: jax.Array | None = None,
        count_labels: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed cross-entropy (nats), correct count and count over the labels that count: byte
    labels (``< 256``, not BOS/EOS) for the byte-level bundle, every label for token models.
    ``valid``: labels that can be hit at all (a draft vocabulary's; the others count as misses
    and stay out of the loss); ``count_labels``: the labels the count is taken over (default
    ``labels``)."""
    over = labels if count_labels is None else count_labels
    mask = over < 256 if bytes_only else over >= 0
    lp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(lp, labels[..., None], axis=-1)[..., 0]
    hit = jnp.argmax(logits, axis=-1) == labels
    can = mask if valid is None else mask & valid
    return jnp.sum(nll * can), jnp.sum(hit & can), jnp.sum(mask)


def _chain_attention(q, k1, v1, extra_k: list, extra_v: list) -> jax.Array:
    """Query row ``i`` sees pass-1 keys ``j <= i`` plus the chain's own keys at row ``i``
    (the MTP cache during a chained draft). ``q [B, T, H, D]``, keys ``[B, T, Hkv, D]``.
    The same attention core as inference: the chain keys are appended after the pass-1
    keys and the visibility mask is causal on the first block, the diagonal on the rest."""
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    eye = jnp.eye(t, dtype=bool)
    ok = jnp.concatenate([causal] + [eye] * len(extra_k), axis=-1)[None]  # [1, T, T * (1 + n)]
    k = jnp.concatenate([k1, *extra_k], axis=1).transpose(0, 2, 1, 3)  # head-major [B, Hkv, T', D]
    v = jnp.concatenate([v1, *extra_v], axis=1).transpose(0, 2, 1, 3)
    return attend_visible(q, k, v, ok)


def mtp_chain_logits(params: dict, config: ModelConfig, hidden: jax.Array, tokens: jax.Array, depth: int):
    """Teacher-forced MTP chain as the drafter runs it: pass ``k`` (1-based) at row ``i``
    takes (hidden, token ``t_{i+k}``) at position ``i + k - 1`` and predicts ``t_{i+k+1}``;
    pass 1's hidden is the target's (as the module reads it: ``mtp_source``), pass ``k > 1``'s
    is pass ``k - 1``'s output. ``hidden [B, T, d]`` (rows ``0..T-1``), ``tokens [B, T + depth]``.
    Returns ``depth`` logits ``[B, T, V]``."""
    m, mc = params["mtp"], config.mtp_config
    b, t, _ = hidden.shape
    rows = jnp.arange(t, dtype=jnp.int32)[None]
    h, out, ks, vs = hidden, [], [], []
    k1 = v1 = None
    for k in range(1, depth + 1):
        h_in, x = mtp_attention_input(params, config, h, tokens[:, k : k + t])
        q, kk, vv = project_qkv(m["block"], h_in, jnp.broadcast_to(rows + k - 1, (b, t)), mc, None)
        if k == 1:
            k1, v1 = kk, vv
            attn = _chain_attention(q, k1, v1, [], [])
        else:
            ks.append(kk)
            vs.append(vv)
            attn = _chain_attention(q, k1, v1, ks, vs)
        h = block_finish(m["block"], x, attn, mc)
        out.append(mtp_logits(params, config, h))  # over the draft vocabulary, if the module has one
    return out


def draft_labels(params: dict, config: ModelConfig, labels: jax.Array) -> jax.Array:
    """Target-token ``labels`` as indices into the MTP module's draft vocabulary (-1 outside it)."""
    ids = params["mtp"]["draft_ids"]
    index = jnp.full((config.vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    return jnp.where(labels >= 0, index[jnp.clip(labels, 0, config.vocab_size - 1)], -1)


ANCHOR_STRIDE = 16  # the block stage: one block per 16 positions of a window (its offset shifts them)


def anchors_for(windows: jax.Array, k: int, first: int) -> jax.Array:
    """int32 ``[B, A]``: the blocks' anchors of each window, every ``ANCHOR_STRIDE`` positions from
    ``first`` (the prompt's last token: every label is the target's), shifted by an offset
    the window's own first token picks (each step sees other anchors; the loss stays a pure
    function of the window)."""
    t = windows.shape[1] - 1
    n = max(1, (t - k - first) // ANCHOR_STRIDE)
    offset = windows[:, :1] % ANCHOR_STRIDE
    return jnp.minimum(first + offset + ANCHOR_STRIDE * jnp.arange(n, dtype=jnp.int32)[None], t - 2)


def block_loss(config: ModelConfig, first: int, bytes_only: bool):
    """``loss(params, windows [B, T + 1]) -> (mean CE over block positions, (nll [k-1], hits [k-1],
    count [k-1]))`` (sums per block position). The target's params are frozen by the caller
    (``run_stage``'s split); its hidden states are held constant here too."""
    k = config.block_size

    def loss(params, windows):
        tokens = windows[:, :-1]
        _, hidden = hidden_states(Model(params, config), tokens, taps=config.block_taps)
        taps = jax.lax.stop_gradient(hidden[..., config.d_model:])
        anchors = anchors_for(windows, k, first)
        x = train_block_hidden(params, config, taps, tokens, anchors)  # [B, A, k, d]
        logits = block_logits(params, config, x[:, :, 1:])  # [B, A, k - 1, V]
        at = anchors[:, :, None] + 1 + jnp.arange(k - 1)  # the label positions
        labels = jnp.take_along_axis(tokens, jnp.clip(at, 0, tokens.shape[1] - 1).reshape(at.shape[0], -1),
                                     axis=1).reshape(at.shape)
        ok = (at < tokens.shape[1]) & ((labels < 256) if bytes_only else (labels >= 0))
        lp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(lp, labels[..., None], axis=-1)[..., 0]
        hit = jnp.argmax(logits, axis=-1) == labels
        axes = (0, 1)
        nll_j, hit_j, cnt_j = (jnp.sum(jnp.where(ok, a, 0), axis=axes) for a in (nll, hit, ok))
        return jnp.mean(nll_j / jnp.maximum(cnt_j, 1)), (nll_j, hit_j, cnt_j)

    return loss


def make_loss(stage: str, config: ModelConfig, mtp_depth: int, bytes_only: bool = True, block_first: int = 0
              ) -> Callable:
    """``loss(trainable, frozen, windows [B, T + 1]) -> (loss, (nll_sum, hits, count))``
    (``block_first``: the block stage's first anchor, ``specjax.train_block.block_loss``)."""
    if stage == "block":
        inner = block_loss(config, block_first, bytes_only)
        return lambda trainable, frozen, windows: inner(merge_params(stage, trainable, frozen), windows)
    if stage in ("target", "draft"):

        def loss(trainable, frozen, windows):
            lg = logits(Model(trainable, config), windows[:, :-1])
            nll, hit, cnt = cross_entropy(lg, windows[:, 1:], bytes_only)
            return nll / jnp.maximum(cnt, 1), (nll, hit, cnt)

        return loss

    def mtp_loss(trainable, frozen, windows):
        params = merge_params("mtp", trainable, frozen)
        tokens = windows[:, :-1]
        t = tokens.shape[1] - mtp_depth
        _, hidden = hidden_states(Model(params, config), tokens, taps=config.mtp_taps)
        hidden = jax.lax.stop_gradient(hidden)[:, :t]  # the target stays frozen
        hidden = mtp_source(params, config, hidden)  # an EAGLE-3 head's fc over the taps is trained
        lgs = mtp_chain_logits(params, config, hidden, windows, mtp_depth)
        total, stats = 0.0, []
        for k, lg in enumerate(lgs, start=1):
            labels = windows[:, k + 1 : k + 1 + t]
            if config.mtp_draft_vocab:  # a label outside the draft vocabulary is a miss, out of the loss
                drafted = draft_labels(params, config, labels)
                nll, hit, cnt = cross_entropy(lg, jnp.maximum(drafted, 0), bytes_only, drafted >= 0,
                                              count_labels=labels)
            else:
                nll, hit, cnt = cross_entropy(lg, labels, bytes_only)
            total = total + nll / jnp.maximum(cnt, 1)
            stats.append((nll, hit, cnt))
        nll, hit, cnt = (jnp.stack(s) for s in zip(*stats, strict=True))
        return total / mtp_depth, (nll, hit, cnt)

    return mtp_loss


def split_params(stage: str, params: dict) -> tuple[dict, dict]:
    """(trainable, frozen) of a stage: the MTP stage trains only ``params['mtp']``, the block
    stage only ``params['block']``."""
    if stage == "block":
        return params["block"], {k: v for k, v in params.items() if k != "block"}
    if stage == "mtp":  # a draft vocabulary's ids are data, not weights: they stay frozen
        mtp = params["mtp"]
        frozen = {k: v for k, v in params.items() if k != "mtp"}
        if "draft_ids" in mtp:
            frozen[FROZEN_IDS] = mtp["draft_ids"]
        return {k: v for k, v in mtp.items() if k != "draft_ids"}, frozen
    return {k: v for k, v in params.items() if k != "mtp"}, {k: v for k, v in params.items() if k == "mtp"}


def merge_params(stage: str, trainable: dict, frozen: dict) -> dict:
    """``split_params``'s inverse: the stage's whole parameter tree."""
    if stage == "block":
        return dict(frozen, block=trainable)
    if stage != "mtp":
        return dict(trainable, **frozen)
    rest = {k: v for k, v in frozen.items() if k != FROZEN_IDS}
    return dict(rest, mtp=dict(trainable, draft_ids=frozen[FROZEN_IDS]) if FROZEN_IDS in frozen else trainable)
