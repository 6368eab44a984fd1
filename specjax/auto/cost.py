"""The step-cost table ``depth="auto"`` decides by: given, cached on disk, or measured on the
engine's own compiled steps (``measure_cost``), and the two ways a caller times a window
(``whole_run_timer``: ``generate``'s compiled loop run again; ``slice_timer``: slices of one
state that keeps advancing, for ``stream`` and batch jobs)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.auto.policy import AutoState, CostTable, DepthPolicy
from specjax.engine.config import EngineConfig
from specjax.errors import fail

__all__ = [
    "SLICES", "check_cost", "cost_cache_path", "cost_key", "cost_table", "known_cost", "load_cached_cost",
    "measure_cost", "measured_cost", "monotone_costs", "placeholder_cost", "slice_timer", "store_cached_cost",
    "warm_steps", "whole_run_timer",
]

Timer = Callable[[int, int, int], tuple[float, int]]  # (window index, warm steps, steps) -> (seconds, steps taken)


def check_cost(cost: object, policy: DepthPolicy | None) -> None:
    """``cost`` must be ``None``, a ``CostTable`` over the policy's windows, or a file path."""
    if cost is None:
        return
    if policy is None:
        fail("cost", cost, "is the step-cost table of depth='auto'; this depth is fixed")
    if isinstance(cost, CostTable):
        if cost.windows != policy.windows:
            fail("cost", f"windows {list(cost.windows)}", f"must be depth='auto''s windows {list(policy.windows)}")
    elif not isinstance(cost, str | os.PathLike):
        fail("cost", cost, "must be a CostTable, a JSON file path, or None (measured at warm-up)")


def placeholder_cost(eng: EngineConfig, batch: int) -> CostTable:
    """Every window costing the same: used while the real table is measured."""
    return CostTable.create(eng.windows, [batch], [[1.0] * len(eng.windows)])


def cost_key(eng: EngineConfig, shapes: list) -> dict:
    """What a step's cost depends on: the device, the static engine, the batch's ``shapes``
    (and how it is run: ``generate``'s loop, ``stream``'s steps or a batch job's)."""
    dev = jax.devices()[0]
    # 3: generate's tables timed over whole runs in interleaved rounds (measure_cost); 4: the MTP
    # block's cache the target's size (its drafting steps got cheaper: older tables overrate them);
    # 5: drafting windows flattened downward (monotone_costs: older tables priced them at the slowest)
    return {"v": 5,
            "backend": dev.platform, "device": dev.device_kind, "devices": jax.device_count(),
            "jax": jax.__version__, "engine": repr(eng), "shapes": [list(x) for x in shapes]}


def measure_cost(eng: EngineConfig, batch: int, timed: Timer, *, warm: int = 0, steps: int = 32, rounds: int = 3,
                 max_rounds: int = 16, budget_s: float = 4.0, baseline: bool = True) -> CostTable | None:
    """Seconds per step at each window. ``timed(window index, warm, steps) -> (seconds, steps
    taken)`` runs the engine's own compiled steps: ``warm`` at the widest window (so the timed
    steps see a grown context: a wide window's attention cost grows with it), then ``steps``
    at the window. The windows (and, with ``baseline``, the same call stopped after the warm
    steps: a loop's prefill, warm-up and dispatch, subtracted) are timed in interleaved rounds,
    the order rotating from round to round, so a slow spell of a shared machine falls on
    different windows in different rounds rather than on every repeat of one; each keeps its
    fastest. ``rounds`` rounds, more (up to ``max_rounds``) while the measurement has taken
    under ``budget_s`` (cheap steps get more samples). A wider window never costs less than a
    narrower one (``monotone_costs``). With no step past the warm-up (rows finished) it
    retries without one; ``None`` when no step ran."""
    calls = ([-1] if baseline else []) + list(range(len(eng.windows)))
    best = dict.fromkeys(calls, np.inf)
    taken = dict.fromkeys(calls, 0)
    t0, r = time.perf_counter(), 0
    while r < rounds or (r < max_rounds and time.perf_counter() - t0 < budget_s):
        for c in calls[r % len(calls):] + calls[:r % len(calls)]:
            s, n = timed(max(c, 0), warm, 0 if c < 0 else steps)
            best[c], taken[c] = min(best[c], s), max(taken[c], n)
        if r == 0 and min(taken[k] for k in calls if k >= 0) == 0:
            return measure_cost(eng, batch, timed, steps=steps, rounds=rounds, max_rounds=max_rounds,
                                budget_s=budget_s, baseline=baseline) if warm else None
        r += 1
    base = best[-1] if baseline else 0.0
    secs = [max(best[k] - base, 1e-6) / taken[k] for k in range(len(eng.windows))]
    return CostTable.create(eng.windows, [batch], [monotone_costs(secs).tolist()])


def monotone_costs(secs) -> np.ndarray:
    """Measured seconds per step at ascending windows, made non-decreasing. A shared machine
    only ever slows a run, so the fastest of a few is high by noise, never low: where a wider
    drafting window measured cheaper than a narrower one, the narrower one's figure is the
    inflated one and takes the wider's (flattened downward). Before, the wider took the
    narrower's: one slow window priced every wider one at its figure (n-gram at B=1: windows
    2-4 all at 2.08x window 1 where whole runs gave depth 1 the speed of plain decoding). The
    narrowest window (plain decoding) keeps its own figure and the others never go under it:
    pricing drafting as free is the costly mistake at large batch."""
    s = np.asarray(secs, np.float64)
    return np.maximum(np.concatenate([s[:1], np.minimum.accumulate(s[:0:-1])[::-1]]), s[0])


def warm_steps(max_new_tokens: int) -> int:
    """Widest-window steps before the timed ones, so they see some context (a few: the cost
    measured after 16 steps and after 40 differed by under 6% on the bundled model)."""
    return min(max_new_tokens // 16, 8)


# how stream and batch jobs time a window: slices of one state that keeps advancing, 2 runs a window
SLICES = {"steps": 24, "rounds": 2, "max_rounds": 2, "baseline": False}


def known_cost(eng: EngineConfig, cost, key: dict) -> tuple[CostTable | None, str | None]:
    """``cost_table`` without measuring: a given table (``"given"``), one cached on disk under
    ``key`` (``"cached"``), or ``(None, None)``."""
    if isinstance(cost, CostTable):
        return cost, "given"
    if cost is not None:
        table = CostTable.load(cost)
        check_cost(table, eng.controller.policy)
        return table, "given"
    table = load_cached_cost(key)
    return (table, "cached") if table is not None else (None, None)


def cost_table(eng: EngineConfig, batch: int, cost, key: dict, timed, **measure) -> tuple[CostTable, str]:
    """The table ``depth="auto"`` decides by, and where it came from: ``"given"`` (a
    ``CostTable`` or file), ``"cached"`` (measured earlier, on disk) or ``"measured"`` now
    (``measure_cost`` with the ``measure`` settings)."""
    table, source = known_cost(eng, cost, key)
    return (table, source) if table is not None else measured_cost(eng, batch, key, timed, **measure)


def measured_cost(eng: EngineConfig, batch: int, key: dict, timed, **measure) -> tuple[CostTable, str]:
    """``cost_table``'s last resort: measured now (``"measured"``) and kept on disk under ``key``,
    or, with no step to time, the placeholder (``"none"``)."""
    table = measure_cost(eng, batch, timed, **measure)
    if table is None:
        return placeholder_cost(eng, batch), "none"
    store_cached_cost(key, table)
    return table, "measured"


def forced(st: Any, k: int) -> Any:
    """``st`` with window ``k`` forced on every step, every row drafting (cost measurement)."""
    return st.replace(auto=st.auto.replace(force=jnp.int32(k)))


def whole_run_timer(run: Callable[..., Any], params: dict, args: tuple, auto: AutoState) -> Timer:
    """``measure_cost``'s timer for ``generate``: the compiled loop ``run(params, *args, auto,
    stop_i)`` run to ``warm + steps`` steps, the last ``steps`` at window ``k`` (the ``warm``
    before at the widest), timed whole (its prefill is the baseline ``measure_cost`` subtracts)."""
    def timed(k: int, warm: int, steps: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        st = run(params, *args, auto.replace(force=jnp.int32(k), force_from=jnp.int32(warm)),
                 jnp.int32(warm + steps))
        i = int(st.i)  # blocks until the loop is done
        return time.perf_counter() - t0, max(i - warm, 0)
    return timed


def slice_timer(state: Any, advance: Callable[[Any, int], Any], windows: int) -> tuple[Timer, list]:
    """``measure_cost``'s timer over slices of one state that keeps advancing (``stream``, batch
    jobs): ``advance(state, n) -> state`` runs ``n`` steps. The first call takes the state to
    ``warm`` steps at the widest of ``windows`` windows; each call then runs one step at the
    forced window outside the clock (the first compiles) and ``steps`` on it. Returns the timer
    and a one-item list holding the latest state (the tokens the slices emitted are kept: a
    forced window is still exact)."""
    box = [state]

    def timed(k: int, warm: int, steps: int) -> tuple[float, int]:
        s = box[0]
        if int(s.i) < warm:
            s = advance(forced(s, windows - 1), warm - int(s.i))
        s = forced(s, k)
        if steps:
            s = advance(s, 1)
        i0 = int(s.i)
        t0 = time.perf_counter()
        s = advance(s, steps)
        taken = int(s.i) - i0
        box[0] = s
        return time.perf_counter() - t0, taken
    return timed, box


# ----------------------------------------------------------------------------- the on-disk cache


def cost_cache_path() -> Path:
    """Where measured cost tables are kept: ``$SPECJAX_CACHE_DIR/costs.json`` (default
    ``~/.cache/specjax``)."""
    root = os.environ.get("SPECJAX_CACHE_DIR") or Path.home() / ".cache" / "specjax"
    return Path(root) / "costs.json"


def _cache_key(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


# the cache file as last read: (path, its (inode, mtime_ns, size)) -> {key: CostTable}. Every ``generate``
# under depth="auto" looks its table up: parsing the file each time was ~0.5 ms of host time a call
_READ: dict[tuple[str, tuple[int, int, int]], dict[str, CostTable | None]] = {}


def load_cached_cost(key: dict) -> CostTable | None:
    """The table stored under ``key`` (anything JSON-able naming what the cost depends on:
    device, model shapes, batch, capacity, windows, ...), or ``None``. The file is parsed again
    only when it changed (its inode, modification time or size)."""
    path = cost_cache_path()
    try:
        st = path.stat()
        seen = (str(path), (st.st_ino, st.st_mtime_ns, st.st_size))
        if seen not in _READ:
            raw = json.loads(path.read_text())
            _READ.clear()  # one file version kept
            _READ[seen] = {k: _parse(v) for k, v in raw.items()}
        return _READ[seen].get(_cache_key(key))
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # absent or unreadable: measure again


def _parse(raw: object) -> CostTable | None:
    try:
        return CostTable.create(raw["windows"], raw["batches"], raw["seconds"])
    except (KeyError, TypeError, ValueError):
        return None  # a bad entry: measured again


def store_cached_cost(key: dict, table: CostTable) -> None:
    """Keep ``table`` under ``key`` (best effort: an unwritable cache only costs a re-measure)."""
    path = cost_cache_path()
    try:
        old = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        old = {}
    old[_cache_key(key)] = {"key": key, "windows": list(table.windows), "batches": np.asarray(table.batches).tolist(),
                            "seconds": np.asarray(table.seconds).tolist()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(old, default=str))
        tmp.replace(path)
        _READ.clear()
    except OSError:
        pass
