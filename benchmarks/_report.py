"""What the benchmarks share: write their JSON result and print it if asked; the step-loop
options; the knob sweeps' options and prompt sets."""

from __future__ import annotations

import json
import pathlib
import random
import sys

import jax


def write_result(result: dict, out: str | None, as_json: bool, indent: int = 1) -> bool:
    """Write ``result`` to ``out`` (if given) and print it as one JSON line when ``as_json``;
    True when printed (the caller skips its table)."""
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=indent) + "\n")
    if as_json:
        print(json.dumps(result))
    return as_json


def emit(rows: list[dict], out: str | None, as_json: bool) -> bool:
    """``write_result`` of ``rows`` wrapped with the device and JAX version."""
    return write_result({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, out,
                        as_json, indent=2)


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


def knob_args(ap, knobs, *, knob: str, values: str, batches: str, extra=None):
    """Parse the options the knob sweeps share (``--knob --values --with --batches --json --out``,
    and ``extra(ap)``'s own): ``(args, values, batches)``, the lists parsed (a value ``none``: the
    knob left out; ``args.fixed``: ``--with``'s other knobs as a dict), or a one-line exit naming
    the bad option."""
    ap.add_argument("--knob", choices=knobs, default=knob)
    ap.add_argument("--values", default=values, help="comma-separated; none: the knob left out")
    ap.add_argument("--with", dest="fixed", default="", help="other knobs held at these values: k=v,...")
    ap.add_argument("--batches", default=batches)
    if extra is not None:
        extra(ap)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    try:
        vals = [None if v.strip() == "none" else float(v) for v in a.values.split(",")]
        bs = [int(b) for b in a.batches.split(",")]
        pairs = [kv.split("=") for kv in a.fixed.split(",") if kv.strip()]
        a.fixed = {k.strip(): float(v) for k, v in pairs}
    except ValueError as e:
        sys.exit(f"--values / --batches / --with: {e}")
    if set(a.fixed) - set(knobs) or a.knob in a.fixed:
        sys.exit(f"--with: knobs other than --knob, from {', '.join(knobs)}; got {', '.join(a.fixed)}")
    if any(b < 1 for b in bs):
        sys.exit(f"--batches: every batch must be >= 1, got {a.batches}")
    return a, vals, bs


PRIORS = ("fixed", "measured")


def add_priors(ap) -> None:
    """``--priors``: the estimates' priors to run auto with (``parse_priors`` parses it)."""
    ap.add_argument("--priors", default="fixed",
                    help="comma-separated: fixed (DepthPolicy.prior at every position, the default), measured "
                         "(one prior per draft position, CostTable.acceptance: the first group's depth-3 verdicts "
                         "pooled, what a warm-up at the widest window would see)")


def parse_priors(a) -> list[str]:
    """``--priors`` as a list, or a one-line exit naming what is allowed."""
    out = a.priors.split(",")
    if not set(out) <= set(PRIORS):
        sys.exit(f"--priors: {', '.join(PRIORS)}; got {a.priors}")
    return out


PROMPT_SETS = ("bench", "recipe", "slices")


def prompt_set(name: str, n: int = 64, seed: int = 7) -> list[str]:
    """The knob sweeps' prompt sets: ``bench`` (the bench's prompts,
    ``specjax/data/bench_prompts.json``), ``recipe`` (``n`` others by the bench's own recipe:
    held-out stdlib snippets ending after a ``def`` line, the candidates half way between the
    bench's picks, so none of them) and ``slices`` (``n`` seeded slices of held-out stdlib files
    of at least 2000 characters, 70-110 characters each, cut anywhere). The last two read this
    Python's stdlib."""
    from specjax.bench import bench_prompts, recipe_candidates, recipe_pick
    from specjax.corpus import is_held_out, stdlib_files

    if name == "bench":
        return bench_prompts()
    if name == "recipe":
        return [text for _, _, text in recipe_pick(recipe_candidates(), n, shift=0.5)]
    if name != "slices":
        raise ValueError(f"prompt set {name!r} is invalid: one of {', '.join(PROMPT_SETS)}")
    rng = random.Random(seed)
    texts = [t for rel, path in stdlib_files() if is_held_out(rel)
             for t in [path.read_text(errors="replace")] if len(t) >= 2000]
    out = []
    for _ in range(n):
        t = rng.choice(texts)
        at = rng.randrange(0, len(t) - 200)
        out.append(t[at:at + rng.randrange(70, 111)])
    return out
