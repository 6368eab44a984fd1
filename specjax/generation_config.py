"""``GenerationConfig``: every setting of a generation (sampling, drafter, depth, cache, rule,
attention, stops, token budget) in one frozen value, checked once when it is made.

``generate``, ``stream``, ``batch_generate``, ``Bundle.generate``, ``generate_text`` and the
CLI all take one (``config=``) and, as before, the same settings as keywords (a keyword
overrides the config's field). What depends on the model (token ids in its vocabulary, a
drafter it can serve, prompts that fit its context) is checked against it before any compile
(``specjax.validate``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from specjax.advance import KvAdvance, parse_kv_advance
from specjax.auto.policy import CostTable, DepthPolicy
from specjax.cache.base import ATTENTION_IMPLS
from specjax.drafters import AUTO, DRAFTERS, resolve_drafter
from specjax.errors import fail, is_int, is_real, shown
from specjax.protocols import Drafter
from specjax.tree import DynamicTree, tree_label, tree_window

__all__ = ["DEFAULT_DEPTH", "MAX_DEPTH", "GenerationConfig", "check_sampling", "fail", "is_int", "shown",
           "takes_settings"]

MAX_DEPTH = 8
DEFAULT_DEPTH = 3  # drafts per step when neither depth= nor a preset tree says
MAX_TREE_NODES = 64  # draft nodes a tree may hold (the verify window is one more)
INT32_MAX = 2**31 - 1  # top_k travels as an int32 per row
CACHES = ("dense", "paged")


def check_sampling(where: str, temperature: object, top_k: object, top_p: object) -> None:
    """One row's sampling settings (``where`` prefixes the names in errors: ``""`` for the
    config's own fields, ``"requests[3] (id 7)."`` for one request of a batch job)."""
    if not is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        fail(f"{where}temperature", temperature, "must be a finite float >= 0")
    if top_k is not None and (not is_int(top_k) or not 1 <= top_k <= INT32_MAX):
        fail(f"{where}top_k", top_k, f"must be an int in [1, {INT32_MAX}] or None")
    if top_p is not None and (not is_real(top_p) or not 0 < top_p <= 1):
        fail(f"{where}top_p", top_p, "must lie in (0, 1]")


def _ints(value: object) -> object:
    """A list of ints as a tuple (a frozen config holds no mutable list); anything else as is."""
    return tuple(value) if isinstance(value, list | np.ndarray) else value


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """The settings of a generation. Made once, checked once (``ValueError`` naming the field,
    its value and what is allowed); ``replace(**changes)`` makes a checked copy.

    * ``max_new_tokens``: per prompt (one int, or one per prompt for ``generate`` / ``stream``;
      a batch job's default for requests that give none, and their bound for a stream).
    * ``drafter``: ``"auto"`` (``"mtp"`` if the model has an MTP module, else ``"block"`` if it
      has a block drafter, else ``"draft_model"`` if a draft model is given, else ``"ngram"``),
      one of those names, ``None`` (plain
      decoding on the same step: the baseline) or a drafter object (``specjax.protocols.Drafter``).
    * ``depth``: drafts per step (``1 .. MAX_DEPTH``; ``None``, the default: ``DEFAULT_DEPTH``, a
      preset tree's own depth, or with ``drafter="block"`` the whole block, ``block_size - 1``),
      ``"auto"`` (each step picks its window from 1 .. ``max_depth + 1`` and each row its draft
      count: ``specjax.auto``), or a
      ``DepthPolicy``. ``cost``: ``depth="auto"``'s step-cost table (a ``CostTable`` or a JSON
      file; default: measured at warm-up and cached on disk). ``ngram_n``: the n-gram drafter's n.
    * ``kv_advance``: ``"per_sequence"`` | ``"cohort"`` | ``None`` (the latched rule).
    * ``cache``: ``"dense"`` | ``"paged"`` | ``None`` (the default: dense for ``generate`` and
      ``stream``; paged for batch jobs where the model's layers are all global, so rows share
      cached prompt prefixes, else dense). ``attention_impl``: ``"xla"`` | ``"pallas"`` |
      ``"auto"`` (Pallas on TPU, XLA elsewhere).
    * ``temperature`` (0: greedy), ``top_k``, ``top_p``: data, never a recompile.
    * ``seed``: one int (each row's seed derived from it and the row, or for a batch job the
      request id) or one per prompt (used as given).
    * ``eos_id``: a stop id or several (a row stops at the first of any); ``None``: none.
    * ``tree``: verify a token tree each step instead of a chain (the MTP drafter proposes it):
      a preset, children per node at each draft depth (``(2, 2, 1)``: 2 first drafts, 2
      children each, 1 child each: 10 nodes; or ``"2x2x1"``), whose depth is ``len(tree)``
      (an int ``depth`` must equal it); or ``"dynamic:N,K"`` (``specjax.tree.DynamicTree``): each step
      and row, the ``N`` most probable nodes of an expansion to ``depth`` that grows the ``K``
      best branches by their ``K`` best children (EAGLE-2). ``None``: a chain of ``depth`` drafts.
      With ``depth="auto"`` each step verifies the tree or a chain (or decodes plainly), as the
      step-cost table prices them (the node budget as a per-step choice: ``specjax.auto``); a
      dynamic tree is then drafted to ``max_depth``, a preset to its own depth.
    """

    max_new_tokens: int | tuple[int, ...] = 64
    drafter: str | Drafter | None = "auto"
    depth: int | str | DepthPolicy | None = None
    max_depth: int = 3
    cost: CostTable | str | os.PathLike | None = None
    ngram_n: int = 3
    kv_advance: str | KvAdvance | None = None
    cache: str | None = None
    attention_impl: str = "auto"
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | tuple[int, ...] = 0
    eos_id: int | tuple[int, ...] | None = None
    tree: tuple[int, ...] | DynamicTree | str | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "seed", "eos_id"):
            object.__setattr__(self, name, _ints(getattr(self, name)))
        object.__setattr__(self, "tree", tree_setting(self.tree))
        if self.tree is not None and not (is_int(self.depth) or self.depth in (None, "auto")):
            fail("tree", tree_label(self.tree), f"does not combine with depth={self.depth!r}: give an int depth "
                 "(a preset tree sets its own) or 'auto'")
        if isinstance(self.tree, tuple) and is_int(self.depth) and self.depth != len(self.tree):
            fail("depth", self.depth, f"tree={tree_label(self.tree)} drafts to depth {len(self.tree)}: leave depth "
                 f"out (a preset tree sets its own) or give {len(self.tree)}")
        news = self.max_new_tokens
        if not (is_int(news) and news >= 1) and not (
                isinstance(news, tuple) and news and all(is_int(n) and n >= 1 for n in news)):
            fail("max_new_tokens", shown(news), "must be an int >= 1 or one per prompt")
        d = self.drafter
        if isinstance(d, str) and d not in (AUTO, *DRAFTERS):
            fail("drafter", d, f"must be one of {[AUTO, *DRAFTERS]}, None or a drafter object (specjax.protocols)")
        if not isinstance(d, str | type(None)):
            resolve_drafter(d)  # a user's drafter: name, propose and a hash
        if isinstance(self.depth, DepthPolicy):
            self.depth.check(MAX_DEPTH)
            if self.depth.tree:
                fail("depth", "DepthPolicy(tree=True)", "needs a tree: give tree= with depth='auto'")
        elif self.depth not in (None, "auto") and not (is_int(self.depth) and 1 <= self.depth <= MAX_DEPTH):
            fail("depth", self.depth,
                 f"must be an int in [1, {MAX_DEPTH}], 'auto' or a DepthPolicy (or None: the default)")
        if not (is_int(self.max_depth) and 1 <= self.max_depth <= MAX_DEPTH):
            fail("max_depth", self.max_depth,
                  f"must be an int in [1, {MAX_DEPTH}] (the widest depth='auto' may draft)")
        if self.tree is not None and self.depth == "auto":
            d = len(self.tree) if isinstance(self.tree, tuple) else self.max_depth
            if tree_window(self.tree, d) <= d + 1:
                fail("tree", tree_label(self.tree), f"holds no more nodes than the depth-{d} chain; under "
                     f"depth='auto' a tree must hold more than {d} (it is the widest choice, beside the chains)")
        if not (is_int(self.ngram_n) and self.ngram_n >= 1):
            fail("ngram_n", self.ngram_n, "must be an int >= 1")
        if self.kv_advance is not None:
            try:
                parse_kv_advance(self.kv_advance)
            except ValueError:
                fail("kv_advance", self.kv_advance, "must be 'per_sequence', 'cohort' or None (the latched rule)")
        if self.cache is not None and self.cache not in CACHES:
            fail("cache", self.cache, "must be 'dense' or 'paged' (or None: the entry point's default)")
        if self.attention_impl not in ATTENTION_IMPLS:
            fail("attention_impl", self.attention_impl, f"must be one of {list(ATTENTION_IMPLS)}")
        check_sampling("", self.temperature, self.top_k, self.top_p)
        seed = self.seed
        if not (is_int(seed) and 0 <= seed < 2**32) and not (
                isinstance(seed, tuple) and seed and all(is_int(s) and 0 <= s < 2**32 for s in seed)):
            fail("seed", shown(seed), "must be an int in [0, 2**32) or one per prompt")
        eos = self.eos_id
        if eos is not None and not is_int(eos) and not (isinstance(eos, tuple) and all(is_int(i) for i in eos)):
            fail("eos_id", shown(eos), "must be an int token id, a list of them, or None")

    def replace(self, **changes: Any) -> GenerationConfig:
        """A checked copy with ``changes`` (a name that is not a field is a ``TypeError``)."""
        unknown = sorted(set(changes) - FIELDS)
        if unknown:
            raise TypeError(f"unknown setting {unknown[0]!r}; the settings are {sorted(FIELDS)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, config: GenerationConfig | None, **settings: Any) -> GenerationConfig:
        """``config`` (default: the defaults) with ``settings`` over it."""
        if config is not None and not isinstance(config, GenerationConfig):
            fail("config", config, "must be a GenerationConfig or None")
        base = config or DEFAULT
        return base.replace(**settings) if settings else base


def tree_setting(value: object) -> tuple[int, ...] | DynamicTree | None:
    """``tree`` as a tuple (``"2x2x1"`` and lists too) or a ``DynamicTree`` (``"dynamic:N,K"``),
    checked: a preset has 1 .. ``MAX_DEPTH`` levels of ints >= 1, and a tree at most
    ``MAX_TREE_NODES`` draft nodes."""
    if value is None:
        return None
    given = value
    if isinstance(value, str) and value.startswith("dynamic:"):
        try:
            n, k = (int(x) for x in value[len("dynamic:"):].split(","))
        except ValueError:
            fail("tree", given, "a dynamic tree is 'dynamic:N,K': N nodes, K children per expanded node")
        value = DynamicTree(n, k)
    if isinstance(value, DynamicTree):
        if not (is_int(value.nodes) and 1 <= value.nodes <= MAX_TREE_NODES and is_int(value.topk)
                and 1 <= value.topk <= value.nodes):
            fail("tree", str(given), f"a dynamic tree needs 1 <= K <= N <= {MAX_TREE_NODES}")
        return value
    if isinstance(value, str):
        try:
            value = tuple(int(k) for k in value.lower().split("x"))
        except ValueError:
            fail("tree", given, "must be children per depth, like (2, 2, 1) or '2x2x1', or 'dynamic:N,K'")
    value = _ints(value)
    if not (isinstance(value, tuple) and 1 <= len(value) <= MAX_DEPTH and all(is_int(k) and k >= 1 for k in value)):
        fail("tree", shown(given), f"must be 1 .. {MAX_DEPTH} ints >= 1 (children per node at each draft depth), "
             "like (2, 2, 1) or '2x2x1', or 'dynamic:N,K'")
    value = tuple(int(k) for k in value)
    if sum(math.prod(value[:i + 1]) for i in range(len(value))) > MAX_TREE_NODES:
        fail("tree", shown(given), f"holds more than {MAX_TREE_NODES} draft nodes")
    return value


FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationConfig))
DEFAULT = GenerationConfig()


def takes_settings(fn: Callable) -> Callable:
    """Show ``GenerationConfig``'s fields as ``fn``'s keyword arguments (``help(generate)``, IDEs
    reading ``__signature__``): ``fn`` takes them as ``**settings``."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(GenerationConfig) if f.name not in taken]
    fn.__signature__ = sig.replace(parameters=params)
    return fn
