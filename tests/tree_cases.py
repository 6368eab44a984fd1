"""Random token trees verified greedily, shared by the tree-budget and tree-simulator tests."""

import jax.numpy as jnp
import numpy as np

from specjax.tree import ancestors, tree_greedy_verify


def verified_trees(seed, n, vocab, b=4):
    """``b`` random windows of ``n`` nodes (each a chain of ``u`` known nodes, then a random
    tree below the last), greedily verified against random logits over ``vocab`` tokens:
    ``(parents, u, anc, a, path)``. """
    rng = np.random.default_rng(seed)
    u = rng.integers(1, n, b).astype(np.int32)
    parents = np.zeros((b, n), np.int32)
    for r in range(b):
        parents[r] = [j - 1 if j < u[r] else int(rng.integers(u[r] - 1, j)) for j in range(n)]
        parents[r, 0] = -1
    tokens = rng.integers(0, vocab, (b, n)).astype(np.int32)
    lg = rng.normal(size=(b, n, vocab)).astype(np.float32)
    anc = ancestors(jnp.asarray(parents))
    a, path, _ = tree_greedy_verify(jnp.asarray(lg), jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(u),
                                    anc=anc)
    return parents, u, anc, a, path
