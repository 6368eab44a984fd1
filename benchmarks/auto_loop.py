"""Where does depth="auto" lose time next to a fixed depth at the same window? Its loop
structure, its choice, or the host work around a call? In one run, interleaved, on the bundled
model, for one drafter at batch ``B`` (prefill excluded from the loop timings):

* ``fixed``: the fixed engine's loop at window ``W`` (depth ``W - 1``): one ``while_loop``;
* ``auto``: what ``generate`` runs (``engine.run_steps``: one inner ``while_loop`` per
  window inside an outer one), window ``W`` forced, every row drafting;
* ``auto, one loop``: the same step and choice (``engine._chosen_step``) in one ``while_loop``;
* ``auto, no choice``: the same step without the choice after it (the window and drafts fixed);
* ``auto, switch``: one ``while_loop`` whose body dispatches every window by ``lax.switch``
  on the choice (the alternative to the nested loops).

Each gets per-step time (fastest and median of ``--repeats`` runs of ``--steps`` steps) and,
from the compiled loop, its ``while`` / ``conditional`` ops and XLA:GPU's command buffers
(``command_buffer`` computations: kernels launched as one CUDA graph). Then whole
``generate`` calls of 16 new tokens (plain, fixed depth, auto with a given table that keeps
window ``W``): host time per call (wall minus ``seconds_run``) and device time per call
(``seconds_run``); against the loops' per-step times they split auto's cost into what a call
pays once (prefill, state set-up, read-back) and what each step pays.

    python benchmarks/auto_loop.py --drafter mtp --batch 1 [--window 4] [--steps 64] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp

import specjax
from specjax import engine as E
from specjax.bench import bench_prompts
from specjax.depth_policy import CostTable

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import emit, loop_args  # noqa: E402

MAX_DEPTH = 3


def _switch_loop(eng, steps):
    """One ``while_loop``; each step dispatches its window by ``lax.switch`` on ``auto.pick``
    (no backlog settles: a timing variant at a drafting window, not an engine)."""
    def loop(params, st):
        branches = [E._chosen_step(eng, params, k) for k in range(len(eng.windows))]
        return jax.lax.while_loop(lambda s: s.i < steps, lambda s: jax.lax.switch(s.auto.pick, branches, s), st)
    return loop


def loops(bundle, prompts, drafter: str, window: int, steps: int) -> dict:
    """name -> (prefill, jitted loop, params, args)."""
    fixed_eng, params, args = E._setup(bundle.model, prompts, 128, drafter, None, window - 1, None, "dense", 0.0,
                                       None, None, 0, None, 3, "auto", MAX_DEPTH)
    eng, _, _ = E._setup(bundle.model, prompts, 128, drafter, None, "auto", None, "dense", 0.0, None, None, 0, None,
                         3, "auto", MAX_DEPTH)
    b, k = len(prompts), eng.windows.index(window)
    forced = E.auto_state(eng, E.placeholder_cost(eng, b), b).replace(force=jnp.int32(k), force_from=jnp.int32(0))
    until = lambda s: s.i < steps  # noqa: E731
    pre_fixed = jax.jit(lambda p, a: E._fresh_prefill(fixed_eng, p, *a))
    pre_auto = jax.jit(lambda p, a: E._pick(eng, E._fresh_prefill(eng, p, *a).replace(auto=forced)))
    variants = {
        "fixed": (pre_fixed, lambda p, s: E.run_steps(fixed_eng, p, s, until)),
        "auto": (pre_auto, lambda p, s: E.run_steps(eng, p, s, until)),
        "auto, one loop": (pre_auto, lambda p, s: jax.lax.while_loop(until, E._chosen_step(eng, p, k), s)),
        "auto, no choice": (pre_auto, lambda p, s: jax.lax.while_loop(
            until, lambda x: E._step_window(eng, p, x, window, x.auto.drafts), s)),
        "auto, switch": (pre_auto, _switch_loop(eng, steps)),
    }
    return {name: (pre, jax.jit(loop, donate_argnums=1), params, args) for name, (pre, loop) in variants.items()}


def structure(compiled) -> dict:
    """Control-flow ops and command buffers of a compiled loop."""
    text = compiled.as_text()
    return {"while_ops": text.count(" while("), "conditional_ops": text.count(" conditional("),
            "command_buffers": text.count("command_buffer")}


def per_call(bundle, prompts, drafter: str, window: int, calls: int) -> dict:
    """Whole ``generate`` calls of 16 new tokens (fastest of ``calls``): host milliseconds (wall
    minus ``seconds_run``), device milliseconds (``seconds_run``: prefill, the loop, the
    read-back) and batch steps; with the loop's per-step time they split a call's cost into
    per-call and per-step parts."""
    windows = tuple(range(1, MAX_DEPTH + 2))
    keep = CostTable.create(windows, [len(prompts)], [[1.0 if w == window else 9.0 for w in windows]])
    configs = {"plain": (None, 1, None), f"depth {window - 1}": (drafter, window - 1, None),
               "auto": (drafter, "auto", keep)}
    out = {}
    for name, (d, k, c) in configs.items():
        run = functools.partial(specjax.generate, bundle.model, prompts, max_new_tokens=16, depth=k,
                                max_depth=MAX_DEPTH, cost=c, **bundle.generate_kwargs({"drafter": d}))
        run()
        host, device = float("inf"), float("inf")
        for _ in range(calls):
            t0 = time.perf_counter()
            r = run()
            wall = time.perf_counter() - t0
            host, device = min(host, wall - r.metrics["seconds_run"]), min(device, r.metrics["seconds_run"])
        out[name] = {"host_ms": 1e3 * host, "run_ms": 1e3 * device, "steps": r.metrics["steps"]}
    return out


def measure(bundle, drafter: str, batch: int, window: int, steps: int, repeats: int) -> tuple[list[dict], dict]:
    prompts = bundle.encode_prompts(bench_prompts(), bos=False)[:batch]
    built = loops(bundle, prompts, drafter, window, steps)
    names = list(built)
    times: dict[str, list[float]] = {name: [] for name in names}
    shape, compiled = {}, {}
    for r in range(repeats + 1):  # the first round compiles (once: its executable is timed); the order rotates
        for name in names[r % len(names):] + names[: r % len(names)]:
            pre, loop, params, args = built[name]
            st = jax.block_until_ready(pre(params, args))
            if r == 0:
                compiled[name] = loop.lower(params, st).compile()
                shape[name] = structure(compiled[name])
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](params, st))
            times[name].append(time.perf_counter() - t0)
    fixed = min(times["fixed"][1:])
    rows = [{"config": name, "drafter": drafter, "batch": batch, "window": window,
             "ms_per_step_min": 1e3 * min(t[1:]) / steps,
             "ms_per_step_median": 1e3 * sorted(t[1:])[(len(t) - 1) // 2] / steps,
             "vs_fixed": min(t[1:]) / fixed, **shape[name]} for name, t in times.items()]
    return rows, per_call(bundle, prompts, drafter, window, calls=max(repeats, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", choices=["mtp", "ngram"], default="mtp")
    a = loop_args(ap, batch=1, windows=range(2, MAX_DEPTH + 2), window=MAX_DEPTH + 1, steps=64, repeats=5)
    rows, calls = measure(specjax.load_model(), a.drafter, a.batch, a.window, a.steps, a.repeats)
    if emit(rows + [{"config": f"generate call: {k}", **v} for k, v in calls.items()], a.out, a.json):
        return
    print(f"{a.drafter}, B={a.batch}, {a.steps} steps at window {a.window}: min / median of {a.repeats} runs")
    for r in rows:
        print(f"{r['config']:<18} {r['ms_per_step_min']:7.3f} ms  {r['ms_per_step_median']:7.3f} ms  "
              f"{r['vs_fixed']:5.2f}x fixed   while {r['while_ops']:2d}  conditional {r['conditional_ops']:2d}  "
              f"command buffers {r['command_buffers']}")
    print("generate calls of 16 new tokens: host ms (wall - seconds_run) / device ms (seconds_run) / steps")
    for k, v in calls.items():
        print(f"{k:<18} {v['host_ms']:7.2f} ms  {v['run_ms']:7.2f} ms  {v['steps']:3d} steps")


if __name__ == "__main__":
    main()
