"""Small random models for engine tests, sharpened so greedy argmax gaps are not ties."""

import jax
import numpy as np
from scipy import stats

from specjax.model import ModelConfig, init_model, logits

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


def filtered(lg, temperature, top_p, top_k=0):
    p = np.exp((lg - lg.max()) / temperature)
    if top_k:  # reference top-k: the k most probable (ties at the k-th kept)
        p = np.where(p >= np.sort(p)[::-1][top_k - 1], p, 0.0)
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    mass = 0.0
    for t in order:  # reference top-p: smallest prefix reaching top_p
        if mass >= top_p:
            break
        keep[t] = True
        mass += p[t]
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def exact_continuations(model, prompt, n, temperature, top_p, top_k=0):
    """Exact distribution over all ``n``-token continuations, by enumeration (temperature, then
    top-k, then top-p: ``specjax.sampling.probs``' order)."""
    v = model.config.vocab_size
    out = {}

    def rec(prefix, prob):
        if len(prefix) == n:
            out[tuple(prefix)] = prob
            return
        lg = np.asarray(logits(model, np.array([prompt + prefix])), np.float64)[0, -1]
        p = filtered(lg, temperature, top_p, top_k)
        for t in range(v):
            if p[t] > 0:
                rec(prefix + [t], prob * p[t])

    rec([], 1.0)
    return out


def chi2_pvalue(samples, exact):
    keys = sorted(exact)
    counts = {k: 0 for k in keys}
    for s in samples:
        assert tuple(s) in counts, f"sampled {s}, which has probability 0"
        counts[tuple(s)] += 1
    n = len(samples)
    obs = np.array([counts[k] for k in keys], float)
    exp = np.array([exact[k] * n for k in keys])
    big = exp >= 5  # pool rare outcomes into one bin
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
