"""The mutation check's entries (``tests/mutations.py``) all still apply: each anchor names one
definition and its snippet occurs exactly once there (a refactor that breaks one fails here,
in seconds, not after the check's 20 minutes)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import mutation_check  # noqa: E402
from mutations import MUTATIONS, Mutation  # noqa: E402


def test_every_mutation_applies_and_names_are_unique():
    stale = {m.name: got for m in MUTATIONS if isinstance(got := mutation_check.locate(m), str)}
    assert not stale, stale
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
    for m in MUTATIONS:
        assert m.old != m.new and m.tests, m.name
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).is_file(), (m.name, t)


def test_an_anchor_follows_its_function_and_refuses_ambiguity(tmp_path):
    """A function found by name in whichever module defines it; a name defined twice needs
    ``FILE::name``; a snippet outside the named function does not apply."""
    pkg = tmp_path / "specjax"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f(x):\n    return x + 1\n\n\nclass C:\n    def g(self):\n        return 2\n")
    (pkg / "b.py").write_text("def h():\n    return 3\n\n\ndef g():\n    return 2\n")
    locate = mutation_check.locate
    path, text, at = locate(Mutation("m", "f", "x + 1", "x + 2", ("t",)), tmp_path)
    assert path == pkg / "a.py" and text[at:at + 5] == "x + 1"
    assert locate(Mutation("m", "C.g", "return 2", "return 0", ("t",)), tmp_path)[0] == pkg / "a.py"
    assert locate(Mutation("m", "g", "return 2", "return 0", ("t",)), tmp_path)[0] == pkg / "b.py"
    assert "defined 0 times" in locate(Mutation("m", "nope", "x", "y", ("t",)), tmp_path)
    assert "found 0 times in h" in locate(Mutation("m", "h", "x + 1", "y", ("t",)), tmp_path)
    (pkg / "c.py").write_text("def f(x):\n    return x + 1\n")
    assert "defined 2 times" in locate(Mutation("m", "f", "x + 1", "x", ("t",)), tmp_path)
    assert locate(Mutation("m", "specjax/c.py::f", "x + 1", "x", ("t",)), tmp_path)[0] == pkg / "c.py"
    assert locate(Mutation("m", "specjax/b.py", "return 3", "return 4", ("t",)), tmp_path)[0] == pkg / "b.py"
