"""Tree construction shared by the drafters: EAGLE-2's beam expansion (``beam_tree``), the tree a
set of kept candidates forms (``kept_tree``), beam slot positions and top-k candidates."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.tree import DynamicTree


def beam_tree(tree: DynamicTree, depth: int, root: tuple[jax.Array, jax.Array], level, carry):
    """EAGLE-2's expansion (``DynamicTree(nodes, K)``) to ``depth``, per row as data; the drafter
    supplies ``root = (tokens, logp) [B, K]`` (the root's ``K`` most probable children) and
    ``level(lvl, beam_tok [B, K], beam_par [B, K], rows [B, K, S], carry) -> (kid_tok, kid_logp
    [B, K * K], carry)``: the children of each beam node at depth ``lvl`` (node-major), where
    ``beam_par`` indexes each one's parent in the level above's beam (0 at depth 1: the root)
    and ``rows`` marks its scratch ancestors (itself included) among the ``S = (depth - 1) * K``
    beam slots (beam node ``i`` of depth ``lvl`` in slot ``(lvl - 1) * K + i``).

    Each depth the ``K`` candidates of highest cumulative log-probability (summed along the
    branch) form the beam and are expanded; the ``nodes`` candidates of highest cumulative
    log-probability are verified. A child never scores above its parent, so they form a tree
    (ties keep the earlier candidate: the parent); candidates are numbered level by level, so
    the kept ones, in candidate order, are topological. Returns ``(tokens [B, N], parents
    [B, N + 1], carry)``, parents in tree numbering (node 0 the root)."""
    k = tree.topk
    tok, logp = root
    b = tok.shape[0]
    scratch = max((depth - 1) * k, 1)
    cand_tok, cand_par, cand_cum = [tok], [jnp.full((b, k), -1, jnp.int32)], [logp]
    beam_tok, beam_cum = tok, logp
    beam_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # the beam's candidate ids
    beam_par = jnp.zeros((b, k), jnp.int32)
    rows_above = jnp.zeros((b, 1, scratch), bool)  # the level above's scratch ancestors (the root: none)
    offset = k  # candidate id of the next level's first
    for lvl in range(1, depth):
        me = (lvl - 1) * k + jnp.arange(k, dtype=jnp.int32)  # this beam's scratch slots
        rows = jnp.take_along_axis(rows_above, beam_par[:, :, None], axis=1)
        rows = rows | (jnp.arange(scratch)[None, None, :] == me[None, :, None])
        kid_tok, kid_logp, carry = level(lvl, beam_tok, beam_par, rows, carry)
        kid_cum = jnp.repeat(beam_cum, k, axis=1) + kid_logp
        cand_tok.append(kid_tok)
        cand_par.append(jnp.repeat(beam_cand, k, axis=1))
        cand_cum.append(kid_cum)
        beam_cum, best = jax.lax.top_k(kid_cum, k)  # the next beam, among the K * K
        beam_tok = jnp.take_along_axis(kid_tok, best, axis=1)
        beam_cand, beam_par = offset + best, best // k
        rows_above = rows
        offset += k * k
    cand_tok, cand_par, cand_cum = (jnp.concatenate(x, axis=1) for x in (cand_tok, cand_par, cand_cum))
    keep = jnp.sort(jax.lax.top_k(cand_cum, tree.size(depth))[1], axis=1)  # [B, N] candidate ids, topological
    return (*kept_tree(cand_tok, cand_par, keep), carry)


def kept_tree(cand_tok: jax.Array, cand_par: jax.Array, sel: jax.Array,
              attached: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The tree of the candidates ``sel [B, N]`` (ids, topological) keeps: ``(tokens [B, N],
    parents [B, N + 1])`` in tree numbering (node 0 the root, ``-1`` its parent), from each
    candidate's token ``cand_tok [B, C]`` and parent candidate ``cand_par [B, C]`` (``-1``: the
    root). A kept node whose parent is not kept, or that is not ``attached [B, N]``, hangs
    below the root (still a draft)."""
    b, n = sel.shape
    node_of = jnp.zeros_like(cand_par).at[jnp.arange(b)[:, None], sel].set(jnp.arange(1, n + 1, dtype=jnp.int32)[None])
    par = jnp.take_along_axis(cand_par, sel, axis=1)  # each kept candidate's parent candidate (-1: root)
    root = par < 0 if attached is None else (par < 0) | ~attached
    par_node = jnp.where(root, 0, jnp.take_along_axis(node_of, jnp.maximum(par, 0), axis=1))
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par_node], axis=1)
    return jnp.take_along_axis(cand_tok, sel, axis=1), parents


def beam_positions(known: jax.Array, depth: int, k: int) -> jax.Array:
    """int32 ``[B, S]``: the position of each beam slot (``beam_tree``): depth ``lvl`` runs at
    ``known + lvl - 1`` (the root, the last known token, at ``known - 1``)."""
    scratch = max((depth - 1) * k, 1)
    return known[:, None] + jnp.repeat(jnp.arange(scratch // k + 1, dtype=jnp.int32), k)[None, :scratch]



def top_logits(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The top ``k`` tokens of logits ``[B, n, V]`` and their log-probabilities (temperature 1):
    int32 and float32 ``[B, n * k]``, node-major (node 0's children first, most probable first)."""
    logp, top = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
    return top.astype(jnp.int32).reshape(top.shape[0], -1), logp.reshape(logp.shape[0], -1)
