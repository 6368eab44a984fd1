"""What does depth="auto"'s step at a forced window cost next to the fixed engine at that
window? In one run, interleaved (prefill excluded), on the bundled model: a compiled loop of
steps at window ``W`` for n-gram auto, MTP auto with the block run on every commit
(``backlog_limit=0``) and MTP auto deferring the block (``MtpDrafter.settle``, the default
``R``), each against the fixed engine at that window (W = 1: plain decoding; else the same
drafter at depth W - 1). The first fixed row is timed twice, as two rows, so the table shows
its own noise. Each row also gets XLA's static cost analysis of one compiled step (flops,
bytes accessed, fused kernels): figures that do not move with the machine's load.

    python benchmarks/window_one.py --batch 8 [--window 1] [--steps 96] [--repeats 6] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import specjax
from specjax import engine as E
from specjax.bench import bench_prompts
from specjax.depth_policy import CostTable
from specjax.drafter import MtpDrafter

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import emit, loop_args  # noqa: E402

MAX_DEPTH = 3


def _loop(bundle, prompts, drafter, depth, window, steps):
    """(prefill, loop, step, params, args): the loop runs ``steps`` steps at ``window``
    (forced under depth="auto", every row drafting), ``step`` is one of them."""
    eng, params, args = E._setup(bundle.model, prompts, 128, drafter, None, depth, None, "dense", 0.0, None, None, 0,
                                 None, 3, "auto", MAX_DEPTH)
    b = len(prompts)
    auto = None
    if eng.policy is not None:
        k = eng.windows.index(window)
        if window == 1:  # the policy's own choice: window 1 under a table where drafting never pays
            auto = E.auto_state(eng, CostTable.create(eng.windows, [b], [[1.0] + [100.0] * (len(eng.windows) - 1)]), b)
        else:  # forced, every row drafting
            auto = E.auto_state(eng, E.placeholder_cost(eng, b), b).replace(force=jnp.int32(k), force_from=jnp.int32(0))
        one = lambda p, s: E._chosen_step(eng, p, k)(s)  # noqa: E731
    else:
        one = lambda p, s: E._step_window(eng, p, s, window, None)  # noqa: E731
    pre = jax.jit(lambda p, a: E._fresh_prefill(eng, p, *a).replace(auto=auto))
    loop = jax.jit(lambda p, s: E.run_steps(eng, p, s, lambda s: s.i < steps), donate_argnums=1)
    return pre, loop, one, params, args


def static_cost(pre, one, params, args) -> dict:
    """XLA's cost analysis of one compiled step (state donated, as in the loop)."""
    st = pre(params, args)
    compiled = jax.jit(one, donate_argnums=1).lower(params, st).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops_per_step": float(cost.get("flops", 0.0)), "bytes_per_step": float(cost.get("bytes accessed", 0.0)),
            "fusions_per_step": compiled.as_text().count(" fusion(")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = loop_args(ap, batch=8, windows=range(1, MAX_DEPTH + 2), window=1, steps=96, repeats=6)
    bundle = specjax.load_model()
    prompts = bundle.encode_prompts(bench_prompts(), bos=False)[: a.batch]
    deferred = f"mtp auto, deferred (R={MtpDrafter().backlog_limit})"
    mtp_auto = {"mtp auto, block every step": (MtpDrafter(backlog_limit=0), "auto"), deferred: (MtpDrafter(), "auto")}
    if a.window == 1:  # every auto row against plain decoding
        configs = {"plain": (None, 1), "plain (again)": (None, 1), "ngram auto": ("ngram", "auto"), **mtp_auto}
        versus = dict.fromkeys(configs, "plain")
    else:  # each auto row against its drafter at the fixed depth
        fixed = a.window - 1
        configs = {f"mtp depth {fixed}": ("mtp", fixed), f"mtp depth {fixed} (again)": ("mtp", fixed), **mtp_auto,
                   f"ngram depth {fixed}": ("ngram", fixed), "ngram auto": ("ngram", "auto")}
        versus = {name: f"{name.split()[0]} depth {fixed}" for name in configs}
    loops = {name: _loop(bundle, prompts, d, k, a.window, a.steps) for name, (d, k) in configs.items()}
    static = {name: static_cost(pre, one, params, args) for name, (pre, _, one, params, args) in loops.items()}
    names = list(loops)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(a.repeats + 1):  # the first round compiles; the order rotates from round to round
        for name in names[r % len(names):] + names[: r % len(names)]:
            pre, loop, _, params, args = loops[name]
            st = jax.block_until_ready(pre(params, args))
            t0 = time.perf_counter()
            jax.block_until_ready(loop(params, st))
            times[name].append(time.perf_counter() - t0)
    best = {name: min(t[1:]) / a.steps for name, t in times.items()}
    rows = [{"config": name, "batch": a.batch, "window": a.window, "ms_per_step_min": 1e3 * best[name],
             "ms_per_step_median": 1e3 * sorted(t[1:])[len(t[1:]) // 2] / a.steps,
             "versus": versus[name], "vs_fixed": best[name] / best[versus[name]], **static[name]}
            for name, t in times.items()]
    if emit(rows, a.out, a.json):
        return
    print(f"B={a.batch}, {a.steps} steps at window {a.window}, min / median of {a.repeats} runs; "
          f"one compiled step's static cost")
    for r in rows:
        print(f"{r['config']:<32} {r['ms_per_step_min']:7.3f} ms  {r['ms_per_step_median']:7.3f} ms  "
              f"{r['vs_fixed']:5.2f}x {r['versus']:<13}  {r['flops_per_step'] / 1e6:8.1f} Mflop  "
              f"{r['bytes_per_step'] / 1e6:8.1f} MB  {r['fusions_per_step']:4d} fusions")


if __name__ == "__main__":
    main()
