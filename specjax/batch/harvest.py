"""Harvest: finished rows become ``Completion``s with their metrics and latency."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import numpy as np

from specjax import latency
from specjax.batch.requests import Completion, Row
from specjax.engine import (
    EngineConfig,
    EngineState,
    check_status,
    row_status,
)


@dataclasses.dataclass(frozen=True)
class Timed:
    """A running request's host times: arrival, its admit's start and end, and the global
    step its first decode step runs at; and the prompt tokens the prefix cache served it."""

    arrival: float
    admit_start: float
    admit_end: float
    start_step: int
    cached_tokens: int = 0  # prompt tokens it started on from the prefix cache


def completions(eng: EngineConfig, st: EngineState, held: list[Row | None], done: np.ndarray,
                timed: list[Timed | None], timeline: latency.Timeline,
                in_use: int | None = None) -> Iterator[Completion]:
    """Completions of rows that finished since the last harvest (``done [B]``, read back);
    their slots become free. ``in_use``: the paged pool's pages held by rows at this round."""
    finished = [s for s in range(len(held)) if held[s] is not None and done[s]]
    if not finished:
        return
    host = jax.device_get((st.seq, st.prompt_len, st.known, st.steps, st.emitted, st.accepted, st.proposed, st.trace,
                           row_status(eng, st)))
    seq, plen, known, steps, emitted, accepted, proposed, trace, status = (np.asarray(x) for x in host)
    # only the finished slots are judged
    check_status(np.where(np.isin(np.arange(len(held)), finished), status, 0), "slots")
    out = []
    for s in finished:
        r, t = held[s], timed[s]
        held[s] = timed[s] = None
        toks = seq[s, plen[s] : known[s]].tolist()
        n_steps = int(steps[s])
        reason = "eos" if toks and toks[-1] in r.eos else "length"
        out.append(Completion(r.id, toks, reason, {
            "num_tokens": len(toks),
            "steps": n_steps,
            "tok_per_step": float(emitted[s] / n_steps) if n_steps else 0.0,
            "accepted_drafts": int(accepted[s]),
            "mean_accepted_length": float((accepted[s] + n_steps) / n_steps) if n_steps else 0.0,
            "accepted_trace": [int(x) for x in trace[s, :n_steps]],
            "drafter": eng.drafter.name, "depth": "auto" if eng.controller else eng.depth,
            "kv_advance": eng.kv_rule.value, "proposed_drafts": int(proposed[s]),
            "prompt_tokens": len(r.prompt), "cached_tokens": t.cached_tokens, "pages_in_use": in_use,
            **latency.request_latency(timeline, arrival=t.arrival, admit_start=t.admit_start, admit_end=t.admit_end,
                                      start_step=t.start_step, trace=trace[s, :n_steps], num_tokens=len(toks)),
        }))
    yield from out
