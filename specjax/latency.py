"""Per-request latency of a batch job, from the host's clock at round boundaries.

A decode call never syncs with the host, so no single step is timed: a call that ran global
steps ``[i_lo, i_hi)`` between host times ``t_lo`` (its dispatch, after the round's admits
finished) and ``t_hi`` (the device read after it) spreads its time evenly over its steps
(``Timeline``). A row's first token, sampled by its prefill, carries the time its admit
finished; the tokens of its k-th decode step the end time of global step ``start + k``.
Host work, admits and prefill chunks between calls fall into the next call's first step, so
a prefill that stalls the live rows shows up in their inter-token latency, as a user
streaming them sees it.

Per request (seconds; the names of vLLM's serving benchmark):

- ``queue_s``: arrival (the job's start for a listed job; the moment a stream yielded it)
  to the start of its admit;
- ``ttft_s``: arrival to its first token (queue and prefill included);
- ``itl_s``: the wait before each decode step's tokens, one entry per step (a step's
  accepted drafts arrive together, as a streamed chunk counts once in vLLM's benchmark);
- ``tpot_s``: mean time per token after the first, ``(e2e - ttft) / (tokens - 1)``;
- ``e2e_s``: arrival to its last token.

``latency_summary`` turns completions into the job's mean / p50 / p95 / p99 / max of each
(``itl_s`` over every step of every request).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["LATENCY_FIELDS", "Timeline", "latency_line", "latency_summary", "now", "request_latency"]

LATENCY_FIELDS = ("queue_s", "ttft_s", "tpot_s", "itl_s", "e2e_s")
now = time.perf_counter  # the job's clock (a module attribute, so tests can drive it)


class Timeline:
    """The wall times of a job's decode steps: one segment per decode call (host side)."""

    def __init__(self) -> None:
        self._seg: list[tuple[int, int, float, float]] = []  # (i_lo, i_hi, t_lo, t_hi), i_lo ascending

    def add(self, i_lo: int, i_hi: int, t_lo: float, t_hi: float) -> None:
        """Global steps ``[i_lo, i_hi)`` ran between host times ``t_lo`` and ``t_hi``."""
        if i_hi > i_lo:
            self._seg.append((int(i_lo), int(i_hi), float(t_lo), float(t_hi)))

    def drop_before(self, step: int) -> None:
        """Forget the calls that ended before global step ``step`` (no running row reads them
        again), so a long job's timeline stays as short as its rows' lives."""
        self._seg = [s for s in self._seg if s[1] > step]

    def step_end(self, steps: np.ndarray) -> np.ndarray:
        """float64 ``[n]``: the time each global step of ``steps [n]`` ended (every one must
        lie in a recorded segment)."""
        steps = np.asarray(steps, np.int64)
        if steps.size == 0:
            return np.zeros((0,), np.float64)
        i_lo, i_hi, t_lo, t_hi = (np.array(c) for c in zip(*self._seg, strict=True))
        seg = np.searchsorted(i_lo, steps, side="right") - 1
        if np.any(seg < 0) or np.any(steps >= i_hi[np.maximum(seg, 0)]):
            raise ValueError(f"steps {steps.min()}..{steps.max()} lie outside the recorded decode calls")
        frac = (steps - i_lo[seg] + 1) / (i_hi[seg] - i_lo[seg])  # a step ends a 1/n share into its call
        return t_lo[seg] + frac * (t_hi[seg] - t_lo[seg])


def request_latency(timeline: Timeline, *, arrival: float, admit_start: float, admit_end: float, start_step: int,
                    trace: np.ndarray, num_tokens: int) -> dict[str, Any]:
    """One request's figures (module docstring). ``trace [steps]``: drafts accepted at each of
    its decode steps (every one emits a token: a row steps only until it is done), the first
    of which was global step ``start_step``; ``num_tokens``: its tokens, the prefill's first
    included."""
    times = timeline.step_end(start_step + np.arange(len(trace)))
    last = float(times[-1]) if len(times) else admit_end
    itl = np.diff(np.concatenate([[admit_end], times]))
    return {
        "queue_s": admit_start - arrival,
        "ttft_s": admit_end - arrival,
        "tpot_s": (last - admit_end) / (num_tokens - 1) if num_tokens > 1 else 0.0,
        "itl_s": itl.tolist(),
        "e2e_s": last - arrival,
    }


def _stats(x: list[float]) -> dict[str, float]:
    if not x:
        return {}
    a = np.asarray(x, np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(a.max())}


def latency_summary(completions: Iterable[Any]) -> dict[str, dict[str, float]]:
    """The job's latency: mean / p50 / p95 / p99 / max of each field of ``LATENCY_FIELDS``
    over ``completions`` (``Completion``s, or their ``metrics`` dicts); ``itl_s`` pools every
    decode step of every request. Empty for a field no completion carries."""
    per: dict[str, list[float]] = {k: [] for k in LATENCY_FIELDS}
    for c in completions:
        m = getattr(c, "metrics", c)
        for k in LATENCY_FIELDS:
            if k in m:
                per[k] += m[k] if isinstance(m[k], list) else [m[k]]
    return {k: _stats(v) for k, v in per.items()}


def latency_line(summary: dict[str, dict[str, float]]) -> str:
    """One line of a job's latency (``latency_summary``): p50 / p95 / p99 of time to first
    token, inter-token latency and queue wait."""
    def show(key: str, scale: float, unit: str) -> str:
        s = summary.get(key) or {}
        return "/".join(f"{s[p] * scale:.{0 if scale > 1 else 2}f}" for p in ("p50", "p95", "p99")) + f" {unit}" \
            if s else "-"
    return (f"latency p50/p95/p99: time to first token {show('ttft_s', 1.0, 's')}, inter-token "
            f"{show('itl_s', 1e3, 'ms')}, queue {show('queue_s', 1.0, 's')}")
