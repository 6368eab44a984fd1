"""Plain NumPy loop references for masks and attention."""

import numpy as np


def ref_visible(q_pos, key_pos, lead_pad, window=None):
    b, t_q = q_pos.shape
    t = key_pos.shape[1]
    out = np.zeros((b, t_q, t), bool)
    for i in range(b):
        for q in range(t_q):
            for j in range(t):
                p = key_pos[i, j]
                ok = p >= 0 and lead_pad[i] <= p <= q_pos[i, q]
                if window is not None:
                    ok = ok and p > q_pos[i, q] - window
                out[i, q, j] = ok
    return out


def ref_attention(q, k, v, q_pos, key_pos, lead_pad, window=None, scale=None):
    """Loop over rows, queries and heads; softmax over visible keys only.
    ``q [B, t_q, Hq, D]``, ``k, v [B, Hkv, T, D]`` (head-major, as the caches store them)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t_q, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    vis = ref_visible(np.asarray(q_pos), np.asarray(key_pos), np.asarray(lead_pad), window)
    out = np.zeros((b, t_q, hq, d))
    for i in range(b):
        for t in range(t_q):
            js = np.nonzero(vis[i, t])[0]
            if len(js) == 0:
                continue
            for h in range(hq):
                s = np.array([q[i, t, h] @ k[i, h // g, j] for j in js]) * scale
                p = np.exp(s - s.max())
                p /= p.sum()
                out[i, t, h] = sum(pj * v[i, h // g, j] for pj, j in zip(p, js, strict=True))
    return out
