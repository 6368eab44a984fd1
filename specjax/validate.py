"""Checks of ``generate``'s arguments, before anything compiles: each error names the
argument, its value and what is allowed."""

from __future__ import annotations

import numpy as np

from specjax.auto.policy import DepthPolicy
from specjax.drafters import drafter_kind
from specjax.generation_config import DEFAULT_DEPTH, MAX_DEPTH, GenerationConfig, fail, shown
from specjax.protocols import BlockHead, check_model
from specjax.sampling import derive_seed
from specjax.tree import Tree, tree_window

__all__ = ["EOS_WIDTH", "MAX_DEPTH", "check_drafter_models", "check_eos", "default_depth", "eos_table", "fail",
           "resolve_depth", "validate"]

EOS_WIDTH = 4  # stop ids a row holds on device (a longer list widens every row: one more compile)


def default_depth(drafter: object, model: object) -> int:
    """Drafts per step when neither ``depth=`` nor a preset tree says: a block drafter's whole
    block (its one pass drafts ``block_size - 1`` tokens whatever the depth), else ``DEFAULT_DEPTH``."""
    decoder = getattr(model, "decoder", None)
    if drafter_kind(drafter) == "block" and isinstance(decoder, BlockHead) and decoder.block_size:
        return decoder.block_size - 1
    return DEFAULT_DEPTH


def resolve_depth(depth: object, max_depth: int, drafter: object, static_batch: bool = False,
                  tree: Tree | None = None, model: object = None) -> tuple[int, DepthPolicy | None]:
    """``depth`` (an int, ``None`` for the default, ``"auto"`` with ``max_depth``, or a ``DepthPolicy``, as a
    ``GenerationConfig`` checked them) -> (the engine's depth, its policy). Plain decoding
    (``drafter=None``) has neither. ``"auto"`` chooses by ``"makespan"`` for a ``static_batch``
    (``generate``, ``stream``: the batch lasts as long as its slowest row) and by ``"goodput"``
    otherwise (``batch_generate``: a finished row's slot takes new work, so tokens per second
    summed over rows is what counts). With a ``tree`` it is the widest choice, drafted to
    ``max_depth``, beside every chain. A preset ``tree`` sets its own depth, whatever ``depth``;
    ``None`` is ``default_depth`` for ``model``."""
    if isinstance(tree, tuple):
        max_depth = len(tree)
        depth = depth if depth == "auto" else len(tree)
    elif depth is None:
        depth = default_depth(drafter, model)
    if drafter_kind(drafter) is None:
        return 0, None
    if isinstance(depth, DepthPolicy):
        return depth.max_depth, depth
    if depth == "auto":
        d = int(max_depth)
        return d, DepthPolicy.auto(d, "makespan" if static_batch else "goodput",
                                   always_offers=drafter_kind(drafter) != "ngram",
                                   tree_window=None if tree is None else tree_window(tree, d))
    return int(depth), None


def validate(model, prompts, cfg: GenerationConfig, drafter, draft_model) -> tuple[list[int], list[int], tuple]:
    """What ``cfg`` (checked when made) and the prompts must satisfy on this model: prompts of
    its token ids that fit its context with their new tokens, a per-prompt list's length, a
    drafter the models can serve, stop ids in its vocabulary. Returns (each row's seed, each
    row's max_new_tokens, the stop ids)."""
    model_cfg = check_model("model", model)
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
        bad = np.nonzero((arr < 0) | (arr >= model_cfg.vocab_size))[0]
        if len(bad):
            fail(f"prompts[{i}][{int(bad[0])}]", int(arr[bad[0]]),
                 f"token ids must lie in [0, {model_cfg.vocab_size})")
    max_new_tokens = cfg.max_new_tokens
    per_row = isinstance(max_new_tokens, tuple)
    news = list(max_new_tokens) if per_row else [max_new_tokens] * len(prompts)
    if len(news) != len(prompts):
        fail("max_new_tokens", shown(max_new_tokens), f"must be an int >= 1 or one per prompt ({len(prompts)})")
    lens = [len(p) for p in prompts]
    longest = max(lens)
    which = lens.index(longest)
    limit = model_cfg.max_seq_len
    if longest >= limit:
        fail(f"prompts[{which}]", f"{longest} tokens",
             f"the model's context is max_seq_len={limit} tokens: a prompt may hold at most "
             f"{limit - 1} (to leave room for one new token)")
    over = [i for i in range(len(prompts)) if lens[i] + news[i] > limit]
    if per_row and over:
        i = over[0]
        fail(f"max_new_tokens[{i}]", news[i], f"prompt length {lens[i]} (prompts[{i}]) + max_new_tokens must be "
             f"<= the model's max_seq_len={limit}: at most {limit - lens[i]} new tokens fit")
    if over:
        fail("max_new_tokens", shown(max_new_tokens),
             f"prompt length {longest} (prompts[{which}]) + max_new_tokens must be <= the model's "
             f"max_seq_len={limit}: at most {limit - longest} new tokens fit")
    check_drafter_models(drafter, model, draft_model, need_context=True)
    seed = cfg.seed
    seeds = [seed] * len(prompts) if isinstance(seed, int | np.integer) else list(seed)
    if len(seeds) != len(prompts):
        fail("seed", list(seed), f"must be an int in [0, 2**32) or one per prompt ({len(prompts)})")
    if isinstance(seed, int | np.integer):  # one base seed: each row's own stream, from (seed, row)
        seeds = [derive_seed(int(seed), i) for i in range(len(prompts))]
    stops = check_eos("eos_id", shown(cfg.eos_id), model_cfg.vocab_size)
    return [int(s) for s in seeds], [int(n) for n in news], stops


def check_drafter_models(drafter, model, draft_model, need_context: bool = False) -> None:
    """The models give ``drafter`` (a name, ``None`` or a drafter object, as a
    ``GenerationConfig`` checked it, ``"auto"`` resolved) what it needs: an MTP module for
    ``"mtp"``; for ``"draft_model"`` a draft model (the model protocol) with the target's
    vocabulary (and, with ``need_context``, at least its context)."""
    kind = drafter_kind(drafter)
    cfg = check_model("model", model)
    if kind == "mtp" and cfg.mtp_depth < 1:
        fail("drafter", drafter, "the model has no MTP module (mtp_depth=0)")
    if kind == "block" and not (isinstance(cfg, BlockHead) and cfg.block_size):
        fail("drafter", drafter, "the model has no block drafter (block_size=0): train one with "
             "`specjax train-drafter --kind block`")
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
