"""Requests of a batch job: the public ``Request`` / ``Completion``, each request validated
against the model and the job (``Job.row``), and the host arrays of one admit."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.engine import (
    PAGE_SIZE,
    prompt_bucket,
)
from specjax.generation_config import check_sampling, is_int, shown
from specjax.prefix_cache import page_keys
from specjax.protocols import DecoderModel
from specjax.sampling import RowSampling, derive_seed
from specjax.validate import EOS_WIDTH, check_eos, eos_table, fail


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. ``None`` fields take the job's defaults."""

    prompt: Sequence[int]
    id: Any = None  # default: the request's index in the stream
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # default: derived from (the job's seed, id)
    eos_id: int | list[int] | None = None  # a list: the row stops on any


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its new tokens (EOS included when hit), why it stopped
    (``"eos"`` | ``"length"``) and its own metrics (``num_tokens``, ``steps``,
    ``tok_per_step``, ``accepted_drafts``, ``mean_accepted_length``, ``accepted_trace``;
    ``prompt_tokens`` and ``cached_tokens``, those the prefix cache served; ``pages_in_use``,
    the paged pool's pages held by rows in the round it finished (``None``: dense); and
    its latency in seconds: ``queue_s``, ``ttft_s``, ``tpot_s``, ``e2e_s``, and ``itl_s``
    per decode step; ``specjax.latency``)."""

    id: Any
    tokens: list[int]
    finish_reason: str
    metrics: dict


@dataclasses.dataclass(frozen=True)
class Row:
    """A validated request, resolved against the job's defaults (host side)."""

    id: Any
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    eos: tuple[int, ...]  # stop ids (empty: none)
    pages: int  # worst-case pages this request can hold (paged caches)
    key_ahead: int = 0  # tokens past a page its key covers (an MTP block's entry reads the next token)

    @property
    def bucket(self) -> int:
        """Its prompt's padded width (``prompt_bucket``): an admit holds one bucket."""
        return prompt_bucket([self.prompt])

    @functools.cached_property
    def keys(self) -> list[bytes]:
        """Its prompt's full pages' chain keys (``specjax.prefix_cache``)."""
        return page_keys(self.prompt, PAGE_SIZE, self.key_ahead)


def _as_request(r: Any, index: int) -> Request:
    if isinstance(r, Request):
        return r if r.id is not None else dataclasses.replace(r, id=index)
    if isinstance(r, dict):
        unknown = set(r) - {f.name for f in dataclasses.fields(Request)}
        if unknown:
            fail(f"requests[{index}]", sorted(unknown)[0], f"unknown field; allowed: "
                  f"{[f.name for f in dataclasses.fields(Request)]}")
        if "prompt" not in r:
            fail(f"requests[{index}]", r, "has no 'prompt'")
        return Request(**{**r, "id": r.get("id", index)})
    if isinstance(r, list | tuple | np.ndarray):
        return Request(prompt=r, id=index)
    fail(f"requests[{index}]", r, "must be a Request, a dict with 'prompt', or a list of token ids")
    raise AssertionError  # unreachable


@dataclasses.dataclass(frozen=True)
class Job:
    """The job's static settings and defaults, checked once."""

    model: DecoderModel
    max_new_tokens: int
    max_prompt_len: int
    depth: int  # slots past a row's length a step writes, less one: its drafts (a tree's nodes and beams)
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    eos_id: int | list[int] | None
    pages: int | None
    bounded: bool  # a stream: max_new_tokens bounds each request (it sized the caches)
    eos_width: int | None  # stop ids per row a stream's requests must fit (None: listed, the list sizes it)
    groups: int = 1  # pool groups (the mesh's data axis): a request must fit one group's pool
    key_ahead: int = 0  # its rows' prefix keys cover this many tokens past each page (``Row``)

    def row(self, r: Request, index: int, where: str | None = None) -> Row:
        """Validate one request against the model and the job; errors name the request
        (``where``, default ``requests[index] (id ...)``) and the field."""
        cfg = self.model.decoder
        at = f"requests[{index}] (id {r.id!r})." if where is None else f"{where}: "  # a field's prefix in errors
        where = where or f"requests[{index}] (id {r.id!r})"
        prompt = r.prompt
        if not isinstance(prompt, list | tuple | np.ndarray) or len(prompt) == 0:
            fail(f"{at}prompt", prompt, "must be a non-empty list of int token ids")
        arr = np.asarray(prompt)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            fail(f"{at}prompt", prompt, "must be a flat list of int token ids")
        bad = np.nonzero((arr < 0) | (arr >= cfg.vocab_size))[0]
        if len(bad):
            fail(f"{at}prompt[{int(bad[0])}]", int(arr[bad[0]]), f"token ids must lie in [0, {cfg.vocab_size})")
        n_new = self.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
        if self.bounded and (not is_int(n_new) or not 1 <= n_new <= self.max_new_tokens):
            fail(f"{at}max_new_tokens", n_new, f"must be an int in [1, {self.max_new_tokens}] (for a stream "
                  "of requests the job's max_new_tokens bounds every request)")
        if not is_int(n_new) or n_new < 1:
            fail(f"{at}max_new_tokens", n_new, "must be an int >= 1")
        if self.bounded and len(arr) > self.max_prompt_len:
            fail(f"{at}prompt", f"{len(arr)} tokens", f"at most max_prompt_len={self.max_prompt_len} tokens")
        if n_new >= cfg.max_seq_len:
            fail(f"{at}max_new_tokens", n_new, f"must be < the model's max_seq_len={cfg.max_seq_len} "
                 "(the prompt needs a token)")
        if len(arr) + n_new > cfg.max_seq_len:
            fail(f"{at}prompt", f"{len(arr)} tokens", f"prompt + max_new_tokens ({n_new}) must be <= the "
                  f"model's max_seq_len={cfg.max_seq_len}: at most {cfg.max_seq_len - n_new} prompt tokens fit")
        temp = self.temperature if r.temperature is None else r.temperature
        top_k = self.top_k if r.top_k is None else r.top_k
        top_p = self.top_p if r.top_p is None else r.top_p
        check_sampling(f"{at}", temp, top_k, top_p)
        if r.seed is not None and (not is_int(r.seed) or not 0 <= r.seed < 2**32):
            fail(f"{at}seed", r.seed, "must be an int in [0, 2**32)")
        eos = check_eos(f"{at}eos_id", shown(self.eos_id) if r.eos_id is None else r.eos_id, cfg.vocab_size)
        if self.eos_width is not None and len(eos) > self.eos_width:
            fail(f"{at}eos_id", list(eos), f"at most {self.eos_width} stop ids in a streamed job (the job's "
                  "widest list, at least EOS_WIDTH, sizes every row's stops)")
        w = self.depth + 1
        pages = -(-(len(arr) + n_new + 2 * w - 1) // PAGE_SIZE)  # (a prefill reserves only its prompt)
        if self.pages is not None and pages > self.pages // self.groups:
            g = self.groups
            held = f"pool holds pages={self.pages}" if g == 1 else \
                f"pool of each of the mesh's {g} data shards holds pages/{g}={self.pages // g}"
            fail(f"{where}", f"{len(arr)} + {n_new} tokens", f"needs {pages} pages of {PAGE_SIZE} tokens but the "
                 f"{held}")
        seed = derive_seed(self.seed, r.id) if r.seed is None else int(r.seed)
        return Row(r.id, [int(t) for t in arr], int(n_new), float(temp), top_k, top_p, seed, eos, pages,
                    self.key_ahead)


def checked_rows(job: Job, requests: Iterable[Any], where: Sequence[str] | None = None) -> Iterator[Row]:
    """Each request validated as it is read; ``where`` names listed requests in errors."""
    seen = set()
    for i, r in enumerate(requests):
        name = None if where is None else where[i]
        row = job.row(_as_request(r, i), i, name)
        if row.id in seen:
            fail(f"{name or f'requests[{i}]'}.id", row.id, "duplicate id: ids must be unique")
        seen.add(row.id)
        yield row


def admit_inputs(batch: list[list[tuple[int, Row]]], refill: int, slots: int, eos_width: int = EOS_WIDTH,
                 chunk: int | None = None):
    """Host arrays for one admit: ``batch``'s slot groups in order (group-major; ``_pick``), each
    padded to the same row count: the fullest group's, rounded up to a power of two, at most
    ``ceil(refill / groups)`` (a prefill's work follows the requests admitted; a few row counts
    per bucket compile). Padding rows point at slot ``slots``. ``chunk``: the prompt width
    rounds up to whole chunks (a chunk past a row's prompt writes padding inside it)."""
    laid = admit_layout(batch, refill, slots)
    width = prompt_bucket([r.prompt for s, r in laid if s < slots])
    if chunk is not None:
        width = -(-width // chunk) * chunk
    rows = np.array([s for s, _ in laid], np.int32)
    toks = np.zeros((len(laid), width), np.int32)
    for i, (_, r) in enumerate(laid):  # host-side batch assembly
        toks[i, : len(r.prompt)] = r.prompt
    req = [r for _, r in laid]
    plen = np.array([len(r.prompt) for r in req], np.int32)
    return (
        jnp.asarray(rows), jnp.asarray(toks), jnp.asarray(plen),
        jnp.asarray(plen + np.array([r.max_new_tokens for r in req], np.int32)),
        jnp.asarray(eos_table([r.eos for r in req], eos_width)),
        jnp.asarray(np.array([r.seed for r in req], np.uint32)),
        RowSampling.rows([r.temperature for r in req], [r.top_k for r in req], [r.top_p for r in req]),
    )


def admit_layout(batch: list[list[tuple[int, Row]]], refill: int, slots: int) -> list[tuple[int, Row]]:
    """``batch``'s ``(slot, request)`` pairs in admit order: group-major, each group padded to
    the fullest group's count rounded up to a power of two, at most ``ceil(refill / groups)``
    (padding: slot ``slots``, a copy of a real request)."""
    fullest = max(len(g) for g in batch)
    rg = min(-(-refill // len(batch)), 1 << (fullest - 1).bit_length())
    real = next(x for g in batch for x in g)
    return [x for g in batch for x in g + [(slots, real[1])] * (rg - len(g))]
