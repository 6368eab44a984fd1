"""What does depth="auto"'s window 1 cost next to plain decoding? In one run, interleaved: a
compiled loop of forced window-1 steps (prefill excluded) for plain decoding, n-gram auto,
MTP auto with the block run on every commit (``backlog_limit=0``) and MTP auto deferring the
block (``MtpDrafter.settle``, the default ``R``), on the bundled model.

    python benchmarks/window_one.py --batch 8 [--steps 96] [--repeats 6] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

import specjax
from specjax import engine as E
from specjax.bench import bench_prompts
from specjax.depth_policy import CostTable
from specjax.drafter import MtpDrafter

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import emit  # noqa: E402


def _loop(bundle, prompts, drafter, depth, steps):
    """(prefill, loop, params, args): the loop runs ``steps`` steps, window 1 forced by a cost
    table under which drafting never pays."""
    eng, params, args = E._setup(bundle.model, prompts, 128, drafter, None, depth, None, "dense", 0.0, None, None, 0,
                                 None, 3, "auto", 3)
    b = len(prompts)
    auto = None
    if eng.policy is not None:
        auto = E.auto_state(eng, CostTable.create(eng.windows, [b], [[1.0] + [100.0] * (len(eng.windows) - 1)]), b)
    pre = jax.jit(lambda p, a: E._fresh_prefill(eng, p, *a).replace(auto=auto))
    loop = jax.jit(lambda p, s: E.run_steps(eng, p, s, lambda s: s.i < steps), donate_argnums=1)
    return pre, loop, params, args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    bundle = specjax.load_model()
    prompts = bundle.encode_prompts(bench_prompts(), bos=False)[: a.batch]
    configs = {"plain": (None, 1), "ngram auto": ("ngram", "auto"),
               "mtp auto, block every step": (MtpDrafter(backlog_limit=0), "auto"),
               f"mtp auto, deferred (R={MtpDrafter().backlog_limit})": (MtpDrafter(), "auto")}
    loops = {name: _loop(bundle, prompts, d, k, a.steps) for name, (d, k) in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(a.repeats + 1):  # the first round compiles
        for name, (pre, loop, params, args) in loops.items():
            st = jax.block_until_ready(pre(params, args))
            t0 = time.perf_counter()
            jax.block_until_ready(loop(params, st))
            times[name].append(time.perf_counter() - t0)
    plain = min(times["plain"][1:]) / a.steps
    rows = [{"config": name, "batch": a.batch, "ms_per_step_min": 1e3 * min(t[1:]) / a.steps,
             "ms_per_step_median": 1e3 * sorted(t[1:])[len(t[1:]) // 2] / a.steps,
             "vs_plain": min(t[1:]) / a.steps / plain} for name, t in times.items()]
    if emit(rows, a.out, a.json):
        return
    print(f"B={a.batch}, {a.steps} window-1 steps, min / median of {a.repeats} runs")
    for r in rows:
        print(f"{r['config']:<32} {r['ms_per_step_min']:7.3f} ms  {r['ms_per_step_median']:7.3f} ms  "
              f"{r['vs_plain']:5.2f}x plain")


if __name__ == "__main__":
    main()
