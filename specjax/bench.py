"""``specjax bench``: plain decoding vs the cohort and per-sequence rules on the bundled
model, for each drafter and batch size, measured side by side in one run.

Every configuration decodes the same fixed held-out prompts
(``specjax/data/bench_prompts.json``), split into batches of ``B``. Each configuration is
compiled and warmed on one batch first; the timed pass then covers all prompts, so
``tok_per_s`` excludes compilation. ``tok_per_step`` is tokens per decode step per
sequence (emitted tokens / row-steps while active).
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["bench", "bench_prompts", "machine", "plot"]

PROMPTS_FILE = pathlib.Path(__file__).resolve().parent / "data" / "bench_prompts.json"
RULES = ("cohort", "per_sequence")
SAMPLED_TOP_P = 0.95  # sampled rows: temperature 0.8, top-p 0.95 (what local LLM tools default to)


def bench_prompts(n: int | None = None) -> list[str]:
    """The fixed held-out prompts (first ``n``)."""
    prompts = [p["text"] for p in json.loads(PROMPTS_FILE.read_text())["prompts"]]
    if n is not None:
        if not 1 <= n <= len(prompts):
            raise ValueError(f"prompts={n} is invalid: must be in [1, {len(prompts)}]")
        prompts = prompts[:n]
    return prompts


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    devs = jax.devices()
    return (f"{devs[0].platform} backend ({len(devs)} x {devs[0].device_kind}), {cpu}, "
            f"{os.cpu_count()} cores, jax {jax.__version__}, Python {platform.python_version()}")


def _configs(drafters: Sequence[str]) -> list[tuple[str, str]]:
    return [("none", "per_sequence")] + [(d, r) for d in drafters for r in RULES]


def _run(bundle, token_prompts, drafter, rule, depth, max_new_tokens, temperature=0.0, first=0):
    """One batch; sampled rows use ``top_p`` 0.95 and the prompt's index as its seed (so a
    prompt samples the same tokens at every batch size)."""
    from specjax.engine import generate

    kw = bundle.generate_kwargs({"drafter": None if drafter == "none" else drafter})
    return generate(bundle.model, token_prompts, max_new_tokens=max_new_tokens, depth=depth, kv_advance=rule,
                    temperature=temperature, top_p=SAMPLED_TOP_P if temperature > 0 else None,
                    seed=list(range(first, first + len(token_prompts))), **kw)


def bench(
    bundle,
    *,
    batches: Sequence[int] = (1, 8, 32, 64),
    drafters: Sequence[str] = ("mtp", "draft_model", "ngram"),
    depth: int = 3,
    max_new_tokens: int = 128,
    n_prompts: int | None = None,
    progress: bool = True,
    temperatures: Sequence[float] = (0.0, 0.8),
) -> dict:
    """Measure every (temperature, batch, drafter, rule) over the prompt set; returns
    ``{"machine", "settings", "rows": [...]}``. Temperature 0 is greedy; a sampled row uses
    top-p 0.95 and per-prompt seeds."""
    from tqdm import tqdm

    from specjax.drafter import DRAFTERS
    from specjax.engine import prompt_bucket

    bad = [d for d in drafters if d not in DRAFTERS]
    if bad:
        raise ValueError(f"drafters={list(drafters)} is invalid: each must be one of {list(DRAFTERS)}")
    prompts = bench_prompts(n_prompts)
    for b in batches:
        if not isinstance(b, int) or b < 1 or len(prompts) % b:
            raise ValueError(f"batch {b!r} is invalid: must be >= 1 and divide the {len(prompts)} prompts")
    toks = bundle.encode_prompts(prompts, bos=False)  # snippets from the middle of files
    if any(not isinstance(t, int | float) or not 0 <= t < 10 for t in temperatures) or not temperatures:
        raise ValueError(f"temperatures={list(temperatures)} is invalid: each must be a float in [0, 10)")
    jobs = [(t, b, d, r) for t in temperatures for b in batches for d, r in _configs(drafters)]
    rows = []
    for t, b, d, r in tqdm(jobs, desc="bench", disable=not progress, file=sys.stderr):
        groups = [toks[i : i + b] for i in range(0, len(toks), b)]
        # compile + warm up once per prompt-width bucket (each is its own compile: none in the timed pass)
        widths = {prompt_bucket(g): g for g in groups}
        for g in widths.values():
            warm = _run(bundle, g, d, r, depth, max_new_tokens, t)
        emitted = row_steps = accepted = new = compiles = 0
        acc_pos = np.zeros(depth, np.int64)
        prop_pos = np.zeros(depth, np.int64)
        t0 = time.perf_counter()
        for i, g in enumerate(groups):
            res = _run(bundle, g, d, r, depth, max_new_tokens, t, first=i * b)
            m = res.metrics
            compiles += m["compiles"]
            new += sum(len(t) for t in res.tokens)
            emitted += m["emitted"]
            row_steps += m["total_row_steps"]
            accepted += m["accepted_drafts"]
            if d != "none":
                acc_pos += m["accepted_per_position_count"]
                prop_pos += m["proposed_per_position_count"]
        wall = time.perf_counter() - t0
        rows.append({
            "temperature": float(t), "drafter": d, "kv_advance": r if d != "none" else "n/a", "batch": b,
            "tok_per_step": emitted / max(row_steps, 1),
            "mean_accepted_length": (accepted + row_steps) / max(row_steps, 1),
            "acceptance_per_position": (acc_pos / np.maximum(prop_pos, 1)).tolist() if d != "none" else [],
            "tok_per_s": new / wall, "new_tokens": new, "seconds": wall,
            "compiles_in_timed_pass": compiles,
            "warm_compiles": warm.metrics["compiles"],
        })
    for row in rows:
        plain = next(x for x in rows if x["batch"] == row["batch"] and x["drafter"] == "none"
                     and x["temperature"] == row["temperature"])
        row["speedup_vs_plain"] = row["tok_per_s"] / plain["tok_per_s"]
    settings = {"batches": list(batches), "drafters": list(drafters), "depth": depth,
                "max_new_tokens": max_new_tokens, "prompts": len(prompts), "temperatures": list(temperatures),
                "sampled_top_p": SAMPLED_TOP_P,
                "bundle": str(bundle.path)}
    return {"machine": machine(), "settings": settings, "rows": rows}


def table(result: dict) -> str:
    head = (f"{'temp':>4} {'drafter':<12} {'kv_advance':<13} {'B':>3} {'tok/step':>9} {'acc.len':>8} "
            f"{'accept@1/2/3':>16} {'tok/s':>9} {'vs plain':>9}")
    lines = [result["machine"], head, "-" * len(head)]
    for r in result["rows"]:
        acc = "/".join(f"{x:.2f}" for x in r["acceptance_per_position"]) or "-"
        lines.append(f"{r['temperature']:>4.1f} {r['drafter']:<12} {r['kv_advance']:<13} {r['batch']:>3} "
                     f"{r['tok_per_step']:>9.3f} "
                     f"{r['mean_accepted_length']:>8.3f} {acc:>16} {r['tok_per_s']:>9.1f} "
                     f"{r['speedup_vs_plain']:>8.2f}x")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """tok/step and tok/s vs batch size, one line per (drafter, rule)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    keys = sorted({(r.get("temperature", 0.0), r["drafter"], r["kv_advance"]) for r in result["rows"]})
    for key in keys:
        rows = sorted((r for r in result["rows"] if (r.get("temperature", 0.0), r["drafter"], r["kv_advance"]) == key),
                      key=lambda r: r["batch"])
        label = ("plain" if key[1] == "none" else f"{key[1]} / {key[2]}") + (f" (T={key[0]})" if key[0] else "")
        style = ":" if key[0] else ("--" if key[2] == "cohort" else "-")
        xs = [r["batch"] for r in rows]
        axes[0].plot(xs, [r["tok_per_step"] for r in rows], style, marker="o", label=label)
        axes[1].plot(xs, [r["tok_per_s"] for r in rows], style, marker="o", label=label)
    for ax, ylabel in zip(axes, ("tokens per step per sequence", "tokens per second (after compile)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"specjax bench, depth {result['settings']['depth']}: {result['machine']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
