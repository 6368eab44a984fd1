"""The mutation check's entries (``tests/mutations.py``) all still apply: each anchor names one
definition and its snippet occurs exactly once there, and every test they name exists (a
refactor or a renamed test fails here, in seconds, not after the check's half hour)."""

import subprocess
import sys

from paths import ROOT

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
    path, text, at, old, new = locate(Mutation("m", "f", "x + 1", "x + 2", ("t",)), tmp_path)
    assert path == pkg / "a.py" and text[at:at + 5] == "x + 1" and (old, new) == ("x + 1", "x + 2")
    assert locate(Mutation("m", "C.g", "return 2", "return 0", ("t",)), tmp_path)[0] == pkg / "a.py"
    assert locate(Mutation("m", "g", "return 2", "return 0", ("t",)), tmp_path)[0] == pkg / "b.py"
    assert "defined 0 times" in locate(Mutation("m", "nope", "x", "y", ("t",)), tmp_path)
    assert "found 0 times in h" in locate(Mutation("m", "h", "x + 1", "y", ("t",)), tmp_path)
    (pkg / "c.py").write_text("def f(x):\n    return x + 1\n")
    assert "defined 2 times" in locate(Mutation("m", "f", "x + 1", "x", ("t",)), tmp_path)
    assert locate(Mutation("m", "specjax/c.py::f", "x + 1", "x", ("t",)), tmp_path)[0] == pkg / "c.py"
    assert locate(Mutation("m", "specjax/b.py", "return 3", "return 4", ("t",)), tmp_path)[0] == pkg / "b.py"


def test_every_named_test_id_is_collected():
    """Each entry's tests and each recorded catcher name tests pytest collects (an unknown id
    is pytest's exit 4: the check would call that entry stale, never caught)."""
    ids = sorted({t for m in MUTATIONS for t in m.tests} | set(mutation_check.load_catchers().values()))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    unknown = set(mutation_check.load_catchers()) - {m.name for m in MUTATIONS}
    assert not unknown, f"tests/mutation_catchers.json names entries that do not exist: {sorted(unknown)}"


def test_a_snippet_matches_on_dedented_lines(tmp_path):
    """Lines moved into a block (or out of one) still match, the replacement moved with them; a
    dedented match that is not at a line's start, or found twice, does not apply."""
    pkg = tmp_path / "specjax"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f(x):\n    if x:\n        y = x + 1\n        return y\n    return 0\n")
    m = Mutation("m", "f", "    y = x + 1\n    return y\n", "    y = x + 2\n    return y\n", ("t",))
    path, text, at, old, new = mutation_check.locate(m, tmp_path)
    assert old == "        y = x + 1\n        return y\n" and new == "        y = x + 2\n        return y\n"
    assert text[at:at + len(old)] == old
    deeper = Mutation("m", "f", "            return y\n", "            return 1\n", ("t",))
    assert mutation_check.locate(deeper, tmp_path)[3:] == ("        return y\n", "        return 1\n")
    twice = Mutation("m", "f", "return", "yield", ("t",))
    assert "found 2 times" in mutation_check.locate(twice, tmp_path)
    mid = Mutation("m", "f", "1\n            return y", "2\n            return y", ("t",))
    assert mutation_check.locate(mid, tmp_path)[3] == "1\n        return y"


def test_only_a_failing_test_counts_as_caught():
    """pytest's exit 1 (or a crash) catches; 0 misses; 2-5 (interrupted, internal error, an unknown
    test id, nothing collected) are stale, never caught."""
    assert mutation_check.verdict(1) == "caught" and mutation_check.verdict(-11) == "caught"
    assert mutation_check.verdict(0) == "missed"
    assert [mutation_check.verdict(c) for c in (2, 3, 4, 5)] == ["stale"] * 4


def test_the_failing_test_id_is_read_whole():
    """A parametrized id with spaces is the catcher recorded, not its first word."""
    out = ("x\nFAILED tests/t.py::test_f[a huge max_new_tokens] - AssertionError: no\n"
           "FAILED tests/t.py::test_g\n")
    assert mutation_check._FAILED.search(out).group(1) == "tests/t.py::test_f[a huge max_new_tokens]"
    assert mutation_check._FAILED.findall(out)[1] == "tests/t.py::test_g"


def test_a_renamed_test_makes_its_mutation_stale_not_caught(tmp_path):
    """A real run of the check's runner on a scratch tree: the catcher and the entry's list both
    name a test that does not exist, so the verdict is stale; with the real test it is caught."""
    (tmp_path / "specjax").mkdir()
    (tmp_path / "specjax" / "a.py").write_text("def f(x):\n    return x + 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "import sys\nsys.path.insert(0, str(__import__('pathlib').Path(__file__).parents[1]))\n"
        "from specjax.a import f\n\n\ndef test_f():\n    assert f(1) == 2\n")
    m = Mutation("m", "f", "x + 1", "x + 2", ("tests/test_a.py::test_gone",))
    got = mutation_check.run_one(m, tmp_path, catcher="tests/test_a.py::test_gone_too")
    assert got["status"] == "stale", got
    m = Mutation("m", "f", "x + 1", "x + 2", ("tests/test_a.py::test_f",))
    got = mutation_check.run_one(m, tmp_path, catcher="tests/test_a.py::test_gone_too")
    assert got["status"] == "caught" and got["caught_by"] == "tests/test_a.py::test_f", got
    assert (tmp_path / "specjax" / "a.py").read_text() == "def f(x):\n    return x + 1\n"
