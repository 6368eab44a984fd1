"""Training a block drafter (``specjax.model.block``) for a frozen target: distillation on the
target's own greedy continuations.

``continuations`` turns a corpus into sequences the target wrote itself: a corpus prompt of
``prompt`` tokens, then the target's greedy tokens (plain decoding with the engine). A block
drafter's drafts are accepted where they equal what the target would write next, so those
tokens are its labels. ``specjax.train.block_loss`` runs the frozen target over a window (its tapped hidden
states), then the drafter over ``A`` blocks per window at once (``train_block_hidden``): block
``a`` starts at an anchor inside the generated part and predicts the next ``k - 1`` tokens, one
cross-entropy per block position. The stage runs through ``specjax.train.run_stage`` (optax,
resumable orbax checkpoints, a progress bar, held-out accuracy per block position).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import jax
import numpy as np

from specjax.corpus import Corpus
from specjax.model import Model
from specjax.model.block import init_block_params
from specjax.train import run_stage, write_json_line

__all__ = ["attach_block", "continuations", "train_block"]


def attach_block(model: Model, *, block_size: int, layers: int = 1, taps: tuple[int, ...] | None = None,
                 mask_id: int | None = None, seed: int = 0) -> Model:
    """``model`` with a fresh block drafter. ``taps``: the target layers it reads (default: a
    low, a middle and the last layer, as DFlash picks); ``mask_id``: the mask token (default:
    the vocabulary's last id)."""
    cfg = model.config
    if taps is None:
        taps = tuple(sorted({min(1, cfg.n_layers - 1), cfg.n_layers // 2, cfg.n_layers - 1}))
    cfg = dataclasses.replace(cfg, block_size=block_size, block_layers=layers, block_taps=tuple(taps),
                              block_mask_id=cfg.vocab_size - 1 if mask_id is None else mask_id)
    dtype = model.params["embed"].dtype
    return Model({**model.params, "block": init_block_params(jax.random.key(seed), cfg, dtype)}, cfg)


def continuations(model: Model, stream: np.ndarray, count: int, length: int, prompt: int, *, seed: int = 0,
                  batch: int = 64, progress: bool = True) -> np.ndarray:
    """``count`` sequences ``int32 [count, length]``: a corpus window's first ``prompt`` tokens,
    then the target's greedy continuation (plain decoding; a row that stops early is padded
    with its last token). Windows start at random offsets of ``stream`` (``seed``)."""
    from specjax.generation import generate

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, stream.size - prompt, size=count)
    out = np.zeros((count, length), np.int32)
    base = dataclasses.replace(model.config, block_size=0, block_layers=0, block_taps=(), mtp_depth=0)
    plain = Model({k: v for k, v in model.params.items() if k not in ("block", "mtp")}, base)
    for i in range(0, count, batch):
        prompts = [stream[s : s + prompt].tolist() for s in starts[i : i + batch]]
        got = generate(plain, prompts, max_new_tokens=length - prompt, drafter=None).tokens
        for j, row in enumerate(got):
            seq = (prompts[j] + row)[:length]
            out[i + j, : len(seq)] = seq
            out[i + j, len(seq):] = seq[-1]
        if progress:
            print(f"\rcontinuations {min(i + batch, count)}/{count}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return out


def train_block(model: Model, corpus: Corpus, out: str | pathlib.Path, sc, *, block_size: int = 8,
                layers: int = 1, taps: tuple[int, ...] | None = None, sequences: int = 1024, prompt: int = 32,
                resume: bool = False, progress: bool = True, bytes_only: bool = True) -> tuple[Model, dict]:
    """Attach a fresh block drafter to the frozen ``model`` and train it (``sc``: a
    ``StageConfig``; windows of ``sc.seq_len``) on ``sequences`` greedy continuations of corpus
    prompts (and held-out ones for the evaluation). Checkpoints under ``out/train``."""

    fresh = attach_block(model, block_size=block_size, layers=layers, taps=taps, seed=sc.seed)
    length = sc.seq_len  # windows of seq_len + 1 start every seq_len: a window is one sequence (and a token after)
    held_n = max(sc.eval_windows, 1)
    data = Corpus(continuations(model, corpus.train, sequences, length, prompt, seed=sc.seed, progress=progress)
                  .reshape(-1),
                  continuations(model, corpus.held_out, held_n, length, prompt, seed=sc.seed + 1,
                                progress=progress).reshape(-1),
                  corpus.train_files, corpus.held_out_files, f"greedy continuations of {corpus.source}")
    log = pathlib.Path(out) / "train" / "log.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    trained, summary = run_stage("block", fresh, data, sc, pathlib.Path(out) / "train",
                                 resume=resume, progress=progress, log=lambda r: write_json_line(log, r),
                                 bytes_only=bytes_only, block_first=prompt - 1)
    summary.update(sequences=sequences, prompt=prompt, corpus=corpus.describe())
    return trained, summary
