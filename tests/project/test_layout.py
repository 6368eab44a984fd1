"""The package layout's rules, checked on the source: the kernels depend on JAX only, and no
two modules import each other (function-level imports included: a lazy import that dodges a
cycle is still a cycle)."""

import ast
from pathlib import Path

from paths import ROOT

PACKAGES = ("specjax", "pallas_kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            rel = p.relative_to(ROOT).with_suffix("")
            out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


def _imports(path: Path) -> set[str]:
    """Every module an ``import`` anywhere in the file names (``from a.b import c``: ``a.b``,
    and ``a.b.c`` when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_kernels_import_nothing_from_specjax():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.split(".")[0] == "specjax")
           for p in (ROOT / "pallas_kernels").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_no_two_modules_import_each_other():
    mods = _modules()
    graph = {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()}
    # a package's own __init__ re-exporting its modules is not a cycle: drop the edges into it
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    cycles, done = [], set()

    def visit(m, path):
        if m in path:
            cycles.append(path[path.index(m):] + [m])
            return
        if m in done:
            return
        for dep in sorted(graph[m]):
            visit(dep, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    assert not cycles, cycles


def test_the_kernels_package_exports_kernels_and_references():
    import pallas_kernels

    for name in ("ragged_attention", "ring_attention", "paged_attention", "dense_reference", "ring_reference",
                 "paged_reference", "visible"):
        assert name in pallas_kernels.__all__ and callable(getattr(pallas_kernels, name)), name
    assert pallas_kernels.MASK_VALUE <= -1e9


def test_no_module_imports_another_modules_private_names():
    """What one module uses of another is public (``from specjax.x import _name`` is how a
    private name leaks into another module's code; tests may reach inside)."""
    bad = []
    for pkg in PACKAGES + ("benchmarks", "scripts"):
        for p in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                    bad += [f"{p.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not bad, bad


def test_the_engine_knows_no_depth_policy():
    """The engine package imports nothing from ``specjax.auto`` (depth="auto" plugs in as a
    step controller), and the step names no policy, estimate, prior or cost."""
    import re

    for p in (ROOT / "specjax" / "engine").rglob("*.py"):
        assert not [m for m in _imports(p) if m.startswith("specjax.auto")], p
    step = (ROOT / "specjax" / "engine" / "step.py").read_text()
    assert not re.findall(r"\b(policy|policies|auto|est|estimates?|prior|cost|choose|DepthPolicy)\b", step)


def test_the_slow_lane_names_existing_test_modules():
    """``tests/conftest.py`` marks whole modules slow by name: a renamed module would slip into
    the quick lane unnoticed."""
    from conftest import SLOW

    present = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(name for name in SLOW if name not in present)
    assert not missing, missing


MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_HASATTR = 500, 80, 10


def test_modules_and_functions_stay_short():
    """No module of ``specjax/`` over 500 lines and no function over 80 (docstring included):
    a module holds one concept, a function one step of it."""
    long_modules, long_functions = [], []
    for p in (ROOT / "specjax").rglob("*.py"):
        text = p.read_text()
        name = str(p.relative_to(ROOT))
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append((f"{name}::{node.name}", n))
    assert not long_modules and not long_functions, (long_modules, long_functions)


def test_interfaces_are_protocols_not_attribute_probes():
    """Capabilities are declared (``specjax.protocols``, the drafters' Protocol), not probed:
    at most a handful of ``hasattr`` in ``specjax/``."""
    count = sum(p.read_text().count("hasattr(") for p in (ROOT / "specjax").rglob("*.py"))
    assert count <= MAX_HASATTR, count


AREAS = {"engine", "cache", "kernels", "api", "io", "training", "tools", "project"}


def test_tests_mirror_the_code_and_import_no_test_module():
    """Each test module sits in its area's folder (``tests/<area>/``), and shares models and
    helpers through ``tests/*.py`` helper modules or fixtures, never by importing another test
    module (whose folder may not be on the path)."""
    tests = ROOT / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, loose
    areas = {p.parent.name for p in tests.rglob("test_*.py")}
    assert areas <= AREAS, areas - AREAS
    bad = [f"{p.relative_to(tests)}: {m}" for p in tests.rglob("test_*.py") for m in _imports(p)
           if m.split(".")[0].startswith("test_")]
    assert not bad, bad
