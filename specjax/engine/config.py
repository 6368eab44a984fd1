"""The static engine: ``EngineConfig`` (everything a compile depends on), how big its caches
are (``request_capacity``, ``prompt_bucket``) and ``make_engine``, which builds one."""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.advance import KvAdvance
from specjax.cache.base import CAPACITY_BLOCK, resolve_attention_impl
from specjax.drafters import drafter_kind, resolve_drafter
from specjax.engine.controller import StepController
from specjax.protocols import BlockHead, Decoder, DecoderModel, MtpTapped, check_model
from specjax.sharding import data_shards
from specjax.tree import DynamicTree, Tree, max_children, preset_parents, tree_label, tree_scratch, tree_window

__all__ = ["PAGE_SIZE", "EngineConfig", "check_tree", "check_tree_memory", "make_engine", "prompt_bucket",
           "request_capacity"]

PAGE_SIZE = 16  # tokens per page of a paged cache


def request_capacity(prompt_width: int, max_new_tokens: int, depth: int, *, bucket: bool = True) -> int:
    """Cache slots per row for one request batch (``prompt_width`` = the padded prompt).

    The largest slot any write touches: a row's committed length reaches at most
    ``max_len - 1`` (``max_len = prompt + max_new_tokens``; a finished row stays there and
    keeps receiving masked writes), and past it a step writes the verify window ``w`` and a
    draft model reserves ``2w`` (its window plus ``d`` chained feeds). So
    ``prompt_width + max_new_tokens + 2w - 1`` slots, exactly (tested at the boundary).

    With ``bucket`` the result rounds up to a multiple of ``CAPACITY_BLOCK`` (eight buckets
    per octave above 1024 slots), so nearby requests share one compile and kernel blocks
    divide it. The model's ``max_seq_len`` is only a validation bound, never a size.
    """
    w = depth + 1
    need = max(prompt_width, 1) + max_new_tokens + 2 * w - 1
    if not bucket:
        return need
    step = CAPACITY_BLOCK if need <= 1024 else max(CAPACITY_BLOCK, (1 << (need - 1).bit_length()) // 8)
    return -(-need // step) * step


def prompt_bucket(prompts: list[list[int]]) -> int:
    """Padded prompt width of a batch: the longest prompt rounded up to a power of two (>= 8).
    Each bucket is its own compile (warm every bucket before timing)."""
    return max(8, 1 << (max(len(p) for p in prompts) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The static configuration of a generation: everything a compile depends on (hashable;
    a static argument of every jitted function). The state that changes is ``EngineState``."""

    target: Decoder  # the target model's static half (``specjax.protocols``); its params are ``params["target"]``
    drafter: Any
    depth: int
    kv_rule: KvAdvance
    cache_kind: str
    greedy: bool  # every row greedy: argmax, no distributions (else per-row ``RowSampling``)
    capacity: int  # cache slots per row (request-sized: ``request_capacity``)
    max_steps: int  # trace length (a step emits >= 1 token per active row, so capacity bounds it)
    draft: Decoder | None = None  # a draft model's (drafter "draft_model"); its params are ``params["draft"]``
    attention_impl: str = "xla"  # resolved: "xla" | "pallas"
    num_pages: int | None = None  # paged pool size (None: every row's full capacity)
    # picks each step's window among several and each row's draft count (depth="auto":
    # ``specjax.auto.AutoDepth``); None: a fixed depth, one window, every row drafts all it can
    controller: StepController | None = None
    mesh: Any = None  # a ("data", "model") jax.sharding.Mesh (specjax.sharding), or None: one device
    pool_groups: int = 1  # paged pools: one per data shard (the mesh's data axis; ``PagedKVCache.split_pool``)
    # a token tree to verify each step: a preset (``specjax.tree.preset_parents``: children per node
    # at each draft depth; ``depth = len(tree)``) or a ``DynamicTree`` drafted to ``depth``; None: a chain
    tree: Tree | None = None

    @property
    def window(self) -> int:
        """The widest verify window (every step's, without a controller): ``depth + 1`` drafts and
        known token, or a tree's nodes and its root."""
        return self.depth + 1 if self.tree is None else tree_window(self.tree, self.depth)

    @property
    def windows(self) -> tuple[int, ...]:
        return (self.window,) if self.controller is None else self.controller.windows

    @property
    def dtype(self) -> Any:
        return self.target.dtype

    def at_window(self, w: int) -> EngineConfig:
        """The engine a step at verify window ``w`` (one of ``windows``) hands its drafter:
        depth ``w - 1``, no controller (the drafter drafts exactly that many), a chain (a tree
        engine's narrower windows are chains)."""
        return self if w == self.window else dataclasses.replace(self, depth=w - 1, controller=None, tree=None)

    @property
    def branches(self) -> int:
        """Sibling ranks a tree step counts per level (``max_children``; 0 for a chain)."""
        return 0 if self.tree is None else max_children(self.tree)

    @property
    def scratch(self) -> int:
        """Slots a drafter writes past the window (a dynamic tree's beams; 0 for a chain)."""
        return 0 if self.tree is None else tree_scratch(self.tree, self.depth)

    def new_cache(self, dec: Decoder, batch: int) -> Any:
        """Empty caches of ``dec`` (the target or the draft model) for ``batch`` rows. Rolling and
        compressed caches reach a window plus chained draft writes (``2w + 2``) past the committed
        length; the prefill, however wide, is bounded per row (``bound_write``), so it does not
        size their rings. A paged pool is split into ``pool_groups`` pools (one per data shard)
        when the cache can be (``split_pool``)."""
        cache = dec.init_cache(batch, self.capacity, kind=self.cache_kind, slack=2 * self.window + 2 + self.scratch,
                               page_size=PAGE_SIZE, num_pages=self.num_pages)
        if self.pool_groups > 1 and hasattr(cache, "split_pool"):
            cache = cache.split_pool(self.pool_groups)
        return cache


def make_engine(model: DecoderModel, *, drafter, draft_model, depth, kv_advance_rule, cache, greedy: bool = True,
                ngram_n: int = 3, capacity: int | None = None, attention_impl: str = "xla",
                num_pages: int | None = None, controller: StepController | None = None, mesh=None,
                pool_groups: int | None = None, tree: Tree | None = None) -> EngineConfig:
    """The static engine. ``capacity`` (cache slots per row; ``request_capacity``) defaults to
    what the model's longest sequence would need; ``generate`` passes the request's.
    ``greedy``: every row decodes greedily (no distributions are built); otherwise each row
    samples under its own ``RowSampling`` (a temperature-0 row stays exactly greedy).
    ``controller`` (``depth="auto"``: ``specjax.auto.AutoDepth(policy)``): the step picks its
    window from ``controller.windows`` and ``depth`` must be the widest minus one. ``mesh``: the
    ``("data", "model")`` mesh the model was sharded for (``specjax.sharding``; ``None``: one
    device). ``pool_groups``: paged pools per batch (default: the mesh's data axis, one pool per
    data shard; 1 without). ``model`` and ``draft_model`` follow the model protocol
    (``specjax.protocols``); ``drafter`` is a name, ``None`` or a drafter object
    (``specjax.protocols.Drafter``). ``tree``: verify a token tree each step, a preset
    (``specjax.tree.preset_parents``; ``depth`` must be ``len(tree)``) or a ``DynamicTree``
    drafted to ``depth`` (one device, a drafter that proposes trees: the MTP head)."""
    kind = drafter_kind(drafter)
    d = 0 if kind is None else depth
    if tree is not None:
        tree = tree if isinstance(tree, DynamicTree) else tuple(int(k) for k in tree)
        check_tree(tree, d, resolve_drafter(drafter, ngram_n), controller, mesh)
        for arg, m in (("model", model), ("draft_model", draft_model if kind == "draft_model" else None)):
            check_tree_memory(tree, d, arg, getattr(m, "config", None))
    if kind is None:
        controller = None
    if controller is not None:
        chains = controller.windows[:-1] if tree is not None else controller.windows
        if chains[-1] != d + 1 or (tree is not None and controller.windows[-1] != tree_window(tree, d)):
            end = "" if tree is None else f", then the tree's window {tree_window(tree, d)}"
            raise ValueError(f"controller windows {controller.windows} must end at depth + 1 = {d + 1}{end}")
    target = check_model("model", model)
    if kind == "block":
        target = block_target(target, d, controller, mesh)
    elif kind == "mtp" and isinstance(target, MtpTapped) and target.mtp_taps:  # an EAGLE-3 head reads taps
        if mesh is not None:
            raise ValueError("an EAGLE-3 MTP head runs on one device for now: pass mesh=None")
        target = target.with_taps(target.mtp_taps)
    if capacity is None:
        capacity = request_capacity(0, target.max_seq_len, d)
    if kind == "ngram" and ngram_n >= capacity:
        raise ValueError(f"ngram_n={ngram_n} is invalid: must be less than the token buffer of {capacity} "
                         "(the longest prompt, its new tokens and the draft window): a longer n-gram never matches")
    if tree is not None and kind is not None:
        check_tree_width(tree, kind, model, draft_model, capacity - ngram_n + 1)
    return EngineConfig(
        target=target,
        drafter=resolve_drafter(drafter, ngram_n),
        depth=d,
        kv_rule=kv_advance_rule,
        cache_kind=cache,
        greedy=bool(greedy),
        capacity=capacity,
        max_steps=capacity,
        draft=None if draft_model is None or kind != "draft_model" else check_model("draft_model", draft_model),
        attention_impl=resolve_attention_impl(attention_impl),
        num_pages=num_pages,
        controller=controller,
        mesh=mesh,
        pool_groups=data_shards(mesh) if pool_groups is None else pool_groups,
        tree=tree,
    )


def block_target(target, depth: int, controller, mesh):
    """The target a block drafter reads (its forward ``with_taps``), once the model has one and
    ``depth`` fits its block."""
    k = target.block_size if isinstance(target, BlockHead) else 0
    if not k:
        raise ValueError("drafter='block' needs a model with a block drafter (block_size=0): train one with "
                         "`specjax train-drafter --kind block`")
    if depth > k - 1:
        raise ValueError(f"depth={depth} is invalid with drafter='block': one pass drafts block_size - 1 = {k - 1} "
                         f"tokens; give depth 1 .. {k - 1}")
    if controller is not None:
        raise ValueError(f"depth='auto' is not offered with drafter='block' yet: give depth=1 .. {k - 1}")
    if mesh is not None:
        raise ValueError("drafter='block' runs on one device for now: pass mesh=None")
    return target.with_taps()


def check_tree_memory(tree: Tree, depth: int, arg: str, config) -> None:
    """A model with compressed-memory layers verifies a tree only where every node reads memory
    pooled from committed tokens alone: ``compress_window`` at least the tree's window."""
    if getattr(config, "compressed_layers", ()) and config.compress_window < tree_window(tree, depth):
        raise ValueError(f"tree={tree_label(tree)} verifies {tree_window(tree, depth)} tokens a step, but {arg}'s "
                         f"compressed layers keep compress_window={config.compress_window} raw tokens: a tree "
                         "needs at least its window (its nodes must read only memory pooled from committed tokens)")


def check_tree_width(tree: Tree, kind: str, model, draft_model, ngram_starts: int) -> None:
    """A tree's widest branching fits what its drafter ranks: the MTP module's (draft)
    vocabulary, the draft model's vocabulary, the n-gram drafter's candidate starts."""
    widest = tree.topk if isinstance(tree, DynamicTree) else max(tree)
    if kind == "mtp":  # an MTP module is specjax's Llama's: its config says the draft vocabulary
        vocab = model.decoder.vocab_size
        limit, what = getattr(model.decoder.config, "mtp_draft_vocab", 0) or vocab, "the MTP module's vocabulary"
    elif kind == "draft_model":
        limit, what = draft_model.decoder.vocab_size, "the draft model's vocabulary"
    elif kind == "ngram":
        limit, what = ngram_starts, "the n-gram drafter's candidate matches (token buffer - ngram_n + 1)"
    else:
        return
    if widest > limit:
        raise ValueError(f"tree={tree_label(tree)} is invalid: it ranks {widest} candidates per node, more than "
                         f"{what} holds ({limit})")


def check_tree(tree: Tree, depth: int, drafter, controller, mesh) -> None:
    """What a tree step needs today (a ``ValueError`` naming what is not met)."""
    shown = tree_label(tree)
    if not drafter.trees:
        raise ValueError(f"tree={shown} needs a drafter that proposes trees ('mtp', 'draft_model', 'ngram'); "
                         f"drafter {getattr(drafter, 'name', drafter)!r} drafts chains only")
    if isinstance(tree, DynamicTree):
        if not (tree.nodes >= 1 and tree.topk >= 1 and depth >= 1):
            raise ValueError(f"tree={shown} is invalid at depth={depth}: nodes, topk and depth must be >= 1")
    else:
        preset_parents(tree)  # the shape itself
        if not drafter.tree_presets:
            raise ValueError(f"tree={shown} is a preset; drafter {drafter.name!r} drafts dynamic trees only: "
                             "tree='dynamic:N,K'")
        if depth != len(tree):
            raise ValueError(f"tree={shown} drafts to depth {len(tree)}, but depth={depth}: they must agree")
    if controller is not None and tree_window(tree, depth) <= depth + 1:
        raise ValueError(f"tree={shown} holds no more nodes than the depth-{depth} chain: under depth='auto' a "
                         f"tree must be wider than the chain (more than {depth} nodes)")
