"""Checks of ``generate``'s arguments, before anything compiles: each error names the
argument, its value and what is allowed."""

from __future__ import annotations

import math

import numpy as np

from specjax.depth_policy import DepthPolicy
from specjax.drafter import DRAFTERS, drafter_kind, resolve_drafter
from specjax.protocols import check_model
from specjax.sampling import derive_seed

__all__ = ["EOS_WIDTH", "check_drafter_models", "check_eos", "eos_table", "fail", "resolve_depth", "validate"]

EOS_WIDTH = 4  # stop ids a row holds on device (a longer list widens every row: one more compile)

MAX_DEPTH = 8


def fail(arg: str, value: object, allowed: str) -> None:
    """Raise ``ValueError('<arg>=<value> is invalid: <allowed>')``."""
    raise ValueError(f"{arg}={value!r} is invalid: {allowed}")


def resolve_depth(depth: object, max_depth: object, drafter: object,
                  static_batch: bool = False) -> tuple[int, DepthPolicy | None]:
    """``depth`` (an int, ``"auto"`` with ``max_depth``, or a ``DepthPolicy``) -> (the engine's
    depth, its policy). Plain decoding (``drafter=None``) has neither. ``"auto"`` chooses by
    ``"makespan"`` for a ``static_batch`` (``generate``, ``stream``: the batch lasts as long as
    its slowest row) and by ``"goodput"`` otherwise (``batch_generate``: a finished row's slot
    takes new work, so tokens per second summed over rows is what counts)."""
    if drafter_kind(drafter) is None:
        return 0, None
    if isinstance(depth, DepthPolicy):
        depth.check(MAX_DEPTH)
        return depth.windows[-1] - 1, depth
    if depth == "auto":
        if isinstance(max_depth, bool) or not isinstance(max_depth, int | np.integer) \
                or not 1 <= max_depth <= MAX_DEPTH:
            fail("max_depth", max_depth, f"must be an int in [1, {MAX_DEPTH}] (the widest depth='auto' may draft)")
        return int(max_depth), DepthPolicy.auto(int(max_depth), "makespan" if static_batch else "goodput",
                                                always_offers=drafter_kind(drafter) != "ngram")
    if isinstance(depth, bool) or not isinstance(depth, int | np.integer) or not 1 <= depth <= MAX_DEPTH:
        fail("depth", depth, f"must be an int in [1, {MAX_DEPTH}], 'auto' or a DepthPolicy")
    return int(depth), None


def validate(model, prompts, max_new_tokens, drafter, draft_model, cache, temperature, top_k, top_p, seed, eos_id):
    """Everything but the depth (``resolve_depth``); returns (seeds, max_new_tokens per row, stop ids)."""
    cfg = check_model("model", model)
    if not isinstance(prompts, list | tuple) or len(prompts) == 0:
        fail("prompts", prompts, "must be a non-empty list of token-id lists")
    if all(isinstance(p, int | np.integer) for p in prompts):
        fail("prompts", prompts, "is one flat list of ints: pass a list of prompts, e.g. [prompt]")
    for i, p in enumerate(prompts):
        if not isinstance(p, list | tuple | np.ndarray):
            fail(f"prompts[{i}]", p, "must be a list of int token ids")
        if len(p) == 0:
            fail(f"prompts[{i}]", p, "a prompt must hold at least one token")
        arr = np.asarray(p)
        if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1:
            fail(f"prompts[{i}]", p, "must be a list of int token ids")
        bad = np.nonzero((arr < 0) | (arr >= cfg.vocab_size))[0]
        if len(bad):
            fail(f"prompts[{i}][{int(bad[0])}]", int(arr[bad[0]]), f"token ids must lie in [0, {cfg.vocab_size})")
    per_row = isinstance(max_new_tokens, list | tuple)
    news = list(max_new_tokens) if per_row else [max_new_tokens] * len(prompts)
    if len(news) != len(prompts) or any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1
                                        for n in news):
        fail("max_new_tokens", max_new_tokens, f"must be an int >= 1 or one per prompt ({len(prompts)})")
    lens = [len(p) for p in prompts]
    longest = max(lens)
    which = lens.index(longest)
    if longest >= cfg.max_seq_len:
        fail(f"prompts[{which}]", f"{longest} tokens",
              f"the model's context is max_seq_len={cfg.max_seq_len} tokens: a prompt may hold at most "
              f"{cfg.max_seq_len - 1} (to leave room for one new token)")
    over = [i for i in range(len(prompts)) if lens[i] + news[i] > cfg.max_seq_len]
    if per_row and over:
        i = over[0]
        fail(f"max_new_tokens[{i}]", news[i], f"prompt length {lens[i]} (prompts[{i}]) + max_new_tokens must be "
              f"<= the model's max_seq_len={cfg.max_seq_len}: at most {cfg.max_seq_len - lens[i]} new tokens fit")
    if over:
        fail("max_new_tokens", max_new_tokens,
              f"prompt length {longest} (prompts[{which}]) + max_new_tokens must be <= the model's "
              f"max_seq_len={cfg.max_seq_len}: at most {cfg.max_seq_len - longest} new tokens fit")
    check_drafter_models(drafter, model, draft_model, need_context=True)
    if cache not in ("dense", "paged"):
        fail("cache", cache, "must be 'dense' or 'paged'")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not math.isfinite(temperature) \
            or temperature < 0:
        fail("temperature", temperature, "must be a finite float >= 0")
    if top_p is not None and not 0 < top_p <= 1:
        fail("top_p", top_p, "must lie in (0, 1]")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        fail("top_k", top_k, "must be an int >= 1 or None")
    seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompts) or any(not isinstance(s, int) or not 0 <= s < 2**32 for s in seeds):
        fail("seed", seed, f"must be an int in [0, 2**32) or one per prompt ({len(prompts)})")
    if isinstance(seed, int):  # one base seed: each row's own stream, from (seed, row)
        seeds = [derive_seed(seed, i) for i in range(len(prompts))]
    return seeds, [int(n) for n in news], check_eos("eos_id", eos_id, cfg.vocab_size)


def check_drafter_models(drafter, model, draft_model, need_context: bool = False) -> None:
    """``drafter`` is ``None``, a name in ``DRAFTERS`` or a drafter object, and the models give it
    what it needs: an MTP module for ``"mtp"``; for ``"draft_model"`` a draft model (the model
    protocol) with the target's vocabulary (and, with ``need_context``, at least its context)."""
    if isinstance(drafter, str) and drafter not in DRAFTERS:
        fail("drafter", drafter, f"must be one of {list(DRAFTERS)}, None or a drafter object (specjax.protocols)")
    if not isinstance(drafter, str | type(None)):
        resolve_drafter(drafter)  # a user's drafter: name, propose and a hash
    kind = drafter_kind(drafter)
    cfg = check_model("model", model)
    if kind == "mtp" and cfg.mtp_depth < 1:
        fail("drafter", drafter, "the model has no MTP module (mtp_depth=0)")
    if kind == "draft_model":
        if draft_model is None:
            fail("draft_model", draft_model, "drafter='draft_model' needs a draft model (a specjax Model, "
                 "specjax.nnx_model(...) or any model following specjax.protocols)")
        dcfg = check_model("draft_model", draft_model)
        if dcfg.vocab_size != cfg.vocab_size:
            fail("draft_model", f"vocab_size {dcfg.vocab_size}", f"must equal the target's vocab_size {cfg.vocab_size}")
        if need_context and dcfg.max_seq_len < cfg.max_seq_len:
            fail("draft_model", f"max_seq_len {dcfg.max_seq_len}",
                 f"must be >= the target's max_seq_len {cfg.max_seq_len}")


def check_eos(arg: str, eos: object, vocab_size: int) -> tuple[int, ...]:
    """``eos``: ``None``, one token id or a list of them (a row stops on any) -> the ids."""
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int | np.integer) and not isinstance(eos, bool) else eos
    if not isinstance(ids, list | tuple) or not all(isinstance(i, int | np.integer) and not isinstance(i, bool)
                                                    for i in ids):
        fail(arg, eos, "must be an int token id, a list of them, or None")
    if not all(0 <= i < vocab_size for i in ids):
        fail(arg, eos, f"every stop id must lie in [0, {vocab_size})")
    return tuple(int(i) for i in ids)


def eos_table(rows: list[tuple[int, ...]], width: int | None = None) -> np.ndarray:
    """Per-row stop ids ``int32 [B, E]``, ``-1``-padded; ``E = max(EOS_WIDTH, longest list)``."""
    width = max([EOS_WIDTH] + [len(r) for r in rows]) if width is None else width
    out = np.full((len(rows), width), -1, np.int32)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out
