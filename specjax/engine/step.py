"""One speculative step at one verify window: draft, verify, commit. Pure: ``state -> state``.

Per row (window ``w = depth + 1``): the row enters with ``u`` known tokens not yet in its
cache; the drafter proposes ``w - u`` drafts (or the count a step controller asked for); the
target runs once over the ``w``-token window at the row's own cache offset; verification
accepts ``a`` drafts and yields one more token; the production plan function (``plan_step``,
under the latched ``KvAdvance`` rule) says how far each row's caches advance and how many
tokens it re-feeds next step. Finished rows stay in the batch at static shape: they present
``committed = w`` (so they never set the cohort minimum) and do not advance.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.engine.config import EngineConfig
from specjax.engine.prefill import Chunk
from specjax.engine.state import EngineState
from specjax.plan import plan_step
from specjax.protocols import MixedForward, reachable_positions
from specjax.sampling import SAMPLE, TREE, position_keys, probs, sample
from specjax.tree import (
    TreeMask,
    accepted_sources,
    ancestors,
    branch_verdicts,
    first_child_verdicts,
    max_children,
    sibling_rank,
    tree_greedy_verify,
    tree_rejection_verify,
)
from specjax.verify import greedy_verify, rejection_verify

__all__ = ["StepVerdicts", "Verified", "commit", "commit_drafter", "emit", "step_window", "step_with_chunk", "verify"]


class StepVerdicts(NamedTuple):
    """What one step revealed per row (int32 ``[B]`` each): what a step controller learns from."""

    asked: jax.Array  # drafts the row was asked for (those it could not offer count as rejected)
    accepted: jax.Array  # drafts the target accepted
    token: jax.Array  # the target's own token after them
    # a chain's verdicts (a chain step's own; a tree step's main branch: ``first_child_verdicts``)
    chain_asked: jax.Array
    chain_accepted: jax.Array


class Verified(NamedTuple):
    """A verify forward's outcome, before the commit (per row; ``verify``)."""

    a: jax.Array  # int32 [B]: drafts accepted
    path: jax.Array  # int32 [B, d]: the accepted drafts in order (valid below ``a``)
    nxt: jax.Array  # int32 [B]: the target's token after them
    hidden: jax.Array  # [B, w, d_model]: the window's hidden, accepted path first (what the drafter commits)
    cache: Any  # the target's caches, written (and compacted: the accepted path in place)
    dstate: Any
    asked: jax.Array  # int32 [B]: draft depths the row was asked for
    proposed: jax.Array  # int32 [B]: drafts the row offered (a tree's nodes)
    chain: tuple[jax.Array, jax.Array] | None = None  # a tree's main branch: a chain's (asked, accepted) [B]
    branch: tuple[jax.Array, jax.Array] | None = None  # a tree's (tested, accepted) [B, d, K] (``branch_verdicts``)


def step_window(eng: EngineConfig, params: dict, st: EngineState, w: int,
                drafts: tuple[jax.Array, jax.Array] | None = None) -> tuple[EngineState, StepVerdicts]:
    """The step at verify window ``w`` (static, one of ``eng.windows``). ``drafts``: ``(asked,
    offered)`` int32 ``[B]``, the drafts each row was asked for and offers to verify (a step
    controller's choice); ``None``: every slot of the window. State arrays keep the engine's
    ``depth``; the step counts its verdicts (``seen_pos``) and nothing else a controller keeps.
    With ``eng.tree`` the widest window is a token tree (``_tree_verify``); every other is a chain
    (a step controller picks among them)."""
    st, verdicts, _ = step_with_chunk(eng, params, st, w, None, drafts)
    return st, verdicts


def step_with_chunk(eng: EngineConfig, params: dict, st: EngineState, w: int, chunk: Chunk | None,
                    drafts: tuple[jax.Array, jax.Array] | None = None
                    ) -> tuple[EngineState, StepVerdicts, tuple[jax.Array, Any] | None]:
    """``step_window`` with a prefill ``chunk`` of pending rows (``specjax.engine.prefill.Chunk``,
    rows outside ``st``) in the same target forward (``forward_mixed``: the weights are read
    once for the window and the chunk). Returns ``(st, verdicts, (hidden [R, c, d], cache))``,
    the chunk's half for ``chunk_commit``. ``st``'s paged pool ends with the chunk's K/V; a
    slot both write (a pending row's, which ``st`` holds done) takes the chunk's. ``drafts``:
    as ``step_window``'s (a step controller's counts). ``chunk=None``: ``step_window``."""
    v, out = verify(eng, params, st, w, drafts, chunk)
    st, verdicts = commit(eng, params, st, w, v)
    return st, verdicts, out


def verify(eng: EngineConfig, params: dict, st: EngineState, w: int,
           drafts: tuple[jax.Array, jax.Array] | None = None, chunk: Chunk | None = None) -> tuple[Verified, Any]:
    """A step up to its commit at window ``w``: draft, the target's forward, acceptance (the
    widest window with ``eng.tree``: a token tree's, ``_tree_verify``; else a chain's).
    Returns ``(Verified, chunk's half or None)``."""
    if eng.tree is not None and w == eng.window:
        return _tree_verify(eng, params, st, chunk)
    return _chain_verify(eng, params, st, w, drafts, chunk)


def _target_forward(eng: EngineConfig, params: dict, window: jax.Array, pos: jax.Array, cache: Any,
                    tree: TreeMask | None, chunk: Chunk | None) -> tuple[jax.Array, Any, tuple | None]:
    """The target's verify forward over ``window [B, w]`` at ``pos`` (``tree``: a token tree's
    mask), and ``chunk``'s tokens in the same forward where one rides along: ``(hidden, cache,
    (chunk hidden, chunk cache) or None)``. A model without ``forward_mixed`` runs the chunk
    after the window, over the pool the window left."""
    tp, impl = params["target"], eng.attention_impl
    extra = {} if tree is None else {"tree": tree}
    if chunk is None:
        return (*eng.target.forward_hidden(tp, window, pos, cache, attention_impl=impl, **extra), None)
    if isinstance(eng.target, MixedForward):
        (hidden, cache), out = eng.target.forward_mixed(
            tp, [(window, pos, cache, tree), (chunk.tokens, chunk.positions, chunk.cache, None)], attention_impl=impl)
        return hidden, cache, out
    hidden, cache = eng.target.forward_hidden(tp, window, pos, cache, attention_impl=impl, **extra)
    chunk_hidden, chunk_cache = eng.target.forward_hidden(tp, chunk.tokens, chunk.positions,
                                                          chunk.cache.on_pool_of(cache), attention_impl=impl)
    return hidden, cache.on_pool_of(chunk_cache), (chunk_hidden, chunk_cache)


def _chain_verify(eng: EngineConfig, params: dict, st: EngineState, w: int,
                  drafts: tuple[jax.Array, jax.Array] | None, chunk: Chunk | None = None) -> tuple[Verified, Any]:
    """Draft a chain and verify it: ``u`` known tokens, then ``w - u`` drafts (``chunk``: a
    prefill chunk in the same forward, ``step_with_chunk``)."""
    d = w - 1
    c = st.seq.shape[1]
    lengths, u = st.cache.lengths, st.u
    at_w = eng.at_window(w)

    # draft: the drafter's proposals, then each row's count
    proposals, draft_probs, dstate = eng.drafter.propose(at_w, params, st)
    proposals = proposals[:, :d]  # an MTP chain yields its first draft even at depth 0
    draft_probs = None if draft_probs is None else draft_probs[:, :d]
    asked, proposed = (w - u, w - u) if drafts is None else drafts

    # verify: u known tokens, then w - u drafts, at this row's own offset, in one target forward
    j = jnp.arange(w, dtype=jnp.int32)[None]
    pos = lengths[:, None] + j
    known_tok = jnp.take_along_axis(st.seq, jnp.clip(pos, 0, c - 1), axis=1)
    if d:
        draft_tok = jnp.take_along_axis(proposals, jnp.clip(j - u[:, None], 0, d - 1), axis=1)
        window = jnp.where(j < u[:, None], known_tok, draft_tok)
    else:
        window = known_tok
    hidden, cache, out = _target_forward(eng, params, window, reachable_positions(pos, st.max_len),
                                         st.cache.reserve(w, st.live), None, chunk)
    logits = eng.target.head(params["target"], hidden)  # [B, w, V]
    if eng.greedy:
        a, nxt = greedy_verify(logits, proposals, u, proposed)
    else:
        a, nxt = rejection_verify(logits, proposals, draft_probs, u, lengths, st.seeds, st.sampling, proposed)
    return Verified(a, proposals, nxt, hidden, cache, dstate, asked, proposed), out


def _tree_verify(eng: EngineConfig, params: dict, st: EngineState, chunk: Chunk | None = None
                 ) -> tuple[Verified, Any]:
    """Draft a token tree (``eng.tree``) and verify it in one target forward.

    Window node ``j < u`` is a known token (a chain); the drafter's tree (a preset or a
    dynamic one: its parents are data) hangs below node ``u - 1``, in topological order, cut to
    the ``w - u`` nodes left (a prefix of a topological order is a tree). Node ``j`` is written
    at slot ``lengths + j`` and runs at its branch position; it attends to the committed prefix
    and its own ancestors (``TreeMask``).
    Verification walks the tree (greedy) or tests each node's children against the residual
    (``tree_rejection_verify``, lossless); the accepted path's K/V and hidden then move into
    slots ``u ..`` (``accepted_sources``), so the commit is a chain's."""
    w, depth = eng.window, eng.depth
    c = st.seq.shape[1]
    lengths, u = st.cache.lengths, st.u

    # [B, w - 1] tokens and [B, w] parents (node 0 the root, -1): the drafter's tree, topological
    tokens, tree_parents, dstate = eng.drafter.propose_tree(eng, params, st)
    j = jnp.arange(w, dtype=jnp.int32)[None]
    k = jnp.clip(j - u[:, None] + 1, 1, w - 1)  # the tree node a draft slot holds
    is_known = j < u[:, None]
    parents = jnp.where(is_known, j - 1, jnp.take_along_axis(tree_parents, k, axis=1) + u[:, None] - 1)
    anc = ancestors(parents)
    node_depth = jnp.sum(anc, axis=2).astype(jnp.int32) - 1
    pos = lengths[:, None] + node_depth
    known_tok = jnp.take_along_axis(st.seq, jnp.clip(lengths[:, None] + j, 0, c - 1), axis=1)
    window = jnp.where(is_known, known_tok, jnp.take_along_axis(tokens, k - 1, axis=1))

    mask = TreeMask(lengths, anc, pos, pos)
    hidden, cache, out = _target_forward(eng, params, window, reachable_positions(pos, st.max_len),
                                         st.cache.reserve(w, st.live), mask, chunk)
    logits = eng.target.head(params["target"], hidden)  # [B, w, V]
    if eng.greedy:
        a, path, nxt = tree_greedy_verify(logits, window, parents, u, max_depth=depth, anc=anc)
    else:
        # one uniform per node, keyed by its position and its rank among its siblings: the nodes a
        # walk tests have distinct keys, and a later step (which decides later positions) never
        # reuses one
        rank = sibling_rank(parents)
        keys = jax.vmap(jax.vmap(jax.random.fold_in))(position_keys(st.seeds, pos, TREE), rank)
        uniform = jax.vmap(jax.vmap(jax.random.uniform))(keys)
        a, path, resid = tree_rejection_verify(probs(logits, st.sampling), window, parents, u, uniform,
                                               max_depth=depth, max_children=max_children(eng.tree))
        nxt = sample(position_keys(st.seeds, (lengths + u + a)[:, None], SAMPLE)[:, 0], resid)
    src = accepted_sources(path, u, w)
    hidden = jnp.take_along_axis(hidden, src[:, :, None], axis=1)
    if eng.drafter.compacts:  # a drafter whose own caches hold the window (a draft model)
        dstate = eng.drafter.compact_tree(dstate, src)
    path_tok = jnp.take_along_axis(window, jnp.clip(path, 0, w - 1), axis=1)
    asked = jnp.max(jnp.where(is_known, 0, node_depth - u[:, None] + 1), axis=1)  # the drafts' deepest level
    chain = first_child_verdicts(parents, u, path, a, anc)
    branch = branch_verdicts(parents, u, path, a, eng.branches)
    return Verified(a, path_tok, nxt, hidden, cache.compact(src), dstate, asked, w - u, chain, branch), out


def commit(eng: EngineConfig, params: dict, st: EngineState, w: int, v: Verified
            ) -> tuple[EngineState, StepVerdicts]:
    """Emit the accepted drafts and the next token, advance by the rule's plan, commit the
    drafter, count."""
    new, n_new, advance = emit(eng, st, w, v)
    return _count(eng, st, new.replace(dstate=commit_drafter(eng, params, st, w, v, new, advance)), v, n_new)


def commit_drafter(eng: EngineConfig, params: dict, st: EngineState, w: int, v: Verified, new: EngineState,
                    advance: jax.Array) -> Any:
    """The drafter's commit of the step from ``st`` (``new``, ``advance``: what ``emit`` made)."""
    return eng.drafter.commit(eng.at_window(w), params, new, v.dstate, v.hidden, st.cache.lengths, st.u,
                              jnp.where(st.done, 0, v.a), advance)


def emit(eng: EngineConfig, st: EngineState, w: int, v: Verified) -> tuple[EngineState, jax.Array, jax.Array]:
    """Emit ``drafts[:a] + nxt`` per row (cut at EOS and the token budget) and advance the caches
    by the rule's plan: ``(state, n_new [B], advance [B])``; the drafter's state is not yet committed."""
    b, c = st.seq.shape
    u, active = st.u, ~st.done
    a, nxt, d = v.a, v.nxt, v.path.shape[1]

    # emit drafts[:a] + nxt at positions known .. known + a, cut at EOS / the token budget
    k = jnp.arange(d + 1, dtype=jnp.int32)[None]
    padded = jnp.concatenate([v.path, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tok = jnp.where(k < a[:, None], padded, nxt[:, None])
    valid = (k <= a[:, None]) & (k < (st.max_len - st.known)[:, None]) & active[:, None]
    is_eos = valid & jnp.any(new_tok[:, :, None] == st.eos[:, None, :], axis=2)
    first_eos = jnp.min(jnp.where(is_eos, k, d + 1), axis=1)
    valid &= k <= first_eos[:, None]
    n_new = jnp.sum(valid, axis=1).astype(jnp.int32)
    dest = jnp.where(valid, st.known[:, None] + k, c)  # explicit out-of-range: dropped
    seq = st.seq.at[jnp.arange(b)[:, None], dest].set(new_tok, mode="drop")
    known = st.known + n_new
    done = st.done | (first_eos <= d) | (known >= st.max_len)

    # commit through the production plan function; finished rows neither set the min nor move
    plan = plan_step(u, jnp.where(active, a, w - u), w, eng.kv_rule)
    advance = jnp.where(active, plan.advance, 0)
    st = st.replace(seq=seq, known=known, u=jnp.where(active, plan.next_uncached, u),
                    cache=v.cache.advance(advance), done=done)
    return st, n_new, advance


def _count(eng: EngineConfig, old: EngineState, st: EngineState, v: Verified, n_new: jax.Array
           ) -> tuple[EngineState, StepVerdicts]:
    """The row's counters after a step (``old``: the state it began from): a verdict at draft
    position k is an acceptance or the first rejection."""
    dmax, b = eng.depth, st.seq.shape[0]
    a, active = v.a, ~old.done
    act = active.astype(jnp.int32)
    kd = jnp.arange(dmax, dtype=jnp.int32)[None]
    asked, proposed = v.asked, v.proposed
    verdict = kd < jnp.minimum(a + 1, asked)[:, None]
    out = st.replace(
        steps=old.steps + act,
        emitted=old.emitted + n_new,
        accepted=old.accepted + jnp.minimum(a, n_new) * act,  # drafts emitted: none cut by EOS/budget
        proposed=old.proposed + proposed * act,
        acc_pos=old.acc_pos + ((kd < a[:, None]) & active[:, None]).astype(jnp.int32),
        prop_pos=old.prop_pos + ((kd < asked[:, None]) & active[:, None]).astype(jnp.int32),
        seen_pos=old.seen_pos + (verdict & active[:, None]).astype(jnp.int32),
        trace=old.trace.at[jnp.arange(b), jnp.where(active, old.steps, eng.max_steps)].set(a, mode="drop"),
        i=old.i + 1,
    )
    if v.branch is not None:  # a tree step: what each level's children revealed
        on = active[:, None, None].astype(jnp.int32)
        out = out.replace(branch_tested=old.branch_tested + v.branch[0] * on,
                          branch_accepted=old.branch_accepted + v.branch[1] * on)
    chain = (asked, a) if v.chain is None else v.chain  # a chain step's verdicts are its own
    return out, StepVerdicts(asked, a, v.nxt, *chain)
