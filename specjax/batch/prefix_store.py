"""The prefix cache's side of a batch job: whether its rows can share cached prompt pages,
the job's ``PrefixCache``, and the pages each admitted row starts on and registers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.batch.requests import Row, admit_layout
from specjax.batch.slots import paged_pools
from specjax.engine import (
    PAGE_SIZE,
    EngineConfig,
    EngineState,
)
from specjax.prefix_cache import PrefixCache
from specjax.validate import fail


def prefix_refusal(eng: EngineConfig) -> str | None:
    """Why rows of this engine cannot start on cached prefix pages, or ``None`` if they can."""
    target = jax.eval_shape(lambda: eng.new_cache(eng.target, eng.pool_groups))
    if not getattr(target, "shares_prefixes", False):
        return "needs cache='paged' and a model whose layers are all global (a sliding-window or compressed " \
               "layer keeps no prefix pages)"
    if eng.drafter.name == "draft_model":
        if not getattr(jax.eval_shape(lambda: eng.new_cache(eng.draft, eng.pool_groups)), "shares_prefixes", False):
            return "needs a draft model whose layers are all global too"
    elif eng.drafter.name not in ("none", "ngram", "mtp"):
        return f"runs with drafters 'none', 'ngram', 'mtp' and 'draft_model' (the {eng.drafter.name!r} drafter " \
               "keeps caches of its own that cached pages do not hold)"
    return None


def job_prefix_cache(eng: EngineConfig, prefix_cache: bool | None, groups: int) -> PrefixCache | None:
    """The job's prefix cache: on by default wherever it applies; ``True`` where it cannot
    apply is refused."""
    if prefix_cache not in (None, True, False):
        fail("prefix_cache", prefix_cache, "must be True, False or None (on wherever it applies)")
    if prefix_cache is False:
        return None
    why = prefix_refusal(eng)
    if why is not None:
        if prefix_cache:
            fail("prefix_cache", True, why)
        return None
    return PrefixCache(PAGE_SIZE, groups, pools=2 if eng.drafter.name == "draft_model" else 1)


def name_pages(eng: EngineConfig, st: EngineState, prefixes: PrefixCache | None, picked: list[tuple[int, Row]],
               started: dict, slots: int) -> None:
    """The prefix cache: the full prompt pages the rows ``picked`` just wrote (past the cached
    ones they ``started`` on) name their prefixes; one read of the block tables."""
    if prefixes is None:
        return
    tables = np.stack(jax.device_get([c.block_table for c in paged_pools(st)]), axis=-1)
    for s, r in picked:
        m, g = len(started.get(s, ())), s // (slots // eng.pool_groups)
        prefixes.add(r.keys[m:], tables[s, m : len(r.keys)], g)
        prefixes.count(len(r.prompt), m)


def share_inputs(batch: list[list[tuple[int, Row]]], refill: int, slots: int, started: dict, max_pages: int,
                 pools: int = 1) -> tuple:
    """``admit``'s prefix arguments for ``batch`` (laid out as ``admit_inputs``): ``(pages
    [pools, R, M], count [R], upto [R])``, the cached pages each row starts on in each pool,
    and its full prompt pages, registered once written."""
    laid = admit_layout(batch, refill, slots)
    pages = np.full((pools, len(laid), max_pages), -1, np.int32)
    count, upto = np.zeros(len(laid), np.int32), np.zeros(len(laid), np.int32)
    for i, (s, r) in enumerate(laid):
        if s == slots:
            continue
        got = started.get(s, ())
        if got:
            pages[:, i, : len(got)] = np.asarray(got).T
        count[i], upto[i] = len(got), len(r.keys)
    return jnp.asarray(pages), jnp.asarray(count), jnp.asarray(upto)
