"""Token trees for tree verification (#51, the data layer): a per-row tree of ``N`` window
nodes as data, its ancestor mask, the attention visibility it implies, greedy verification
by walking it, and where the accepted path's K/V come from when the row's window is compacted.

Layout, per row: the verify window holds ``N`` nodes in topological order (a node's parent
comes before it). ``parents [B, N]`` int32: ``parents[:, 0] = -1`` (the root), ``0 <=
parents[j] < j`` otherwise, and ``-1`` for an unused node past the row's tree (``valid``
says which are used). The first ``u`` nodes are the row's known, not yet cached tokens, a
chain (``parents[j] = j - 1``); the drafts hang below node ``u - 1``. A chain of ``d``
drafts is the tree ``parents = [-1, 0, 1, ..., N - 2]``: every function here gives it
exactly what the chain engine computes (tested).

Node ``j`` is written at cache slot ``lengths + j`` (window order) and runs at position
``lengths + depth[j]`` (its RoPE position: its place on its own branch). It attends to the
row's committed prefix and to its own ancestors in the window (itself included), never to a
sibling's branch. Every shape is static; a row's tree shape is data (no recompile).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import TreeMask, tree_mask_visible

__all__ = ["DynamicTree", "Tree", "TreeMask", "accepted_sources", "ancestors", "branch_verdicts", "chain_parents",
           "earlier_siblings", "sibling_rank", "tree_spec",
           "depths", "first_child_verdicts", "max_children", "preset_depths", "preset_parents", "tree_greedy_verify",
           "tree_label", "tree_levels", "tree_positions", "tree_reach", "tree_rejection_verify", "tree_scratch",
           "tree_size", "tree_visible", "tree_window"]


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A per-row tree chosen each step by the drafter's own probabilities (EAGLE-2's expansion,
    Li et al. 2024): at every draft depth the ``topk`` most probable nodes so far (cumulative
    probability along the branch) are expanded by their ``topk`` most probable children; the
    ``nodes`` most probable of all candidates are verified. Its shape is data (no recompile)."""

    nodes: int  # draft nodes verified per row (the window is one more)
    topk: int  # children per expanded node, and nodes expanded per depth

    def candidates(self, depth: int) -> int:
        """Candidate nodes drafted to ``depth``: ``topk`` at depth 1, ``topk**2`` below."""
        return self.topk + (depth - 1) * self.topk**2

    def size(self, depth: int) -> int:
        """Draft nodes in the window: ``nodes``, or every candidate when there are fewer."""
        return min(self.nodes, self.candidates(depth))

    def __str__(self) -> str:
        return f"dynamic:{self.nodes},{self.topk}"


Tree = tuple[int, ...] | DynamicTree  # a preset (children per node at each draft depth) or a dynamic tree


def tree_label(tree: Tree) -> object:
    """How errors show a tree: a preset as the list it reads as, a dynamic tree as its spec."""
    return str(tree) if isinstance(tree, DynamicTree) else list(tree)


def tree_spec(tree: Tree) -> str:
    """A tree as ``tree=`` and ``--tree`` take it: ``"2x2x1"``, ``"dynamic:8,2"``."""
    return str(tree) if isinstance(tree, DynamicTree) else "x".join(str(k) for k in tree)


def tree_window(tree: Tree, depth: int) -> int:
    """The verify window of a tree drafted to ``depth``: its draft nodes and the root."""
    return (tree.size(depth) if isinstance(tree, DynamicTree) else tree_size(tree)) + 1


def tree_scratch(tree: Tree, depth: int) -> int:
    """Slots a drafter's expansion of the tree writes past the known tokens besides the window's
    (a dynamic tree's beams: ``(depth - 1) * K``; a preset drafts in its window's slots)."""
    return (depth - 1) * tree.topk if isinstance(tree, DynamicTree) else 0


def tree_reach(tree: Tree | None, depth: int) -> int:
    """Slots past a row's length a step writes, less one (what sizes its caches and pages): a
    chain's ``depth`` drafts, or a tree's nodes and its drafter's beams."""
    return depth if tree is None else tree_window(tree, depth) - 1 + tree_scratch(tree, depth)


def max_children(tree: Tree) -> int:
    """The most children any node of the tree can have (a bound the sampled walk loops over)."""
    return tree.topk if isinstance(tree, DynamicTree) else max(tree)


def chain_parents(batch: int, n: int) -> jax.Array:
    """int32 ``[B, N]``: the chain ``[-1, 0, 1, ..., N - 2]`` in every row."""
    return jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (batch, n))


def preset_parents(branching: tuple[int, ...]) -> np.ndarray:
    """A static tree (Medusa/SpecInfer style) below a root: ``branching[k]`` children for every
    node at draft depth ``k``, e.g. ``(2, 2, 1)``: 2 first drafts, 2 children each, 1 child each
    (1 + 2 + 4 + 4 = 11 nodes). int32 ``[N]``, breadth-first (topological). The first child of
    each node is its drafter's top candidate; ``(1, 1, 1)`` is the depth-3 chain."""
    if not branching or any(not isinstance(b, int | np.integer) or b < 1 for b in branching):
        raise ValueError(f"branching={branching!r} is invalid: a non-empty tuple of ints >= 1")
    parents, level = [-1], [0]
    for b in branching:
        nxt = []
        for p in level:
            for _ in range(b):
                nxt.append(len(parents))
                parents.append(p)
        level = nxt
    return np.asarray(parents, np.int32)


def preset_depths(branching: tuple[int, ...]) -> np.ndarray:
    """int32 ``[N]``: each preset node's draft depth (the root 0), ``preset_parents``' order."""
    return np.concatenate([[0]] + [[k + 1] * n for k, (_, n) in enumerate(tree_levels(branching))]).astype(np.int32)


def tree_levels(branching: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[(first, count), ...]``: the preset's nodes at draft depth ``1 .. len(branching)``
    (breadth-first indices, ``preset_parents``): depth ``k`` holds ``prod(branching[:k])``."""
    out, first, count = [], 1, 1
    for b in branching:
        count *= b
        out.append((first, count))
        first += count
    return out


def tree_size(branching: tuple[int, ...]) -> int:
    """Draft nodes of the preset (its root excluded): a verify window of ``tree_size + 1``."""
    first, count = tree_levels(branching)[-1]
    return first + count - 1


def ancestors(parents: jax.Array) -> jax.Array:
    """bool ``[B, N, N]``: ``anc[b, i, j]`` when node ``j`` is node ``i`` or one of its ancestors
    (``parents [B, N]``; an unused node, parent ``-1`` past the root, has only itself). Built by
    pointer doubling: ``ceil(log2 N)`` steps of ``[B, N]`` gathers, whatever the trees' shapes."""
    b, n = parents.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    anc = idx[None, :, None] == idx[None, None, :]  # itself
    anc = jnp.broadcast_to(anc, (b, n, n))
    hop = parents  # 2^k-th ancestor, -1 past the root
    reach = anc | ((hop[:, :, None] == idx[None, None, :]) & (hop[:, :, None] >= 0))
    for _ in range(max(int(np.ceil(np.log2(max(n, 2)))), 1)):
        # everything within 2^(k+1) hops: within 2^k of me, or within 2^k of my 2^k-th ancestor
        via = jnp.take_along_axis(reach, jnp.clip(hop, 0, n - 1)[:, :, None], axis=1)
        reach = reach | (via & (hop >= 0)[:, :, None])
        hop = jnp.where(hop >= 0, jnp.take_along_axis(hop, jnp.clip(hop, 0, n - 1), axis=1), -1)
    return reach


def earlier_siblings(parents: jax.Array) -> jax.Array:
    """bool ``[B, N, N]``: ``[b, j, i]`` when node ``i`` is an earlier sibling of node ``j`` (same
    parent, ``i < j``: window order is the drafter's rank order)."""
    return jnp.tril(parents[:, :, None] == parents[:, None, :], -1)


def sibling_rank(parents: jax.Array) -> jax.Array:
    """int32 ``[B, N]``: each node's rank among its siblings (0: its parent's first child)."""
    return jnp.sum(earlier_siblings(parents), axis=2).astype(jnp.int32)


def depths(parents: jax.Array) -> jax.Array:
    """int32 ``[B, N]``: each node's ancestors, itself excluded (the root 0; a chain ``0 .. N-1``)."""
    return jnp.sum(ancestors(parents), axis=2).astype(jnp.int32) - 1


def tree_positions(lengths: jax.Array, parents: jax.Array) -> jax.Array:
    """int32 ``[B, N]``: each node's position, ``lengths + depth`` (its place on its branch)."""
    return lengths[:, None] + depths(parents)


def tree_visible(q_pos: jax.Array, key_pos: jax.Array, lead_pad: jax.Array, lengths: jax.Array,
                 parents: jax.Array, window: int | None = None) -> jax.Array:
    """bool ``[B, N, T]``: may window node ``i`` of row ``b`` (at ``q_pos [B, N]``,
    ``tree_positions``) read cache slot ``s`` (holding ``key_pos [B, T]``, slot order). A
    committed slot (``s < lengths``) by the usual rule (``lead_pad``, causal, ``window``); a
    window slot ``lengths + j`` only when node ``j`` is ``i`` or an ancestor of ``i``."""
    b, t = key_pos.shape
    slot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    node_pos = tree_positions(lengths, parents)
    return tree_mask_visible(slot, key_pos, lead_pad, TreeMask(lengths, ancestors(parents), q_pos, node_pos), window)


def tree_greedy_verify(logits: jax.Array, tokens: jax.Array, parents: jax.Array, u: jax.Array,
                       valid: jax.Array | None = None, max_depth: int | None = None, anc: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy verification of a tree: from the last known node (``u - 1``), take the child whose
    token is the target's argmax, while there is one.

    ``logits [B, N, V]`` (node ``j``'s logits predict the token after it, on its branch),
    ``tokens [B, N]`` (each node's token), ``parents [B, N]``, ``u [B]`` known nodes (a chain
    prefix), ``valid [B, N]`` the nodes in use (default all), ``anc`` the trees' ``ancestors``
    (computed when not given). Among children with the same token the first in window order
    wins. Returns ``(a [B]`` accepted drafts, ``path [B, D]`` the accepted nodes in order
    (``-1`` past ``a``), ``bonus [B])``: the target's token after the last accepted node.
    ``D = max_depth`` (default ``N - 1``): the deepest draft a tree holds.

    No walk: a draft is accepted when it and every draft above it is the first child of its
    parent to match the target's token there, and it hangs below ``u - 1``; the accepted ones
    form one path (at most one such child per node), ordered by their depth."""
    b, n, _ = logits.shape
    d = n - 1 if max_depth is None else max_depth
    anc = ancestors(parents) if anc is None else anc
    tgt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
    valid = jnp.ones((b, n), bool) if valid is None else valid
    node = jnp.arange(n, dtype=jnp.int32)[None]
    drafts = valid & (node >= u[:, None])
    match = drafts & (parents >= 0) & (tokens == jnp.take_along_axis(tgt, jnp.maximum(parents, 0), axis=1))
    sibling = earlier_siblings(parents)
    first = match & ~jnp.any(sibling & match[:, None, :], axis=2)
    below_root = jnp.take_along_axis(anc, jnp.broadcast_to((u - 1)[:, None, None], (b, n, 1)), axis=2)[:, :, 0]
    good = drafts & below_root & jnp.all(~anc | (first | ~drafts)[:, None, :], axis=2)
    level = jnp.sum(anc & drafts[:, None, :], axis=2)  # drafts on the branch: 1 for the first drafts
    level = jnp.where(good, level, 0)
    a = jnp.minimum(jnp.max(level, axis=1), d).astype(jnp.int32)
    at = level[:, None, :] == jnp.arange(1, d + 1, dtype=jnp.int32)[None, :, None]  # [B, D, N]
    path = jnp.where(jnp.any(at, axis=2), jnp.argmax(at, axis=2), -1).astype(jnp.int32)
    cur = jnp.where(a > 0, jnp.take_along_axis(path, jnp.maximum(a - 1, 0)[:, None], axis=1)[:, 0], u - 1)
    bonus = jnp.take_along_axis(tgt, cur[:, None], axis=1)[:, 0]
    return a, path, bonus


def accepted_sources(path: jax.Array, u: jax.Array, n: int) -> jax.Array:
    """int32 ``[B, N]``: for each window slot ``k`` after compaction, the node whose K/V it
    takes: the known nodes stay (``k < u``), then the accepted path in order
    (``u + i <- path[i]``), and every other slot keeps its own node (masked out by the row's
    lengths after the advance; never zero-filled). A chain's accepted nodes are already in
    place: its sources are the identity."""
    b, d = path.shape
    k = jnp.arange(n, dtype=jnp.int32)[None]
    i = k - u[:, None]  # path index a slot takes
    from_path = jnp.take_along_axis(path, jnp.clip(i, 0, max(d - 1, 0)), axis=1) if d else jnp.full((b, n), -1)
    take = (i >= 0) & (i < d) & (from_path >= 0)
    return jnp.where(take, from_path, jnp.broadcast_to(k, (b, n))).astype(jnp.int32)


def first_child_verdicts(parents: jax.Array, u: jax.Array, path: jax.Array, a: jax.Array,
                         anc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What a chain of first children would have revealed (the tree's main branch: each draft
    the first child of its parent in window order, the drafter's top candidate):
    ``(asked [B]`` the branch's drafts, ``accepted [B])`` those the verified ``path [B, D]``
    (``a [B]`` accepted) took. ``parents [B, N]`` and ``anc`` (``ancestors``) in window
    numbering, nodes below ``u [B]`` known. A top-first tree holds the chain its drafter would
    draft, and verification tests a node's first child first, against the target's own
    distribution as a chain would (greedy: the same token; sampled: the same probability): so
    these are the chain's verdicts, free with the tree's (where the tree cut its main branch
    short, fewer are revealed). A step controller learns a chain's acceptance from them."""
    b, n = parents.shape
    node = jnp.arange(n, dtype=jnp.int32)[None]
    drafts = node >= u[:, None]
    earlier_sibling = jnp.any(earlier_siblings(parents), axis=2)  # [B, N]
    off = drafts & earlier_sibling  # a draft some sibling precedes
    main = drafts & ~jnp.any(anc & off[:, None, :], axis=2)  # no ancestor (itself included) off the branch
    level = jnp.sum(anc & drafts[:, None, :], axis=2)  # drafts on the branch: 1 for the first drafts
    asked = jnp.max(jnp.where(main, level, 0), axis=1).astype(jnp.int32)
    k = jnp.arange(path.shape[1], dtype=jnp.int32)[None]
    on_main = jnp.take_along_axis(main, jnp.clip(path, 0, n - 1), axis=1) & (k < a[:, None]) & (path >= 0)
    return asked, jnp.sum(on_main, axis=1).astype(jnp.int32)  # main is closed upward: a prefix of the path


def branch_verdicts(parents: jax.Array, u: jax.Array, path: jax.Array, a: jax.Array, k: int
                    ) -> tuple[jax.Array, jax.Array]:
    """What a verified tree revealed per draft level and sibling rank (acceptance per branch):
    ``(tested, accepted)`` int32 ``[B, D, k]`` (``D = path.shape[1]``), 1 where the walk tested
    (accepted) the rank-``r`` child (window order) of its node at level ``j``. At each level the
    walk reached, the children are tested in order until one is accepted, or all are (both
    verifications: greedy takes the first child carrying the target's token, sampled the first
    its residual accepts), so ``accepted / tested`` at ``(j, r)`` estimates ``P(rank r accepted
    | ranks < r rejected)`` there (``specjax.sim.TreeAcceptance`` learns from it). ``parents
    [B, N]`` in window numbering, nodes below ``u [B]`` known; ``path [B, D]``, ``a [B]``:
    the verified path. Ranks past ``k`` are not counted (verification tests at most ``k``)."""
    b, n = parents.shape
    d = path.shape[1]
    node = jnp.arange(n, dtype=jnp.int32)[None]
    drafts = node >= u[:, None]
    rank = sibling_rank(parents)
    level = jnp.arange(d, dtype=jnp.int32)[None]  # [1, D]
    cur = jnp.concatenate([(u - 1)[:, None], path[:, : d - 1]], axis=1)  # the node whose children level j tests
    kids = jnp.sum(drafts[:, None, :] & (parents[:, None, :] == cur[:, :, None]), axis=2)  # [B, D]
    took = level < a[:, None]  # the walk accepted a child at level j
    r = jnp.where(took, jnp.take_along_axis(rank, jnp.clip(path, 0, n - 1), axis=1), -1)  # [B, D]
    count = jnp.where(took, r + 1, jnp.where(level == a[:, None], kids, 0))  # children tested at level j
    rk = jnp.arange(k, dtype=jnp.int32)[None, None]
    return (rk < count[:, :, None]).astype(jnp.int32), (rk == r[:, :, None]).astype(jnp.int32)


def tree_rejection_verify(p: jax.Array, tokens: jax.Array, parents: jax.Array, u: jax.Array, uniform: jax.Array,
                          valid: jax.Array | None = None, max_depth: int | None = None,
                          max_children: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Lossless verification of a tree of deterministic drafts (each draft one-hot in its
    drafter, as top-k candidates are): recursive rejection over a node's children (SpecInfer,
    Miao et al. 2024, multi-step speculative sampling with one-hot proposals).

    From the last known node, with ``r`` its target distribution: its children are tried in
    window order; child ``c`` (token ``x``) is accepted with probability ``r(x)``
    (``uniform[c] < r(x)``), and then the walk moves to ``c`` with ``r = p[c]``; a rejected
    child's token leaves the residual, ``r <- norm(r - r(x) e_x)``. When no child is accepted
    the row stops, and its next token is to be drawn from the returned ``r``: the emitted
    sequence is distributed exactly as the target's own samples (tested by chi-square).

    ``p [B, N, V]``: the target's sampling distribution at each node (temperature, top-k/p
    applied), ``tokens [B, N]``, ``parents [B, N]``, ``u [B]``, ``uniform [B, N]``: one uniform
    per node (each node is tested at most once, against its parent's residual), ``valid
    [B, N]``, ``max_children``: the most children a node has (default ``N - 1``: each step tests
    that many candidates, not every node). Returns ``(a [B], path [B, D], r [B, V])``."""
    b, n, v = p.shape
    d = n - 1 if max_depth is None else max_depth
    valid = jnp.ones((b, n), bool) if valid is None else valid
    node = jnp.arange(n, dtype=jnp.int32)
    drafts = valid & (node[None] >= u[:, None])
    cur = u - 1
    r = jnp.take_along_axis(p, cur[:, None, None], axis=1)[:, 0]  # [B, V]
    going = jnp.ones((b,), bool)
    a = jnp.zeros((b,), jnp.int32)
    path = []
    rows = jnp.arange(b)
    m = n - 1 if max_children is None else min(max_children, n - 1)
    for _ in range(d):
        moved = jnp.zeros((b,), bool)
        nxt = cur
        is_child = drafts & (parents == cur[:, None])  # [B, N]
        # the first m children in window order: the m highest of -j over children
        score = jnp.where(is_child, -node[None], -n - node[None])
        kids = jax.lax.top_k(score, m)[1].astype(jnp.int32) if m else jnp.zeros((b, 0), jnp.int32)
        for i in range(m):  # children in window order: each tests against what is left
            j = kids[:, i]
            x = jnp.take_along_axis(tokens, j[:, None], axis=1)[:, 0]
            test = going & ~moved & jnp.take_along_axis(is_child, j[:, None], axis=1)[:, 0]
            rx = r[rows, x]
            take = test & (jnp.take_along_axis(uniform, j[:, None], axis=1)[:, 0] < rx)
            left = test & ~take
            # rejected: remove x from the residual (and renormalise); accepted: its own distribution
            cut = r.at[rows, x].set(jnp.where(left, 0.0, rx))
            mass = jnp.sum(cut, axis=-1, keepdims=True)
            cut = jnp.where(mass > 0, cut / jnp.where(mass > 0, mass, 1.0), r)
            r = jnp.where(left[:, None], cut, jnp.where(take[:, None], p[rows, j], r))
            nxt = jnp.where(take, j, nxt)
            moved = moved | take
        cur = nxt
        a = a + moved.astype(jnp.int32)
        path.append(jnp.where(moved, cur, -1))
        going = going & moved
    return a, (jnp.stack(path, axis=1) if path else jnp.zeros((b, 0), jnp.int32)), r
