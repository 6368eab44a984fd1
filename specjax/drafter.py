"""Drafters: propose ``depth`` draft tokens per row and commit per-row accepted counts.

Protocol (all pure, traced inside the engine's jitted step):

* ``empty(eng, batch, width) -> dstate``: an empty state for ``batch`` rows (prefills of
  up to ``width`` tokens); ``rows_view(eng, dstate, rows, width)`` an empty state for
  refilling ``rows [R]`` and ``put_rows(dstate, rows, sub)`` merges it back (slot refill);
  ``release(dstate, idle)`` returns the pages of ``idle [B]`` rows to a paged pool;
* ``prefill(eng, params, st, hidden, positions, live) -> dstate`` after the target prefill,
  filling the empty ``st.dstate`` (``live [B]``: rows that are real, not padding);
* ``propose(eng, params, st) -> (drafts [B, d], draft_probs [B, d, V] | None, dstate)``: ``draft_probs`` is
  the draft distribution (``None`` when drafts are deterministic, i.e. one-hot);
* ``commit(eng, params, st, dstate, hidden, old_lengths, u, a, advance) -> dstate``
  after verification (``st.seq`` already holds the emitted tokens);
* optional, for work a window-1 step (``depth="auto"``) may defer: ``backlog_size(eng) -> R``
  (0: nothing deferred), ``backlog(dstate) -> int32 []`` (the most any row has deferred) and
  ``settle(eng, params, st) -> dstate`` (do it now). ``engine.run_steps`` settles before a
  drafting window and when the backlog reaches ``R`` (``MtpDrafter``).

Drafter caches mirror the target's per-row lengths and advance by the same plan.

A user's drafter follows the smaller public protocol (``specjax.protocols.Drafter``: it
sees a ``DraftContext``, not the engine's state); ``PluggedDrafter`` adapts it to this one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass
from specjax.cache import DenseKVCache
from specjax.cache.base import CAPACITY_BLOCK
from specjax.protocols import DraftContext, check_drafter, reachable_positions
from specjax.sampling import draft_token
from specjax.tree import DynamicTree, TreeMask, ancestors, preset_depths, preset_parents, tree_levels

__all__ = ["DRAFTERS", "DraftModelDrafter", "MtpDrafter", "NgramDrafter", "NoDrafter", "PluggedDrafter", "drafter_kind",
           "pick", "resolve_drafter", "AUTO", "default_drafter"]

DRAFTERS = ("mtp", "draft_model", "ngram")
AUTO = "auto"  # every entry point's default drafter: ``default_drafter``


def default_drafter(drafter: object, model: object, draft_model: object) -> object:
    """``drafter``, with ``"auto"`` (the default of ``generate``, ``stream``, ``batch_generate``,
    the bundles and the CLI) resolved by one rule: ``"mtp"`` when the model carries an MTP
    module, else ``"draft_model"`` when a draft model is given, else ``"ngram"``."""
    if not (isinstance(drafter, str) and drafter == AUTO):
        return drafter
    if getattr(getattr(model, "decoder", None), "mtp_depth", 0):
        return "mtp"
    return "draft_model" if draft_model is not None else "ngram"


def pick(logits: jax.Array, eng: Any, st: Any, positions: jax.Array):
    """Draft tokens from ``logits [B, V]`` for absolute ``positions [B]`` (``sampling.draft_token``)."""
    return draft_token(logits, eng.greedy, st.seeds, st.sampling, positions)


def pick_mtp(eng: Any, params: dict, st: Any, h: jax.Array, positions: jax.Array):
    """The MTP module's draft from its hidden ``h [B, d]`` for ``positions [B]``: over its draft
    vocabulary when it has one (the draft index mapped to the target's token; under sampling the
    distribution scattered into the full vocabulary, zero outside: lossless verification), else
    over the target's head."""
    dec = eng.target
    if not hasattr(dec, "mtp_head"):  # a model with only the protocol's head
        return pick(dec.head(params["target"], h), eng, st, positions)
    logits, ids = dec.mtp_head(params["target"], h)
    tok, p = pick(logits, eng, st, positions)
    if ids is None:
        return tok, p
    if p is not None:
        p = jnp.zeros((p.shape[0], dec.vocab_size), p.dtype).at[:, ids].set(p)
    return ids[tok], p


def _stack_probs(probs_all: list, greedy: bool):
    return None if greedy else jnp.stack(probs_all, axis=1)


def gather_tokens(seq: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(seq, jnp.clip(idx, 0, seq.shape[1] - 1), axis=1)


class _Stateless:
    """A drafter that keeps no state of its own: nothing to prefill, refill or release."""

    def empty(self, eng, batch, width):
        return None

    def rows_view(self, eng, dstate, rows, width):
        return None

    def put_rows(self, dstate, rows, sub):
        return None

    def release(self, dstate, idle):
        return dstate

    def prefill(self, eng, params, st, hidden, positions, live):
        return None


@dataclasses.dataclass(frozen=True)
class NoDrafter(_Stateless):
    """Plain decoding (depth 0): the baseline, on the same step."""

    name: str = "none"

    def propose(self, eng, params, st):
        b = st.seq.shape[0]
        return jnp.zeros((b, 0), jnp.int32), None, st.dstate

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        return dstate


@dataclasses.dataclass(frozen=True)
class NgramDrafter(_Stateless):
    """Prompt lookup: find the latest earlier occurrence of the last ``n`` known tokens
    (prompt + generated) and propose what followed it. No model, draft probabilities one-hot."""

    n: int = 3
    name: str = "ngram"

    def _starts(self, seq: jax.Array, known: jax.Array) -> jax.Array:
        """int32 [B, S]: each candidate start ``s`` where an earlier occurrence of the row's last
        ``n`` known tokens begins and its continuation starts inside the known tokens, else -1."""
        n, c = self.n, seq.shape[1]
        pattern = gather_tokens(seq, known[:, None] - n + jnp.arange(n)[None])  # [B, n]
        starts = jnp.arange(c - n + 1)  # candidate match starts
        windows = seq[:, starts[:, None] + jnp.arange(n)[None]]  # [B, S, n]
        hit = jnp.all(windows == pattern[:, None, :], axis=-1)
        hit &= (starts[None] + n < known[:, None]) & (known[:, None] >= n)  # continuation starts inside known
        return jnp.where(hit, starts[None], -1)

    def _match(self, seq: jax.Array, known: jax.Array) -> jax.Array:
        """int32 [B]: start of the latest earlier occurrence of each row's last ``n`` known
        tokens whose continuation starts inside the known tokens, -1 where there is none."""
        return jnp.max(self._starts(seq, known), axis=1)

    def offer(self, eng, st) -> tuple[jax.Array, jax.Array]:
        """(int32 [B]: drafts each row can offer now (``<= eng.depth``): the known tokens after
        its match, 0 with none; int32 [B]: its first draft, -1 with none). Under ``depth="auto"``
        a row offers no more (a row without a match drafts nothing, and a step where no row has
        one runs at window 1), and a window-1 step checks its token against the first draft."""
        best = self._match(st.seq, st.known)
        count = jnp.where(best >= 0, jnp.clip(st.known - best - self.n, 0, eng.depth), 0)
        first = jnp.where(best >= 0, gather_tokens(st.seq, (best + self.n)[:, None])[:, 0], -1)
        return count.astype(jnp.int32), first.astype(jnp.int32)

    def available(self, eng, st) -> jax.Array:
        """int32 [B]: the drafts each row can offer now (``offer``'s count)."""
        return self.offer(eng, st)[0]

    def propose(self, eng, params, st):
        seq, known = st.seq, st.known
        b, d = seq.shape[0], eng.depth
        if d == 0:  # depth="auto" at window 1: no lookup at all
            return jnp.zeros((b, 0), jnp.int32), None, st.dstate
        best = self._match(seq, known)
        follow = gather_tokens(seq, (best + self.n)[:, None] + jnp.arange(d)[None])
        last = gather_tokens(seq, known[:, None] - 1)
        drafts = jnp.where((best >= 0)[:, None], follow, last)
        return drafts.astype(jnp.int32), None, st.dstate

    tree_presets = False  # its trees are dynamic: ``DynamicTree(nodes, K)`` with K matches

    def propose_tree(self, eng, params, st):
        """Several continuations (``DynamicTree(N, K)``): the ``K`` latest earlier occurrences
        of the last ``n`` known tokens, each followed for ``depth`` tokens, merged as a trie
        (continuations sharing a prefix share its nodes) and kept match by match, the latest
        first, up to ``N`` nodes (the order is topological: a node's parent is its own
        match's, or an earlier match's with the same prefix). A row without a match proposes
        its last token repeated, as the chain does. Returns ``(tokens [B, N], parents [B, N + 1],
        dstate)``; nodes past what the trie holds are fillers below the root (still drafts)."""
        seq, known = st.seq, st.known
        n = self.n
        k, d = eng.tree.topk, eng.depth
        size = eng.tree.size(d)
        b = seq.shape[0]
        begin = jax.lax.top_k(self._starts(seq, known), k)[0]  # [B, K]: the latest first, -1: none
        has = begin >= 0
        follow = gather_tokens(seq, ((begin + n)[:, :, None] + jnp.arange(d)[None, None]).reshape(b, k * d))
        last = gather_tokens(seq, known[:, None] - 1)  # [B, 1]
        cand = jnp.where(has[:, :, None], follow.reshape(b, k, d), last[:, :, None])  # [B, K, D]
        # the trie: candidate (m, t) is (m', t) for the first m' whose continuation agrees up to t
        same = jnp.cumprod((cand[:, :, None, :] == cand[:, None, :, :]).astype(jnp.int32), axis=3) > 0  # [B, K, K', D]
        rep = jnp.argmax(same, axis=2).astype(jnp.int32)  # [B, K, D]
        m = jnp.arange(k, dtype=jnp.int32)[None, :, None]
        t = jnp.arange(d, dtype=jnp.int32)[None, None, :]
        keep = (rep == m) & (has[:, :, None] | (m == 0))  # a trie node; chains past the matches are not
        parent = jnp.where(t == 0, -1, jnp.roll(rep, 1, axis=2) * d + t - 1)  # the candidate above (-1: the root)
        cand, keep, parent = (x.reshape(b, k * d) for x in (cand, keep, parent))
        if size > k * d:  # fillers below the root
            pad = size - k * d
            cand = jnp.concatenate([cand, jnp.broadcast_to(last, (b, pad))], axis=1)
            keep = jnp.concatenate([keep, jnp.zeros((b, pad), bool)], axis=1)
            parent = jnp.concatenate([parent, jnp.full((b, pad), -1, jnp.int32)], axis=1)
        order = jnp.arange(cand.shape[1], dtype=jnp.int32)[None]
        sel = jnp.sort(jax.lax.top_k(jnp.where(keep, -order, -order - cand.shape[1]), size)[1], axis=1)
        tokens, parents = kept_tree(cand, parent, sel, jnp.take_along_axis(keep, sel, axis=1))
        return tokens.astype(jnp.int32), parents, st.dstate

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        return dstate


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """A separate small model with its own per-row caches (same vocab)."""

    name: str = "draft_model"

    def empty(self, eng, batch, width):
        return eng.new_cache(eng.draft, batch)

    def rows_view(self, eng, dstate, rows, width):
        return dstate.rows_view(rows, width)

    def put_rows(self, dstate, rows, sub):
        return dstate.put_rows(rows, sub)

    def release(self, dstate, idle):
        return dstate.release(idle)

    def prefill(self, eng, params, st, hidden, positions, live):
        # a chunk of the prompt from each row's own length (``prefill_chunk``): its own tokens count
        count = jnp.clip(st.prompt_len - st.dstate.lengths, 0, positions.shape[1])
        cache = st.dstate.reserve(count, live).bound_write(count)
        tokens = gather_tokens(st.seq, positions)  # (the engine's positions: already reachable ones)
        _, cache = eng.draft.forward_hidden(params["draft"], tokens, positions, cache,
                                            attention_impl=eng.attention_impl)
        return cache.advance(count)  # only the K/V is needed: no logits

    def propose(self, eng, params, st):
        dec, dp, d, w = eng.draft, params["draft"], eng.depth, eng.depth + 1
        cache = st.dstate
        lengths, u = cache.lengths, st.u
        cache = cache.reserve(2 * w, st.live)
        pos = lengths[:, None] + jnp.arange(w)[None]
        x, cache = dec.forward_hidden(dp, gather_tokens(st.seq, pos), reachable_positions(pos, st.max_len), cache,
                                      attention_impl=eng.attention_impl)
        first = dec.head(dp, jnp.take_along_axis(x, (u - 1)[:, None, None], axis=1)[:, 0])
        tok, probs_k = pick(first, eng, st, lengths + u)
        drafts, probs_all = [tok], [probs_k]
        for k in range(1, d + 1):  # feed d_k at L + u + k - 1 (the last feed only writes its KV)
            at = lengths + u + k - 1
            x, cache = dec.forward_hidden(dp, tok[:, None], reachable_positions(at[:, None], st.max_len),
                                          cache.with_lengths(at),
                                          attention_impl=eng.attention_impl)
            if k < d:
                tok, probs_k = pick(dec.head(dp, x[:, 0]), eng, st, at + 1)
                drafts.append(tok)
                probs_all.append(probs_k)
        cache = cache.with_lengths(lengths)
        return jnp.stack(drafts, axis=1), _stack_probs(probs_all, eng.greedy), cache

    tree_presets = False  # its trees are dynamic (``DynamicTree``)

    def propose_tree(self, eng, params, st):
        """EAGLE-2's expansion (``beam_tree``) with the draft model: its window over the known
        tokens gives the root's children; each depth's beam then runs one forward, each node
        reading the committed prefix and its own branch's beam slots (``known + (lvl - 1) * K
        + i``, a ``TreeMask``). One more forward writes every kept node's K/V in the verify
        window's layout (node ``i`` at slot ``known + i - 1``), so the accepted path compacts
        as the target's does (``compact_tree``) and the commit advances over it."""
        dec, dp, depth = eng.draft, params["draft"], eng.depth
        k, w = eng.tree.topk, depth + 1
        cache = st.dstate
        lengths, u, known = cache.lengths, st.u, st.known
        b = known.shape[0]
        cache = cache.reserve(w + max(eng.window - 1, eng.scratch), st.live)
        pos = lengths[:, None] + jnp.arange(w)[None]
        x, cache = dec.forward_hidden(dp, gather_tokens(st.seq, pos), reachable_positions(pos, st.max_len), cache,
                                      attention_impl=eng.attention_impl)
        root = dec.head(dp, jnp.take_along_axis(x, (u - 1)[:, None, None], axis=1))  # [B, 1, V]
        beam_pos = beam_positions(known, depth, k)

        def level(lvl, beam_tok, beam_par, rows, cache):
            at = jnp.broadcast_to(known[:, None] + lvl - 1, (b, k))
            mask = TreeMask(known, rows, at, beam_pos)
            h, cache = dec.forward_hidden(dp, beam_tok, reachable_positions(at, st.max_len),
                                          cache.with_lengths(known + (lvl - 1) * k),
                                          attention_impl=eng.attention_impl, tree=mask)
            return (*_top_logits(dec.head(dp, h), k), cache)

        tokens, parents, cache = beam_tree(eng.tree, depth, _top_logits(root, k), level, cache)
        anc = ancestors(parents)
        node_pos = known[:, None] + jnp.sum(anc, axis=2)[:, 1:].astype(jnp.int32) - 2  # depth d at known + d - 1
        mask = TreeMask(known, anc[:, 1:, 1:], node_pos, node_pos)
        _, cache = dec.forward_hidden(dp, tokens, reachable_positions(node_pos, st.max_len), cache.with_lengths(known),
                                      attention_impl=eng.attention_impl, tree=mask)
        return tokens, parents, cache.with_lengths(lengths)

    def compact_tree(self, dstate, src):
        """The draft model's window compacted as the target's (``ModelCache.compact``)."""
        return dstate.compact(src)

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        return dstate.advance(advance)

    def status(self, dstate) -> jax.Array:
        """int32 [B]: the draft model's caches' status bits (``cache.base``)."""
        return dstate.status


@pytree_dataclass
class MtpState:
    """The MTP drafter's state. Invariant: ``cache.lengths + pending_n`` = the target's
    committed lengths; ``h``/``first`` belong to the last position the block has run over."""

    cache: DenseKVCache  # the MTP block's own per-row cache (one layer)
    h: jax.Array  # [B, d_model]: MTP hidden at the last committed position
    first: jax.Array  # [B]: first draft (predicted from the last commit)
    first_probs: jax.Array | None  # [B, V] when sampling
    pending: jax.Array  # [B, R, d_model]: target hiddens of window-1 commits the block has not run over yet
    pending_n: jax.Array  # int32 [B]: how many of ``pending`` each row holds (R = 0: nothing is deferred)
    # a batch job's prefix cache: the block's K/V of cached prompt pages, ``(k, v) [num_pages,
    # Hkv, page_size, D]`` by the target's page ids (``MtpDrafter.keep_prefix``); None: no cache
    prefix: tuple[jax.Array, jax.Array] | None = None


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


def _top(dec, tp, h: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The top ``k`` tokens of the MTP block's head at each of ``h [B, n, d]`` and their
    log-probabilities (temperature 1): int32 and float32 ``[B, n * k]``, node-major (node 0's
    children first, most probable first), as target ids."""
    if hasattr(dec, "mtp_head"):
        logits, ids = dec.mtp_head(tp, h)
    else:
        logits, ids = dec.head(tp, h), None
    top, logp = _top_logits(logits, k)
    return (top if ids is None else ids[top]), logp


def _top_logits(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``_top`` of logits ``[B, n, V]`` already computed (a draft model's head)."""
    logp, top = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
    return top.astype(jnp.int32).reshape(top.shape[0], -1), logp.reshape(logp.shape[0], -1)


def _pool_offset(eng, dstate, rows: jax.Array) -> jax.Array:
    """int32 ``[R]``: where the pool group of each of slots ``rows`` starts in the MTP block's
    store of cached pages (``MtpState.prefix``: one part per pool group, as the target's pool,
    whose block tables hold group-local page ids); 0 with one pool."""
    b, n, g = dstate.cache.k[0].shape[0], dstate.prefix[0].shape[0], eng.pool_groups
    return (jnp.minimum(rows, b - 1) // (b // g) * (n // g)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class MtpDrafter:
    """DeepSeek-V3-style MTP head of the target, chained to ``depth`` drafts.

    Under ``depth="auto"`` a window-1 step (no drafts) does not run the MTP block: its commit
    keeps the target's hidden in ``MtpState.pending``, and ``settle`` runs the block over all
    pending positions in one call before the next drafting step (or when ``R`` are pending).
    The block's cache, ``h`` and first draft come out exactly as if it had run every step;
    plain-decoding stretches then cost the block one call per ``R`` tokens, not one per token."""

    name: str = "mtp"
    # R: window-1 commits the block may defer (0: it runs on every commit). A settle is one block
    # call over R positions, whose fixed cost a batch of one feels: forced window-1 steps at B=1
    # cost 1.08x plain decoding at R = 16, 1.04x at 64 (forced window-1 steps, B=1). The settle
    # writes only the pending slots (``mtp_hidden_at``), so the block's cache is the target's size
    backlog_limit: int = 64

    def backlog_size(self, eng) -> int:
        """``R`` in this engine (a window-1 step beside drafting ones exists only under a step
        controller: ``depth="auto"``)."""
        return self.backlog_limit if 1 in eng.windows and eng.window > 1 else 0

    def _after(self, eng, params, st, cache, hidden, lengths, count):
        """MTP over ``hidden [B, t, d]`` at ``lengths + [0, t)``; keep the output at slot
        ``count - 1`` (the last committed position) and draft the next token from it."""
        dec = eng.target
        t = hidden.shape[1]
        pos = lengths[:, None] + jnp.arange(t)[None]
        nxt = gather_tokens(st.seq, pos + 1)
        pos = reachable_positions(pos, st.max_len)
        last = jnp.maximum(count - 1, 0)  # (a padding row of a prefill commits 0)
        if hasattr(dec, "mtp_hidden_at"):  # attention and MLP for the one slot read, K/V up to it
            h, cache = dec.mtp_hidden_at(params["target"], hidden, nxt, pos, cache, last,
                                         attention_impl=eng.attention_impl)
        else:  # a model with only the protocol's mtp_hidden: every slot, one kept
            mtp_out, cache = dec.mtp_hidden(params["target"], hidden, nxt, pos, cache,
                                            attention_impl=eng.attention_impl)
            h = jnp.take_along_axis(mtp_out, last[:, None, None], axis=1)[:, 0]
        # logits only for the one position a draft is taken from (not all t)
        tok, probs_k = pick_mtp(eng, params, st, h, lengths + count + 1)
        return cache, h, tok, probs_k

    def empty(self, eng, batch, width, capacity=None):
        dec = eng.target
        r = self.backlog_size(eng)
        if capacity is None:
            capacity = eng.capacity
            if not hasattr(dec, "mtp_hidden_at"):  # its settle writes all R slots from the block's lagging length
                capacity += -(-r // CAPACITY_BLOCK) * CAPACITY_BLOCK
            # (with it, only the pending ones: up to the target's length. 128 slots more took the
            # block's attention at B=64 from 384 keys to 512, 1.04x-1.06x a drafting step)
        cache = dec.init_mtp_cache(batch, capacity)
        first_probs = None if eng.greedy else jnp.zeros((batch, dec.vocab_size), jnp.float32)
        return MtpState(cache, jnp.zeros((batch, dec.hidden_size), eng.dtype), jnp.zeros((batch,), jnp.int32),
                        first_probs, jnp.zeros((batch, r, dec.hidden_size), eng.dtype),
                        jnp.zeros((batch,), jnp.int32))

    def rows_view(self, eng, dstate, rows, width, shared=None):
        """Empty rows for refilling ``rows [R]`` with prompts of ``width`` tokens. ``shared =
        (pages [R, M], count [R])`` (the prefix cache): row ``r`` starts on the target's cached
        pages ``pages[r, :count[r]]``, so the block's cache starts with their K/V from
        ``dstate.prefix`` and its length at their end."""
        sub = self.empty(eng, rows.shape[0], width, capacity=width)
        if shared is None:
            return sub
        page = dstate.prefix[0].shape[2]
        if width < page:  # a prompt shorter than a page has no cached page
            return sub
        pages, count = shared
        b, m = rows.shape[0], min(pages.shape[1], width // page)  # pages the view holds (a row's cached all fit)
        ids = jnp.maximum(pages[:, :m], 0) + _pool_offset(eng, dstate, rows)[:, None]
        keep = (jnp.arange(m * page) < (count * page)[:, None])[:, None, :, None]

        def slots(store, into):  # [R, Hkv, m * page, D]: the rows' cached pages, slot-major
            got = jnp.take(store, ids, axis=0).transpose(0, 2, 1, 3, 4)
            got = jnp.where(keep, got.reshape(b, got.shape[1], m * page, -1), 0).astype(into.dtype)
            return into.at[:, :, : m * page].set(got)

        c = sub.cache
        cache = c.replace(k=(slots(dstate.prefix[0], c.k[0]),), v=(slots(dstate.prefix[1], c.v[0]),),
                          lengths=count * page)
        return sub.replace(cache=cache)

    def with_prefix_store(self, eng, dstate, num_pages: int, page_size: int):
        """``dstate`` with an empty store of the block's K/V for ``num_pages`` cached pages."""
        one = dstate.cache.k[0]
        shape = (num_pages, one.shape[1], page_size, one.shape[3])
        return dstate.replace(prefix=(jnp.zeros(shape, one.dtype), jnp.zeros(shape, one.dtype)))

    def keep_prefix(self, eng, dstate, rows, table, upto):
        """The block's K/V of rows ``rows [R]``'s first ``upto [R]`` pages (their full prompt
        pages, just registered in the target's pool) into ``dstate.prefix`` at the target's
        page ids ``table [B, M]``: a later row starting on those pages starts with them."""
        k_store, v_store = dstate.prefix
        n, _, page, _ = k_store.shape
        c = dstate.cache.k[0]
        b, r = c.shape[0], rows.shape[0]
        m = min(table.shape[1], c.shape[2] // page)
        mine = jnp.minimum(rows, b - 1)
        ids = table[mine, :m] + _pool_offset(eng, dstate, rows)[:, None]
        ids = jnp.where((jnp.arange(m) < upto[:, None]) & (rows < b)[:, None], ids, n)  # n: dropped

        def pages(slots, store):  # [R, m, Hkv, page, D]
            got = slots[mine, :, : m * page].reshape(r, slots.shape[1], m, page, -1).transpose(0, 2, 1, 3, 4)
            return store.at[ids].set(got.astype(store.dtype), mode="drop")

        return dstate.replace(prefix=(pages(c, k_store), pages(dstate.cache.v[0], v_store)))

    def release(self, dstate, idle):
        return dstate  # a dense cache: nothing to return

    def put_rows(self, dstate, rows, sub):
        put = lambda big, small: big.at[rows].set(small.astype(big.dtype), mode="drop")  # noqa: E731
        probs_ = None if dstate.first_probs is None else put(dstate.first_probs, sub.first_probs)
        return MtpState(dstate.cache.put_rows(rows, sub.cache), put(dstate.h, sub.h), put(dstate.first, sub.first),
                        probs_, dstate.pending, put(dstate.pending_n, sub.pending_n), dstate.prefix)

    def prefill(self, eng, params, st, hidden, positions, live):
        # a chunk of the prompt from each row's own length (``prefill_chunk``); a row whose
        # prompt ended in an earlier chunk keeps its hidden state and first draft
        s = st.dstate
        start = s.cache.lengths
        count = jnp.clip(st.prompt_len - start, 0, hidden.shape[1])
        cache, h, tok, first_probs = self._after(eng, params, st, s.cache, hidden, start, count)
        new = count > 0
        h, tok = jnp.where(new[:, None], h, s.h), jnp.where(new, tok, s.first)
        if first_probs is not None:
            first_probs = jnp.where(new[:, None], first_probs, s.first_probs)
        return s.replace(cache=cache.advance(count), h=h, first=tok, first_probs=first_probs)

    def propose(self, eng, params, st):
        dec, d = eng.target, eng.depth
        s: MtpState = st.dstate
        cache, h, tok = s.cache, s.h, s.first
        drafts, probs_all = [tok], [s.first_probs]
        base = st.known - 1  # MTP position of (h, first)
        for k in range(1, d):  # chain: (h_k, d_k) at the next position predicts d_{k+1}
            at = base + k - 1
            mtp_out, cache = dec.mtp_hidden(params["target"], h[:, None], tok[:, None],
                                            reachable_positions(at[:, None], st.max_len),
                                            cache.replace(lengths=at), attention_impl=eng.attention_impl)
            h = mtp_out[:, 0]
            tok, probs_k = pick_mtp(eng, params, st, h, at + 2)
            drafts.append(tok)
            probs_all.append(probs_k)
        cache = cache.replace(lengths=s.cache.lengths)
        return jnp.stack(drafts, axis=1), _stack_probs(probs_all, eng.greedy), s.replace(cache=cache)

    def propose_tree(self, eng, params, st):
        """The tree ``eng.tree`` below each row's last known token: ``(tokens [B, T], parents
        [B, T + 1], dstate)``, parents in tree numbering (node 0 the root, ``-1`` its parent),
        topological order. Drafts are deterministic (the block's top tokens), so sampled
        verification stays lossless. A preset's nodes take the top-``k`` children of their
        own branch's block output (``_preset_tree``); a ``DynamicTree`` expands the most
        probable branches (``_dynamic_tree``)."""
        if isinstance(eng.tree, DynamicTree):
            return self._dynamic_tree(eng, params, st)
        return self._preset_tree(eng, params, st)

    @staticmethod
    def _branch_block(eng, params, st, cache, h_par, tok, depth, first, mask_rows, node_pos):
        """One block call over ``n`` nodes at draft depth ``depth`` (``tok [B, n]``, their
        parents' block outputs ``h_par [B, n, d]``): each runs at position ``base + depth - 1``,
        is written at scratch slot ``base + first + i`` and reads the committed prefix and the
        scratch slots ``mask_rows [B, n, S]`` allows (its own branch; ``node_pos [B, S]``)."""
        base = st.known - 1
        b, n = tok.shape
        pos = jnp.broadcast_to(base[:, None] + depth - 1, (b, n))
        mask = TreeMask(base, mask_rows, pos, node_pos)
        return eng.target.mtp_hidden(params["target"], h_par, tok, reachable_positions(pos, st.max_len),
                                     cache.replace(lengths=base + first), attention_impl=eng.attention_impl,
                                     tree=mask)

    def _preset_tree(self, eng, params, st):
        """The preset ``eng.tree`` (``specjax.tree.preset_parents``), breadth-first: each node's
        children are the top-``k`` tokens of the block's output on the node's own branch
        (``k = eng.tree[depth]``). One block call per depth over all its nodes, each attending
        to its own ancestors only (scratch slot ``base + node - 1``). A chain preset is exactly
        ``propose``'s greedy chain."""
        dec, tp = eng.target, params["target"]
        s: MtpState = st.dstate
        preset, levels = preset_parents(eng.tree), tree_levels(eng.tree)
        t = len(preset) - 1
        b = st.known.shape[0]
        # draft node i (1-based) runs at position base + depth - 1, written at slot base + i - 1
        node_pos = st.known[:, None] - 1 + jnp.asarray(preset_depths(eng.tree)[1:] - 1)[None]
        anc = ancestors(jnp.asarray(preset)[None])[:, 1:, 1:]  # [1, T, T]: among the draft nodes
        h = s.h[:, None]  # [B, 1, d]: the root's
        tokens = [_top(dec, tp, h, eng.tree[0])[0]]  # [B, k1]: the first drafts
        cache = s.cache
        prev_first = 0  # the root
        for depth, (first, n) in enumerate(levels[:-1], start=1):
            par = jnp.asarray(preset[first:first + n] - prev_first)  # each node's parent within the level above
            rows = jnp.broadcast_to(anc[:, first - 1:first - 1 + n], (b, n, t))
            h, cache = self._branch_block(eng, params, st, cache, h[:, par], tokens[-1], depth, first - 1, rows,
                                          node_pos)
            tokens.append(_top(dec, tp, h, eng.tree[depth])[0])
            prev_first = first
        parents = jnp.broadcast_to(jnp.asarray(preset), (b, t + 1))
        return jnp.concatenate(tokens, axis=1), parents, s.replace(cache=cache.replace(lengths=s.cache.lengths))

    def _dynamic_tree(self, eng, params, st):
        """EAGLE-2's expansion (``beam_tree``): each depth's beam runs one block call, each
        node over its own branch (its parent's block output and its own token); beam slot
        ``i`` of depth ``lvl`` is the block's scratch slot ``base + (lvl - 1) * K + i``."""
        dec, tp = eng.target, params["target"]
        s: MtpState = st.dstate
        k, depth = eng.tree.topk, eng.depth
        node_pos = beam_positions(st.known - 1, depth, k)

        def level(lvl, beam_tok, beam_par, rows, carry):
            h_above, cache = carry
            h_par = jnp.take_along_axis(h_above, beam_par[:, :, None], axis=1)
            h, cache = self._branch_block(eng, params, st, cache, h_par, beam_tok, lvl, (lvl - 1) * k, rows,
                                          node_pos)
            return (*_top(dec, tp, h, k), (h, cache))

        tokens, parents, (_, cache) = beam_tree(eng.tree, depth, _top(dec, tp, s.h[:, None], k), level,
                                                (s.h[:, None], s.cache))
        return tokens, parents, s.replace(cache=cache.replace(lengths=s.cache.lengths))

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        r = dstate.pending.shape[1]
        if eng.depth == 0 and r:  # a window-1 step: keep the hidden of its one position for ``settle``
            b = hidden.shape[0]
            slot = jnp.where(advance > 0, dstate.pending_n, r)  # a row that commits nothing writes nothing
            return dstate.replace(pending=dstate.pending.at[jnp.arange(b), slot].set(hidden[:, 0], mode="drop"),
                                  pending_n=dstate.pending_n + advance)
        cache, h, tok, first_probs = self._after(eng, params, st, dstate.cache, hidden, old_lengths, u + a)
        return dstate.replace(cache=cache.advance(advance), h=h, first=tok, first_probs=first_probs)

    def status(self, dstate) -> jax.Array:
        """int32 [B]: the block's cache's status bits (``cache.base``)."""
        return dstate.cache.status

    def backlog(self, dstate) -> jax.Array:
        """int32 []: the most commits any row has deferred (``settle`` is due at ``R``)."""
        return jnp.max(dstate.pending_n)

    def settle(self, eng, params, st) -> MtpState:
        """Run the block over every row's pending positions (one call over ``R``); a row with
        none pending keeps its state."""
        s: MtpState = st.dstate
        if not s.pending.shape[1]:  # nothing is ever deferred
            return s
        n = s.pending_n
        cache, h, tok, probs_ = self._after(eng, params, st, s.cache, s.pending, s.cache.lengths, jnp.maximum(n, 1))
        has = n > 0
        keep = lambda new, old: None if old is None else jnp.where(  # noqa: E731
            has.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
        return s.replace(cache=cache.advance(n), h=keep(h, s.h), first=keep(tok, s.first),
                         first_probs=keep(probs_, s.first_probs), pending_n=jnp.zeros_like(n))


@dataclasses.dataclass(frozen=True)
class PluggedDrafter:
    """A user's drafter (``specjax.protocols.Drafter``) in the engine: it sees a ``DraftContext``,
    and its state (per-row arrays, or ``None``) follows slot refill row by row."""

    user: Any

    @property
    def name(self) -> str:
        return str(self.user.name)

    def _init(self, batch):
        init = getattr(self.user, "init", None)
        return None if init is None else init(batch)

    def empty(self, eng, batch, width):
        return self._init(batch)

    def rows_view(self, eng, dstate, rows, width):
        return self._init(rows.shape[0])

    def put_rows(self, dstate, rows, sub):
        return jax.tree.map(lambda big, small: big.at[rows].set(small.astype(big.dtype), mode="drop"), dstate, sub)

    def release(self, dstate, idle):
        return dstate

    def prefill(self, eng, params, st, hidden, positions, live):
        return st.dstate

    @staticmethod
    def context(eng, st) -> DraftContext:
        return DraftContext(st.seq, st.known, st.live, st.seeds, st.sampling, eng.depth, eng.greedy)

    def propose(self, eng, params, st):
        b = st.seq.shape[0]
        if eng.depth == 0:  # depth="auto" at window 1: no drafts asked
            return jnp.zeros((b, 0), jnp.int32), None, st.dstate
        drafts, draft_probs, state = self.user.propose(self.context(eng, st), st.dstate)
        if drafts.shape != (b, eng.depth):
            raise ValueError(f"drafter {self.name!r}: propose returned drafts of shape {drafts.shape}, "
                             f"expected (batch, depth) = {(b, eng.depth)}")
        if eng.greedy:
            draft_probs = None  # greedy verification compares tokens only
        return drafts.astype(jnp.int32), draft_probs, state

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        commit = getattr(self.user, "commit", None)
        return dstate if commit is None else commit(self.context(eng, st), dstate, a)


BUILTIN = {"mtp": MtpDrafter, "draft_model": DraftModelDrafter, "ngram": NgramDrafter}


def resolve_drafter(drafter: object, ngram_n: int = 3) -> Any:
    """``drafter`` (``None``, a name in ``DRAFTERS``, a built-in drafter or a user's
    ``protocols.Drafter``) -> the engine's drafter object."""
    if drafter is None:
        return NoDrafter()
    if isinstance(drafter, str):
        return NgramDrafter(ngram_n) if drafter == "ngram" else BUILTIN[drafter]()
    if isinstance(drafter, NoDrafter | NgramDrafter | DraftModelDrafter | MtpDrafter | PluggedDrafter):
        return drafter
    if _wraps(drafter):  # a wrapper of a drafter (specjax.controlled.Controlled): resolve what it wraps
        return dataclasses.replace(drafter, inner=resolve_drafter(drafter.inner, ngram_n))
    check_drafter("drafter", drafter)
    return PluggedDrafter(drafter)


def _wraps(drafter: object) -> bool:
    """Is ``drafter`` a wrapper of another drafter (``inner``), as ``specjax.controlled.Controlled``
    is? Asked of its class: a wrapper forwards attribute lookups to what it wraps."""
    return bool(getattr(type(drafter), "wraps_drafter", False))


def drafter_kind(drafter: object) -> str | None:
    """What a ``drafter`` argument needs from the models: ``None`` (plain decoding), ``"mtp"``,
    ``"draft_model"``, ``"ngram"`` or ``"custom"`` (a user's drafter: nothing)."""
    if drafter is None or isinstance(drafter, NoDrafter):
        return None
    if isinstance(drafter, str):
        return drafter
    if _wraps(drafter):  # what its inner drafter needs (an MTP module, a draft model)
        return drafter_kind(drafter.inner)
    for name, cls in BUILTIN.items():
        if isinstance(drafter, cls):
            return name
    return "custom"
