"""The small models the batch tests share (``tests/api/``): a sharp target, a sliding-window
one, a noisy draft of the first, and requests checked against ``generate`` alone."""

import numpy as np

from specjax import Request, generate
from specjax.model import ModelConfig

from engine_models import noisy, sharp

SMALL = ModelConfig(vocab_size=31, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
                    tie_embeddings=False)
SLIDING = ModelConfig(vocab_size=31, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=64, max_seq_len=64,
                      tie_embeddings=False, sliding_window=5, global_every=2)
MODEL = sharp(SMALL, seed=3)
SLIDING_MODEL = sharp(SLIDING, seed=4)
DRAFT = noisy(MODEL, 0.3, seed=9)
EOS = 5


def make_requests(n, seed, prefix="r"):
    rng = np.random.default_rng(seed)
    return [Request(prompt=rng.integers(0, 31, rng.integers(2, 9)).tolist(), id=f"{prefix}{i}",
                    max_new_tokens=int(rng.integers(3, 30))) for i in range(n)]


def alone(model, r, **kw):
    return alone_run(model, r, **kw).tokens[0]


def alone_run(model, r, **kw):
    return generate(model, [list(r.prompt)], max_new_tokens=r.max_new_tokens, **kw)
