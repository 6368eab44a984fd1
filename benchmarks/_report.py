"""What the benchmarks share: write their JSON result and print it if asked; the step-loop options."""

from __future__ import annotations

import json
import pathlib

import jax


def emit(rows: list[dict], out: str | None, as_json: bool) -> bool:
    """Wrap ``rows`` with the device and JAX version, write it to ``out`` (if given) and print it
    as one JSON line when ``as_json``; True when printed (the caller skips its table)."""
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print(json.dumps(result))
    return as_json


def loop_args(ap, *, batch: int, windows: range, window: int, steps: int, repeats: int):
    """Parse the options the step-loop benchmarks share (``--batch --window --steps --repeats
    --json --out``), each count checked to be >= 1."""
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--window", type=int, default=window, choices=windows)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.batch < 1 or a.steps < 1 or a.repeats < 1:
        ap.error(f"--batch, --steps and --repeats must be >= 1, got {a.batch}, {a.steps}, {a.repeats}")
    return a
