"""``batch_generate``: a job's settings checked once, its engine built, its requests run
through the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax

from specjax.advance import kv_advance as resolve_kv_advance
from specjax.auto import AutoDepth
from specjax.auto.cost import check_cost
from specjax.batch.prefix_store import job_prefix_cache, prefix_refusal
from specjax.batch.requests import Completion, Job, Request, Row, checked_rows
from specjax.batch.scheduler import schedule
from specjax.compile_cache import default_on
from specjax.drafters import default_drafter
from specjax.engine import (
    PAGE_SIZE,
    EngineConfig,
    make_engine,
    prompt_bucket,
    request_capacity,
)
from specjax.generation import check_mesh
from specjax.generation_config import GenerationConfig, is_int, takes_settings
from specjax.protocols import DecoderModel, check_model
from specjax.sharding import data_shards, shard_model
from specjax.tree import tree_reach
from specjax.validate import EOS_WIDTH, check_drafter_models, check_eos, fail, resolve_depth


@takes_settings
def batch_generate(
                   model: DecoderModel,
                   requests: Iterable[Any],
                   config: GenerationConfig | None = None,
                   *,
                   draft_model: DecoderModel | None = None,
                   mesh: Any = None,
                   slots: int = 32,
                   max_prompt_len: int | None = None,
                   pages: int | None = None,
                   refill_rows: int | None = None,
                   sync_every: int = 64,
                   prefill_chunk: int | None = None,
                   prefix_cache: bool | None = None,
                   stop: Callable[[], bool] | None = None,
                   where: Sequence[str] | None = None,
                   **settings: Any,
                   ) -> Iterator[Completion]:
    """Generate for every request of ``requests`` through ``slots`` rows, refilling a row as
    soon as it finishes; yields a ``Completion`` per request, in completion order.

    ``requests``: any iterable (a generator too) of ``Request``s, dicts with ``prompt`` (token
    ids) and optional ``id``, ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
    ``seed``, ``eos_id``, or plain token-id lists. ``id`` defaults to the stream index; ids
    must be unique. ``config`` (``GenerationConfig``) and the keyword settings over it (as in
    ``generate``; ``max_new_tokens`` and ``seed`` one int each) are the defaults of requests
    that omit them; for a stream, ``max_new_tokens`` also bounds every request's own.

    A list is validated whole before anything compiles, and sizes the caches; a generator is
    validated request by request, and caches are sized by ``max_prompt_len`` (default: the
    model's context minus ``max_new_tokens``). ``pages``: the paged pool's size (``cache=
    "paged"``; default every slot's full capacity): requests wait for pages, never fail.
    ``refill_rows``: rows prefilled per admit (default ``slots // 4``); decoding runs until
    that many rows are free (fewer when the stream runs dry) or ``sync_every`` steps.
    ``prefill_chunk``: prompts longer than this are prefilled ``prefill_chunk`` tokens per
    decode step (each chunk in the step's own forward: ``step_and_chunk``): a long prompt
    stalls the running rows for one chunk at a time, not its whole prefill; its row joins the
    decode loop when its last chunk has taken its first token (dense and paged caches,
    sliding-window and compressed layers, ``depth="auto"``, a mesh and the prefix cache too). ``prefix_cache`` (``cache=
    "paged"``, the default cache of a batch job whose model's layers are all global; on
    wherever it applies): a request whose prompt begins with full pages
    already in the pool starts on them (reference-counted, never written by it) and computes
    only the rest; unreferenced cached pages are evicted least recently used when the pool
    needs them (``specjax.prefix_cache``; a model whose layers are all global, any drafter; each
    completion's ``cached_tokens`` says what it reused). ``stop``: checked between
    rounds; when it returns True the job ends early (requests still running are dropped,
    nothing partial is yielded). ``where``: how validation errors
    name each listed request (default ``requests[i] (id ...)``; the CLI names file lines).
    ``depth="auto"`` (with ``max_depth``, ``cost``): as in ``generate``; without a table the
    first rounds time a few real decode steps at each window (then kept on disk).
    ``mesh`` (``specjax.make_mesh``; one process): slots split over ``"data"`` (``slots`` must
    divide by it), the model over ``"model"``, as in ``generate``. A paged pool is one pool per
    data shard (``pages`` must divide by ``data``; a request must fit ``pages / data``).
    Compiles: one decode loop per (slots, ...) and one admit per prompt bucket; sampling
    settings, seeds and lengths are data.
    """
    default_on()  # the persistent compilation cache, before the first compile
    cfg = GenerationConfig.of(config, **settings)
    # the default cache: paged, where rows can share cached prompt prefixes (else dense, below)
    cache = cfg.cache or ("dense" if prefix_cache is False and pages is None else "paged")
    _check_settings(cfg, cache, slots, sync_every, pages, refill_rows, prefill_chunk)
    drafter = default_drafter(cfg.drafter, model, draft_model)
    check_drafter_models(drafter, model, draft_model)
    d, policy = resolve_depth(cfg.depth, cfg.max_depth, drafter, tree=cfg.tree, model=model)
    reach = tree_reach(cfg.tree, d)
    check_cost(cfg.cost, policy)
    model, draft_model, groups = _on_mesh(model, draft_model, mesh, slots, pages)
    listed = isinstance(requests, Sequence) and not isinstance(requests, str | bytes)
    job, bound = _make_job(model, cfg, listed, max_prompt_len, reach, pages, groups, drafter)
    rows = _job_rows(job, requests, listed, where, bound)
    eng, cache = _job_engine(model, draft_model, cfg, drafter, d, policy, rows, reach, cache, pages, prefill_chunk,
                             mesh)
    params = {"target": model.params} | ({} if eng.draft is None else {"draft": draft_model.params})
    refill = refill_rows or max(1, slots // 4)
    pool = pages if pages is not None else slots * -(-eng.capacity // PAGE_SIZE)
    prefixes = job_prefix_cache(eng, prefix_cache, eng.pool_groups)
    return schedule(eng, params, rows.rows, slots, rows.width, refill, sync_every,
                    pool if cache == "paged" else None, stop or (lambda: False), rows.eos_width, cfg.cost, listed,
                    prefill_chunk, prefixes)


def _make_job(model, cfg: GenerationConfig, listed: bool, max_prompt_len, reach: int, pages, groups: int,
              drafter: str) -> tuple[Job, int]:
    """The job's request defaults and bounds (``Job``), and the prompt length a stream's caches
    are sized for."""
    model_cfg = check_model("model", model)
    if not listed and cfg.max_new_tokens >= model_cfg.max_seq_len:  # it sizes a stream's caches
        fail("max_new_tokens", cfg.max_new_tokens, f"must be < the model's max_seq_len={model_cfg.max_seq_len}")
    bound = max_prompt_len if max_prompt_len is not None else max(1, model_cfg.max_seq_len - cfg.max_new_tokens)
    if not is_int(bound) or bound < 1:
        fail("max_prompt_len", bound, "must be an int >= 1")
    job = Job(model, cfg.max_new_tokens, bound if not listed else model_cfg.max_seq_len - 1, reach,
              float(cfg.temperature), cfg.top_k, cfg.top_p, cfg.seed, cfg.eos_id, pages, bounded=not listed,
              eos_width=None if listed else max(EOS_WIDTH, len(check_eos("eos_id", cfg.eos_id,
                                                                          model_cfg.vocab_size))),
              groups=groups, key_ahead=int(drafter == "mtp"))
    job.row(Request([0], max_new_tokens=1), -1, where="batch_generate")  # the defaults (temperature, ...)
    return job, bound


def _check_settings(cfg: GenerationConfig, cache: str, slots, sync_every, pages, refill_rows, prefill_chunk) -> None:
    """The job's own settings (not the requests'), each failing by name."""
    for name, val, lo in (("slots", slots, 1), ("max_new_tokens", cfg.max_new_tokens, 1),
                          ("sync_every", sync_every, 1)):
        if not is_int(val) or val < lo:
            fail(name, val, f"must be an int >= {lo}")
    if not is_int(cfg.seed):
        fail("seed", cfg.seed, "must be one int in [0, 2**32) (each request's seed is derived from it and its id)")
    if pages is not None and (cache != "paged" or not is_int(pages) or pages < 1):
        fail("pages", pages, "is the paged pool's size: an int >= 1, with cache='paged'")
    if refill_rows is not None and (not is_int(refill_rows) or not 1 <= refill_rows <= slots):
        fail("refill_rows", refill_rows, f"must be an int in [1, slots={slots}]")
    if prefill_chunk is not None and (not is_int(prefill_chunk) or prefill_chunk < 1):
        fail("prefill_chunk", prefill_chunk, "must be an int >= 1 (prompt tokens per chunk), or None")


def _on_mesh(model, draft_model, mesh, slots, pages) -> tuple[Any, Any, int]:
    """``(model, draft model, data shards)``: the models sharded over ``mesh`` (if any), checked
    against the slots and pages they split."""
    check_mesh(mesh, slots, "slots", slots)
    groups = data_shards(mesh)
    if pages is not None and pages % groups:
        fail("pages", pages, f"must divide by the mesh's data axis ({groups}): each data shard holds its own pool "
             "of pages / data")
    if mesh is None:
        return model, draft_model, groups
    if jax.process_count() > 1:
        fail("mesh", mesh, "batch_generate runs in one process (each host its own job); generate takes many")
    return (shard_model(model, mesh), None if draft_model is None else shard_model(draft_model, mesh, replicate=True),
            groups)


class _JobRows(NamedTuple):
    rows: Iterator[Row]
    width: int  # the prompt bucket the caches are sized for
    longest_new: int
    greedy: bool
    eos_width: int


def _job_rows(job: Job, requests, listed: bool, where, bound: int) -> _JobRows:
    """The checked rows and what they size: a list is checked whole before any compile and
    sizes the caches; a stream is checked request by request, sized by ``bound``."""
    if listed:
        checked = list(checked_rows(job, requests, where))
        return _JobRows(iter(checked), prompt_bucket([r.prompt for r in checked]) if checked else 8,
                        max((r.max_new_tokens for r in checked), default=1),
                        all(r.temperature == 0 for r in checked), max([EOS_WIDTH] + [len(r.eos) for r in checked]))
    # unknown requests: per-row sampling (a temperature-0 row stays exactly greedy)
    return _JobRows(checked_rows(job, requests), prompt_bucket([[0] * bound]), job.max_new_tokens, False,
                    job.eos_width)


def _job_engine(model, draft_model, cfg: GenerationConfig, drafter: str, depth: int, policy, rows: _JobRows,
                reach: int, cache: str, pages, prefill_chunk, mesh) -> tuple[EngineConfig, str]:
    """The job's engine and its cache kind: the default (``cfg.cache`` None, no ``pages``) falls
    back to dense where the prefix cache has nothing to share."""
    cap_width = rows.width if prefill_chunk is None else -(-rows.width // prefill_chunk) * prefill_chunk  # whole chunks

    def engine(cache: str) -> EngineConfig:
        return make_engine(model, drafter=drafter, draft_model=draft_model, depth=depth,
                           kv_advance_rule=resolve_kv_advance(cfg.kv_advance), cache=cache, greedy=rows.greedy,
                           ngram_n=cfg.ngram_n, capacity=request_capacity(cap_width, rows.longest_new, reach),
                           attention_impl=cfg.attention_impl, num_pages=pages,
                           controller=None if policy is None else AutoDepth(policy), mesh=mesh, tree=cfg.tree)

    eng = engine(cache)
    if cfg.cache is None and pages is None and prefix_refusal(eng) is not None:  # nothing to share: dense
        return engine("dense"), "dense"
    return eng, cache
