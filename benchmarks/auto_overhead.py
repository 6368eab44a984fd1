"""What does depth="auto" cost where it does not draft? Whole ``generate`` calls on the same
prompts, interleaved in one run: plain decoding, a fixed depth, auto with window 1 forced by a
cost table under which drafting never pays, and auto with its measured (cached) table, on the
bundled model. Prefill, the drafter's own prefill and (MTP) the block's settles are included.

    python benchmarks/auto_overhead.py --drafter mtp --batch 8 [--groups 8] [--rounds 3] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import specjax
from specjax.bench import bench_prompts
from specjax.depth_policy import CostTable
from specjax.engine import prompt_bucket

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import emit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", choices=["mtp", "ngram"], default="mtp")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8, help="batches of held-out prompts per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the fastest is kept)")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    for name in ("batch", "groups", "rounds", "depth", "max_new_tokens"):
        if getattr(a, name) < 1:
            sys.exit(f"--{name.replace('_', '-')}={getattr(a, name)} is invalid: must be >= 1")
    bundle = specjax.load_model()
    toks = bundle.encode_prompts(bench_prompts(), bos=False)
    if a.batch * a.groups > len(toks):
        sys.exit(f"--batch {a.batch} x --groups {a.groups} is invalid: there are {len(toks)} held-out prompts")
    groups = [toks[i * a.batch : (i + 1) * a.batch] for i in range(a.groups)]
    windows = tuple(range(1, a.depth + 2))
    steep = CostTable.create(windows, [a.batch], [[1.0] + [100.0] * a.depth])  # drafting never pays

    def run(drafter, depth, g, cost=None):
        kw = bundle.generate_kwargs({"drafter": drafter})
        return specjax.generate(bundle.model, g, max_new_tokens=a.max_new_tokens, depth=depth, max_depth=a.depth,
                                seed=list(range(len(g))), cost=cost, **kw)

    configs = {"plain": (None, 1, None), f"depth {a.depth}": (a.drafter, a.depth, None),
               "auto, window 1 forced": (a.drafter, "auto", steep), "auto": (a.drafter, "auto", None)}
    for d, k, c in configs.values():  # compile (and measure auto's table) once per prompt-width bucket
        for g in {prompt_bucket(g): g for g in groups}.values():
            run(d, k, g, c)
    times: dict[str, list[float]] = {name: [] for name in configs}
    share: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for name, (d, k, c) in configs.items():
            t0 = time.perf_counter()
            for g in groups:
                r = run(d, k, g, c)
            times[name].append(time.perf_counter() - t0)
            if k == "auto":
                share[name] = r.metrics["window_share"]
    plain = min(times["plain"])
    rows = [{"config": name, "drafter": a.drafter, "batch": a.batch, "seconds_min": min(t),
             "speed_vs_plain": plain / min(t), "window_share_last_batch": share.get(name)} for name, t in times.items()]
    if emit(rows, a.out, a.json):
        return
    print(f"{a.drafter}, B={a.batch}, {a.groups} batches x {a.max_new_tokens} new tokens, fastest of {a.rounds} "
          f"interleaved rounds")
    for r in rows:
        print(f"{r['config']:<24} {r['seconds_min']:8.3f} s  {r['speed_vs_plain']:6.3f}x plain's speed")


if __name__ == "__main__":
    main()
