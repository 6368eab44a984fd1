"""``specjax bench``: plain decoding vs the cohort and per-sequence rules on the bundled
model, for each drafter and batch size, measured side by side in one run; and, for the
``mtp`` and ``ngram`` drafters under the per-sequence rule, every fixed depth up to
``depth`` next to ``depth="auto"`` (``max_depth = depth``).

Workloads: ``code``, the fixed held-out prompts (``specjax/data/bench_prompts.json``), and
``mixed``, the same prompts with every other one made repetitive (``mixed_prompts``), each
split into batches of ``B``. Each configuration is compiled and warmed on one batch first;
the timed pass then covers all prompts, so ``tok_per_s`` excludes compilation. The rows of
one batch size are timed interleaved, batch by batch (``_cell``).
``tok_per_step`` is tokens per decode step per sequence (emitted tokens / row-steps while active).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import platform
import re
import sys
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["bench", "bench_prompts", "machine", "mixed_prompts", "plot", "plot_depth"]

PROMPTS_FILE = pathlib.Path(__file__).resolve().parent / "data" / "bench_prompts.json"
RULES = ("cohort", "per_sequence")
DEPTH_DRAFTERS = ("mtp", "ngram")  # drafters whose depth rows (1 .. depth, "auto") the bench runs
WORKLOADS = ("code", "mixed")
SAMPLED_TOP_P = 0.95  # sampled rows: temperature 0.8, top-p 0.95 (what local LLM tools default to)


def bench_prompts(n: int | None = None) -> list[str]:
    """The fixed held-out prompts (first ``n``)."""
    prompts = [p["text"] for p in json.loads(PROMPTS_FILE.read_text())["prompts"]]
    if n is not None:
        if not 1 <= n <= len(prompts):
            raise ValueError(f"prompts={n} is invalid: must be in [1, {len(prompts)}]")
        prompts = prompts[:n]
    return prompts


PROMPT_BYTES = 112  # a recipe prompt: up to this many bytes of whole lines, ending after a ``def ...:`` line


def recipe_candidates() -> list[tuple[str, int, str]]:
    """``(file, offset, text)``: every prompt the bench's recipe allows, in corpus order: a
    snippet of a held-out stdlib file (never trained on) of up to ``PROMPT_BYTES`` bytes of
    whole lines, ending right after a ``def ...:`` line (``scripts/make_bench_prompts.py``
    picks the bench's 64 from these). Reads this Python's stdlib."""
    from specjax.corpus import is_held_out, stdlib_files

    cands = []
    for rel, path in stdlib_files():
        if not is_held_out(rel):
            continue
        data = path.read_bytes()
        for m in re.finditer(rb"\n( *)def [^\n]{0,80}:\n", data):
            end = m.end()
            start = data.find(b"\n", max(0, end - PROMPT_BYTES)) + 1
            if 0 < start < m.start() + 1 and data[start:end].isascii():
                cands.append((rel, start, data[start:end].decode()))
    return cands


def recipe_pick(cands: Sequence, n: int, shift: float = 0.0) -> list:
    """``n`` of ``cands`` evenly spaced, the ``i``-th at ``(i + shift) * len / n``: ``shift`` 0 is
    the bench's own pick; 0.5 the candidates half way between them (none of the bench's)."""
    if not 0.0 <= shift < 1.0 or not 1 <= n <= len(cands):
        raise ValueError(f"shift={shift!r} / n={n!r} are invalid: shift in [0, 1), n in [1, {len(cands)}]")
    step = len(cands) / n
    return [cands[int((i + shift) * step)] for i in range(n)]


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


def mixed_prompts(prompts: Sequence[str]) -> list[str]:
    """The ``mixed`` workload: every other prompt made repetitive (its first half twice, so no
    longer than it was), the others as they are."""
    return [p[: max(1, len(p) // 2)] * 2 if i % 2 == 0 else p for i, p in enumerate(prompts)]


TREE = "tree:"  # a tree row's depth: "tree:2x2x1"
AUTO_TREE = "+auto"  # a tree under depth="auto" (the tree, a chain or plain decoding each step): "dynamic:6,2@4+auto"


def _tree_of(depth: int | str):
    """``(tree, its depth or None, under depth="auto")`` of a tree row (its depth
    ``"tree:2x2x1"``, or a dynamic tree drafted to ``D``: ``"tree:dynamic:8,2@5"``; without
    ``@D``, to the bench's depth; ending ``+auto``: the tree beside every chain, chosen per step
    by depth="auto"), else None."""
    if not str(depth).startswith(TREE):
        return None
    from specjax.generation_config import GenerationConfig

    spec, auto = depth[len(TREE):], depth.endswith(AUTO_TREE)
    spec, _, d = spec.removesuffix(AUTO_TREE).partition("@")
    tree = GenerationConfig(tree=spec).tree
    return tree, len(tree) if isinstance(tree, tuple) else int(d) if d else None, auto


def _is_auto(k: int | str) -> bool:
    """A row whose windows depth="auto" picks (a chain's or a tree's): it reports their shares."""
    tree = _tree_of(k)
    return k == "auto" or bool(tree and tree[2])


def _positions(k: int | str, depth: int) -> int:
    """Draft positions a row reports: its depth, a tree's depth, ``depth`` for "auto"."""
    tree = _tree_of(k)
    return (tree[1] or depth) if tree else depth if k == "auto" else k


def _configs(drafters: Sequence[str], depth: int, workload: str,
             trees: Sequence[str] = ()) -> list[tuple[str, str, int | str]]:
    """(drafter, rule, depth) per row: plain and both rules at ``depth`` (``code`` only), then
    the depth rows of ``DEPTH_DRAFTERS`` under the per-sequence rule, then each tree of each
    drafter (presets: the MTP drafter's only)."""
    rows: list[tuple[str, str, int | str]] = [("none", "per_sequence", 0)]
    if workload == "code":
        rows += [(d, r, depth) for d in drafters for r in RULES]
    for d in drafters:
        if d in DEPTH_DRAFTERS:
            fixed = range(1, depth + 1) if workload == "mixed" else range(1, depth)
            rows += [(d, "per_sequence", k) for k in fixed] + [(d, "per_sequence", "auto")]
    rows += [(d, "per_sequence", TREE + t) for d in drafters for t in trees if d == "mtp" or t.startswith("dynamic")]
    return rows


def _run(bundle, token_prompts, drafter, rule, depth, max_new_tokens, temperature=0.0, first=0, max_depth=3):
    """One batch; sampled rows use ``top_p`` 0.95 and the prompt's index as its seed (so a
    prompt samples the same tokens at every batch size)."""
    from specjax.generation import generate

    kw = bundle.generate_kwargs({"drafter": None if drafter == "none" else drafter})
    tree = _tree_of(depth)
    if tree:
        kw.update(tree=tree[0])
        depth, max_depth = ("auto" if tree[2] else tree[1] or max_depth), tree[1] or max_depth
    return generate(bundle.model, token_prompts, max_new_tokens=max_new_tokens, depth=depth or 1, kv_advance=rule,
                    temperature=temperature, top_p=SAMPLED_TOP_P if temperature > 0 else None,
                    seed=list(range(first, first + len(token_prompts))), max_depth=max_depth, **kw)


def _cell(bundle, toks, t, wl, b, configs, depth, max_new_tokens, rounds, bar) -> list[dict]:
    """The rows of one (temperature, workload, batch): every configuration warmed up (compiled),
    then timed batch by batch in rotating order; each keeps its fastest of ``rounds`` passes."""
    from specjax.engine import prompt_bucket

    groups = [toks[i : i + b] for i in range(0, len(toks), b)]
    widths = {prompt_bucket(g): g for g in groups}  # one compile per prompt-width bucket: none in the timed pass
    warm = {}
    for c in configs:
        for g in widths.values():
            warm[c] = _run(bundle, g, *c, max_new_tokens, t, max_depth=depth)
            bar.update()
    tally = {c: collections.Counter() for c in configs}
    shares = dict.fromkeys(configs, 0.0)  # steps at each window of an auto row
    acc_pos = {c: np.zeros(_positions(c[2], depth), np.int64) for c in configs}
    prop_pos = {c: np.zeros(_positions(c[2], depth), np.int64) for c in configs}
    per_round = {c: [] for c in configs}  # each pass's seconds (the row keeps the fastest)
    for rnd in range(rounds):
        wall = dict.fromkeys(configs, 0.0)
        for i, g in enumerate(groups):
            turn = i + rnd * len(groups)
            for c in configs[turn % len(configs):] + configs[: turn % len(configs)]:
                d, _, k = c
                t0 = time.perf_counter()
                res = _run(bundle, g, *c, max_new_tokens, t, first=i * b, max_depth=depth)
                wall[c] += time.perf_counter() - t0
                bar.update()
                if rnd:  # every pass emits the same tokens (per-prompt seeds): count the first
                    continue
                m = res.metrics
                tally[c].update(compiles=m["compiles"], proposed=m["proposed_drafts"], emitted=m["emitted"],
                                row_steps=m["total_row_steps"], accepted=m["accepted_drafts"],
                                new=sum(len(x) for x in res.tokens))
                if _is_auto(k):
                    shares[c] = shares[c] + np.asarray(m["window_share"]) * m["steps"]
                if d != "none":
                    positions = _positions(k, depth)  # draft positions this row's runs report
                    acc_pos[c][:positions] += m["accepted_per_position_count"]
                    prop_pos[c][:positions] += m["proposed_per_position_count"]
        for c in configs:
            per_round[c].append(wall[c])
    fastest = {c: min(per_round[c]) for c in configs}
    rows = []
    for c in configs:
        d, r, k = c
        n, positions, steps = tally[c], _positions(k, depth), max(tally[c]["row_steps"], 1)
        rows.append({
            "temperature": float(t), "workload": wl, "drafter": d, "kv_advance": r if d != "none" else "n/a",
            "depth": k, "batch": b, "mean_proposed_drafts": n["proposed"] / steps,
            "window_share": (shares[c] / max(shares[c].sum(), 1)).tolist() if _is_auto(k) else None,
            "tok_per_step": n["emitted"] / steps,
            "mean_accepted_length": (n["accepted"] + n["row_steps"]) / steps,
            "acceptance_per_position": ((acc_pos[c] / np.maximum(prop_pos[c], 1))[:positions].tolist()
                                        if d != "none" else []),
            "tok_per_s": n["new"] / fastest[c], "new_tokens": n["new"], "seconds": fastest[c],
            "seconds_per_round": per_round[c],
            "compiles_in_timed_pass": n["compiles"],
            "warm_compiles": warm[c].metrics["compiles"],
        })
    return rows


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
    workloads: Sequence[str] = WORKLOADS,
    rounds: int = 1,
    trees: Sequence[str] = (),
) -> dict:
    """Measure every (temperature, workload, batch, drafter, rule, depth) over the prompt set;
    returns ``{"machine", "settings", "rows": [...]}``. Temperature 0 is greedy; a sampled row
    uses top-p 0.95 and per-prompt seeds. ``depth="auto"`` rows measure (or read from the
    disk cache) their cost table in the warm-up, never in the timed pass.

    The rows of one (temperature, workload, batch) are timed side by side: each batch of
    prompts runs under every configuration in turn (the order rotating from batch to batch),
    so a slow spell of a shared machine falls on all of them, not on whichever row it met;
    with ``rounds`` > 1 the pass repeats and each row keeps its fastest (``seconds_per_round``
    and ``speedup_vs_plain_per_round`` keep every pass: the spread one run shows). ``trees``:
    token-tree rows (per-sequence) beside the chains: a preset (``"2x2x1"``) for the MTP drafter,
    a dynamic tree (``"dynamic:8,2@4"``) for every drafter, either ending ``+auto`` for the tree
    under depth="auto" (each step the tree, a chain or plain decoding, priced by the cost
    table: the node budget per step); each gets ``vs_best_chain``, its tok/s over the best of
    plain and every chain depth of its drafter."""
    from tqdm import tqdm

    from specjax.engine import prompt_bucket

    _check_bench(drafters, workloads, rounds, depth, trees)
    prompts = bench_prompts(n_prompts)
    for b in batches:
        if not isinstance(b, int) or b < 1 or len(prompts) % b:
            raise ValueError(f"batch {b!r} is invalid: must be >= 1 and divide the {len(prompts)} prompts")
    toks = {"code": bundle.encode_prompts(prompts, bos=False),  # snippets from the middle of files
            "mixed": bundle.encode_prompts(mixed_prompts(prompts), bos=False)}
    if any(not isinstance(t, int | float) or not 0 <= t < 10 for t in temperatures) or not temperatures:
        raise ValueError(f"temperatures={list(temperatures)} is invalid: each must be a float in [0, 10)")
    room = bundle.model.config.max_seq_len - max_new_tokens
    longest = max(len(t) for wl in workloads for t in toks[wl])
    if longest > room:  # checked before any run, not when the first long prompt comes up
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: the longest prompt holds {longest} tokens and "
                         f"the model's context is {bundle.model.config.max_seq_len}: at most "
                         f"{bundle.model.config.max_seq_len - longest} new tokens fit")
    cells = [(t, wl, b) for t in temperatures for wl in workloads for b in batches]
    runs = 0
    for _, wl, b in cells:  # the progress bar counts generate calls: warm-ups and timed ones
        groups = [toks[wl][i : i + b] for i in range(0, len(toks[wl]), b)]
        runs += len(_configs(drafters, depth, wl, trees)) * (len({prompt_bucket(g) for g in groups})
                                                              + rounds * len(groups))
    bar = tqdm(total=runs, desc="bench", disable=not progress, file=sys.stderr)
    rows = []
    for t, wl, b in cells:
        rows += _cell(bundle, toks[wl], t, wl, b, _configs(drafters, depth, wl, trees), depth, max_new_tokens,
                      rounds, bar)
    bar.close()
    _compare(rows)
    settings = {"batches": list(batches), "drafters": list(drafters), "depth": depth, "workloads": list(workloads),
                "max_new_tokens": max_new_tokens, "prompts": len(prompts), "temperatures": list(temperatures),
                "sampled_top_p": SAMPLED_TOP_P, "rounds": rounds, "trees": list(trees),
                "bundle": str(bundle.path)}
    return {"machine": machine(), "settings": settings, "rows": rows}


def _check_bench(drafters, workloads, rounds, depth, trees) -> None:
    """``bench``'s settings, each failing by name before any run."""
    from specjax.drafters import DRAFTERS
    from specjax.generation_config import GenerationConfig
    from specjax.validate import MAX_DEPTH

    bad = [d for d in drafters if d not in DRAFTERS]
    if bad:
        raise ValueError(f"drafters={list(drafters)} is invalid: each must be one of {list(DRAFTERS)}")
    if not workloads or any(w not in WORKLOADS for w in workloads):
        raise ValueError(f"workloads={list(workloads)} is invalid: each must be one of {list(WORKLOADS)}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: must be an int >= 1")
    if not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth={depth!r} is invalid: must be an int in [1, {MAX_DEPTH}]")
    for t in trees:
        spec, _, d = t.removesuffix(AUTO_TREE).partition("@")
        d = int(d) if d.isdigit() else depth
        # a bad tree: an error before any run
        fixed = {} if not spec.startswith("dynamic") else dict(depth=d)  # a preset sets its own depth
        GenerationConfig(tree=spec, **(dict(depth="auto", max_depth=d) if t.endswith(AUTO_TREE) else fixed))
    if any(not t.startswith("dynamic") for t in trees) and "mtp" not in drafters:
        raise ValueError(f"trees={list(trees)} holds a preset, which needs the mtp drafter among "
                         f"drafters={list(drafters)}")


def _compare(rows: list[dict]) -> None:
    """Each row's ratios beside its peers of the same (temperature, workload, batch): over plain
    decoding (``speedup_vs_plain``, per round too), an auto row over the best fixed depth, a tree
    row over the best chain."""
    for row in rows:
        plain = next(x for x in rows if x["batch"] == row["batch"] and x["drafter"] == "none"
                     and x["temperature"] == row["temperature"] and x["workload"] == row["workload"])
        row["speedup_vs_plain"] = row["tok_per_s"] / plain["tok_per_s"]
        # each pass's side-by-side ratio: how far one pass of the same work moves on this machine
        row["speedup_vs_plain_per_round"] = [p / s for p, s in zip(plain["seconds_per_round"],
                                                                   row["seconds_per_round"], strict=True)]
    for row in rows:
        if row["depth"] == "auto":  # auto vs the best of plain and every fixed depth of its drafter
            peers = [x for x in rows if x["batch"] == row["batch"] and x["temperature"] == row["temperature"]
                     and x["workload"] == row["workload"] and x["depth"] != "auto" and not _tree_of(x["depth"])
                     and (x["drafter"] == "none" or (x["drafter"] == row["drafter"]
                                                     and x["kv_advance"] == "per_sequence"))]
            best = max(peers, key=lambda x: x["tok_per_s"])
            row["vs_best_fixed"] = row["tok_per_s"] / best["tok_per_s"]
            row["best_fixed"] = "plain" if best["drafter"] == "none" else f"depth {best['depth']}"
    for row in rows:
        if _tree_of(row["depth"]):  # a tree vs the best of plain and every chain depth of its drafter
            peers = [x for x in rows if x["batch"] == row["batch"] and x["temperature"] == row["temperature"]
                     and x["workload"] == row["workload"] and isinstance(x["depth"], int)
                     and (x["drafter"] == "none" or (x["drafter"] == row["drafter"]
                                                     and x["kv_advance"] == "per_sequence"))]
            best = max(peers, key=lambda x: x["tok_per_s"])
            row["vs_best_chain"] = row["tok_per_s"] / best["tok_per_s"]
            row["best_chain"] = "plain" if best["drafter"] == "none" else f"depth {best['depth']}"


def table(result: dict) -> str:
    head = (f"{'temp':>4} {'load':<5} {'drafter':<12} {'kv_advance':<13} {'depth':>5} {'B':>3} {'tok/step':>9} "
            f"{'acc.len':>8} {'accept@1/2/3':>16} {'tok/s':>9} {'vs plain':>9} {'vs best':>8}")
    lines = [result["machine"], head, "-" * len(head)]
    for r in result["rows"]:
        acc = "/".join(f"{x:.2f}" for x in r["acceptance_per_position"]) or "-"
        vs = r.get("vs_best_fixed", r.get("vs_best_chain"))
        best = f"{vs:>7.2f}x" if vs is not None else f"{'':>8}"
        lines.append(f"{r['temperature']:>4.1f} {r['workload']:<5} {r['drafter']:<12} {r['kv_advance']:<13} "
                     f"{str(r['depth'] or '-').removeprefix(TREE):>5} {r['batch']:>3} {r['tok_per_step']:>9.3f} "
                     f"{r['mean_accepted_length']:>8.3f} {acc:>16} {r['tok_per_s']:>9.1f} "
                     f"{r['speedup_vs_plain']:>8.2f}x {best}")
    return "\n".join(lines)


def _main_rows(result: dict) -> list[dict]:
    """The rule comparison: the ``code`` workload at the run's depth (and plain)."""
    depth = result["settings"]["depth"]
    return [r for r in result["rows"] if r.get("workload", "code") == "code" and r.get("depth", depth) in (0, depth)]


def plot(result: dict, path: str) -> None:
    """tok/step and tok/s vs batch size, one line per (drafter, rule), at the run's depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    main = _main_rows(result)
    keys = sorted({(r.get("temperature", 0.0), r["drafter"], r["kv_advance"]) for r in main})
    for key in keys:
        rows = sorted((r for r in main if (r.get("temperature", 0.0), r["drafter"], r["kv_advance"]) == key),
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


def plot_depth(result: dict, path: str, temperature: float = 0.0) -> bool:
    """tok/s vs batch size for plain, each fixed depth and ``depth="auto"`` (per-sequence rule),
    one panel per (workload, drafter). False when the run has no depth rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("temperature", 0.0) == temperature and "depth" in r]
    panels = sorted({(r["workload"], r["drafter"]) for r in rows if r["depth"] == "auto"})
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (wl, dr) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if r["workload"] == wl and (r["drafter"] == "none" or (
            r["drafter"] == dr and r["kv_advance"] == "per_sequence"))]
        for k in sorted({r["depth"] for r in mine}, key=lambda k: (k == "auto", str(k))):
            line = sorted((r for r in mine if r["depth"] == k), key=lambda r: r["batch"])
            label = "plain" if k == 0 else f"depth {k}"
            ax.plot([r["batch"] for r in line], [r["tok_per_s"] for r in line], "-" if k == "auto" else "--",
                    marker="o", linewidth=2.5 if k == "auto" else 1, label=label)
        ax.set_title(f"{dr}, {wl} prompts", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens per second")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"depth='auto' vs fixed depths (per_sequence, T={temperature}): {result['machine']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
