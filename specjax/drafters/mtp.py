"""The target's own MTP module (DeepSeek-V3 style) as a drafter: chained drafts, preset and dynamic
trees, window-1 work deferred under ``depth="auto"``, and its K/V of a batch job's cached pages."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax._pytree import pytree_dataclass
from specjax.cache import DenseKVCache
from specjax.cache.base import CAPACITY_BLOCK
from specjax.drafters.base import EngineDrafter, gather_tokens, pick, stack_probs
from specjax.drafters.tree import beam_positions, beam_tree, top_logits
from specjax.protocols import MtpHead, MtpOneSlot, MtpTapped, reachable_positions
from specjax.tree import DynamicTree, TreeMask, ancestors, preset_depths, preset_parents, tree_levels


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


def pick_mtp(eng: Any, params: dict, st: Any, h: jax.Array, positions: jax.Array):
    """The MTP module's draft from its hidden ``h [B, d]`` for ``positions [B]``: over its draft
    vocabulary when it has one (the draft index mapped to the target's token; under sampling the
    distribution scattered into the full vocabulary, zero outside: lossless verification), else
    over the target's head."""
    dec = eng.target
    if not isinstance(dec, MtpHead):  # a model with only the protocol's head
        return pick(dec.head(params["target"], h), eng, st, positions)
    logits, ids = dec.mtp_head(params["target"], h)
    tok, p = pick(logits, eng, st, positions)
    if ids is None:
        return tok, p
    if p is not None:
        p = jnp.zeros((p.shape[0], dec.vocab_size), p.dtype).at[:, ids].set(p)
    return ids[tok], p


def _top(dec, tp, h: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The top ``k`` tokens of the MTP block's head at each of ``h [B, n, d]`` and their
    log-probabilities (temperature 1): int32 and float32 ``[B, n * k]``, node-major (node 0's
    children first, most probable first), as target ids."""
    if isinstance(dec, MtpHead):
        logits, ids = dec.mtp_head(tp, h)
    else:
        logits, ids = dec.head(tp, h), None
    top, logp = top_logits(logits, k)
    return (top if ids is None else ids[top]), logp


def _pool_offset(eng, dstate, rows: jax.Array) -> jax.Array:
    """int32 ``[R]``: where the pool group of each of slots ``rows`` starts in the MTP block's
    store of cached pages (``MtpState.prefix``: one part per pool group, as the target's pool,
    whose block tables hold group-local page ids); 0 with one pool."""
    b, n, g = dstate.cache.k[0].shape[0], dstate.prefix[0].shape[0], eng.pool_groups
    return (jnp.minimum(rows, b - 1) // (b // g) * (n // g)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class MtpDrafter(EngineDrafter):
    """DeepSeek-V3-style MTP head of the target, chained to ``depth`` drafts.

    Under ``depth="auto"`` a window-1 step (no drafts) does not run the MTP block: its commit
    keeps the target's hidden in ``MtpState.pending``, and ``settle`` runs the block over all
    pending positions in one call before the next drafting step (or when ``R`` are pending).
    The block's cache, ``h`` and first draft come out exactly as if it had run every step;
    plain-decoding stretches then cost the block one call per ``R`` tokens, not one per token."""

    name: str = "mtp"
    trees: ClassVar[bool] = True
    reports_status: ClassVar[bool] = True
    defers: ClassVar[bool] = True
    stores_prefixes: ClassVar[bool] = True
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
        if isinstance(dec, MtpOneSlot):  # attention and MLP for the one slot read, K/V up to it
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
            if not isinstance(dec, MtpOneSlot):  # its settle writes all R slots from the block's lagging length
                capacity += -(-r // CAPACITY_BLOCK) * CAPACITY_BLOCK
            # (with it, only the pending ones: up to the target's length. 128 slots more took the
            # block's attention at B=64 from 384 keys to 512, 1.04x-1.06x a drafting step)
        cache = dec.init_mtp_cache(batch, capacity)
        first_probs = None if eng.greedy else jnp.zeros((batch, dec.vocab_size), jnp.float32)
        width = dec.mtp_width if isinstance(dec, MtpTapped) else dec.hidden_size  # the module's own hidden
        return MtpState(cache, jnp.zeros((batch, width), eng.dtype), jnp.zeros((batch,), jnp.int32),
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
        return jnp.stack(drafts, axis=1), stack_probs(probs_all, eng.greedy), s.replace(cache=cache)

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
