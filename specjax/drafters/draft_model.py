"""A separate small draft model with its own per-row caches (the target's vocabulary): chains and
EAGLE-2 dynamic trees."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.drafters.base import EngineDrafter, gather_tokens, pick, stack_probs
from specjax.drafters.tree import beam_positions, beam_tree, top_logits
from specjax.protocols import reachable_positions
from specjax.tree import TreeMask, ancestors


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(EngineDrafter):
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
        return jnp.stack(drafts, axis=1), stack_probs(probs_all, eng.greedy), cache

    trees: ClassVar[bool] = True
    compacts: ClassVar[bool] = True
    reports_status: ClassVar[bool] = True
    tree_presets: ClassVar[bool] = False  # its trees are dynamic (``DynamicTree``)

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
            return (*top_logits(dec.head(dp, h), k), cache)

        tokens, parents, cache = beam_tree(eng.tree, depth, top_logits(root, k), level, cache)
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
