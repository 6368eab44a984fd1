"""What the layer-loop benchmarks share: write their JSON result and print it if asked."""

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
