"""Small random models for engine tests, sharpened so greedy argmax gaps are not ties."""

import jax

from specjax.model import ModelConfig, init_model

GLOBAL = ModelConfig(vocab_size=31, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
                     tie_embeddings=False)
SLIDING = ModelConfig(vocab_size=31, d_model=32, n_layers=3, n_heads=4, n_kv_heads=1, d_ff=64, max_seq_len=64,
                      tie_embeddings=False, sliding_window=6, global_every=3)
TINY = ModelConfig(vocab_size=4, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16,
                   tie_embeddings=False)


def sharp(cfg, seed=0, s_emb=3.0, s_head=40.0):
    m = init_model(cfg, seed=seed)
    p = dict(m.params)
    p["embed"] = p["embed"] * s_emb
    p["lm_head"] = p["lm_head"] * s_head
    return m.replace(params=p)


def noisy(model, scale, seed=5):
    """A draft model: the target with relative Gaussian noise on every weight."""
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [x + scale * x.std() * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return model.replace(params=jax.tree.unflatten(tree, out))
