"""The target's block drafter (DFlash style, ``specjax.model.block``): every draft of a step from
one drafter pass, whatever the depth."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from specjax._pytree import pytree_dataclass
from specjax.cache import DenseKVCache
from specjax.cache.base import CAPACITY_BLOCK
from specjax.drafters.base import EngineDrafter, gather_tokens, pick, stack_probs
from specjax.drafters.tree import beam_tree, top_logits
from specjax.protocols import reachable_positions
from specjax.tree import DynamicTree, preset_parents


@pytree_dataclass
class BlockState:
    """The block drafter's state. Invariant: ``cache.lengths`` are the target's cache lengths,
    and the cache holds context entries of every position before the row's last known token
    (a commit writes all it verified, ``u + a``, and advances by the rule's plan)."""

    cache: DenseKVCache  # per drafter layer, the context K/V (then a pass's scratch block)


@dataclasses.dataclass(frozen=True)
class BlockDrafter(EngineDrafter):
    """Drafts ``depth <= block_size - 1`` tokens per step in one pass of the model's block
    drafter over the row's last known token and ``block_size - 1`` mask tokens; the pass reads
    the row's context (projected from the target's tapped hidden states, kept per row and
    advanced by the plan like the target's caches). The engine runs the target ``with_taps``."""

    name: str = "block"
    reports_status: ClassVar[bool] = True
    trees: ClassVar[bool] = True

    def empty(self, eng, batch, width, capacity=None):
        if capacity is None:  # a pass writes its block past the context: room for it
            k = eng.target.block_size
            capacity = eng.capacity + -(-k // CAPACITY_BLOCK) * CAPACITY_BLOCK
        return BlockState(eng.target.init_block_cache(batch, capacity))

    def rows_view(self, eng, dstate, rows, width):
        return self.empty(eng, rows.shape[0], width, capacity=width)

    def put_rows(self, dstate, rows, sub):
        return BlockState(dstate.cache.put_rows(rows, sub.cache))

    def release(self, dstate, idle):
        return dstate  # a dense cache: nothing to return

    def prefill(self, eng, params, st, hidden, positions, live):
        # a chunk of the prompt from each row's own length (``prefill_chunk``)
        cache = st.dstate.cache
        count = jnp.clip(st.prompt_len - cache.lengths, 0, hidden.shape[1])
        cache = eng.target.block_context(params["target"], hidden, positions, cache, count)
        return BlockState(cache.advance(count))

    def _pass(self, eng, params, st):
        """One drafter pass over each row's last known token and ``k - 1`` masks: ``(logits
        [B, k - 1, V], dstate)``; row ``j`` of the logits drafts position ``known + j``."""
        dec, k = eng.target, eng.target.block_size
        cache = st.dstate.cache
        last = st.known - 1  # the block starts at the last known token; the context is every position before it
        pos = reachable_positions(last[:, None] + jnp.arange(k, dtype=jnp.int32)[None], st.max_len)
        first = gather_tokens(st.seq, last[:, None])[:, 0]
        logits, cache = dec.block_draft(params["target"], first, pos, cache.replace(lengths=last),
                                        attention_impl=eng.attention_impl)
        return logits, BlockState(cache.replace(lengths=st.dstate.cache.lengths))  # the block's K/V was scratch

    def propose(self, eng, params, st):
        logits, dstate = self._pass(eng, params, st)
        drafts, probs_all = [], []
        for j in range(min(max(eng.depth, 1), logits.shape[1])):  # the drafts the step verifies
            tok, p = pick(logits[:, j], eng, st, st.known + j)
            drafts.append(tok)
            probs_all.append(p)
        return jnp.stack(drafts, axis=1), stack_probs(probs_all, eng.greedy), dstate

    def propose_tree(self, eng, params, st):
        """The tree ``eng.tree`` below each row's last known token from one pass: ``(tokens
        [B, T], parents [B, T + 1], dstate)`` (``DrafterTrees``). The block's positions do not
        depend on one another's tokens, so a node at draft depth ``j`` takes its children from
        position ``j``'s distribution whatever its branch: a preset gives each node the top
        ``tree[j]`` tokens there; a ``DynamicTree`` grows the ``K`` best branches by cumulative
        log-probability and keeps the ``N`` best nodes (``beam_tree``). Drafts are deterministic
        (top tokens), so sampled verification stays lossless."""
        logits, dstate = self._pass(eng, params, st)
        if isinstance(eng.tree, DynamicTree):
            k = eng.tree.topk
            tok, logp = top_logits(logits[:, :eng.depth], k)  # [B, depth * k]: position j's top k at j * k

            def level(lvl, beam_tok, beam_par, rows, carry):  # every beam node: position lvl's top k
                at = slice(lvl * k, (lvl + 1) * k)
                return jnp.tile(tok[:, at], (1, k)), jnp.tile(logp[:, at], (1, k)), carry

            tokens, parents, _ = beam_tree(eng.tree, eng.depth, (tok[:, :k], logp[:, :k]), level, None)
            return tokens, parents, dstate
        b = logits.shape[0]
        preset = preset_parents(eng.tree)
        tokens, nodes = [], 1  # nodes at the level above (the root)
        for j, kids in enumerate(eng.tree):  # each node of depth j + 1: position j's top ``kids``, parent-major
            top = top_logits(logits[:, j:j + 1], kids)[0]
            tokens.append(jnp.tile(top, (1, nodes)))
            nodes *= kids
        return jnp.concatenate(tokens, axis=1), jnp.broadcast_to(jnp.asarray(preset), (b, len(preset))), dstate

    def commit(self, eng, params, st, dstate, hidden, old_lengths, u, a, advance):
        # every verified position's context entry (u known tokens, a accepted drafts): the next
        # block starts after them; the lengths move by the plan
        pos = old_lengths[:, None] + jnp.arange(hidden.shape[1], dtype=jnp.int32)[None]
        cache = eng.target.block_context(params["target"], hidden, reachable_positions(pos, st.max_len),
                                         dstate.cache, u + a)
        return BlockState(cache.advance(advance))

    def status(self, dstate):
        """int32 [B]: the context cache's status bits (``cache.base``)."""
        return dstate.cache.status
