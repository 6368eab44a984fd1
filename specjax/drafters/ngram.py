"""Prompt lookup (n-gram) drafting: no model; chains and dynamic trees (a trie of matches)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.drafters.base import Stateless, gather_tokens
from specjax.drafters.tree import kept_tree


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Stateless):
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

    trees: ClassVar[bool] = True
    offers: ClassVar[bool] = True
    tree_presets: ClassVar[bool] = False  # its trees are dynamic: ``DynamicTree(nodes, K)`` with K matches

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
