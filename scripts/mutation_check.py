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

A snippet matches on dedented lines: the same lines moved into or out of a block (every line
shifted by the same indentation) still match, and the replacement is shifted with them.

Verdicts come from pytest's exit code: 1 (a test failed) is *caught*; 0 is *missed*; 2-5
(interrupted, internal error, usage error such as an unknown test id, nothing collected) are
*stale*, never caught, so a renamed test cannot turn its mutations into false catches; a run
killed by a signal (a crash) is caught.

``tests/mutation_catchers.json`` records, per entry, the test that failed last time. A run
tries that one test first (one short pytest) and, when it passes or no longer exists, runs
the entry's whole list: the verdict is always a real failing test. ``--record`` rewrites the
file from this run's catches.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import functools
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import forked_pytest  # noqa: E402  (scripts/: this script's folder)
import xla_env  # noqa: E402  (the suite's XLA settings: set before the forkserver imports jax)
from mutations import MUTATIONS, Mutation  # noqa: E402  (the entries: tests/mutations.py)

SOURCE_ROOTS = ("specjax", "pallas_kernels", "benchmarks", "scripts")  # where ``at`` names are looked up
CATCHERS = ROOT / "tests" / "mutation_catchers.json"  # {entry name: the test id that caught it last}
STALE_EXITS = (2, 3, 4, 5)  # pytest: interrupted, internal error, usage error (unknown id), nothing collected


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


def shift(snippet: str, by: int) -> str | None:
    """``snippet`` with every line that starts on a new line moved ``by`` columns (a negative
    ``by`` removes that many leading spaces; ``None`` where a line has fewer). Its first line
    moves too when the snippet starts at a line's indentation (with a space); a snippet that
    starts mid-line keeps its first line. Blank lines stay blank."""
    lines = snippet.split("\n")
    out = []
    for i, line in enumerate(lines):
        if (i == 0 and not line.startswith(" ")) or not line.strip():
            out.append(line)
        elif by >= 0:
            out.append(" " * by + line)
        elif line[:-by].strip(" ") == "" and len(line) >= -by:
            out.append(line[-by:])
        else:
            return None
    return "\n".join(out)


def _shifts(old: str) -> list[int]:
    """The indentation shifts worth trying for ``old`` besides none: every shift that puts its
    least indented moving line at a multiple of 4 columns, from 0 to 32."""
    lines = old.split("\n")
    moving = [ln for i, ln in enumerate(lines) if ln.strip() and (i > 0 or ln.startswith(" "))]
    if not moving:
        return []
    least = min(len(ln) - len(ln.lstrip(" ")) for ln in moving)
    return [c - least for c in range(0, 33, 4) if c != least]


def _find(span: str, old: str, whole_lines: bool) -> tuple[int, int]:
    """(occurrences of ``old`` in ``span``, the first one's offset); ``whole_lines``: only where
    it starts a line."""
    if not whole_lines:
        return span.count(old), span.find(old)
    lined = "\n" + span
    return lined.count("\n" + old), lined.find("\n" + old)


def locate(m: Mutation, root: Path = ROOT) -> tuple[Path, str, int, str, str] | str:
    """``(file, its text, offset of the snippet, the snippet as found, the replacement)`` for
    ``m``, or why it does not apply. The snippet must occur exactly once in ``at``: as written,
    or else on dedented lines (``shift``: every line moved by the same columns, the replacement
    moved with it)."""
    got = resolve(m.at, root)
    if isinstance(got, str):
        return got
    file, a, b = got
    text = (root / file).read_text()
    span = text[a:b]
    count, at = _find(span, m.old, False)
    if count == 0:
        hits = []
        for by in _shifts(m.old):
            old = shift(m.old, by)
            if old is not None and (found := _find(span, old, m.old.startswith(" ")))[0]:
                hits.append((by, old, *found))
        count = sum(h[2] for h in hits)
        if count == 1:
            by, old, _, at = hits[0]
            new = shift(m.new, by)
            if new is None:
                return f"the replacement cannot move {by} columns as its snippet did in {m.at} ({file})"
            return root / file, text, a + at, old, new
    if count != 1:
        return f"snippet found {count} times in {m.at} ({file})"
    return root / file, text, a + at, m.old, m.new


def copy_tree(dest: Path, name: str = "tree") -> Path:
    """The checkout without its virtualenv, git data and caches: where mutations happen."""
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "runs",
                                    ".hypothesis")
    return Path(shutil.copytree(ROOT, dest / name, ignore=ignore))


def _pytest(root: Path, tests: list[str] | tuple[str, ...]) -> subprocess.CompletedProcess:
    """``pytest -x`` over ``tests`` in ``root``, forked from a server that imported jax, pytest
    and the rest once (``forked_pytest``): seconds less per run than a fresh interpreter."""
    # the preloaded hypothesis plugin cannot be assertion-rewritten: harmless, and not a verdict detail
    args = ["-x", "-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning", *tests]
    code, out, err = forked_pytest.run(root, args, drop=(str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")))
    return subprocess.CompletedProcess(args, code, out, err)


# the failing test's id, spaces in its parameters included (pytest ends the id with " - " and the reason)
_FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - |$)", re.M)


def verdict(returncode: int) -> str:
    """pytest's exit code -> ``caught`` (1: a test failed; or killed by a signal), ``missed``
    (0) or ``stale`` (2-5: the run did not test the mutation)."""
    if returncode == 0:
        return "missed"
    return "stale" if returncode in STALE_EXITS else "caught"


def load_catchers(path: Path = CATCHERS) -> dict[str, str]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_one(m: Mutation, root: Path = ROOT, catcher: str | None = None) -> dict:
    """Apply ``m`` in ``root``, run its tests (``catcher`` alone first, when given: the rest only
    if it passes or is stale), restore the file. The result names the test that caught it."""
    got = locate(m, root)
    if isinstance(got, str):
        return {"name": m.name, "status": "stale", "detail": got}
    path, src, at, old, new = got
    t0 = time.time()
    try:
        path.write_text(src[:at] + new + src[at + len(old):])
        proc = _pytest(root, [catcher]) if catcher else None
        if proc is None or verdict(proc.returncode) != "caught":
            proc = _pytest(root, m.tests)
    finally:
        path.write_text(src)
    status = verdict(proc.returncode)
    if proc.returncode < 0:
        detail = f"crashed (signal {-proc.returncode})"
    else:
        detail = (proc.stdout.strip().splitlines() or [""])[-1]
    failed = _FAILED.search(proc.stdout)
    return {
        "name": m.name,
        "status": status,
        "seconds": round(time.time() - t0, 1),
        "detail": detail,
        "caught_by": failed.group(1) if status == "caught" and failed else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", action="append", default=[],
                    help="only mutations whose name contains this (repeatable: any of them)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--check", action="store_true", help="only check that every entry applies; run no tests")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--record", action="store_true",
                    help=f"write each caught entry's failing test to {CATCHERS.relative_to(ROOT)} (tried first "
                         "next time)")
    ap.add_argument("--no-catchers", action="store_true", help="run every entry's whole test list (ignore the record)")
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
    os.environ["HYPOTHESIS_PROFILE"] = "mutation"  # tests/conftest.py: the suite's examples, no shrinking
    xla_env.configure()  # before the first run starts the forkserver (its jax reads these at import)
    scratch = Path(tempfile.mkdtemp(prefix="specjax-mutations-"))
    trees: queue.Queue[Path] = queue.Queue()
    try:
        for k in range(min(args.jobs, len(selected)) or 1):
            trees.put(copy_tree(scratch, f"tree{k}"))

        catchers = {} if args.no_catchers else load_catchers()
        recording = threading.Lock()

        def one(m: Mutation) -> dict:
            root = trees.get()  # a tree no other job is editing
            try:
                result = _report(run_one(m, root, catchers.get(m.name)), args.json)
            finally:
                trees.put(root)
            if args.record and result.get("caught_by"):  # as they come: a run cut short keeps what it learned
                with recording:
                    record({m.name: result["caught_by"]})
            return result

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(one, selected))  # reported as they finish, returned in list order
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    bad = [r for r in results if r["status"] != "caught"]
    if args.json:
        print(json.dumps({"results": results, "missed": len(bad)}))
    else:
        stale = sum(r["status"] == "stale" for r in results)
        print(f"{len(results) - len(bad)}/{len(results)} mutations caught" + (f" ({stale} stale)" if stale else ""))
    return 1 if bad else 0


def record(caught: dict[str, str], path: Path = CATCHERS) -> None:
    """``caught`` ({entry: failing test id}) into the catchers file; entries that no longer
    exist are dropped."""
    names = {m.name for m in MUTATIONS}
    merged = load_catchers(path) | caught
    path.write_text(json.dumps({k: v for k, v in sorted(merged.items()) if k in names}, indent=1) + "\n")


def _report(r: dict, quiet: bool) -> dict:
    if not quiet:
        print(f"{r['status']:>7}  {r['name']}  ({r.get('seconds', 0)}s; {r['detail']})", flush=True)
    return r


if __name__ == "__main__":
    raise SystemExit(main())
