"""Mutation check: apply deliberate bugs one at a time and require a test to fail.

    python scripts/mutation_check.py            # all mutations
    python scripts/mutation_check.py --list     # names only
    python scripts/mutation_check.py -k cohort  # those whose name contains "cohort" (-k again: or)
    python scripts/mutation_check.py -j 1       # one at a time (default: one per core, at most 8)
    python scripts/mutation_check.py --check    # every entry still applies (no tests run)

The entries live in ``tests/mutations.py``. Each replaces one exact snippet (which must occur
exactly once) inside one function, method or class (found by name wherever it is defined, so
moving code between modules keeps the entries valid), reruns the named tests with
``pytest -x``, and restores the file. ``--check`` only verifies that every entry applies. A
mutation that leaves the tests green is *missed*; the script exits 1 if any is.
Mutations are applied to copies of the tree in a temporary folder (one per job, so
parallel jobs never see each other's edits), never to the checkout: a run killed
midway leaves the sources as they were.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import functools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from mutations import MUTATIONS, Mutation  # noqa: E402  (the entries: tests/mutations.py)

SOURCE_ROOTS = ("specjax", "pallas_kernels", "benchmarks", "scripts")  # where ``at`` names are looked up


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


@functools.lru_cache(maxsize=1024)  # keyed by the text itself: an edited file is parsed again
def definitions(text: str) -> dict[str, tuple[int, int]]:
    """``{qualified name: (start, end)}`` character spans of a module's top-level functions and
    classes and of those classes' methods (decorators included)."""
    starts, out = _line_starts(text), {}

    def add(node: ast.AST, name: str) -> None:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        out[name] = (starts[first - 1], starts[node.end_lineno])

    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            add(node, node.name)
            if isinstance(node, ast.ClassDef):
                for m in node.body:
                    if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef):
                        add(m, f"{node.name}.{m.name}")
    return out


def resolve(at: str, root: Path = ROOT) -> tuple[str, int, int] | str:
    """``at`` -> ``(file, start, end)``: the span a mutation edits, or why it cannot be found."""
    file, _, name = at.partition("::") if "::" in at else ((at, "", "") if at.endswith(".py") else ("", "", at))
    if not name:
        path = root / file
        return (file, 0, len(path.read_text())) if path.is_file() else f"no file {file}"
    files = [root / file] if file else sorted(p for r in SOURCE_ROOTS for p in (root / r).rglob("*.py"))
    found = []
    for p in files:
        if p.is_file():
            span = definitions(p.read_text()).get(name)
            if span is not None:
                found.append((str(p.relative_to(root)), *span))
    if len(found) != 1:
        where = f" in {file}" if file else ""
        return f"{name!r} is defined {len(found)} times{where}" + (
            f" ({', '.join(f[0] for f in found)}: write FILE::{name})" if len(found) > 1 else "")
    return found[0]


def locate(m: Mutation, root: Path = ROOT) -> tuple[Path, str, int] | str:
    """``(file, its text, offset of the snippet)`` for ``m``, or why it does not apply."""
    got = resolve(m.at, root)
    if isinstance(got, str):
        return got
    file, a, b = got
    text = (root / file).read_text()
    count = text[a:b].count(m.old)
    if count != 1:
        return f"snippet found {count} times in {m.at} ({file})"
    return root / file, text, a + text[a:b].index(m.old)


def copy_tree(dest: Path, name: str = "tree") -> Path:
    """The checkout without its virtualenv, git data and caches: where mutations happen."""
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "runs",
                                    ".hypothesis")
    return Path(shutil.copytree(ROOT, dest / name, ignore=ignore))


def run_one(m: Mutation, python: str, root: Path = ROOT) -> dict:
    got = locate(m, root)
    if isinstance(got, str):
        return {"name": m.name, "status": "stale", "detail": got}
    path, src, at = got
    t0 = time.time()
    try:
        path.write_text(src[:at] + m.new + src[at + len(m.old):])
        proc = subprocess.run(
            [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
            cwd=root,
            capture_output=True,
            text=True,
            env=os.environ | {"HYPOTHESIS_PROFILE": "ci"},
        )
    finally:
        path.write_text(src)
    caught = proc.returncode != 0
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    return {
        "name": m.name,
        "status": "caught" if caught else "missed",
        "seconds": round(time.time() - t0, 1),
        "detail": tail,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", action="append", default=[],
                    help="only mutations whose name contains this (repeatable: any of them)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--check", action="store_true", help="only check that every entry applies; run no tests")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-j", "--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="mutations run at once, each in its own copy of the tree (default: cores, at most 8)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        print(f"mutation_check: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    selected = [m for m in MUTATIONS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in selected:
            print(f"{m.name}  [{m.at}]")
        return 0
    if args.check:
        stale = [(m, got) for m in selected if isinstance(got := locate(m), str)]
        for m, why in stale:
            print(f"  stale  {m.name}: {why}")
        print(f"{len(selected) - len(stale)}/{len(selected)} mutations apply")
        return 1 if stale else 0
    scratch = Path(tempfile.mkdtemp(prefix="specjax-mutations-"))
    trees: queue.Queue[Path] = queue.Queue()
    try:
        for k in range(min(args.jobs, len(selected)) or 1):
            trees.put(copy_tree(scratch, f"tree{k}"))

        def one(m: Mutation) -> dict:
            root = trees.get()  # a tree no other job is editing
            try:
                return _report(run_one(m, sys.executable, root), args.json)
            finally:
                trees.put(root)

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(one, selected))  # reported as they finish, returned in list order
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    bad = [r for r in results if r["status"] != "caught"]
    if args.json:
        print(json.dumps({"results": results, "missed": len(bad)}))
    else:
        print(f"{len(results) - len(bad)}/{len(results)} mutations caught")
    return 1 if bad else 0


def _report(r: dict, quiet: bool) -> dict:
    if not quiet:
        print(f"{r['status']:>7}  {r['name']}  ({r.get('seconds', 0)}s; {r['detail']})", flush=True)
    return r


if __name__ == "__main__":
    raise SystemExit(main())
